"""``functions.async_execution`` (rpc_core/functions.py, agent.py): the callee answers from the
returned Future's callback, so waiting calls hold no server thread. Bodies run on worker
processes (tests/_world.py)."""

import threading
from typing import Any

import pytest
import torch

import rpc_core
from rpc_core.functions import async_execution
from tests._world import run_world


# -- remote functions ------------------------------------------------------------------------------
@async_execution
def _async_add(to, x, y):
    return rpc_core.rpc_async(to, torch.add, args=(x, y))


@async_execution
def _async_chained(to, x, y, z):
    """torch's test_async_function_chained: a nested call, then a local step in a callback."""
    return rpc_core.rpc_async(to, torch.add, args=(x, y)).then(lambda f: f.wait() + z)


@async_execution
def _async_nested(hops, x):
    """Each hop is itself an async function on the next worker; the last answers directly."""
    if hops == 0:
        fut = torch.futures.Future()
        fut.set_result(x + 1)
        return fut
    nxt = (rpc_core.get_worker_info().id + 1) % 3
    return rpc_core.rpc_async(nxt, _async_nested, args=(hops - 1, x + 1))


@async_execution
def _async_wrong_type():
    return 42


@async_execution
def _async_raises():
    raise ValueError("raised before returning a future")


@async_execution
def _async_fails_later():
    fut = torch.futures.Future()
    fut.set_exception(KeyError("set on the returned future"))
    return fut


class AsyncHolder:
    def __init__(self, to):
        self.to = to

    @async_execution
    def add(self, x):
        return rpc_core.rpc_async(self.to, torch.add, args=(x, 1))

    @staticmethod
    @async_execution
    def static_add(to, x):
        return rpc_core.rpc_async(to, torch.add, args=(x, 2))

    @classmethod
    @async_execution
    def class_add(cls, to, x):
        assert cls is AsyncHolder
        return rpc_core.rpc_async(to, torch.add, args=(x, 3))


# -- returning futures --------------------------------------------------------------------------
def _body_modes(ctx):
    if ctx.rank == 0:
        x, y = torch.ones(2, 2), torch.ones(2, 2)
        want = x + y
        assert torch.equal(rpc_core.rpc_sync(1, _async_add, args=(2, x, y)), want)
        assert torch.equal(rpc_core.rpc_async(1, _async_add, args=(2, x, y)).wait(), want)
        assert torch.equal(rpc_core.remote(1, _async_add, args=(2, x, y)).to_here(), want)
        assert torch.equal(rpc_core.rpc_sync(1, _async_chained, args=(2, x, y, 1)), torch.ones(2, 2) + 2)
        assert torch.equal(rpc_core.remote(1, _async_chained, args=(0, x, y, 1)).to_here(), torch.ones(2, 2) + 2)
        assert rpc_core.rpc_sync(1, _async_nested, args=(5, 0)) == 6
        assert rpc_core.remote(2, _async_nested, args=(4, 0)).to_here() == 5
        assert rpc_core.rpc_sync(0, _async_add, args=(0, 1, 2)) == 3  # to self, async to self
        local = _async_add(1, 1, 2)  # called locally it is the plain function: it returns the Future
        assert isinstance(local, torch.futures.Future) and local.wait() == 3
    return True


def test_async_functions_answer_with_their_futures_value_in_every_mode():
    assert run_world(_body_modes, 3) == [True] * 3


def _body_errors(ctx):
    if ctx.rank == 0:
        msg = r"^Functions decorated with @rpc\.async_function must return a torch\.futures\.Future object, but got "
        with pytest.raises(TypeError, match=msg) as info:
            rpc_core.rpc_sync(1, _async_wrong_type)
        assert isinstance(info.value, RuntimeError)  # as torch raises it
        with pytest.raises(TypeError, match=msg):
            rpc_core.rpc_async(1, _async_wrong_type).wait()
        with pytest.raises(TypeError, match=msg):
            rpc_core.remote(1, _async_wrong_type).to_here()
        with pytest.raises(ValueError, match="raised before returning a future"):
            rpc_core.rpc_sync(1, _async_raises)
        with pytest.raises(KeyError, match="set on the returned future"):
            rpc_core.rpc_sync(1, _async_fails_later)
        with pytest.raises(KeyError, match="set on the returned future"):
            rpc_core.remote(1, _async_fails_later).to_here()
        assert rpc_core.rpc_sync(1, _async_add, args=(0, 1, 1)) == 2  # the callee still serves
    return True


def test_async_function_errors_and_wrong_return_type_reach_the_caller():
    assert run_world(_body_errors, 2) == [True, True]


def _body_methods(ctx):
    if ctx.rank == 0:
        x = torch.zeros(2)
        assert torch.equal(rpc_core.rpc_sync(1, AsyncHolder.static_add, args=(2, x)), x + 2)
        assert torch.equal(rpc_core.rpc_sync(1, AsyncHolder.class_add, args=(2, x)), x + 3)
        assert torch.equal(rpc_core.remote(1, AsyncHolder.class_add, args=(0, x)).to_here(), x + 3)
        holder = rpc_core.remote(1, AsyncHolder, args=(2,))
        assert torch.equal(holder.rpc_sync().add(x), x + 1)
        assert torch.equal(holder.rpc_async().add(x).wait(), x + 1)
        assert torch.equal(holder.remote().add(x).to_here(), x + 1)
        assert torch.equal(holder.rpc_sync().static_add(2, x), x + 2)
        assert torch.equal(holder.rpc_async().class_add(0, x).wait(), x + 3)
        assert torch.equal(holder.remote().class_add(2, x).to_here(), x + 3)
        mine = rpc_core.RRef(AsyncHolder(1))  # proxies on an owner-side RRef
        assert torch.equal(mine.rpc_sync().add(x), x + 1)
    return True


def test_async_static_class_and_instance_methods_work_directly_and_through_rref_proxies():
    assert run_world(_body_methods, 3) == [True] * 3


# -- no server thread held ---------------------------------------------------------------------
N_WAITING = 40
_parked: list[Any] = []
_lock = threading.Lock()
_all_arrived = threading.Event()
_pool_size_seen: list[int] = []


def _pool_size():
    return rpc_core._get_debug_info()["agent.threads_started"]


@async_execution
def _park(i):
    """Answers only once all N_WAITING calls have arrived; the last one releases everybody."""
    fut = torch.futures.Future()
    with _lock:
        _parked.append((fut, i))
        if len(_parked) < N_WAITING:
            return fut
        _pool_size_seen.append(_pool_size())  # every other call is waiting right now
        waiting = list(_parked)
        _parked.clear()
    for f, j in waiting:
        f.set_result(j)
    return fut


def _block(i):
    """The same rendezvous, written as a plain function: each waiting call holds a thread."""
    with _lock:
        _parked.append(i)
        if len(_parked) == N_WAITING:
            _pool_size_seen.append(_pool_size())
            _all_arrived.set()
    if not _all_arrived.wait(60):
        raise TimeoutError("not all calls arrived")
    return i


def _seen():
    return _pool_size_seen[-1]


def _body_no_thread_held(ctx):
    if ctx.rank == 0:
        futs = [rpc_core.rpc_async(1, _park, args=(i,)) for i in range(N_WAITING)]
        assert torch.futures.wait_all(futs) == list(range(N_WAITING))
        async_threads = rpc_core.rpc_sync(1, _seen)
        futs = [rpc_core.rpc_async(1, _block, args=(i,)) for i in range(N_WAITING)]
        assert torch.futures.wait_all(futs) == list(range(N_WAITING))
        blocking_threads = rpc_core.rpc_sync(1, _seen)
        return async_threads, blocking_threads
    return None


def test_waiting_async_calls_hold_no_server_thread():
    (async_threads, blocking_threads), _ = run_world(_body_no_thread_held, 2, options={"num_worker_threads": 2})
    # 40 calls waited at once on a 2-thread worker. Written with async_execution they held
    # no thread, so the pool did not grow to match them (a burst may add a drainer or two);
    # the blocking version needed a thread per waiting call, and got them (no deadlock):
    # the connection's reader runs one of them inline, pool threads the others.
    assert blocking_threads >= N_WAITING - 1
    assert async_threads < N_WAITING // 2, async_threads


def _debug_pool():
    info = rpc_core._get_debug_info()
    return info["agent.thread_pool_size"], info["agent.threads_started"]


def _body_pool_size_reported(ctx):
    if ctx.rank == 0:
        return rpc_core.rpc_sync(1, _debug_pool)
    return None


def test_debug_info_reports_the_configured_pool_size_like_torch():
    # torch's agent reports num_worker_threads as its pool size; rpc_core's threads start
    # lazily, so the size is the configured one while far fewer threads have started.
    (size, started), _ = run_world(_body_pool_size_reported, 2, options={"num_worker_threads": 27})
    assert size == 27
    assert 0 <= started < 27  # the call itself may run inline on its connection's reader
