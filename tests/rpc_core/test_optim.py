"""DistributedOptimizer against the same torch.optim optimizer run locally.

Parameters live on worker1 and worker2 (two nn.Module shards) and on the trainer itself
(worker0); worker3 owns a shard the forward never uses. For every optimizer configuration
the trainer runs a few steps, each in a fresh dist autograd context, and the same steps
with plain torch autograd and the same optimizer in one process: the weights must be equal
after every step; parameters without a gradient (an unused parameter in a used shard, the
whole unused shard) must not move. Errors while constructing or stepping must reach the
caller with their type. All of it runs in one 4-worker world (tests/_world.py).
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
import torch.nn as nn

import rpc_core as rpc
import rpc_core.autograd as dist_autograd
from rpc_core.optim import DistributedOptimizer
from tests._world import WorldError, run_world

STEPS = 3

CONFIGS: list[tuple[str, type, tuple, dict[str, Any]]] = [
    ("sgd", torch.optim.SGD, (0.05,), {}),  # lr passed positionally
    ("sgd_momentum_nesterov_wd", torch.optim.SGD, (), dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("sgd_dampening", torch.optim.SGD, (), dict(lr=0.05, momentum=0.5, dampening=0.2, maximize=True)),
    ("adam_amsgrad", torch.optim.Adam, (), dict(lr=0.05, amsgrad=True, weight_decay=0.01)),
    ("adamw", torch.optim.AdamW, (), dict(lr=0.05, weight_decay=0.1)),
    ("adagrad", torch.optim.Adagrad, (), dict(lr=0.05, lr_decay=0.01, weight_decay=0.01)),
    ("rmsprop", torch.optim.RMSprop, (), dict(lr=0.01, momentum=0.9, centered=True, weight_decay=0.01)),
    ("adadelta", torch.optim.Adadelta, (), dict(lr=1.0, rho=0.8, weight_decay=0.01)),
    ("adamax", torch.optim.Adamax, (), dict(lr=0.05, weight_decay=0.01)),
    ("rprop", torch.optim.Rprop, (), dict(lr=0.05)),
]


class Shard(nn.Module):
    """A linear layer plus a parameter the forward never uses (it gets no gradient)."""

    def __init__(self, seed: int, din: int, dout: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.rand(dout, din, generator=g, dtype=torch.float64) - 0.5)
        self.bias = nn.Parameter(torch.rand(dout, generator=g, dtype=torch.float64) - 0.5)
        self.unused = nn.Parameter(torch.rand(dout, generator=g, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight.t() + self.bias)

    def param_rrefs(self) -> list[rpc.RRef]:
        return [rpc.RRef(p) for p in self.parameters()]

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.parameters()]


def call_method(rref: Any, name: str, *args: Any) -> Any:
    return getattr(rref.local_value(), name)(*args)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.rand(5, 4, generator=g, dtype=torch.float64), torch.rand(5, 3, generator=g, dtype=torch.float64)


def trainer_param() -> torch.Tensor:
    g = torch.Generator().manual_seed(99)
    return (torch.rand(3, generator=g, dtype=torch.float64) - 0.5).requires_grad_()


def loss_of(h1: Any, h2_of: Any, p0: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = h2_of(h1) * p0
    return ((out - y) ** 2).mean()


def run_config(optim_cls: type, args: tuple, kwargs: dict[str, Any]) -> None:
    # Local oracle.
    s1, s2, s3 = Shard(1, 4, 6), Shard(2, 6, 3), Shard(3, 3, 3)
    p0 = trainer_param()
    local_params = [p0] + list(s1.parameters()) + list(s2.parameters()) + list(s3.parameters())
    opt = optim_cls(local_params, *args, **kwargs)
    local_history = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss_of(s1(x), s2, p0, y).backward()
        opt.step()
        local_history.append([p.detach().clone() for p in local_params])

    # Distributed: shards on workers 1, 2, 3 (the last one unused), p0 on the trainer.
    r1 = rpc.remote("worker1", Shard, args=(1, 4, 6))
    r2 = rpc.remote("worker2", Shard, args=(2, 6, 3))
    r3 = rpc.remote("worker3", Shard, args=(3, 3, 3))
    d0 = trainer_param()
    param_rrefs = [rpc.RRef(d0)]
    for r in (r1, r2, r3):
        param_rrefs += rpc.rpc_sync(r.owner(), call_method, args=(r, "param_rrefs"))
    initial = [d0.detach().clone()] + [w for r in (r1, r2, r3) for w in r.rpc_sync().weights()]
    dopt = DistributedOptimizer(optim_cls, param_rrefs, *args, **kwargs)
    for step in range(STEPS):
        x, y = batch(step)
        with dist_autograd.context() as cid:
            h1 = r1.rpc_sync().forward(x)
            loss = loss_of(h1, lambda h: r2.rpc_async().forward(h).wait(), d0, y)
            dist_autograd.backward(cid, [loss])
            dopt.step(cid)
        now = [d0.detach().clone()] + [w for r in (r1, r2, r3) for w in r.rpc_sync().weights()]
        for i, (got, want) in enumerate(zip(now, local_history[step], strict=True)):
            assert got.dtype == want.dtype and torch.allclose(got, want, rtol=1e-9, atol=1e-12), (
                f"step {step}, parameter {i}: distributed {got} != local {want}"
            )
        assert d0.grad is None, "DistributedOptimizer left a .grad behind on the trainer"
    # Parameters with no gradient in any context did not move; the others did.
    unused = {3, 6} | {7, 8, 9}  # Shard.unused of s1 and s2, all of s3 (p0 is index 0)
    for i, (a, b) in enumerate(zip(initial, now, strict=True)):
        if i in unused:
            assert torch.equal(a, b), f"parameter {i} has no gradient but moved"
        else:
            assert not torch.equal(a, b), f"parameter {i} has a gradient but did not move"


def case_configs() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name, cls, args, kwargs in CONFIGS:
        try:
            run_config(cls, args, kwargs)
            out[name] = None
        except BaseException:  # noqa: BLE001 - each config's outcome is reported
            out[name] = traceback.format_exc()
    return out


class FailingOnConstructor(torch.optim.Optimizer):
    def __init__(self, params: Any) -> None:
        super().__init__(params, {})
        raise ValueError("Error creating optimizer.")

    def step(self, closure: Any = None) -> Any:
        raise NotImplementedError


class FailingOnStep(torch.optim.Optimizer):
    def __init__(self, params: Any) -> None:
        super().__init__(params, {})

    def step(self, closure: Any = None) -> Any:
        raise ValueError("Error running optimizer.")


def check_errors() -> None:
    r1 = rpc.remote("worker1", Shard, args=(1, 4, 6))
    r2 = rpc.remote("worker2", Shard, args=(2, 6, 3))
    params = rpc.rpc_sync("worker1", call_method, args=(r1, "param_rrefs"))
    params += rpc.rpc_sync("worker2", call_method, args=(r2, "param_rrefs"))

    with pytest.raises(ValueError, match="Error creating optimizer."):
        DistributedOptimizer(FailingOnConstructor, params)
    with pytest.raises(TypeError, match="bogus"):
        DistributedOptimizer(torch.optim.SGD, params, lr=0.1, bogus=1)  # bad kwargs, raised on the owners

    failing = DistributedOptimizer(FailingOnStep, params)
    x, _ = batch(0)
    with dist_autograd.context() as cid:
        loss = r2.rpc_sync().forward(r1.rpc_sync().forward(x)).sum()
        dist_autograd.backward(cid, [loss])
        with pytest.raises(ValueError, match="Error running optimizer."):
            failing.step(cid)
    sgd = DistributedOptimizer(torch.optim.SGD, params, lr=0.1)
    with pytest.raises(RuntimeError, match="Could not find autograd context with id"):
        sgd.step(cid)  # a released context


def _world(ctx: Any) -> dict[str, str | None] | None:
    if ctx.rank != 0:
        return None
    out = case_configs()
    try:
        check_errors()
        out["errors"] = None
    except BaseException:  # noqa: BLE001 - reported with the configs' outcomes
        out["errors"] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def world() -> Any:
    try:
        return run_world(_world, 4, timeout=120)[0]
    except WorldError as e:
        return e


@pytest.mark.parametrize("case", [c[0] for c in CONFIGS] + ["errors"])
def test_dist_optim(world: Any, case: str) -> None:
    if isinstance(world, WorldError):
        pytest.fail(f"the world failed:\n{world}")
    if world[case] is not None:
        pytest.fail(f"{case} failed on worker0:\n{world[case]}")
