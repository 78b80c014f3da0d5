"""``torch.futures.wait_all`` and ``collect_all`` that return at the first failed rpc_core call,
as torch's do for its own RPC futures.

torch's ``wait_all`` raises the first failure without waiting for the other futures, and
``collect_all``'s future fails with it, because torch's RPC agent marks a failed call's
future failed inside its C++ core, where both look. A Future completed from Python cannot
be marked so: ``set_exception`` (torch's own, and rpc_core's ``set_error``) stores the
exception as the value, for ``wait()`` to raise, and the C++ core takes that future for a
success. So on rpc_core's futures torch's functions would wait for every future before
raising the failure: a program that relies on the early exit (a failed call among slow
ones) would hang as long as the slowest call.

``install`` (run when ``rpc_core`` is imported) puts ``wait_all`` and ``collect_all`` below in
``torch.futures``. They keep torch's behaviour, by calling torch's functions, unless one of
the futures is rpc_core's (a call's ``RpcFuture``, or a future ``set_error`` failed): then
they also return, or fail, at the first failure ``set_error`` makes (``futures.watch_failures``),
with that future's own error (its ``wait()``'s: the class and message the call raised).
``RPC_CORE_WAIT_ALL_EARLY=0`` (read by each call) keeps torch's functions for every future.
A name bound before ``import rpc_core`` (``from torch.futures import wait_all``) keeps torch's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from .. import knobs
from .futures import RpcFuture, failed_here, set_error, unwatch_failures, watch_failures
from .pool import handoff_current

# torch's own, as they were before ``install`` (rpc_core's internal waits use these: they
# wait for every future, whatever fails).
torch_wait_all = torch.futures.wait_all
torch_collect_all = torch.futures.collect_all


def _ours(futures: list[Any]) -> bool:
    """Whether the early exit applies: one of ``futures`` is an rpc_core future."""
    return any(isinstance(f, RpcFuture) or failed_here(f) for f in futures) and knobs.wait_all_early()


class _FirstFailure:
    """Watches ``futures`` for the first one ``set_error`` fails (``start``): calls
    ``on_failure(fut)`` once, for it. ``stop`` ends the watch."""

    def __init__(self, futures: list[Any], on_failure: Callable[[Any], None]) -> None:
        self._futures = futures
        self._ids = {id(f) for f in futures}  # the futures are alive while watched: ids are unique
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self.first: Any = None
        self._watcher = self._failed  # one bound method, so stop() removes this very one

    def start(self) -> None:
        watch_failures(self._watcher)
        # A future failed before the watch began: set_error marked it before it completed it,
        # and tells the watchers after, so one of the two ways finds every failure.
        for f in self._futures:
            if f.done() and failed_here(f):
                self._failed(f)
                break

    def _failed(self, fut: Any) -> None:
        if id(fut) not in self._ids:
            return
        with self._lock:
            if self.first is not None:
                return
            self.first = fut
        self._on_failure(fut)

    def stop(self) -> None:
        unwatch_failures(self._watcher)


def wait_all(futures: list[Any]) -> list[Any]:
    """``torch.futures.wait_all``: the futures' values, in order; raises the first failure
    without waiting for the other futures (see the module doc)."""
    futures = list(futures)
    if not _ours(futures):
        return torch_wait_all(futures)
    every = torch._C._collect_all(futures)  # done when all are done (or one failed in the C++ core)
    if not every.done():  # else nothing to exit early from: torch's way, at torch's cost
        ended = threading.Event()
        every.add_done_callback(lambda _: ended.set())
        watch = _FirstFailure(futures, lambda _: ended.set())
        watch.start()
        try:
            if not ended.is_set():
                handoff_current()  # a pool or reader thread about to block must not hold up other calls
                ended.wait()
        finally:
            watch.stop()
        if watch.first is not None:
            watch.first.wait()  # raises its error
    every.wait()  # raises a failure of torch's core, as torch's wait_all does
    return [f.wait() for f in futures]


def collect_all(futures: list[Any]) -> torch.futures.Future[list[Any]]:
    """``torch.futures.collect_all``: a Future of the list of ``futures`` once all are done;
    it fails with the first failure without waiting for the other futures (see the module doc)."""
    futures = list(futures)
    if not _ours(futures):
        return torch_collect_all(futures)
    out = RpcFuture()
    lock = threading.Lock()
    finished: list[bool] = []

    def finish(error: BaseException | None) -> None:
        with lock:
            if finished:
                return
            finished.append(True)
        watch.stop()
        if error is None:
            out.set_result(futures)
        else:
            set_error(out, error)

    def failed(fut: Any) -> None:
        try:
            fut.wait()
        except BaseException as e:  # noqa: BLE001 - the failure is the combined future's
            finish(e)

    def all_done(every: torch._C.Future[Any]) -> None:
        try:
            every.wait()
        except BaseException as e:  # noqa: BLE001 - a failure of torch's core, as torch's collect_all has it
            finish(e)
            return
        finish(None)

    watch = _FirstFailure(futures, failed)
    every = torch._C._collect_all(futures)
    if not every.done():  # else no failure can come first
        watch.start()
    every.add_done_callback(all_done)
    return out


def install() -> None:
    """Put ``wait_all`` and ``collect_all`` in ``torch.futures`` (again: a no-op)."""
    torch.futures.wait_all = wait_all
    torch.futures.collect_all = collect_all
