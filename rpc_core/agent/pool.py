"""The thread pool that runs incoming calls: few thread hops, never starves.

Jobs go into one queue. A single thread drains it while calls are quick, so a burst of
small requests costs no thread wake-ups and no GIL ping-pong between many threads. When
the draining thread blocks inside a job (a nested ``rpc_sync`` that waits for this very
worker, a lock, a sleep), queued jobs must not wait behind it: a thread that is about to
wait on an RPC future hands the queue over at once (``handoff``), and a watchdog adds a
drainer whenever the queue made no progress for a couple of milliseconds. So cyclic calls
(A -> B -> A -> ...) never deadlock for want of threads, however many are in flight.

A connection's reader runs each request it reads inline (``run_inline``): handing a
request to another thread costs a wake-up of that thread, which on a 2-vCPU VM is most of
a small call's latency. The same two rules keep inline runs from holding up the requests
behind them: a run that is about to wait on an RPC future moves the rest of the reading
loop to another thread at once, and the watchdog moves it when a run lasts longer than a
couple of milliseconds (a lock, a sleep, a long computation).

Idle threads form a stack and the most recently idle one is woken first: a thread's first
torch op (autograd, BLAS) costs milliseconds of per-thread setup, so warm threads win.
Threads start on demand; those beyond ``core_threads`` exit after idling.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("rpc_core")
_IDLE_EXIT_SECONDS = 30.0
_STALL_SECONDS = 0.002
# After an inline run the watchdog keeps polling this long before it sleeps until woken:
# a steady stream of requests then costs no wake-up of the watchdog per request.
_INLINE_POLL_SECONDS = 0.1
# A ThreadGroup forgets its ended threads once it holds this many (or twice as many as after
# the last time it did).
_PRUNE_FIRST = 64

Job = tuple[Callable[..., Any], tuple[Any, ...]]
_tls = threading.local()


class ThreadGroup:
    """The threads one agent starts, so closing the agent can wait for them to end.

    They are daemon threads (a stuck user function must not keep the process alive), and
    a daemon thread still inside a torch call when the interpreter finalizes aborts the
    process ("terminate called without an active exception": torch gives back the GIL in
    a C++ destructor, where CPython's thread exit cannot unwind). So shutdown waits,
    briefly, for the threads it just told to stop.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._prune_at = _PRUNE_FIRST

    def start(self, target: Callable[..., Any], name: str, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            # Ended threads are dropped once the list has doubled since the last pruning, not
            # at every start: rank 0 starts a reader per member, and pruning each time cost
            # it a pass over all of them per member (quadratic in the group's size).
            if len(self._threads) >= self._prune_at:
                self._threads = [x for x in self._threads if x.is_alive()]
                self._prune_at = max(_PRUNE_FIRST, 2 * len(self._threads))
            self._threads.append(t)
        t.start()

    def join(self, timeout: float) -> list[str]:
        """Wait up to ``timeout`` seconds in all for the threads to end (never for the
        calling one); returns the names of those still running."""
        deadline = time.monotonic() + timeout
        me = threading.current_thread()
        with self._lock:
            threads = [t for t in self._threads if t is not me]
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in threads if t.is_alive()]


def handoff_current() -> None:
    """Called by any thread about to block on an RPC future: if it is running a request
    inline, another thread continues its reading loop; if it drains the pool's queue,
    another thread takes the queue."""
    run = getattr(_tls, "inline", None)
    if run is not None and not run.moved:
        run.pool.move(run)
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
    __slots__ = ("wake", "stop", "task")

    def __init__(self) -> None:
        self.wake = threading.Lock()
        self.wake.acquire()  # held = asleep; released to wake the thread
        self.stop = False
        self.task: Callable[[], Any] | None = None  # a moved reading loop to continue


class _InlineRun:
    """A request running inline on the thread that serves a reading loop."""

    __slots__ = ("pool", "resume", "waiting", "stalled", "since", "moved")

    def __init__(
        self,
        pool: ElasticPool,
        resume: Callable[[], Any],
        waiting: Callable[[], bool] | None,
        stalled: Callable[[], Any] | None = None,
    ) -> None:
        self.pool = pool
        self.resume = resume  # continues the reading loop on another thread
        self.waiting = waiting  # whether more input waits for the loop (None: assume so)
        self.stalled = stalled  # called while the run outlasts the stall limit
        self.since = 0.0
        self.moved = False


class ElasticPool:
    def __init__(self, core_threads: int, name: str, threads: ThreadGroup | None = None) -> None:
        self._group = threads if threads is not None else ThreadGroup()
        self._core = core_threads
        self._name = name
        self._lock = threading.Lock()
        self._jobs: collections.deque[Job] = collections.deque()
        self._idle: list[_Worker] = []  # a stack: the last one to go idle is woken first
        self._threads = 0
        self._draining = 0  # threads currently taking jobs from the queue
        self._started = 0  # jobs taken so far: the watchdog's progress counter
        self._closed = False
        self._watch = threading.Condition(self._lock)
        self._watch_sleeping = False
        self._inline: list[_InlineRun] = []  # runs in progress, for the watchdog
        self._inline_runs = 0  # runs started so far
        # Threads start when work first needs them (at most core_threads stay once started):
        # a worker that is rarely called (one of a thousand on a host, each thread a pid and
        # its stack) holds none until then.
        self._group.start(self._watchdog, f"{name}-watchdog")

    @property
    def size(self) -> int:
        """Threads started so far (they start as work first needs them)."""
        return self._threads

    @property
    def capacity(self) -> int:
        """The configured ``num_worker_threads``, or more once the pool grew past it."""
        return max(self._core, self._threads)

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

    def run_inline(
        self,
        resume: Callable[[], Any],
        fn: Callable[..., Any],
        *args: Any,
        waiting: Callable[[], bool] | None = None,
        stalled: Callable[[], Any] | None = None,
    ) -> bool:
        """Run ``fn(*args)`` on this thread, which serves a reading loop. If the run blocks
        on an RPC future, or outlasts the stall limit while ``waiting()`` says more input is
        there, ``resume()`` continues the loop on another thread (a long computation alone
        on its connection keeps its thread: moving would only cost wake-ups). ``stalled()``
        is called (by the watchdog) while the run outlasts the stall limit. Returns False
        if the loop moved: the caller must leave it."""
        run = _InlineRun(self, resume, waiting, stalled)
        prev = getattr(_tls, "inline", None)
        _tls.inline = run
        with self._lock:
            self._inline.append(run)
            self._inline_runs += 1
            run.since = time.monotonic()
            if self._watch_sleeping:
                self._watch.notify()
        try:
            fn(*args)
        except BaseException:
            log.exception("rpc_core: unhandled error in an inline request")
        finally:
            _tls.inline = prev
            with self._lock:
                self._inline.remove(run)
        return not run.moved

    def move(self, run: _InlineRun) -> None:
        """Continue ``run``'s reading loop on another thread (the run itself goes on)."""
        with self._lock:
            self._move_locked(run)

    def _move_locked(self, run: _InlineRun) -> None:
        if run.moved or self._closed:
            return
        run.moved = True
        if self._idle:
            w = self._idle.pop()
            w.task = run.resume
            w.wake.release()
        else:
            self._spawn_locked(start_draining=False, task=run.resume)

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

    def _spawn_locked(self, start_draining: bool, task: Callable[[], Any] | None = None) -> _Worker:
        w = _Worker()
        w.task = task
        if start_draining or task is not None:
            w.wake.release()
        self._threads += 1
        self._group.start(self._work, f"{self._name}-{self._threads}", w)
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
            task = w.task
            if task is not None:
                w.task = None
                try:
                    task()
                except BaseException:
                    log.exception("rpc_core: unhandled error in a reading loop")
                del task
                with self._lock:
                    if self._closed:
                        return
                    self._idle.append(w)
                continue
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
        last_inline, quiet_since = -1, time.monotonic()
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                if self._inline_runs != last_inline or self._inline:
                    last_inline, quiet_since = self._inline_runs, now
                queue_busy = bool(self._jobs and self._draining)
                if not queue_busy and now - quiet_since > _INLINE_POLL_SECONDS:
                    self._watch_sleeping = True
                    self._watch.wait()
                    self._watch_sleeping = False
                    quiet_since = time.monotonic()
                    continue
                seen = self._started
                self._watch.wait(_STALL_SECONDS)
                if self._closed:
                    return
                if self._jobs and self._draining and self._started == seen:
                    self._add_drainer_locked()  # every drainer is stuck in a job
                now = time.monotonic()
                stalled = []
                for run in self._inline:
                    if now - run.since < _STALL_SECONDS:
                        continue
                    if run.stalled is not None:
                        stalled.append(run.stalled)
                    if not run.moved and (run.waiting is None or run.waiting()):
                        self._move_locked(run)  # a long or blocked run with input behind it
                if stalled:
                    # Not under the lock: a callback may write to a socket, and a slow peer
                    # must not hold up every inline run of this pool.
                    self._lock.release()
                    try:
                        for fn in stalled:
                            try:
                                fn()
                            except BaseException:  # one failing callback must not skip the others
                                log.exception("rpc_core: error in a stalled-run callback")
                    finally:
                        self._lock.acquire()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._jobs.clear()
            self._watch.notify_all()
        for w in idle:
            w.stop = True
            w.wake.release()
