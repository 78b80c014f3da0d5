"""Worker side of ``benchmarks/rpc_bench.py``.

Everything that runs inside the spawned RPC worker processes lives here, in an importable
module (never in ``__main__``), because RPC functions travel by reference: the callee
imports this module by name to find ``noop``, ``echo``, ``Shard``, ...

The RPC implementation under test is chosen by name (``"torch"`` or ``"rpc_core"``) and
loaded once per process by :func:`worker_main`; the helpers that need it (for instance to
build ``RRef`` objects on the owner) read it from the module-level ``_IMPL``.
"""

from __future__ import annotations

import gc
import importlib
import os
import statistics
import time
import traceback
import warnings

import torch
import torch.nn as nn

IMPL_MODULES = {
    "torch": ("torch.distributed.rpc", "torch.distributed.autograd", "torch.distributed.optim"),
    "rpc_core": ("rpc_core", "rpc_core.autograd", "rpc_core.optim"),
}

# Names the RPC module must offer for the benchmark to run at all.
REQUIRED_RPC_NAMES = ("init_rpc", "shutdown", "rpc_sync", "rpc_async", "remote", "RRef")


class Impl:
    """The modules of one implementation, plus why the optional parts are missing."""

    def __init__(self, name: str):
        self.name = name
        rpc_name, autograd_name, optim_name = IMPL_MODULES[name]
        self.rpc = importlib.import_module(rpc_name)
        missing = [n for n in REQUIRED_RPC_NAMES if not hasattr(self.rpc, n)]
        if missing:
            where = getattr(self.rpc, "__file__", None) or list(getattr(self.rpc, "__path__", []))
            raise ImportError(f"{rpc_name} (from {where}) lacks {', '.join(missing)}")
        self.autograd = self.autograd_error = None
        self.optim = self.optim_error = None
        try:
            self.autograd = importlib.import_module(autograd_name)
            for n in ("context", "backward", "get_gradients"):
                if not hasattr(self.autograd, n):
                    raise ImportError(f"{autograd_name} lacks {n}")
        except Exception as e:  # noqa: BLE001 - reported per workload
            self.autograd, self.autograd_error = None, f"{type(e).__name__}: {e}"
        try:
            self.optim = importlib.import_module(optim_name)
            if not hasattr(self.optim, "DistributedOptimizer"):
                raise ImportError(f"{optim_name} lacks DistributedOptimizer")
        except Exception as e:  # noqa: BLE001 - reported per workload
            self.optim, self.optim_error = None, f"{type(e).__name__}: {e}"

    def options(self, init_method: str, num_worker_threads: int, rpc_timeout: float, extra: dict):
        cls = getattr(self.rpc, "TensorPipeRpcBackendOptions", None) or self.rpc.RpcBackendOptions
        return cls(
            num_worker_threads=num_worker_threads,
            rpc_timeout=rpc_timeout,
            init_method=init_method,
            **extra,
        )


_IMPL: Impl | None = None


# --------------------------------------------------------------------------------------
# Functions and classes executed on the callee (worker1).
# --------------------------------------------------------------------------------------


def noop():
    return None


def echo(t):
    return t


def small_tensor():
    return torch.ones(10, 10)


class Counter:
    """A small object owned by worker1, for the RRef-argument workload."""

    def __init__(self):
        self.n = 0

    def bump(self):
        self.n += 1
        return self.n


def call_bump(rref):
    """torch's parameter-server tutorial pattern: the RRef travels as an argument to its owner."""
    return rref.local_value().bump()


def process_cpu():
    """This process's CPU time so far (all threads), s: the callee's side of the CPU per call."""
    return time.process_time()


def linear_owned(rref, x):
    """``x @ W.T + b`` with the owner's ``nn.Linear``: the gradient of ``x`` goes back to the caller."""
    return rref.local_value()(x)


def grads_in_context(context_id):
    """Number of gradients recorded in ``context_id`` on this worker (sanity check)."""
    return len(_IMPL.autograd.get_gradients(context_id))


class Shard(nn.Module):
    """One stage of the 3-shard MLP: Linear+ReLU+Linear+ReLU, ``dim`` wide."""

    def __init__(self, dim: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim), nn.ReLU())

    def forward(self, x):
        return self.net(x)

    def parameter_rrefs(self):
        return [_IMPL.rpc.RRef(p) for p in self.parameters()]

    def weight_checksum(self):
        with torch.no_grad():
            return float(sum(p.double().sum() for p in self.parameters()))


# --------------------------------------------------------------------------------------
# Measurements (run on worker0 against worker1).
# --------------------------------------------------------------------------------------

CALLEE = "worker1"


# CPU seconds per call of the last measurement, (caller, callee), each process's time over
# all its threads (time.process_time), or None if the workload did not measure it.
LAST_CPU: tuple[float, float] | None = None


class CpuMeter:
    """Process CPU time spent by the caller (this process) and the callee between ``start``
    and ``stop``; the two calls that read the callee's clock are outside the interval."""

    def __init__(self, impl):
        self.rpc = impl.rpc

    def start(self):
        self.callee0 = self.rpc.rpc_sync(CALLEE, process_cpu)
        self.caller0 = time.process_time()

    def stop(self, calls: int):
        global LAST_CPU
        caller = time.process_time() - self.caller0
        callee = self.rpc.rpc_sync(CALLEE, process_cpu) - self.callee0
        LAST_CPU = (caller / calls, callee / calls)


def _time_calls(fn, warmup: int, iters: int, reps: int, impl=None):
    """Seconds per call of ``fn`` for each repetition (``iters`` calls per repetition);
    with ``impl``, also the CPU time per call on both sides (``LAST_CPU``)."""
    for _ in range(warmup):
        fn()
    samples = []
    meter = CpuMeter(impl) if impl is not None else None
    if meter:
        meter.start()
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t0) / iters)
    if meter:
        meter.stop(iters * reps)
    return samples


def _per_call(samples, scale):
    vals = [s * scale for s in samples]
    return statistics.median(vals), vals


def w_sync_noop(impl, c):
    rpc = impl.rpc
    samples = _time_calls(lambda: rpc.rpc_sync(CALLEE, noop), c["warmup"], c["iters"], c["reps"], impl)
    return _per_call(samples, 1e6)


def w_sync_add(impl, c):
    rpc = impl.rpc
    a, b = torch.randn(10, 10), torch.randn(10, 10)
    got = rpc.rpc_sync(CALLEE, torch.add, args=(a, b))
    if not torch.allclose(got, a + b):
        raise AssertionError("rpc_sync(torch.add) returned a wrong result")
    samples = _time_calls(
        lambda: rpc.rpc_sync(CALLEE, torch.add, args=(a, b)), c["warmup"], c["iters"], c["reps"], impl
    )
    return _per_call(samples, 1e6)


def w_async_noop(impl, c):
    rpc = impl.rpc
    n = c["iters"]  # calls in flight per repetition

    def burst(count):
        futs = [rpc.rpc_async(CALLEE, noop) for _ in range(count)]
        torch.futures.wait_all(futs)

    for _ in range(c["warmup"]):
        burst(min(n, 1000))
    vals = []
    meter = CpuMeter(impl)
    meter.start()
    for _ in range(c["reps"]):
        t0 = time.perf_counter()
        burst(n)
        vals.append(n / (time.perf_counter() - t0))
    meter.stop(n * c["reps"])
    return statistics.median(vals), vals


def _echo(nbytes):
    def run(impl, c):
        rpc = impl.rpc
        t = torch.randn(nbytes // 4)  # float32
        got = rpc.rpc_sync(CALLEE, echo, args=(t,))
        if got.shape != t.shape or got.dtype != t.dtype or not torch.equal(got, t):
            raise AssertionError("echo returned a different tensor")
        del got
        samples = _time_calls(lambda: rpc.rpc_sync(CALLEE, echo, args=(t,)), c["warmup"], c["iters"], c["reps"], impl)
        vals = [2 * nbytes / s / 1e9 for s in samples]  # bytes sent + received, GB = 1e9 B
        return statistics.median(vals), vals

    return run


def w_remote_to_here(impl, c):
    rpc = impl.rpc
    got = rpc.remote(CALLEE, small_tensor).to_here()
    if not torch.equal(got, torch.ones(10, 10)):
        raise AssertionError("remote(...).to_here() returned a wrong result")
    samples = _time_calls(lambda: rpc.remote(CALLEE, small_tensor).to_here(), c["warmup"], c["iters"], c["reps"], impl)
    return _per_call(samples, 1e6)


def w_rref_arg_to_owner(impl, c):
    rpc = impl.rpc
    counter = rpc.remote(CALLEE, Counter)
    if rpc.rpc_sync(CALLEE, call_bump, args=(counter,)) != 1:
        raise AssertionError("the call through the RRef argument did not reach its value")
    samples = _time_calls(
        lambda: rpc.rpc_sync(CALLEE, call_bump, args=(counter,)), c["warmup"], c["iters"], c["reps"], impl
    )
    return _per_call(samples, 1e6)


class Unavailable(Exception):
    pass


def w_remote_linear_step(impl, c):
    if impl.autograd is None:
        raise Unavailable(f"{impl.name} autograd not available: {impl.autograd_error}")
    rpc, dist_autograd = impl.rpc, impl.autograd
    lin = rpc.remote(CALLEE, nn.Linear, args=(256, 256))
    x = torch.randn(64, 256)

    def step(check=False):
        with dist_autograd.context() as ctx:
            out = lin.rpc_sync().forward(x)
            loss = out.sum()
            dist_autograd.backward(ctx, [loss])
            if check:
                n = rpc.rpc_sync(CALLEE, grads_in_context, args=(ctx,))
                if n != 2:
                    raise AssertionError(f"expected 2 gradients on {CALLEE}, found {n}")

    step(check=True)
    samples = _time_calls(step, c["warmup"], c["iters"], c["reps"], impl)
    return _per_call(samples, 1e3)


def w_grad_to_caller_step(impl, c):
    if impl.autograd is None:
        raise Unavailable(f"{impl.name} autograd not available: {impl.autograd_error}")
    rpc, dist_autograd = impl.rpc, impl.autograd
    lin = rpc.remote(CALLEE, nn.Linear, args=(256, 256))
    x = torch.randn(64, 256, requires_grad=True)

    def step(check=False):
        with dist_autograd.context() as ctx:
            out = rpc.rpc_sync(CALLEE, linear_owned, args=(lin, x))
            dist_autograd.backward(ctx, [out.sum()])
            if check:
                g = dist_autograd.get_gradients(ctx)
                w = lin.to_here().weight.detach()
                if x not in g or not torch.allclose(g[x], torch.ones(64, 256) @ w, atol=1e-4):
                    raise AssertionError("the gradient of x that came back to the caller is wrong")
                n = rpc.rpc_sync(CALLEE, grads_in_context, args=(ctx,))
                if n != 2:
                    raise AssertionError(f"expected 2 gradients on {CALLEE}, found {n}")

    step(check=True)
    samples = _time_calls(step, c["warmup"], c["iters"], c["reps"], impl)
    return _per_call(samples, 1e3)


def _mlp3(in_backward: bool):
    """3 shards on the callee, forward over RPC, dist backward, ``DistributedOptimizer`` SGD.
    ``in_backward``: rpc_core steps each owner's optimizer as its part of the backward ends
    (``step_in_backward``, an rpc_core extension); torch, which has no such extension, runs
    the same update as ``step`` after the backward."""

    def w_mlp3(impl, c):
        if impl.autograd is None:
            raise Unavailable(f"{impl.name} autograd not available: {impl.autograd_error}")
        if impl.optim is None:
            raise Unavailable(f"{impl.name} optim not available: {impl.optim_error}")
        rpc, dist_autograd = impl.rpc, impl.autograd
        dim = 256
        shards = [rpc.remote(CALLEE, Shard, args=(dim, i)) for i in range(3)]
        param_rrefs = []
        for s in shards:
            param_rrefs.extend(s.rpc_sync().parameter_rrefs())
        opt = impl.optim.DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=0.01)
        hook = in_backward and hasattr(opt, "step_in_backward")
        x = torch.randn(64, dim)

        def step():
            with dist_autograd.context() as ctx:
                h = x
                for s in shards:
                    h = s.rpc_sync().forward(h)
                loss = (h * h).mean()
                if hook:
                    opt.step_in_backward(ctx)
                dist_autograd.backward(ctx, [loss])
                if not hook:
                    opt.step(ctx)

        before = shards[0].rpc_sync().weight_checksum()
        step()
        if shards[0].rpc_sync().weight_checksum() == before:
            raise AssertionError("the optimizer step did not change the first shard")
        samples = _time_calls(step, c["warmup"], c["iters"], c["reps"], impl)
        return _per_call(samples, 1e3)

    return w_mlp3


MEASUREMENTS = {
    "sync_noop": w_sync_noop,
    "sync_add": w_sync_add,
    "async_noop": w_async_noop,
    "echo_1KB": _echo(1 << 10),
    "echo_1MB": _echo(1 << 20),
    "echo_16MB": _echo(16 << 20),
    "echo_64MB": _echo(64 << 20),
    "remote_to_here": w_remote_to_here,
    "rref_arg_to_owner": w_rref_arg_to_owner,
    "remote_linear_step": w_remote_linear_step,
    "grad_to_caller_step": w_grad_to_caller_step,
    "mlp3_distopt_step": _mlp3(in_backward=False),
    "mlp3_in_backward_step": _mlp3(in_backward=True),
}


# --------------------------------------------------------------------------------------
# Process entry point.
# --------------------------------------------------------------------------------------


def join_world(rank, world_size, impl_name, port, options_extra, queue, rpc_timeout):
    """A spawned worker's start, for every benchmark world: settings, ``init_rpc`` as
    ``worker<rank>``, and rank 0's ("ready", init_s) report. Returns the implementation, or
    None when it cannot be imported (rank 0 then reported ("unavailable", reason))."""
    global _IMPL
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # Known noise from torch's own RPC/optim internals; it says nothing about the figures.
    warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")
    # Same intra-op setting for both implementations: two workers share 2 cores.
    torch.set_num_threads(1)
    try:
        _IMPL = impl = Impl(impl_name)
    except Exception as e:  # noqa: BLE001 - ImportError, or an incomplete package
        if rank == 0:
            queue.put(("unavailable", f"{type(e).__name__}: {e}"))
        return None
    opts = impl.options(f"tcp://127.0.0.1:{port}", 16, rpc_timeout, options_extra)
    t0 = time.perf_counter()
    impl.rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
    if rank == 0:
        queue.put(("ready", time.perf_counter() - t0))
    return impl


def worker_main(rank, world_size, impl_name, port, plan, options_extra, queue):
    """Entry of one spawned worker. Rank 0 measures ``plan`` and reports through ``queue``.

    Messages: ("unavailable", reason) | ("ready", init_s) | ("result", name, value, samples)
    | ("error", name, kind, message) | ("shutdown", seconds) | ("fatal", rank, traceback).
    """
    global LAST_CPU
    try:
        impl = join_world(rank, world_size, impl_name, port, options_extra, queue, rpc_timeout=60)
        if impl is None:
            return
        if rank == 0:
            for name, counts in plan:
                gc.collect()
                LAST_CPU = None
                try:
                    value, samples = MEASUREMENTS[name](impl, counts)
                    queue.put(("result", name, value, samples, LAST_CPU))
                except Unavailable as e:
                    queue.put(("error", name, "unavailable", str(e)))
                except Exception as e:  # noqa: BLE001 - keep measuring the rest
                    queue.put(("error", name, "error", f"{type(e).__name__}: {e}"))
        t0 = time.perf_counter()
        impl.rpc.shutdown()
        if rank == 0:
            queue.put(("shutdown", time.perf_counter() - t0))
    except BaseException:  # re-raised: the parent hears of it first
        queue.put(("fatal", rank, traceback.format_exc()))
        raise
