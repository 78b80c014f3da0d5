"""The servers' SGD (``ps_train.roles.server_optimizer.PlainSGD``) is ``torch.optim.SGD``
bit for bit, states included, without importing ``torch._dynamo``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ps_train.roles.server_optimizer import PlainSGD

SETTINGS = [
    {"lr": 0.05, "momentum": 0.0},
    {"lr": 0.05, "momentum": 0.9},
    {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
]


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g)), torch.nn.Parameter(torch.randn(3, generator=g))]


def _steps(opt, params, seed: int, n: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for step in range(n):
        for k, p in enumerate(params):
            # Now and then a parameter without a gradient: the server's hybrid mode steps some only.
            p.grad = None if (step + k) % 4 == 3 else torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize("kwargs", SETTINGS)
def test_plain_sgd_equals_torch_sgd_bit_for_bit(kwargs):
    ours, theirs = _params(0), _params(0)
    plain, reference = PlainSGD(ours, **kwargs), torch.optim.SGD(theirs, **kwargs)
    _steps(plain, ours, 1, 7)
    _steps(reference, theirs, 1, 7)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    mine, torchs = plain.state_dict(), reference.state_dict()
    assert mine["param_groups"] == torchs["param_groups"]
    assert mine["state"].keys() == torchs["state"].keys()
    for i, state in torchs["state"].items():
        assert mine["state"][i].keys() == state.keys()
        assert all(torch.equal(mine["state"][i][k], v) for k, v in state.items())


@pytest.mark.parametrize("kwargs", SETTINGS[1:])
def test_states_move_between_plain_and_torch_sgd(kwargs):
    # torch's state into ours and ours into torch's: both continue as one uninterrupted run.
    first, second, whole = _params(0), _params(0), _params(0)
    reference = torch.optim.SGD(first, **kwargs)
    _steps(reference, first, 1, 3)
    plain = PlainSGD(second, **kwargs)
    with torch.no_grad():
        for a, b in zip(second, first, strict=True):
            a.copy_(b)
    plain.load_state_dict(reference.state_dict())
    _steps(plain, second, 2, 3)
    back = torch.optim.SGD(first, **kwargs)
    back.load_state_dict(plain.state_dict())
    with torch.no_grad():
        for a, b in zip(first, second, strict=True):
            a.copy_(b)
    _steps(back, first, 3, 2)
    uninterrupted = torch.optim.SGD(whole, **kwargs)
    _steps(uninterrupted, whole, 1, 3)
    _steps(uninterrupted, whole, 2, 3)
    _steps(uninterrupted, whole, 3, 2)
    for a, b in zip(first, whole, strict=True):
        assert torch.equal(a, b)


@pytest.mark.timeout(120)
def test_a_server_with_sgd_does_not_import_dynamo():
    code = (
        "import sys, torch\n"
        "from ps_train.roles.server_optimizer import PlainSGD\n"
        "p = [torch.nn.Parameter(torch.ones(3))]\n"
        "o = PlainSGD(p, lr=0.1, momentum=0.9)\n"
        "p[0].grad = torch.ones(3)\n"
        "o.step(); o.state_dict()\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, check=True)
    assert out.stdout.strip() == "False"
