"""How a call's error reaches its waiters: rebuilt with its type, marked with where it was raised."""

from __future__ import annotations

import copy
import pickle

import pytest

from rpc_core.agent.futures import RpcFuture, raised_on, rebuild_exception
from rpc_core.errors import (
    RemoteFunctionError,
    RpcTimeoutError,
    WorkerLeftError,
    WorkerUnavailableError,
    failed_worker,
)
from rpc_core.protocol import wire


def test_a_rebuilt_exception_has_its_type_and_knows_the_worker_it_was_raised_on() -> None:
    e = rebuild_exception(wire.ExceptionInfo("builtins", "ValueError", "bad value\n\nRemote traceback ...", "worker3"))
    assert type(e) is ValueError and str(e).startswith("bad value")
    assert raised_on(e) == "worker3"


def test_an_exception_whose_type_cannot_be_rebuilt_still_knows_its_worker() -> None:
    e = rebuild_exception(wire.ExceptionInfo("no_such_module", "Boom", "boom", "worker1"))
    assert isinstance(e, RemoteFunctionError) and "no_such_module.Boom: boom" in str(e)
    assert raised_on(e) == "worker1"


def test_errors_that_arise_here_are_not_marked_and_waiters_copies_keep_the_mark() -> None:
    assert raised_on(WorkerUnavailableError("worker2 died")) is None
    fut = RpcFuture()
    fut.set_exception(rebuild_exception(wire.ExceptionInfo("builtins", "KeyError", "k", "worker2")))
    for _ in range(2):  # each waiter gets a fresh copy
        with pytest.raises(KeyError) as info:
            fut.wait()
        assert raised_on(info.value) == "worker2"


def test_an_error_names_the_worker_it_is_about_through_copies_pickles_causes_and_answers() -> None:
    lost = WorkerUnavailableError("worker 'ps1' (rank 1) closed the connection", worker="ps1")
    assert isinstance(lost, ConnectionError) and lost.worker == "ps1"
    for again in (copy.copy(lost), pickle.loads(pickle.dumps(lost)), _waiters_copy(lost)):
        assert type(again) is WorkerUnavailableError and again.worker == "ps1" and str(again) == str(lost)
    timed_out = RpcTimeoutError("RPC ran for more than set timeout (call to worker 'ps0' (rank 0))", worker="ps0")
    assert failed_worker(timed_out) == "ps0"
    # a higher layer's error raised from it still names it; one naming nobody does not
    try:
        try:
            raise lost
        except WorkerUnavailableError as e:
            raise RuntimeError("the update failed") from e
    except RuntimeError as wrapped:
        assert failed_worker(wrapped) == "ps1"
    assert failed_worker(RuntimeError("worker 'ps2' is only text here")) is None
    assert failed_worker(WorkerUnavailableError("no peer known")) is None
    # an error another worker sent back names the worker its causes named there
    back = rebuild_exception(wire.ExceptionInfo("builtins", "RuntimeError", "the update failed", "ps0", "ps1"))
    assert raised_on(back) == "ps0" and failed_worker(back) == "ps1"
    back = rebuild_exception(wire.ExceptionInfo("rpc_core.errors", "WorkerLeftError", "left", "ps0", "trainer3"))
    assert isinstance(back, WorkerLeftError) and back.worker == "trainer3"
    assert failed_worker(rebuild_exception(wire.ExceptionInfo("builtins", "KeyError", "k", "ps0"))) is None


def _waiters_copy(error: BaseException) -> BaseException:
    """What a waiter of a failed call gets: a fresh copy of the error."""
    fut = RpcFuture()
    fut.set_exception(error)
    try:
        fut.wait()
    except BaseException as e:  # noqa: BLE001 - the copy is what this returns
        return e
    raise AssertionError("the future did not fail")


def test_map_result_passes_an_error_on_with_its_class_where_then_wraps_it() -> None:
    import torch

    from rpc_core.agent.futures import map_result

    failed = RpcFuture()
    failed.set_exception(ValueError("creation failed"))
    with pytest.raises(RuntimeError, match="^Got the following error when running the callback: ValueError"):
        failed.then(lambda f: type(f.value())).wait()  # what then() makes of it
    with pytest.raises(ValueError, match="^creation failed$"):
        map_result(failed, type).wait()
    ok: torch.futures.Future[int] = torch.futures.Future()
    mapped = map_result(ok, lambda v: 10 // v)
    ok.set_result(0)
    with pytest.raises(ZeroDivisionError):  # fn's own error, as raised
        mapped.wait()
    assert map_result(RpcFuture(), type).done() is False
    done: torch.futures.Future[int] = torch.futures.Future()
    done.set_result(3)
    assert map_result(done, type).wait() is int
