"""``functions.after_response`` (rpc_core/functions.py, dispatch.py; an rpc_core extension):
work that a served function leaves for after its answer runs on the callee once the answer
is written, so the caller has its answer while that work still runs. Bodies run on worker
processes (tests/_world.py)."""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

import rpc_core
from rpc_core.functions import after_response, async_execution
from tests._world import run_world

# What the callee did, in order; the work left for after an answer waits for _go, which only
# a later call from the caller sets: had it run before the answer, the caller would never
# have had its answer, and could not have sent that call.
_log: list[str] = []
_go = threading.Event()
_done = threading.Event()
_pending: list[torch.futures.Future[Any]] = []
_errors: list[str] = []


def _later(tag: str) -> None:
    _log.append(f"{tag} started")
    if not _go.wait(30):
        _log.append(f"{tag} timed out")
    _log.append(f"{tag} done")
    _done.set()


def _leaves_work(tag: str) -> str:
    after_response(lambda: _later(tag))
    _log.append(f"{tag} returned")
    return tag


@async_execution
def _leaves_work_async(tag: str) -> torch.futures.Future[str]:
    after_response(lambda: _later(tag))
    fut: torch.futures.Future[str] = torch.futures.Future()
    _pending.append(fut)
    _log.append(f"{tag} returned a future")
    return fut


def _complete() -> bool:
    fut = _pending.pop()
    _log.append("future completed")
    fut.set_result("async")
    return True


def _release() -> bool:
    _go.set()
    return True


def _finished() -> list[str]:
    if not _done.wait(30):
        raise TimeoutError(f"the work left for after the answer never finished: {_log}")
    _done.clear()
    _go.clear()
    out = list(_log)
    _log.clear()
    return out


def _leaves_failing_work() -> int:
    after_response(lambda: 1 / 0)
    return 7


def _logged_errors() -> list[str]:
    return list(_errors)


class _Collect(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        _errors.append(record.getMessage())


def _body(ctx: Any) -> Any:
    if ctx.rank == 1:
        logging.getLogger("rpc_core").addHandler(_Collect(logging.ERROR))
        return None
    # A plain function: its answer comes back while the work it left waits for _release.
    assert rpc_core.rpc_sync(1, _leaves_work, args=("sync",), timeout=20) == "sync"
    assert rpc_core.rpc_sync(1, _release, timeout=20)
    sync_order = rpc_core.rpc_sync(1, _finished, timeout=40)
    # An async_execution function: the work waits for the returned future's answer.
    fut = rpc_core.rpc_async(1, _leaves_work_async, args=("async",), timeout=20)
    assert rpc_core.rpc_sync(1, _complete, timeout=20)
    assert fut.wait() == "async"
    assert rpc_core.rpc_sync(1, _release, timeout=20)
    async_order = rpc_core.rpc_sync(1, _finished, timeout=40)
    # Work that raises: the caller has its answer, the callee logs the error and serves on.
    assert rpc_core.rpc_sync(1, _leaves_failing_work, timeout=20) == 7
    assert rpc_core.rpc_sync(1, torch.add, args=(torch.ones(2), 1), timeout=20).tolist() == [2.0, 2.0]
    errors = rpc_core.rpc_sync(1, _logged_errors, timeout=20)
    # Outside a request the work runs at once.
    ran: list[int] = []
    after_response(lambda: ran.append(1))
    return sync_order, async_order, errors, ran


def test_work_left_for_after_the_answer_runs_after_it():
    (sync_order, async_order, errors, ran), _ = run_world(_body, 2)
    assert sync_order == ["sync returned", "sync started", "sync done"]
    assert async_order == ["async returned a future", "future completed", "async started", "async done"]
    assert len(errors) == 1 and "after_response" in errors[0], errors
    assert ran == [1]
