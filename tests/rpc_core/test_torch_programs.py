"""Existing torch.distributed programs run on rpc_core after swapping their imports.

``torch_ps_tutorial.py`` is the parameter server of PyTorch's RPC tutorial, written against
``torch.distributed.rpc`` / ``torch.distributed.autograd`` / ``torch.distributed.optim``.
The test rewrites exactly its import lines to rpc_core's, leaves every other line as it is,
and runs the result: a parameter server (rank 0) and a trainer that drives the remote
model with ``dist_autograd.context``/``backward`` and ``DistributedOptimizer.step``. The
trained weights on the parameter server must equal the same training run locally.

One trainer, as in the tutorial's working configuration: with two trainers sharing the
model, torch itself fails ("modified by an inplace operation": one trainer's optimizer step
bumps the version of weights another trainer's backward still needs; pytorch/tutorials#2095,
pytorch/examples#856), and so does rpc_core, with the same message.
"""

from __future__ import annotations

import importlib
import pathlib
import secrets
import sys
from typing import Any

import pytest
import torch

from tests._world import free_port, run_world

PROGRAM = pathlib.Path(__file__).with_name("torch_ps_tutorial.py")
IMPORT_SWAPS = {
    "import torch.distributed.autograd as dist_autograd": "import rpc_core.autograd as dist_autograd",
    "import torch.distributed.rpc as rpc": "import rpc_core as rpc",
    "from torch.distributed.optim import DistributedOptimizer": "from rpc_core.optim import DistributedOptimizer",
}


def swapped_source() -> str:
    src = PROGRAM.read_text()
    for old, new in IMPORT_SWAPS.items():
        assert src.count(old) == 1, f"{PROGRAM.name} should contain {old!r} once"
        src = src.replace(old, new)
    left = [
        line for line in src.splitlines() if line.startswith(("import torch.distributed", "from torch.distributed"))
    ]
    assert not left, f"imports not swapped: {left}"
    return src


def loaders() -> Any:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(96, 1, 28, 28, generator=g), torch.randint(0, 10, (96,), generator=g)
    train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:64], y[:64]), batch_size=16)
    test = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[64:], y[64:]), batch_size=16)
    return train, test


def local_training(program: Any) -> torch.nn.Module:
    """The oracle: the tutorial's training, in one process with plain autograd and optim.SGD.
    Run with the same seed, data and order, so the dropout masks are the same as well."""
    batches = list(loaders()[0])  # before seeding: iterating a DataLoader draws from the RNG
    torch.manual_seed(0)
    net = program.Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.03)
    for data, target in batches:
        opt.zero_grad()
        torch.nn.functional.nll_loss(net(data), target).backward()
        opt.step()
    return net


def _ps_tutorial(ctx: Any, module_dir: str, module_name: str) -> Any:
    sys.path.insert(0, module_dir)
    program = importlib.import_module(module_name)
    if ctx.rank == 0:
        torch.manual_seed(0)  # the parameter server's Net and its dropout masks follow this seed
        program.run_parameter_server(0, ctx.world_size)
        trained = [p.detach() for p in program.param_server.model.parameters()]
        expected = [p.detach() for p in local_training(program).parameters()]
        # Plain floats back: tensors through a multiprocessing pipe would share memory.
        return [(float((a - b).abs().max()), float(b.abs().max())) for a, b in zip(trained, expected, strict=True)]
    train_loader, test_loader = loaders()
    return program.run_worker(ctx.rank, ctx.world_size, 0, train_loader, test_loader)


@pytest.mark.timeout(180)
def test_torch_ps_tutorial_runs_on_rpc_core(tmp_path: pathlib.Path) -> None:
    name = "ps_tutorial_on_rpc_core"
    (tmp_path / f"{name}.py").write_text(swapped_source())
    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RPC_CORE_AUTH_SECRET": secrets.token_hex(16)}
    results = run_world(_ps_tutorial, 2, args=(str(tmp_path), name), init=False, env=env, port=port, timeout=120)
    diffs = results[0]
    assert len(diffs) == 8
    for i, (diff, scale) in enumerate(diffs):
        assert diff <= 1e-6 + 1e-5 * scale, f"parameter {i}: trained on rpc_core differs from local training by {diff}"
    assert 0.0 <= results[1] <= 1.0  # the trainer's accuracy


# -- the agent/observer structure of PyTorch's distributed/rpc/rl example --------------------------------
RL_PROGRAM = pathlib.Path(__file__).with_name("torch_rl_program.py")
RL_SWAPS = {
    "import torch.distributed.rpc as rpc": "import rpc_core as rpc",
    "from torch.distributed.rpc import RRef, remote, rpc_async, rpc_sync": (
        "from rpc_core import RRef, remote, rpc_async, rpc_sync"
    ),
}


def _rl(ctx: Any, module_dir: str, module_name: str) -> Any:
    sys.path.insert(0, module_dir)
    return importlib.import_module(module_name).run_worker(ctx.rank, ctx.world_size)


def _run_rl(tmp_path: pathlib.Path, name: str, source: str, world_size: int) -> dict[str, Any]:
    (tmp_path / f"{name}.py").write_text(source)
    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RPC_CORE_AUTH_SECRET": secrets.token_hex(16)}
    return run_world(_rl, world_size, args=(str(tmp_path), name), init=False, env=env, port=port, timeout=120)[0]


def rl_source(swap: bool) -> str:
    src = RL_PROGRAM.read_text()
    if swap:
        for old, new in RL_SWAPS.items():
            assert src.count(old) == 1, f"{RL_PROGRAM.name} should contain {old!r} once"
            src = src.replace(old, new)
        left = [
            line
            for line in src.splitlines()
            if line.startswith(("import torch.distributed.", "from torch.distributed."))
        ]
        assert not left, f"imports not swapped: {left}"
    return src


@pytest.mark.timeout(240)
def test_rl_agent_and_observer_equal_torch_rpc(tmp_path: pathlib.Path) -> None:
    """One observer: the episodes are sequential, so rpc_core and torch.distributed.rpc
    (the oracle) draw the same actions (the same episodes) and train the same policy (up to
    float rounding: the policy runs on each library's own server threads)."""
    ours = _run_rl(tmp_path, "rl_on_rpc_core", rl_source(swap=True), 2)
    if not torch.distributed.rpc.is_available():
        pytest.skip("this torch build has no torch.distributed.rpc to compare with")
    theirs = _run_rl(tmp_path, "rl_on_torch", rl_source(swap=False), 2)
    assert ours["episodes"] == theirs["episodes"]
    for k, v in theirs["policy"].items():
        assert torch.allclose(torch.tensor(ours["policy"][k]), torch.tensor(v), atol=1e-6), k
    assert all(ep["steps"] == {1: ep["min_reward"]} for ep in ours["episodes"])


@pytest.mark.timeout(240)
def test_rl_agent_with_three_observers(tmp_path: pathlib.Path) -> None:
    """Three observers call the agent concurrently from their episodes (nested RPCs both ways)."""
    out = _run_rl(tmp_path, "rl3_on_rpc_core", rl_source(swap=True), 4)
    import tests.rpc_core.torch_rl_program as program

    assert len(out["episodes"]) == program.EPISODES
    for ep in out["episodes"]:
        assert set(ep["steps"]) == {1, 2, 3}
        assert all(1 <= n <= program.STEPS_PER_EPISODE for n in ep["steps"].values())
        assert ep["min_reward"] == min(ep["steps"].values())
    torch.manual_seed(program.SEED)
    initial = program.Policy().state_dict()
    final = {k: torch.tensor(v) for k, v in out["policy"].items()}
    assert all(torch.isfinite(v).all() for v in final.values())
    assert any(not torch.equal(final[k], initial[k]) for k in initial), "the agent's policy was trained"
