"""How a call's error reaches its waiters: rebuilt with its type, marked with where it was raised."""
from __future__ import annotations

import pytest

from rpc_core import wire
from rpc_core.errors import RemoteFunctionError, WorkerUnavailableError
from rpc_core.futures import RpcFuture, raised_on, rebuild_exception


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
