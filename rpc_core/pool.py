"""The thread pool that runs incoming calls: few thread hops, never starves.

Jobs go into one queue. A single thread drains it while calls are quick, so a burst of
small requests costs no thread wake-ups and no GIL ping-pong between many threads. When
the draining thread blocks inside a job (a nested ``rpc_sync`` that waits for this very
worker, a lock, a sleep), queued jobs must not wait behind it: a thread that is about to
wait on an RPC future hands the queue over at once (``handoff``), and a watchdog adds a
drainer whenever the queue made no progress for a couple of milliseconds. So cyclic calls
(A -> B -> A -> ...) never deadlock for want of threads, however many are in flight.

Idle threads form a stack and the most recently idle one is woken first: a thread's first
torch op (autograd, BLAS) costs milliseconds of per-thread setup, so warm threads win.
Threads beyond ``core_threads`` exit after idling.
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Callable, Deque, List, Optional, Tuple

log = logging.getLogger("rpc_core")
_IDLE_EXIT_SECONDS = 30.0
_STALL_SECONDS = 0.002

Job = Tuple[Callable[..., Any], Tuple[Any, ...]]
_tls = threading.local()


def handoff_current() -> None:
    """If this thread is a pool thread about to block, let another thread take its queue."""
    pool = getattr(_tls, "pool", None)
    if pool is not None:
        pool.handoff()


def init_torch_thread() -> None:
    """Give this thread torch's intra-op thread count. OpenMP keeps that setting per thread:
    a new Python thread would otherwise run ops with one OpenMP thread per core, which on a
    busy machine spins and makes small ops up to ~10x slower than on the main thread."""
    import torch

    torch.set_num_threads(torch.get_num_threads())


class _Worker:
    __slots__ = ("wake", "stop")

    def __init__(self) -> None:
        self.wake = threading.Lock()
        self.wake.acquire()  # held = asleep; released to wake the thread
        self.stop = False


class ElasticPool:
    def __init__(self, core_threads: int, name: str) -> None:
        self._core = core_threads
        self._name = name
        self._lock = threading.Lock()
        self._jobs: Deque[Job] = collections.deque()
        self._idle: List[_Worker] = []  # a stack: the last one to go idle is woken first
        self._threads = 0
        self._draining = 0  # threads currently taking jobs from the queue
        self._started = 0  # jobs taken so far: the watchdog's progress counter
        self._closed = False
        self._watch = threading.Condition(self._lock)
        self._watch_sleeping = False
        with self._lock:
            for _ in range(core_threads):
                self._idle.append(self._spawn_locked(start_draining=False))
        threading.Thread(target=self._watchdog, name=f"{name}-watchdog", daemon=True).start()

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
            self._jobs.append((fn, args))
            if self._draining == 0:
                self._add_drainer_locked()
            elif self._watch_sleeping:
                self._watch.notify()

    def handoff(self) -> None:
        """Called by a pool thread about to block: let another thread take the queue."""
        if getattr(_tls, "pool", None) is self and self._jobs:
            with self._lock:
                if self._jobs:
                    self._add_drainer_locked()

    # -- internals ------------------------------------------------------------------------------
    def _add_drainer_locked(self) -> None:
        self._draining += 1
        if self._idle:
            self._idle.pop().wake.release()
        else:
            self._spawn_locked(start_draining=True)

    def _spawn_locked(self, start_draining: bool) -> _Worker:
        w = _Worker()
        if start_draining:
            w.wake.release()
        self._threads += 1
        threading.Thread(target=self._work, args=(w,), name=f"{self._name}-{self._threads}", daemon=True).start()
        return w

    def _work(self, w: _Worker) -> None:
        _tls.pool = self
        init_torch_thread()
        jobs = self._jobs
        while True:
            if not w.wake.acquire(timeout=_IDLE_EXIT_SECONDS):
                with self._lock:
                    # Still idle (nobody woke us meanwhile) and beyond the core size: exit.
                    if w in self._idle and self._threads > self._core:
                        self._idle.remove(w)
                        self._threads -= 1
                        return
                continue
            if w.stop:
                return
            while True:
                try:
                    fn, args = jobs.popleft()
                except IndexError:
                    with self._lock:
                        if jobs:
                            continue
                        self._draining -= 1
                        if self._closed:
                            return
                        self._idle.append(w)
                    break
                self._started += 1
                try:
                    fn(*args)
                except BaseException:  # a job must never kill its thread
                    log.exception("rpc_core: unhandled error in a pool job")
                del fn, args

    def _watchdog(self) -> None:
        with self._lock:
            while not self._closed:
                if not (self._jobs and self._draining):
                    self._watch_sleeping = True
                    self._watch.wait()
                    self._watch_sleeping = False
                    continue
                seen = self._started
                self._watch.wait(_STALL_SECONDS)
                if self._jobs and self._started == seen and not self._closed:
                    self._add_drainer_locked()  # every drainer is stuck in a job

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._jobs.clear()
            self._watch.notify_all()
        for w in idle:
            w.stop = True
            w.wake.release()
