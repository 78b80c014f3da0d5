"""The public call API (rpc_core/api.py, agent.py): rpc_sync / rpc_async / remote, targets,
futures, remote errors, timeouts, init/shutdown state. Bodies run on worker processes
(tests/_world.py); each test's name says the rule it checks.

One module, though past 400 lines: one test module per module under test (here the call
API), its sections the API's parts."""

import sys
import threading
import time
import traceback
import types

import pytest
import torch

import rpc_core
from rpc_core import RpcBackendOptions, RpcNotInitializedError, RpcTimeoutError, WorkerInfo
from tests._world import free_port, run_world


# -- remote functions ------------------------------------------------------------------------------
def _whoami():
    return rpc_core.get_worker_info().name


def _add(a, b=0, *, c=0):
    return a + b + c


def _identity(x):
    return x


def _sleep_then(seconds, value):
    time.sleep(seconds)  # a slow remote function (timeout tests), not a wait for something
    return value


_calls = {"slow_done": 0}


def _slow_counted(seconds):
    time.sleep(seconds)
    _calls["slow_done"] += 1
    return seconds


def _count():
    return _calls["slow_done"]


class CustomError(Exception):
    pass


class NeedsTwoArgs(Exception):
    def __init__(self, code, detail):
        super().__init__(f"{code}: {detail}")


def _raise_value_error():
    raise ValueError("Expected error")


def _raise_custom():
    raise CustomError("custom failure 42")


def _raise_needs_two_args():
    raise NeedsTwoArgs(7, "cannot be rebuilt from a message")


def _raise_callee_only_error():
    """Raise an exception whose class exists on this (the callee's) process only."""
    name = f"tests.rpc_core._callee_only_{rpc_core.get_worker_info().id}"
    module = sys.modules.setdefault(name, types.ModuleType(name))
    cls = getattr(module, "GhostError", None) or type("GhostError", (Exception,), {"__module__": name})
    module.GhostError = cls
    raise cls("only the callee knows this type")


def _return_unpicklable():
    return threading.Lock()


# -- calls by name, WorkerInfo and rank; to self -------------------------------------------------------
def _body_targets(ctx):
    n = ctx.world_size
    peer = (ctx.rank + 1) % n
    for to in (
        f"worker{peer}",
        WorkerInfo(f"worker{peer}", peer),
        peer,
        f"worker{ctx.rank}",
        rpc_core.get_worker_info(),
        ctx.rank,
    ):
        want = rpc_core.get_worker_info(to if isinstance(to, str) else f"worker{to if isinstance(to, int) else to.id}")
        assert rpc_core.rpc_sync(to, _whoami) == want.name
        assert rpc_core.rpc_async(to, _whoami).wait() == want.name
        assert rpc_core.remote(to, _whoami).to_here() == want.name
        t = torch.ones(2, 2)
        assert torch.equal(rpc_core.rpc_sync(to, torch.add, args=(t, 1)), t + 1)
    # args as a list, kwargs, keyword-only arguments, args=None
    assert rpc_core.rpc_sync(peer, _add, args=[1, 2], kwargs={"c": 3}) == 6
    assert rpc_core.rpc_sync(peer, _add, kwargs={"a": 5}) == 5
    assert rpc_core.rpc_sync(peer, _whoami, args=None, kwargs=None) == f"worker{peer}"
    return True


def test_calls_reach_workers_by_name_workerinfo_and_rank_and_to_self():
    assert run_world(_body_targets, 3) == [True] * 3


def _body_bad_targets(ctx):
    with pytest.raises(ValueError, match="Cannot get WorkerInfo"):
        rpc_core.rpc_sync(1.0, _whoami)
    with pytest.raises(ValueError, match="Cannot get WorkerInfo"):
        rpc_core.rpc_async(object(), _whoami)
    for bad in (2, -1):
        with pytest.raises(RuntimeError, match=rf"could not find destination rank {bad}; ranks are 0..1"):
            rpc_core.rpc_sync(bad, _whoami)
    with pytest.raises(RuntimeError, match="could not find destination worker 'worker7'.*worker0"):
        rpc_core.remote("worker7", _whoami)
    with pytest.raises(RuntimeError, match="could not find destination"):
        rpc_core.get_worker_info("nobody")
    with pytest.raises(TypeError, match="function should be callable"):
        rpc_core.rpc_sync(1, "not a function")
    with pytest.raises(TypeError, match="function should be callable"):
        rpc_core.remote(1, 42)
    with pytest.raises(RuntimeError, match="already initialized"):
        ctx.init()
    # none of this broke the worker
    assert rpc_core.rpc_sync(1 - ctx.rank, _whoami) == f"worker{1 - ctx.rank}"
    me = rpc_core.get_worker_info()
    return me.name, me.id, repr(me)


def test_bad_destinations_non_callables_and_a_second_init_fail_clearly():
    got = run_world(_body_bad_targets, 2)
    assert got == [("worker0", 0, "WorkerInfo(id=0, name=worker0)"), ("worker1", 1, "WorkerInfo(id=1, name=worker1)")]


def _body_world_of_one(ctx):
    assert rpc_core.rpc_sync("worker0", _add, args=(2, 3)) == 5
    rref = rpc_core.remote(0, _add, args=(torch.ones(1), 1))
    assert rref.is_owner()
    return rref.to_here().item()


def test_a_world_of_one_worker_calls_itself():
    assert run_world(_body_world_of_one, 1) == [2.0]


# -- futures --------------------------------------------------------------------------------------
def _body_futures(ctx):
    futs = [rpc_core.rpc_async(1, _add, args=(i, 10)) for i in range(5)]
    assert all(isinstance(f, torch.futures.Future) for f in futs)
    assert torch.futures.wait_all(futs) == [10, 11, 12, 13, 14]
    collected = torch.futures.collect_all([rpc_core.rpc_async(1, _add, args=(i, 1)) for i in range(3)]).wait()
    assert [f.value() for f in collected] == [1, 2, 3]
    chained = rpc_core.rpc_async(1, _add, args=(1, 1)).then(lambda f: f.value() * 10)
    assert chained.wait() == 20
    mixed = [rpc_core.rpc_async(1, _add, args=(1, 1)), rpc_core.rpc_async(1, _raise_value_error)]
    with pytest.raises(ValueError, match="Expected error"):
        torch.futures.wait_all(mixed)
    done = rpc_core.rpc_async(1, _add, args=(2, 2))
    done.wait()
    assert done.done() and done.value() == 4
    return True


def test_rpc_async_returns_torch_futures_that_wait_all_and_collect_all_accept():
    assert run_world(_body_futures, 2)[0]


def _body_threads(ctx):
    errors = []

    def hammer(k):
        try:
            for i in range(20):
                assert rpc_core.rpc_sync(1 - ctx.rank, _add, args=(k, i)) == k + i
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return True


def test_rpc_sync_is_safe_to_call_from_many_threads():
    assert run_world(_body_threads, 2) == [True, True]


# -- tensors through calls --------------------------------------------------------------------------
def _body_tensors(ctx):
    t = torch.arange(12.0).reshape(3, 4).t()
    back = rpc_core.rpc_sync(1, _identity, args=(t,))
    assert not back.is_contiguous() and back.stride() == t.stride() and torch.equal(back, t)
    p = torch.nn.Parameter(torch.ones(2))
    back = rpc_core.rpc_sync(1, _identity, args=(p,))
    assert isinstance(back, torch.nn.Parameter) and back.requires_grad
    mine = torch.zeros(3)
    back = rpc_core.rpc_sync(0, _identity, args=(mine,))  # to self: a copy, not an alias
    back += 1
    assert mine.sum() == 0
    big = torch.randn(5 << 20)  # 20 MB each way
    back = rpc_core.rpc_sync(1, _identity, args=(big,))
    assert torch.equal(back, big)
    return True


def test_tensors_keep_strides_and_types_through_a_call_and_calls_to_self_copy_them():
    assert run_world(_body_tensors, 2)[0]


# -- functions travel by reference ----------------------------------------------------------------
def _install_caller_only_function():
    """A function that exists in this module on the caller's process only."""

    def fn():
        return "ran"

    fn.__module__, fn.__qualname__, fn.__name__ = __name__, "_only_on_caller", "_only_on_caller"
    sys.modules[__name__]._only_on_caller = fn
    ghost = types.ModuleType("tests.rpc_core._ghost_module")

    def ghost_fn():
        return "ran"

    ghost_fn.__module__, ghost_fn.__qualname__ = ghost.__name__, "ghost_fn"
    ghost.ghost_fn = ghost_fn
    sys.modules[ghost.__name__] = ghost
    return fn, ghost_fn


def _body_missing_function(ctx):
    fn, ghost_fn = _install_caller_only_function()
    assert rpc_core.rpc_sync(0, fn) == "ran"  # it exists here...
    with pytest.raises(
        RuntimeError,
        match=r"(?s)worker1 could not load.*_only_on_caller.*RPC pickler does not "
        r"serialize function code",
    ):
        rpc_core.rpc_sync(1, fn)  # ...but not on the callee
    with pytest.raises(RuntimeError, match=r"(?s)_ghost_module.*RPC pickler does not serialize function code"):
        rpc_core.rpc_async(1, ghost_fn).wait()
    with pytest.raises(RuntimeError, match="RPC pickler does not serialize function code"):
        rpc_core.remote(1, fn).to_here()
    assert rpc_core.rpc_sync(1, _whoami) == "worker1"
    return True


def _body_idle(ctx):
    return True


def _body_missing_function_world(ctx):
    return _body_missing_function(ctx) if ctx.rank == 0 else True


def test_function_missing_on_the_callee_gives_an_error_saying_so():
    assert run_world(_body_missing_function_world, 2) == [True, True]


def _body_unpicklable_function(ctx):
    with pytest.raises(Exception, match="lambda"):
        rpc_core.rpc_sync(1, lambda: 1)
    with pytest.raises(TypeError, match="pickle.*lock"):
        rpc_core.rpc_async(1, _identity, args=(threading.Lock(),))
    assert rpc_core.rpc_sync(1, _whoami) == "worker1"
    return True


def test_a_lambda_or_unpicklable_argument_fails_at_the_caller_saying_what():
    assert run_world(_body_unpicklable_function, 2)[0]


# -- remote exceptions ------------------------------------------------------------------------------
def _body_remote_exceptions(ctx):
    for to in (1, 0):
        where = f"worker{to}"
        for call in (
            lambda f, to=to: rpc_core.rpc_sync(to, f),
            lambda f, to=to: rpc_core.rpc_async(to, f).wait(),
            lambda f, to=to: rpc_core.remote(to, f).to_here(),
        ):
            with pytest.raises(ValueError, match="Expected error") as info:
                call(_raise_value_error)
            text = "".join(traceback.format_exception(info.value))
            assert "_raise_value_error" in text, text  # the raising frame is in the traceback...
            if to != ctx.rank:  # ...which, from another worker, travels in the message
                assert f"Remote traceback (on {where})" in str(info.value)
            with pytest.raises(CustomError, match="custom failure 42"):
                call(_raise_custom)
            if to == ctx.rank:
                continue  # a call to self may hand back the original exception object itself
            with pytest.raises(RuntimeError) as info:
                call(_raise_needs_two_args)
            msg = str(info.value)
            assert type(info.value) is not NeedsTwoArgs
            assert f"Error on {where}" in msg and "Original exception on remote side was" in msg
            assert "NeedsTwoArgs" in msg and "7: cannot be rebuilt from a message" in msg
    peer = 1 - ctx.rank
    with pytest.raises(
        RuntimeError,
        match=rf"(?s)Error on worker{peer}.*Original exception on remote side was "
        rf"tests\.rpc_core\._callee_only_{peer}\.GhostError: only the callee knows",
    ):
        rpc_core.rpc_sync(peer, _raise_callee_only_error)
    with pytest.raises(RuntimeError, match=rf"worker{peer} could not serialize the result.*lock"):
        rpc_core.rpc_sync(peer, _return_unpicklable)
    with pytest.raises(TypeError, match="positional argument"):
        rpc_core.rpc_sync(1, _add, args=(1, 2, 3, 4))
    return True


def test_remote_exceptions_keep_their_type_and_carry_the_remote_traceback():
    assert run_world(_body_remote_exceptions, 2)[0]


# -- timeouts --------------------------------------------------------------------------------------
def _body_timeouts(ctx):
    assert rpc_core.get_rpc_timeout() == 60.0  # the default
    with pytest.raises(RpcTimeoutError, match=r"RPC ran for more than set timeout \(200 ms\).*worker1"):
        rpc_core.rpc_sync(1, _slow_counted, args=(1.0,), timeout=0.2)
    fut = rpc_core.rpc_async(1, _slow_counted, args=(1.0,), timeout=0.2)
    with pytest.raises(RuntimeError, match="RPC ran for more than"):
        fut.wait()
    # 0 = no timeout, even when the default is tiny; a call in flight keeps the timeout it had
    in_flight = rpc_core.rpc_async(1, _sleep_then, args=(0.5, "kept its timeout"))
    rpc_core._set_rpc_timeout(0.1)
    assert rpc_core.get_rpc_timeout() == 0.1
    with pytest.raises(RpcTimeoutError, match="RPC ran for more than"):
        rpc_core.rpc_sync(1, _sleep_then, args=(1.0, None))
    assert rpc_core.rpc_sync(1, _sleep_then, args=(0.5, "no timeout"), timeout=0) == "no timeout"
    assert in_flight.wait() == "kept its timeout"
    rpc_core._set_rpc_timeout(60.0)
    # the callee was not blocked: the timed-out calls ran to completion there
    while rpc_core.rpc_sync(1, _count) < 2:
        rpc_core.rpc_sync(1, _sleep_then, args=(0.2, None))  # the slow calls are still sleeping
    # remote(): a timed-out creation surfaces at to_here()
    rref = rpc_core.remote(1, _sleep_then, args=(1.0, "late"), timeout=0.2)
    with pytest.raises(RpcTimeoutError):
        rref._get_future().wait()
    with pytest.raises(RuntimeError, match=r"RRef creation via rpc.remote\(\) timed out"):
        rref.to_here()
    slow = rpc_core.remote(1, _sleep_then, args=(1.0, "slow"))
    with pytest.raises(RpcTimeoutError, match="RPC ran for more than"):
        slow.to_here(timeout=0.2)
    assert slow.to_here() == "slow"
    return True


def _body_timeouts_world(ctx):
    return _body_timeouts(ctx) if ctx.rank == 0 else True


def test_timeouts_per_call_default_and_zero_means_none():
    assert run_world(_body_timeouts_world, 2) == [True, True]


def _body_default_timeout_from_options(ctx):
    assert rpc_core.get_rpc_timeout() == 0.3
    if ctx.rank == 0:
        with pytest.raises(RpcTimeoutError, match=r"RPC ran for more than set timeout \(300 ms\)"):
            rpc_core.rpc_sync(1, _sleep_then, args=(1.0, None))
        assert rpc_core.rpc_sync(1, _sleep_then, args=(0.5, "ok"), timeout=5) == "ok"
    return True


def test_default_timeout_comes_from_the_options():
    got = run_world(_body_default_timeout_from_options, 2, options={"rpc_timeout": 0.3, "init_timeout": 60})
    assert got == [True, True]


# -- init / shutdown state --------------------------------------------------------------------------
def test_apis_before_init_say_to_call_init_rpc_first():
    """torch's words first (test_torch_compat.py compares them with torch's), then rpc_core's."""
    calls = [
        lambda: rpc_core.rpc_sync("worker1", _whoami),
        lambda: rpc_core.rpc_async(1, _whoami),
        lambda: rpc_core.remote(1, _whoami),
        lambda: rpc_core.get_worker_info(),
        lambda: rpc_core.shutdown(),
    ]
    for call in calls:
        with pytest.raises(
            RpcNotInitializedError,
            match=r"^RPC has not been initialized\. Call rpc_core\.init_rpc "
            r"first",
        ):
            call()
    for call in (rpc_core.get_rpc_timeout, lambda: rpc_core.RRef(1)):
        with pytest.raises(
            RpcNotInitializedError,
            match=r"^Current RPC agent is not set! .*Call rpc_core\.init_rpc "
            r"first",
        ):
            call()


def _body_reinit(ctx, second_port):
    ctx.init()
    first = rpc_core.rpc_sync(1 - ctx.rank, _whoami)
    rpc_core.shutdown()
    with pytest.raises(RpcNotInitializedError):
        rpc_core.rpc_sync(1 - ctx.rank, _whoami)
    ctx.init(name=f"again{ctx.rank}", init_method=f"tcp://127.0.0.1:{second_port}")
    second = rpc_core.rpc_sync(1 - ctx.rank, _whoami)
    rref = rpc_core.remote(1 - ctx.rank, _add, args=(1, 1))
    assert rref.to_here() == 2
    return first, second


def test_after_shutdown_apis_fail_and_the_process_can_init_again():
    got = run_world(_body_reinit, 2, init=False, args=(free_port(),))
    assert got == [("worker1", "again1"), ("worker0", "again0")]


def test_options_validate_their_fields():
    with pytest.raises(TypeError, match="seconds"):
        RpcBackendOptions(rpc_timeout="60")
    with pytest.raises(ValueError, match="^RPC Timeout must be non-negative: .*>= 0"):  # a RuntimeError too
        RpcBackendOptions(rpc_timeout=-1)
    with pytest.raises(RuntimeError, match="^num_worker_threads must be positive"):  # a ValueError too
        RpcBackendOptions(num_worker_threads=0)
    with pytest.raises(ValueError, match="CPU tensors only"):
        RpcBackendOptions(device_maps={"worker1": {0: 1}})
    with pytest.raises(ValueError, match="CPU tensors only"):
        RpcBackendOptions().set_device_map("worker1", {0: 1})
    assert rpc_core.TensorPipeRpcBackendOptions is RpcBackendOptions
