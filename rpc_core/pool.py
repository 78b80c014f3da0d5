"""A thread pool that never starves: every submitted job gets a thread.

``num_worker_threads`` threads are kept ready. When a job arrives and none is idle (all
are blocked, e.g. in nested ``rpc_sync`` calls that wait for this very worker), a new
thread starts instead of queueing the job behind blocked ones, so cyclic calls
(A -> B -> A -> ...) cannot deadlock for want of threads. Extra threads exit after idling.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

log = logging.getLogger("rpc_core")
_IDLE_EXIT_SECONDS = 30.0


class ElasticPool:
    def __init__(self, core_threads: int, name: str) -> None:
        self._core = core_threads
        self._name = name
        self._q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a job and not yet reserved by a submit
        self._threads = 0
        self._closed = False
        with self._lock:
            for _ in range(core_threads):
                self._spawn_locked()
                self._idle += 1

    @property
    def size(self) -> int:
        return self._threads

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._lock:
            if self._idle > 0:
                self._idle -= 1  # reserve a waiting thread for this job
            else:
                self._spawn_locked()
        self._q.put((fn, args))

    def _spawn_locked(self) -> None:
        self._threads += 1
        threading.Thread(target=self._work, name=f"{self._name}-{self._threads}", daemon=True).start()

    def _work(self) -> None:
        while True:
            try:
                item = self._q.get(timeout=_IDLE_EXIT_SECONDS)
            except queue.Empty:
                with self._lock:
                    if self._threads > self._core and self._idle > 0:
                        self._idle -= 1
                        self._threads -= 1
                        return
                continue
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except BaseException:  # a job must never kill its thread
                log.exception("rpc_core: unhandled error in a pool job")
            with self._lock:
                self._idle += 1

    def close(self) -> None:
        with self._lock:
            n, self._closed = self._threads, True
        for _ in range(n):
            self._q.put(None)
