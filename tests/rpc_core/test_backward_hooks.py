"""Hooks in the distributed backward (rpc_core.autograd.hooks, an rpc_core extension) against
plain torch.

A small model split over two workers: worker1 owns the first layer, worker2 the second
(tensors go worker1 -> trainer -> worker2, so the trainer's backward calls worker2, then
worker1), and a third layer applied twice on worker1 (tensors go back and forth between
the trainer and worker1: worker1 gets several gradient calls per backward, and its hook
must run once, after the last). The trainer (worker0) also owns a parameter. For SGD
with momentum and Adam, several steps with ``DistributedOptimizer.step_in_backward`` must
give the weights (and losses) of the same optimizer in one process, bit for bit as
``DistributedOptimizer.step`` does; a hook's result comes back to the trainer by worker
name; a hook that raises makes the trainer's backward raise, naming the worker.
"""

from __future__ import annotations

import traceback
import weakref
from typing import Any

import pytest
import torch
import torch.nn as nn

import rpc_core as rpc
import rpc_core.autograd as dist_autograd
from rpc_core.optim import DistributedOptimizer
from tests._world import WorldError, run_world

STEPS = 4
CONFIGS: list[tuple[str, type, dict[str, Any]]] = [
    ("sgd_momentum", torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    ("adam", torch.optim.Adam, dict(lr=0.02)),
]


class Layer(nn.Module):
    def __init__(self, seed: int, din: int, dout: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.rand(dout, din, generator=g, dtype=torch.float64) - 0.5)
        self.bias = nn.Parameter(torch.rand(dout, generator=g, dtype=torch.float64) - 0.5)

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


def loss_of(l1: Any, l2: Any, l3: Any, p0: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = l3(l2(l1(x)) * p0)  # l3 twice: the trainer sends worker1 a tensor it computed from worker1's
    return ((l3(h) - y) ** 2).mean()


def run_config(name: str, optim_cls: type, kwargs: dict[str, Any], in_backward: bool) -> None:
    l1, l2, l3, p0 = Layer(1, 4, 6), Layer(2, 6, 3), Layer(3, 3, 3), trainer_param()
    params = [p0] + [p for m in (l1, l2, l3) for p in m.parameters()]
    opt = optim_cls(params, **kwargs)
    want_losses, want = [], []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss = loss_of(l1, l2, l3, p0, x, y)
        loss.backward()
        opt.step()
        want_losses.append(loss.item())
        want.append([p.detach().clone() for p in params])

    r1 = rpc.remote("worker1", Layer, args=(1, 4, 6))
    r2 = rpc.remote("worker2", Layer, args=(2, 6, 3))
    r3 = rpc.remote("worker1", Layer, args=(3, 3, 3))
    d0 = trainer_param()
    rrefs = [rpc.RRef(d0)]
    for r in (r1, r2, r3):
        rrefs += rpc.rpc_sync(r.owner(), call_method, args=(r, "param_rrefs"))
    dopt = DistributedOptimizer(optim_cls, rrefs, **kwargs)

    def remote_layer(r: Any) -> Any:
        return lambda h: r.rpc_sync().forward(h)

    for step in range(STEPS):
        x, y = batch(step)
        with dist_autograd.context() as cid:
            loss = loss_of(remote_layer(r1), remote_layer(r2), remote_layer(r3), d0, x, y)
            if in_backward:
                dopt.step_in_backward(cid)
                dist_autograd.backward(cid, [loss])
                # DistributedOptimizer's hook returns nothing; every owner reports it ran.
                assert dist_autograd.backward_results(cid) == {
                    w: {"rpc_core.optim": None} for w in ("worker0", "worker1", "worker2")
                }
            else:
                dist_autograd.backward(cid, [loss])
                dopt.step(cid)
        assert loss.item() == want_losses[step], f"{name} step {step}: loss {loss.item()} != {want_losses[step]}"
        got = [d0.detach().clone()] + [w for r in (r1, r2, r3) for w in r.rpc_sync().weights()]
        for i, (g, w) in enumerate(zip(got, want[step], strict=True)):
            assert torch.equal(g, w), f"{name} step {step}, parameter {i}: distributed {g} != local {w}"


def _staleness_hook(context_id: int, payload: dict[str, int]) -> Any:
    grads = dist_autograd.get_gradients(context_id)
    counted: torch.futures.Future[int] = torch.futures.Future()
    counted.set_result(len(grads))
    # A chained future (``then`` makes a torch._C.Future, not a torch.futures.Future) is waited for too.
    return counted.then(lambda f: {"step": payload["step"], "grads": f.value()})


def _failing_hook(context_id: int, payload: Any) -> None:
    raise ValueError(f"no update for payload {payload}")


def install(which: str) -> None:
    dist_autograd.on_backward_done("test", _staleness_hook if which == "ok" else _failing_hook)


def check_results_and_errors() -> None:
    r1 = rpc.remote("worker1", Layer, args=(1, 4, 6))
    r2 = rpc.remote("worker2", Layer, args=(2, 6, 3))
    rpc.rpc_sync("worker1", install, args=("ok",))
    rpc.rpc_sync("worker2", install, args=("fail",))
    x, _ = batch(0)
    with dist_autograd.context() as cid:
        loss = r1.rpc_sync().forward(x).sum()
        dist_autograd.set_backward_info(cid, "test", {"step": 7})
        dist_autograd.backward(cid, [loss])
        # worker1's hook saw its two gradients; the trainer has no "test" hook.
        assert dist_autograd.backward_results(cid) == {"worker1": {"test": {"step": 7, "grads": 2}}}
    with dist_autograd.context() as cid:
        loss = r2.rpc_sync().forward(r1.rpc_sync().forward(x)).sum()
        dist_autograd.set_backward_info(cid, "test", {"step": 8})
        with pytest.raises(
            ValueError,
            match=r"Error on Node 2: in a backward hook: ValueError: no update for "
            r"payload \{'step': 8\} \(on worker2\)",
        ):
            dist_autograd.backward(cid, [loss])
    with dist_autograd.context() as cid:  # without a payload no hook runs
        loss = r2.rpc_sync().forward(r1.rpc_sync().forward(x)).sum()
        dist_autograd.backward(cid, [loss])
        assert dist_autograd.backward_results(cid) == {}


_saved: list[Any] = []  # weak references to activations a forward saved for its backward


def _forward_keeping(x: torch.Tensor) -> torch.Tensor:
    """On worker1: ``(x @ w) ** 2``, whose graph saves ``x @ w``; a weak reference to it is kept."""
    w = torch.ones(4, 3, dtype=torch.float64, requires_grad=True)
    h = x @ w
    _saved.append(weakref.ref(h))
    return h * h


def _install_graph_hook() -> None:
    dist_autograd.on_backward_done("graph", lambda context_id, payload: None)


def _graph_here(cid: int) -> dict[str, Any]:
    """On worker1: what context ``cid`` holds here."""
    ctx = dist_autograd._retrieve_context(cid)
    return {
        "sends": len(ctx._send_functions()),
        "saved_alive": _saved[-1]() is not None,
        "grads": len(dist_autograd.get_gradients(cid)),
    }


def _take_twice(cid: int) -> tuple[int, int]:
    first = dist_autograd.take_gradients(cid)
    return len(first), len(dist_autograd.take_gradients(cid))


def check_graph_freed_after_hooks() -> None:
    """A worker whose hooks ran frees its part of the graph at once (the activations it
    saved), keeping the gradients until the release or take_gradients; without hooks the
    graph stays until the release."""
    x, _ = batch(0)
    x = x.requires_grad_()
    rpc.rpc_sync("worker1", _install_graph_hook)
    with dist_autograd.context() as cid:
        loss = rpc.rpc_sync("worker1", _forward_keeping, args=(x,)).sum()
        before = rpc.rpc_sync("worker1", _graph_here, args=(cid,))
        dist_autograd.set_backward_info(cid, "graph", None)
        dist_autograd.backward(cid, [loss])
        after = rpc.rpc_sync("worker1", _graph_here, args=(cid,))
        taken = rpc.rpc_sync("worker1", _take_twice, args=(cid,))
        assert dist_autograd.get_gradients(cid)[x].shape == x.shape  # the caller's gradient came back
    assert before == {"sends": 1, "saved_alive": True, "grads": 0}, before
    assert after == {"sends": 0, "saved_alive": False, "grads": 1}, after
    assert taken == (1, 0), taken
    with dist_autograd.context() as cid:  # no payload: nothing freed before the release
        loss = rpc.rpc_sync("worker1", _forward_keeping, args=(x,)).sum()
        dist_autograd.backward(cid, [loss])
        kept = rpc.rpc_sync("worker1", _graph_here, args=(cid,))
    assert kept == {"sends": 1, "saved_alive": True, "grads": 1}, kept


def _world(ctx: Any) -> dict[str, str | None] | None:
    if ctx.rank != 0:
        return None
    out: dict[str, str | None] = {}
    for name, cls, kwargs in CONFIGS:
        for in_backward in (False, True):
            key = f"{name}-{'in_backward' if in_backward else 'step'}"
            try:
                run_config(key, cls, kwargs, in_backward)
                out[key] = None
            except BaseException:  # noqa: BLE001 - each case's outcome is reported
                out[key] = traceback.format_exc()
    try:
        check_results_and_errors()
        out["results_and_errors"] = None
    except BaseException:  # noqa: BLE001 - reported with the others
        out["results_and_errors"] = traceback.format_exc()
    try:
        check_graph_freed_after_hooks()
        out["graph_freed"] = None
    except BaseException:  # noqa: BLE001 - reported with the others
        out["graph_freed"] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def world() -> Any:
    try:
        return run_world(_world, 3, timeout=300)[0]
    except WorldError as e:
        return e


@pytest.mark.timeout(360)
@pytest.mark.parametrize(
    "case", [f"{c[0]}-{m}" for c in CONFIGS for m in ("step", "in_backward")] + ["results_and_errors", "graph_freed"]
)
def test_backward_hooks(world: Any, case: str) -> None:
    if isinstance(world, WorldError):
        pytest.fail(f"the world failed:\n{world}")
    if world[case] is not None:
        pytest.fail(f"{case} failed on worker0:\n{world[case]}")
