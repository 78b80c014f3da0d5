"""Distributed autograd: gradients across workers against a plain-torch oracle.

Every correctness case runs its computation twice on worker0 (the trainer): once in one
process with plain torch autograd (``dist=False``: remote calls become local calls) and
once across workers inside ``dist_autograd.context()`` (``dist=True``). The gradients of
``get_gradients`` must match the local ``.grad`` (float64, allclose), ``.grad`` must stay
None, and the context must hold exactly the leaves that got a gradient. Gradients that live
on other workers (module shards, remote parameters) are fetched over RPC and compared too.

One 4-worker world (tests/_world.py) runs all the cases that need no special world
(``_main_world``), one after the other on worker0, and returns each case's outcome; one
pytest test per case checks it. The killed-worker case gets its own 3-worker world.

One module, though past 400 lines: the cases share that world (its start-up is most of the
run time) and the oracle's helpers (``verify``, ``call``, ``leaves``).
"""

from __future__ import annotations

import os
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn as nn

import rpc_core as rpc
import rpc_core.autograd as dist_autograd
from rpc_core.functions import async_execution
from tests._world import WorldError, run_world

W1, W2, W3 = "worker1", "worker2", "worker3"
CTX_MISSING = "Could not find autograd context with id"


# ---------------------------------------------------------------------------------------------
# Local/distributed call helpers: the same forward code runs both ways.
# ---------------------------------------------------------------------------------------------
def call(dist: bool, how: str, dst: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on ``dst`` (dist) or here (local), by rpc_sync/rpc_async/remote."""
    if not dist:
        out = fn(*args, **kwargs)
        if getattr(fn, "_wrapped_async_rpc_function", None) is not None:
            out = out.wait()
        return out
    if how == "sync":
        return rpc.rpc_sync(dst, fn, args=args, kwargs=kwargs)
    if how == "async":
        return rpc.rpc_async(dst, fn, args=args, kwargs=kwargs).wait()
    if how == "remote":
        return rpc.remote(dst, fn, args=args, kwargs=kwargs).to_here()
    raise ValueError(how)


def acall(dist: bool, dst: Any, fn: Callable[..., Any], *args: Any) -> torch.futures.Future:
    """A Future of ``fn(*args)`` on ``dst`` (rpc_async), or an already completed local one."""
    if dist:
        return rpc.rpc_async(dst, fn, args=args)
    out = fn(*args)
    if getattr(fn, "_wrapped_async_rpc_function", None) is not None:
        return out
    f: torch.futures.Future = torch.futures.Future()
    f.set_result(out)
    return f


# ---------------------------------------------------------------------------------------------
# Functions that run on the workers (module level: RPC sends functions by name).
# ---------------------------------------------------------------------------------------------
def udf(a: torch.Tensor, b: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return torch.tanh(a @ b.t()) * scale + a.sum() * b[0].sum()


def nested(dist: bool, hops: list[str], a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Forward through ``hops`` one nested RPC at a time; the last hop runs ``udf``."""
    if not hops:
        return udf(a, b)
    return call(dist, "sync", hops[0], nested, dist, hops[1:], a * 2, b) + a.sin()


def rref_plus(rref: Any, t: torch.Tensor) -> torch.Tensor:
    return rref.to_here() + t


def rref_local_mul(rref: Any, t: torch.Tensor) -> torch.Tensor:
    return rref.local_value() * t


def sum_of_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum()


def make_shard(seed: int, din: int, dout: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(din, dout), nn.Tanh()).double()


def make_param(seed: int, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=g, dtype=torch.float64).requires_grad_()


def module_grads(module_rref: Any, context_id: int) -> list[Any]:
    """On the module's owner: this context's gradient of each parameter, and its ``.grad``."""
    grads = dist_autograd.get_gradients(context_id)
    return [(grads.get(p), p.grad) for p in module_rref.local_value().parameters()]


def tensor_grad(rref: Any, context_id: int) -> Any:
    t = rref.local_value()
    return dist_autograd.get_gradients(context_id).get(t), t.grad


def use_param(p_rref: Any, x: torch.Tensor) -> torch.Tensor:
    return (p_rref.local_value() * x).sin()


_OWN_LEAF: dict[str, torch.Tensor] = {}


def times_own_leaf(b: torch.Tensor) -> torch.Tensor:
    """Multiplies by a leaf that lives here; ``b`` needs no grad, the result does."""
    w = _OWN_LEAF.setdefault("w", make_param(7, *b.shape))
    return b * w


def own_leaf_grad(context_id: int) -> Any:
    w = _OWN_LEAF["w"]
    return dist_autograd.get_gradients(context_id).get(w), w.grad


@async_execution
def async_mul_add(dist: bool, dst: str, x: torch.Tensor, y: torch.Tensor) -> torch.futures.Future:
    return acall(dist, dst, torch.mul, x, y).then(lambda f: f.wait() + x)


@async_execution
def async_chain(dist: bool, dst: str, x: torch.Tensor, n: int) -> torch.futures.Future:
    fut = acall(dist, dst, torch.mul, x, x)
    for _ in range(n):
        fut = fut.then(lambda f: f.wait() * 2 + x)
    return fut


@async_execution
def async_nested(dist: bool, x: torch.Tensor, y: torch.Tensor) -> torch.futures.Future:
    # worker1 -> worker2 (async function) -> worker3 (builtin), all through futures.
    return acall(dist, W2, async_mul_add, dist, W3, x, y).then(lambda f: f.wait() * y)


@async_execution
def async_rpc_in_callback(dist: bool, x: torch.Tensor, y: torch.Tensor) -> torch.futures.Future:
    # The callback itself makes an RPC: the context must follow it into the callback thread.
    return acall(dist, W2, torch.mul, x, y).then(lambda f: call(dist, "sync", W3, torch.add, f.wait(), x))


class AsyncPS:
    """An object held by an RRef whose method is an async function with its own leaf."""

    def __init__(self, seed: int) -> None:
        self.w = make_param(seed, 3, 4)

    @async_execution
    def forward(self, dist: bool, x: torch.Tensor) -> torch.futures.Future:
        return acall(dist, W3, torch.mul, x, self.w).then(lambda f: f.wait().exp())


def async_ps_grad(ps_rref: Any, context_id: int) -> Any:
    w = ps_rref.local_value().w
    return dist_autograd.get_gradients(context_id).get(w), w.grad


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise ValueError("Simulate error on backward pass")


def fail_in_backward(x: torch.Tensor) -> torch.Tensor:
    return _FailingBackward.apply(x) * 2


class _DieInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        os._exit(17)  # the worker is killed in the middle of the distributed backward pass


def die_in_backward(x: torch.Tensor) -> torch.Tensor:
    return _DieInBackward.apply(x) * 3


def has_context(context_id: int) -> bool:
    return dist_autograd._context.is_valid(context_id)


def context_summary(context_id: int) -> Any:
    ctx = dist_autograd._retrieve_context(context_id)
    return len(ctx._send_functions()), len(ctx._recv_functions()), sorted(ctx._known_worker_ids())


def num_contexts() -> int:
    return dist_autograd._get_debug_info()["num_autograd_contexts"]


def new_context_ids(k: int) -> Any:
    ids = []
    for _ in range(k):
        with dist_autograd.context() as cid:
            ids.append(cid)
    return ids, dist_autograd._get_max_id(), rpc.get_worker_info().id


def remote_get_gradients(context_id: int) -> Any:
    return dist_autograd.get_gradients(context_id)


# ---------------------------------------------------------------------------------------------
# The oracle
# ---------------------------------------------------------------------------------------------
def leaves(seed: int, specs: Sequence[Any]) -> list[torch.Tensor]:
    """Fresh leaves from ``specs`` = [(shape, dtype, requires_grad)], same values per seed."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape, dtype, rg in specs:
        out.append((torch.rand(shape, generator=g, dtype=torch.float64) + 0.5).to(dtype).requires_grad_(rg))
    return out


F64 = torch.float64


def spec(*shapes: Any, dtype: torch.dtype = F64, rg: bool = True) -> list[Any]:
    return [(s, dtype, rg) for s in shapes]


def as_roots(r: Any) -> list[torch.Tensor]:
    return list(r) if isinstance(r, (list, tuple)) else [r]


def assert_close(got: torch.Tensor | None, want: torch.Tensor | None, what: str) -> None:
    assert (got is None) == (want is None), f"{what}: got {got}, want {want}"
    if want is not None:
        assert got is not None
        assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-9), f"{what}: {got} != {want}"


def check_grads(
    grads: dict[torch.Tensor, torch.Tensor],
    inputs: Sequence[torch.Tensor],
    expected: Sequence[torch.Tensor | None],
    scale: float = 1.0,
) -> None:
    for i, (t, e) in enumerate(zip(inputs, expected, strict=True)):
        assert t.grad is None, f"input {i}: .grad was set ({t.grad})"
        assert_close(grads.get(t), None if e is None else e * scale, f"input {i}")
    want = sum(e is not None for e in expected)
    assert len(grads) == want, f"context holds {len(grads)} gradients, expected {want}"


def verify(
    forward: Callable[..., Any],
    specs: Sequence[Any],
    seed: int = 0,
    remote_checks: Sequence[Callable[[bool, int], Any]] = (),
    backward_times: int = 1,
) -> None:
    """Run ``forward(dist, *leaves)`` locally with torch autograd and distributed with
    dist autograd; compare the gradients of the inputs (and whatever ``remote_checks``
    return: called with (dist, context_id) they give a list of gradients, or of
    (gradient, .grad) pairs for tensors living on other workers)."""
    local = leaves(seed, specs)
    roots = as_roots(forward(False, *local))
    for _ in range(backward_times):
        torch.autograd.backward(roots, retain_graph=True)
    expected = [t.grad for t in local]
    local_remote = [chk(False, -1) for chk in remote_checks]
    assert any(e is not None for e in expected) or local_remote, "the oracle computed no gradient"

    inputs = leaves(seed, specs)
    with dist_autograd.context() as cid:
        roots = as_roots(forward(True, *inputs))
        for _ in range(backward_times):
            dist_autograd.backward(cid, roots, retain_graph=True)
        check_grads(dist_autograd.get_gradients(cid), inputs, expected)
        for k, chk in enumerate(remote_checks):
            for j, (got, want) in enumerate(zip(chk(True, cid), local_remote[k], strict=True)):
                got_grad, got_dot_grad = got
                assert got_dot_grad is None, f"remote check {k}/{j}: .grad was set on the owner"
                assert_close(got_grad, want, f"remote check {k}/{j}")


# ---------------------------------------------------------------------------------------------
# Cases (run on worker0, the trainer)
# ---------------------------------------------------------------------------------------------
def case_builtin_ops() -> None:
    for how in ("sync", "async", "remote"):

        def fwd(dist: bool, a: torch.Tensor, b: torch.Tensor, how: str = how) -> torch.Tensor:
            x = call(dist, how, W1, torch.mul, a, b)
            y = call(dist, how, W2, torch.matmul, a, b.t())  # a non-contiguous argument
            z = call(dist, how, W1, torch.add, a, a)  # one tensor twice in one message
            return (x * z).sum() + y.trace()

        verify(fwd, spec((3, 4), (3, 4)))


def case_python_udf() -> None:
    for how in ("sync", "async", "remote"):

        def fwd(dist: bool, a: torch.Tensor, b: torch.Tensor, how: str = how) -> torch.Tensor:
            return call(dist, how, W1, udf, a, b, scale=3.0).sum() + call(dist, how, W2, udf, b, a).pow(2).sum()

        verify(fwd, spec((3, 4), (3, 4)), seed=1)


def split_and_ignore(a: torch.Tensor, b: torch.Tensor, unused: torch.Tensor) -> Any:
    """Several outputs (some unused by the caller) and an argument it does not use."""
    return list(torch.split(a * b, 1)) + [b.exp()]


def complex_args(d: dict[str, Any]) -> dict[str, Any]:
    x, y = d["pair"]
    (z,) = d["nested"]["one"]
    return {"sum": x + y * z, "list": [x * z, d["scale"] * y], "none": None}


def case_outputs_and_containers() -> None:
    """Multiple output tensors of which some are unused, an unused argument, tensors nested
    in dicts/lists/tuples both ways, and a (linear) gradient hook on a leaf."""

    def fwd(dist: bool, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        parts = call(dist, "sync", W1, split_and_ignore, a, b, c)  # c is sent but not used
        out = call(dist, "remote", W2, complex_args, {"pair": (a, b), "nested": {"one": [c]}, "scale": 3.0})
        return parts[0].sum() + parts[2].sum() + out["sum"].sum() + out["list"][1].pow(2).sum()

    verify(fwd, spec((3, 2), (3, 2), (3, 2)), seed=25)

    def fwd_hook(dist: bool, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a.register_hook(lambda g: g * 2)
        return call(dist, "sync", W1, torch.mul, a, b).sum() + call(dist, "async", W2, udf, a, b).sum()

    verify(fwd_hook, spec((3, 3), (3, 3)), seed=26)


def case_graph_recording() -> None:
    """One RPC records one send and one recv on each side; the trainer knows worker1."""
    a, b = leaves(2, spec((2, 2), (2, 2)))
    with dist_autograd.context() as cid:
        rpc.rpc_sync(W1, torch.add, args=(a, b))
        assert context_summary(cid) == (1, 1, [1])
        assert rpc.rpc_sync(W1, context_summary, args=(cid,)) == (1, 1, [0])
        assert dist_autograd._current_context()._context_id() == cid
        # No tensor requiring grad: nothing recorded, but the worker still knows the context.
        rpc.rpc_sync(W2, torch.add, args=(a.detach(), b.detach()))
        assert context_summary(cid) == (1, 1, [1, 2])
        assert rpc.rpc_sync(W2, context_summary, args=(cid,)) == (0, 0, [0])


def case_rref_args() -> None:
    def fwd(dist: bool, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        r: Any  # RRefs when dist, else the local values (and so below)
        t: Any
        if dist:
            r = rpc.remote(W1, torch.mul, args=(a, b))  # owned by worker1
            x = rpc.rpc_sync(W2, rref_plus, args=(r, c))  # worker2 fetches it from worker1
            y = rpc.rpc_sync(W1, rref_local_mul, args=(r, c))  # used on its owner
            z = r.to_here()  # fetched by the trainer
            t = rpc.remote(W3, udf, args=(x, c))
            w = t.rpc_sync().sum()  # RRef proxy: Tensor.sum on the owner
            v = t.remote().mul(a).to_here()  # proxy remote with a tensor argument
        else:
            r = a * b
            x, y, z = r + c, r * c, r
            t = udf(x, c)
            w, v = t.sum(), t.mul(a)
        return (x * y).sum() + z.sum() + w + v.sum()

    verify(fwd, spec((3, 3), (3, 3), (3, 3)), seed=3)


def case_rref_backward() -> None:
    """RRef.backward(context_id) on a user RRef runs the distributed backward from its owner."""
    a, b = leaves(4, spec((3, 3), (3, 3)))
    sum_of_mul(a, b).backward()
    expected = [a.grad, b.grad]
    a2, b2 = leaves(4, spec((3, 3), (3, 3)))
    with dist_autograd.context() as cid:
        r = rpc.remote(W2, sum_of_mul, args=(a2, b2))
        r.backward(cid)
        check_grads(dist_autograd.get_gradients(cid), [a2, b2], expected)
        r.backward(cid, retain_graph=True)
        check_grads(dist_autograd.get_gradients(cid), [a2, b2], expected, scale=2.0)


def case_chain_3_workers() -> None:
    def fwd(dist: bool, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        x = call(dist, "sync", W1, torch.add, a, b)
        y = call(dist, "async", W2, udf, x, b)
        z = call(dist, "remote", W3, torch.sigmoid, y)
        return z.sum()

    verify(fwd, spec((4, 4), (4, 4)), seed=5)

    def fwd_rref_chain(dist: bool, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if not dist:
            return (a * b + b + b).sum()
        r1 = rpc.remote(W1, torch.mul, args=(a, b))
        r2 = rpc.remote(W2, rref_plus, args=(r1, b))  # worker2 pulls from worker1
        r3 = rpc.remote(W3, rref_plus, args=(r2, b))  # worker3 pulls from worker2
        return r3.to_here().sum()

    verify(fwd_rref_chain, spec((4, 4), (4, 4)), seed=6)


def case_round_trips() -> None:
    """trainer -> ps0 -> trainer -> ps1 -> trainer -> ps0, with results reused across hops."""

    def fwd(dist: bool, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        x = call(dist, "sync", W1, udf, a, b)  # ps0: (3, 3)
        y = x * c + a @ a.t()  # trainer
        z = call(dist, "sync", W2, udf, y, c)  # ps1
        w = z.tanh().sum(1)  # trainer
        v = call(dist, "async", W1, torch.mul, w, x[:, 0])  # ps0 again, with ps0's own output
        return v.sum() + call(dist, "remote", W2, torch.sum, y * x)

    verify(fwd, spec((3, 4), (3, 4), (3, 3)), seed=7)


def case_nested_rpc() -> None:
    def fwd(dist: bool, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        deep = call(dist, "sync", W1, nested, dist, [W2, W3], a, b)  # worker1 -> worker2 -> worker3
        back = call(dist, "async", W1, nested, dist, ["worker0"], b, a)  # worker1 -> back to the trainer
        self_ = call(dist, "sync", W2, nested, dist, [W2], a, a)  # worker2 -> itself
        return (deep * back).sum() + self_.sum()

    verify(fwd, spec((3, 3), (3, 3)), seed=8)


def requests_received() -> int:
    """User requests this worker received so far (this one included)."""
    n: int = rpc._get_current_rpc_agent().dispatch.n_received
    return n


def case_gradients_for_the_caller_ride_on_answers() -> None:
    """Gradients for tensors the worker making a gradient call sent come back in that call's
    answer: backward sends no request to the trainer, nor to worker1 from worker2."""

    def fwd(dist: bool, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        x = call(dist, "sync", W1, udf, a, b)  # x: worker1's answer to the trainer
        y = call(dist, "sync", W1, nested, dist, [W2], x, b)  # trainer -> worker1 -> worker2
        return (y * x).sum()

    verify(fwd, spec((3, 3), (3, 3)), seed=12)
    a, b = leaves(12, spec((3, 3), (3, 3)))
    with dist_autograd.context() as cid:
        loss = fwd(True, a, b)
        here, there = requests_received(), rpc.rpc_sync(W1, requests_received)
        dist_autograd.backward(cid, [loss])
        assert requests_received() == here, "backward sent the trainer a gradient call"
        # worker1 got the root pass's one gradient call (x and y came in two answers; a pass
        # sends one call per worker), one more for x once y's answer brought back x's part
        # through the nested call (x was an argument there; its two parts there are added up
        # first), and the call that reads its count: none from worker2
        got = rpc.rpc_sync(W1, requests_received) - there
        assert got == 3, f"worker1 received {got} requests, expected 3"
        assert set(dist_autograd.get_gradients(cid)) == {a, b}


def case_multiple_roots() -> None:
    def fwd(dist: bool, a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
        r1 = call(dist, "sync", W1, torch.mul, a, b).sum()
        r2 = call(dist, "async", W2, udf, a, b).sum()
        r3 = (a * 3).sum()  # a purely local root
        r4 = call(dist, "remote", W3, sum_of_mul, a, a)
        return [r1, r2, r3, r4]

    verify(fwd, spec((3, 3), (3, 3)), seed=9)


def case_tensor_used_by_two_rpcs() -> None:
    def fwd(dist: bool, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        x = call(dist, "sync", W1, torch.mul, a, b)
        y = call(dist, "async", W2, torch.mul, a, a)
        z = call(dist, "sync", W1, udf, a, b)  # a second message to the same worker
        return (x + y + z + a).sum()

    verify(fwd, spec((3, 3), (3, 3)), seed=10)


def case_mixed_requires_grad() -> None:
    def fwd(dist: bool, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        x = call(dist, "sync", W1, torch.mul, a, b)
        y = call(dist, "sync", W2, torch.add, b, b)  # no tensor needs grad
        z = call(dist, "async", W3, udf, b, a)
        return (x * y).sum() + z.sum()

    verify(fwd, [((3, 3), F64, True), ((3, 3), F64, False)], seed=11)

    # Only the callee's own leaf needs grad: the gradient goes to worker1 and stays there.
    def fwd_own_leaf(dist: bool, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (call(dist, "sync", W1, times_own_leaf, b) * a).sum()

    def own_leaf(dist: bool, cid: int) -> list[Any]:
        if not dist:
            w = _OWN_LEAF.pop("w")
            return [w.grad]
        return [rpc.rpc_sync(W1, own_leaf_grad, args=(cid,))]

    verify(fwd_own_leaf, [((3, 3), F64, True), ((3, 3), F64, False)], seed=12, remote_checks=[own_leaf])


def case_different_dtypes() -> None:
    def fwd(dist: bool, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        x = call(dist, "sync", W1, torch.add, a, b)  # float32 + float64 -> float64
        y = call(dist, "async", W2, udf, a, c)  # float32 throughout
        z = call(dist, "remote", W3, torch.mul, c, torch.arange(9).view(3, 3))  # with an int tensor
        return x.sum() + y.double().sum() + z.double().pow(2).sum()

    verify(fwd, [((3, 3), torch.float32, True), ((3, 3), F64, True), ((3, 3), torch.float32, True)], seed=13)


class Traced(torch.Tensor):
    """A tensor subclass that overrides torch functions, as wrappers for logging or
    parallelism do; it travels as a plain tensor."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        Traced.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def case_tensor_subclass_leaf() -> None:
    """A leaf of a subclass that overrides torch functions: its gradient as in plain torch
    (backward passes over such tensors go through torch's public functions, as in torch)."""

    def make() -> torch.Tensor:
        g = torch.Generator().manual_seed(21)
        return torch.rand(3, 3, generator=g, dtype=F64).as_subclass(Traced).requires_grad_()

    def fwd(dist: bool, a: torch.Tensor) -> torch.Tensor:
        return (call(dist, "sync", W1, torch.mul, a, a) * a).sum() + call(dist, "remote", W2, udf, a, a).sum()

    local = make()
    fwd(False, local).backward()
    before = Traced.calls
    a = make()
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [fwd(True, a)])
        grads = dist_autograd.get_gradients(cid)
    assert Traced.calls > before, "the subclass's __torch_function__ never ran"
    assert a.grad is None and list(grads) == [a], grads
    assert local.grad is not None
    assert_close(grads[a].as_subclass(torch.Tensor), local.grad.as_subclass(torch.Tensor), "subclass leaf")


def case_module_shards() -> None:
    """Two nn.Module shards owned by workers 1 and 2, driven through RRef proxies, and a
    parameter owned by worker3 fetched with to_here and used on the trainer."""
    shards: dict[str, Any] = {}  # RRefs ("d...") and the oracle's local objects ("l...")

    def fwd(dist: bool, x: torch.Tensor) -> torch.Tensor:
        s1: Any
        s2: Any
        if dist:
            s1 = shards["d1"] = rpc.remote(W1, make_shard, args=(1, 4, 5))
            s2 = shards["d2"] = rpc.remote(W2, make_shard, args=(2, 5, 2))
            p = shards["dp"] = rpc.remote(W3, make_param, args=(3, 2, 3))
            h = s1.rpc_sync().forward(x)
            out = s2.remote().forward(h).to_here()
            w = p.to_here()
            h2 = s1.rpc_async().forward(x * 2).wait()  # the shard used twice
        else:
            s1 = shards["l1"] = make_shard(1, 4, 5)
            s2 = shards["l2"] = make_shard(2, 5, 2)
            w = shards["lp"] = make_param(3, 2, 3)
            h = s1(x)
            out = s2(h)
            h2 = s1(x * 2)
        return (out @ w).pow(2).sum() + h2.sum()

    def shard_grads(dist: bool, cid: int) -> list[Any]:
        if not dist:
            return [p.grad for p in list(shards["l1"].parameters()) + list(shards["l2"].parameters())] + [
                shards["lp"].grad
            ]
        got = rpc.rpc_sync(W1, module_grads, args=(shards["d1"], cid))
        got += rpc.rpc_sync(W2, module_grads, args=(shards["d2"], cid))
        got.append(rpc.rpc_sync(W3, tensor_grad, args=(shards["dp"], cid)))
        return got

    verify(fwd, spec((6, 4)), seed=14, remote_checks=[shard_grads])


def case_async_execution() -> None:
    ps: dict[str, Any] = {}

    def fwd(dist: bool, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        x = call(dist, "sync", W1, async_mul_add, dist, W2, a, b)
        y = call(dist, "async", W1, async_chain, dist, W3, a, 3)
        z = call(dist, "remote", W1, async_nested, dist, a, b)
        if dist:
            r = ps["d"] = rpc.remote(W2, AsyncPS, args=(15,))
            u = r.rpc_sync().forward(dist, b)
            v = r.rpc_async().forward(dist, a).wait()
        else:
            obj = ps["l"] = AsyncPS(15)
            u = obj.forward(dist, b).wait()
            v = obj.forward(dist, a).wait()
        return (x * y).sum() + z.sum() + (u * v).sum()

    def ps_grad(dist: bool, cid: int) -> list[Any]:
        if not dist:
            return [ps["l"].w.grad]
        return [rpc.rpc_sync(W2, async_ps_grad, args=(ps["d"], cid))]

    verify(fwd, spec((3, 4), (3, 4)), seed=15, remote_checks=[ps_grad])


def case_async_rpc_in_callback() -> None:
    def fwd(dist: bool, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return call(dist, "sync", W1, async_rpc_in_callback, dist, a, b).pow(2).sum()

    verify(fwd, spec((3, 3), (3, 3)), seed=16)


def case_retain_graph_accumulates() -> None:
    shard: dict[str, Any] = {}

    def fwd(dist: bool, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        s: Any
        if dist:
            s = shard["d"] = rpc.remote(W1, make_shard, args=(17, 3, 3))
            h = s.rpc_sync().forward(a)
        else:
            s = shard["l"] = make_shard(17, 3, 3)
            h = s(a)
        return (call(dist, "sync", W2, torch.matmul, h, b) + call(dist, "async", W3, udf, a, b)).sum()

    def grads(dist: bool, cid: int) -> list[Any]:
        if not dist:
            return [p.grad for p in shard["l"].parameters()]
        return rpc.rpc_sync(W1, module_grads, args=(shard["d"], cid))

    # The oracle runs backward 3 times into .grad; dist runs it 3 times in one context.
    verify(fwd, spec((3, 3), (3, 3)), seed=17, remote_checks=[grads], backward_times=3)


def _backward_in_thread(cid: int, roots: list[torch.Tensor], seconds: float) -> None:
    """dist_autograd.backward on another thread, failing (not hanging) if it does not end."""
    err: list[BaseException] = []

    def run() -> None:
        try:
            dist_autograd.backward(cid, roots)
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            err.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"distributed backward still running after {seconds}s (hang)"
    if err:
        raise err[0]


def case_unused_rpc_output() -> None:
    a, b = leaves(18, spec((3, 3), (3, 3)))
    (a + b).sum().backward()
    expected = [a.grad, b.grad]
    a2, b2 = leaves(18, spec((3, 3), (3, 3)))
    with dist_autograd.context() as cid:
        unused = rpc.rpc_sync(W1, torch.mul, args=(a2, b2))  # requires grad, never used
        fut = rpc.rpc_async(W2, nested, args=(True, [W3], a2, b2))  # nested, never used
        loss = rpc.rpc_sync(W3, torch.add, args=(a2, b2)).sum()
        _backward_in_thread(cid, [loss], 30)
        check_grads(dist_autograd.get_gradients(cid), [a2, b2], expected)
        assert unused.requires_grad and fut.wait().requires_grad


def _thread_trainer(p_rref: Any, seed: int, iters: int, barrier: threading.Barrier | None) -> None:
    """Forward through a parameter owned by worker1, backward, check this context's
    gradients (here and on worker1) against the local oracle."""
    p_local = rpc.rpc_sync(W1, make_param, args=(20, 4, 4))
    for it in range(iters):
        x = leaves(seed * 100 + it, spec((4, 4)))[0]
        xl = x.detach().clone().requires_grad_()
        pl = p_local.detach().clone().requires_grad_()
        (use_param_local(pl, xl) * (seed + 1)).sum().backward()
        with dist_autograd.context() as cid:
            out = rpc.rpc_sync(W1, use_param, args=(p_rref, x))
            if barrier is not None:
                barrier.wait(30)  # every thread has its forward recorded before anyone runs backward
            dist_autograd.backward(cid, [(out * (seed + 1)).sum()])
            check_grads(dist_autograd.get_gradients(cid), [x], [xl.grad])
            got, dot_grad = rpc.rpc_sync(W1, tensor_grad, args=(p_rref, cid))
            assert dot_grad is None
            assert_close(got, pl.grad, f"trainer {seed} iteration {it}: gradient of the shared parameter")


def use_param_local(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (p * x).sin()


def remote_trainer(p_rref: Any, seed: int, iters: int) -> str | None:
    try:
        _thread_trainer(p_rref, seed, iters, None)
        return None
    except BaseException:  # noqa: BLE001 - returned for the test to report
        return traceback.format_exc()


def case_concurrent_contexts() -> None:
    """4 threads on the trainer and trainers on workers 2 and 3, all at once, all through the
    same parameter on worker1: each context must hold only its own gradients."""
    p_rref = rpc.remote(W1, make_param, args=(20, 4, 4))
    remote_futs = [rpc.rpc_async(w, remote_trainer, args=(p_rref, 10 + k, 4)) for k, w in enumerate([W2, W3])]
    n = 4
    barrier = threading.Barrier(n)
    errors: list[str] = []

    def run(seed: int) -> None:
        try:
            _thread_trainer(p_rref, seed, 3, barrier)
        except BaseException:  # noqa: BLE001 - reported after the threads end
            errors.append(traceback.format_exc())
            barrier.abort()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "trainer threads did not finish"
    errors += [e for e in (f.wait() for f in remote_futs) if e]
    assert not errors, "\n".join(errors)


def case_context_ids() -> None:
    ids = []
    for _ in range(5):
        with dist_autograd.context() as cid:
            ids.append(cid)
            assert dist_autograd._current_context()._context_id() == cid
    assert all(i >> 48 == 0 for i in ids) and ids == sorted(set(ids))
    assert dist_autograd._get_max_id() == 2**48 - 1
    for w in (2, 3):
        rids, max_id, wid = rpc.rpc_sync(w, new_context_ids, args=(4,))
        assert wid == w
        assert all(i >> 48 == w and 0 <= i < 2**64 for i in rids), [hex(i) for i in rids]
        assert [i & (2**48 - 1) for i in rids] == list(range(rids[0] & (2**48 - 1), (rids[0] & (2**48 - 1)) + 4))
        assert max_id == (2**48 - 1) + (w << 48)
        for i in rids:
            with pytest.raises(RuntimeError, match=CTX_MISSING):
                rpc.rpc_sync(w, remote_get_gradients, args=(i,))
    for i in ids:
        with pytest.raises(RuntimeError, match=CTX_MISSING):
            dist_autograd._retrieve_context(i)


def case_cleanup() -> None:
    """Leaving a context releases it on every worker it touched, whatever the RPCs carried."""
    a, b = leaves(21, spec((2, 2), (2, 2)))
    variants = {
        "tensor_with_grad": lambda: rpc.rpc_sync(W1, torch.add, args=(a, b)),
        "tensor_no_grad": lambda: rpc.rpc_sync(W1, torch.add, args=(a.detach(), b.detach())),
        "no_tensors": lambda: rpc.rpc_sync(W1, num_contexts),
        "nested_rpc": lambda: rpc.rpc_sync(W1, nested, args=(True, [W2, W3], a, b)),
        "remote": lambda: rpc.remote(W2, torch.mul, args=(a, b)).to_here(),
        "async_nested": lambda: rpc.rpc_sync(W1, async_nested, args=(True, a, b)),
    }
    for name, run in variants.items():
        with dist_autograd.context() as cid:
            run()
            touched = [w for w in range(4) if rpc.rpc_sync(w, has_context, args=(cid,))]
            assert 1 in touched or 2 in touched, (name, touched)
        dist_autograd._wait_cleanups()
        left = [w for w in range(4) if rpc.rpc_sync(w, has_context, args=(cid,))]
        assert not left, f"{name}: context {cid} still exists on workers {left} after it was released"
        with pytest.raises(RuntimeError, match=CTX_MISSING):
            dist_autograd.get_gradients(cid)


_gates: dict[str, threading.Event] = {}


def gated_mul(key: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    assert _gates.setdefault(key, threading.Event()).wait(30), f"gate {key} was never opened"
    return a * b


def gated_nested(key: str, dst: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return rpc.rpc_sync(dst, gated_mul, args=(key, a, b)) + a


def gated_then_nested(key: str, dst: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    assert _gates.setdefault(key, threading.Event()).wait(30), f"gate {key} was never opened"
    return rpc.rpc_sync(dst, torch.mul, args=(a, b))  # to a worker that never saw the context


def open_gate(key: str) -> None:
    _gates.setdefault(key, threading.Event()).set()


def case_cleanup_late_messages() -> None:
    """RPCs of a context answer after the context was released (nobody waited for them):
    their late messages must not bring the context back on the callees or on the caller."""
    a, b = leaves(24, spec((2, 2), (2, 2)))
    with dist_autograd.context() as cid:
        fut = rpc.rpc_async(W1, gated_mul, args=("late1", a, b))
        fut2 = rpc.rpc_async(W2, gated_nested, args=("late2", W1, a, b))  # worker2 -> worker1
        fut3 = rpc.rpc_async(W2, gated_then_nested, args=("late3", W3, a, b))  # worker2 -> worker3, late
        assert rpc.rpc_sync(W2, has_context, args=(cid,))
    dist_autograd._wait_cleanups()
    rpc.rpc_sync(W1, open_gate, args=("late1",))
    rpc.rpc_sync(W1, open_gate, args=("late2",))
    rpc.rpc_sync(W2, open_gate, args=("late3",))
    assert fut.wait().requires_grad and fut2.wait().requires_grad and fut3.wait().requires_grad
    # worker2 passes the release on to worker3 (who heard of the context only from the late
    # nested call) once its last request of it is answered: wait for that on every worker
    for w in range(4):
        rpc.rpc_sync(w, dist_autograd._wait_cleanups)
    left = [w for w in range(4) if rpc.rpc_sync(w, has_context, args=(cid,))]
    assert not left, f"context {cid} came back on workers {left} after it was released"


def case_error_messages() -> None:
    a, b = leaves(22, spec((3, 3), (3, 3)))
    with dist_autograd.context() as cid:
        loss = rpc.rpc_sync(W1, torch.mul, args=(a, b)).sum()
        with pytest.raises(RuntimeError, match="is not a scalar, all roots need to be scalar"):
            dist_autograd.backward(cid, [rpc.rpc_sync(W1, torch.mul, args=(a, b))])
        with pytest.raises(RuntimeError, match="requires_grad not set on"):
            dist_autograd.backward(cid, [torch.rand(())])
        with pytest.raises(RuntimeError, match="No tensors provided for gradient computation"):
            dist_autograd.backward(cid, [])
        with pytest.raises(RuntimeError, match="does not have a valid gradient function"):
            dist_autograd.backward(cid, [torch.rand(1, requires_grad=True)])
        for bad in (None, loss, "loss"):
            with pytest.raises(TypeError, match="incompatible function arguments"):
                dist_autograd.backward(cid, bad)  # type: ignore[arg-type]  # wrong on purpose
        with pytest.raises(TypeError, match="incompatible function arguments"):
            dist_autograd.backward(None, [loss])  # type: ignore[arg-type]  # wrong on purpose
        with pytest.raises(RuntimeError, match="Already have an autograd context id for this thread"):
            with dist_autograd.context():
                pass
        # The failed inner context did not disturb the outer one.
        assert dist_autograd._current_context()._context_id() == cid
        with pytest.raises(RuntimeError, match=CTX_MISSING):
            dist_autograd.backward(cid + 12345, [loss])
        assert dist_autograd.get_gradients(cid) == {}  # nothing ran yet
        dist_autograd.backward(cid, [loss])  # the failures left the context usable
        assert set(dist_autograd.get_gradients(cid)) == {a, b}
    with pytest.raises(RuntimeError, match=CTX_MISSING):
        dist_autograd.backward(cid, [loss])
    with pytest.raises(RuntimeError, match=CTX_MISSING):
        dist_autograd.get_gradients(cid)
    with pytest.raises(RuntimeError, match=CTX_MISSING):
        dist_autograd.get_gradients(123456789)
    with pytest.raises(RuntimeError, match="valid autograd context"):
        dist_autograd._current_context()
    # Plain local autograd is unaffected by all of this.
    (a * b).sum().backward()
    assert a.grad is not None


def case_backward_error_on_other_worker() -> None:
    a, b = leaves(23, spec((3, 3), (3, 3)))
    for _ in range(2):  # the engine is not left wedged by the first failure
        with dist_autograd.context() as cid:
            x = rpc.rpc_sync(W1, nested, args=(True, [W2], a, b))  # gradients must cross 2 hops
            y = rpc.rpc_sync(W3, fail_in_backward, args=(x,))  # the failure is on worker3
            with pytest.raises(RuntimeError, match=r"^Error on Node 3: Simulate error on backward pass \(on worker3\)"):
                dist_autograd.backward(cid, [y.sum() + x.sum()])
            # A backward through healthy workers in the same context still works.
            dist_autograd.backward(cid, [rpc.rpc_sync(W1, torch.mul, args=(a, b)).sum()])
            assert set(dist_autograd.get_gradients(cid)) >= {a, b}
    # On the trainer itself: named as node 0.
    with dist_autograd.context() as cid:
        y = fail_in_backward(rpc.rpc_sync(W1, torch.mul, args=(a, b)))
        with pytest.raises(RuntimeError, match=r"^Error on Node 0: Simulate error on backward pass \(on worker0\)"):
            dist_autograd.backward(cid, [y.sum()])


def case_no_leaks() -> None:
    """After all the cases: no context left behind on any worker."""
    dist_autograd._wait_cleanups()
    counts = [rpc.rpc_sync(w, num_contexts) for w in range(4)]
    assert counts == [0, 0, 0, 0], counts


CASES: dict[str, Callable[[], None]] = {
    name[len("case_") :]: fn for name, fn in list(globals().items()) if name.startswith("case_")
}


def _main_world(ctx: Any) -> dict[str, str | None] | None:
    if ctx.rank != 0:
        return None
    outcomes: dict[str, str | None] = {}
    for name, fn in CASES.items():
        try:
            fn()
            outcomes[name] = None
        except BaseException:  # noqa: BLE001 - each case's outcome is reported
            outcomes[name] = traceback.format_exc()
    return outcomes


@pytest.fixture(scope="module")
def main_world() -> Any:
    try:
        return run_world(_main_world, 4, timeout=150)[0]
    except WorldError as e:
        return e


@pytest.mark.parametrize("case", list(CASES))
def test_case(main_world: Any, case: str) -> None:
    if isinstance(main_world, WorldError):
        pytest.fail(f"the world running the cases failed:\n{main_world}")
    if main_world[case] is not None:
        pytest.fail(f"case {case!r} failed on worker0:\n{main_world[case]}")


# ---------------------------------------------------------------------------------------------
# A worker killed during backward: an error, not a hang.
# ---------------------------------------------------------------------------------------------
_release = threading.Event()


def release_worker() -> None:
    _release.set()


def _killed_world(ctx: Any) -> Any:
    try:
        if ctx.rank == 1:
            assert _release.wait(60), "worker0 never released worker1"
            return None
        if ctx.rank == 2:
            _release.wait(60)  # killed in backward before this returns
            return "worker2 survived"
        return _killed_world_trainer()
    finally:
        rpc.shutdown(graceful=False)  # worker2 is gone: no graceful shutdown with it


def _killed_world_trainer() -> str:
    a, b = leaves(30, spec((3, 3), (3, 3)))
    try:
        with dist_autograd.context() as cid:
            x = rpc.rpc_sync(W1, torch.mul, args=(a, b))
            y = rpc.rpc_sync(W1, nested, args=(True, [W2], x, b))  # worker1 -> worker2
            z = rpc.rpc_sync(W2, die_in_backward, args=(y,))  # worker2 dies in backward
            err = None
            try:
                _backward_in_thread(cid, [z.sum()], 30)
            except RuntimeError as e:
                err = str(e)
            assert err is not None, "backward succeeded although worker2 died in it"
            # Backward through the surviving worker still works.
            dist_autograd.backward(cid, [x.sum()])
            assert set(dist_autograd.get_gradients(cid)) == {a, b}
        return err
    finally:
        # Fire and forget: worker1 may shut down before its answer could be read.
        rpc.rpc_async(W1, release_worker)


def test_worker_killed_during_backward() -> None:
    results = run_world(_killed_world, 3, timeout=90, may_die=[2])
    assert results[2] is None, results
    err = results[0]
    assert "Error on Node" in err and ("worker2" in err or "rank 2" in err), err
