"""A thread pool that never starves and keeps its threads warm.

``num_worker_threads`` threads are kept ready. When a job arrives and none is idle (all
are blocked, e.g. in nested ``rpc_sync`` calls that wait for this very worker), a new
thread starts instead of queueing the job behind blocked ones, so cyclic calls
(A -> B -> A -> ...) cannot deadlock for want of threads. Extra threads exit after idling.

Idle threads form a stack and a job goes to the most recently idle one: a thread's first
torch op (autograd, BLAS) costs tens of milliseconds of per-thread setup, so reusing a
warm thread beats waking an arbitrary one.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, List, Optional, Tuple

log = logging.getLogger("rpc_core")
_IDLE_EXIT_SECONDS = 30.0

Job = Tuple[Callable[..., Any], Tuple[Any, ...]]


class _Worker:
    __slots__ = ("wake", "job")

    def __init__(self, job: Optional[Job]) -> None:
        self.wake = threading.Lock()
        self.wake.acquire()  # held = nothing to do; released by submit to hand over a job
        self.job = job


class ElasticPool:
    def __init__(self, core_threads: int, name: str) -> None:
        self._core = core_threads
        self._name = name
        self._lock = threading.Lock()
        self._idle: List[_Worker] = []  # a stack: the last one to go idle is reused first
        self._threads = 0
        self._closed = False
        with self._lock:
            for _ in range(core_threads):
                w = _Worker(None)
                self._idle.append(w)
                self._spawn_locked(w)

    @property
    def size(self) -> int:
        return self._threads

    @property
    def idle(self) -> int:
        return len(self._idle)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._lock:
            if self._closed:
                return
            if self._idle:
                w = self._idle.pop()
                w.job = (fn, args)
                w.wake.release()
                return
            self._spawn_locked(_Worker((fn, args)))

    def _spawn_locked(self, w: _Worker) -> None:
        self._threads += 1
        if w.job is not None:
            w.wake.release()
        threading.Thread(target=self._work, args=(w,), name=f"{self._name}-{self._threads}", daemon=True).start()

    def _work(self, w: _Worker) -> None:
        while True:
            if not w.wake.acquire(timeout=_IDLE_EXIT_SECONDS):
                with self._lock:
                    # Still idle (no submit picked us meanwhile) and beyond the core size: exit.
                    if w in self._idle and self._threads > self._core:
                        self._idle.remove(w)
                        self._threads -= 1
                        return
                continue
            job, w.job = w.job, None
            if job is None:  # close()
                return
            fn, args = job
            try:
                fn(*args)
            except BaseException:  # a job must never kill its thread
                log.exception("rpc_core: unhandled error in a pool job")
            del fn, args, job
            with self._lock:
                if self._closed:
                    return
                self._idle.append(w)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for w in idle:
            w.job = None
            w.wake.release()
