"""The agent's timer thread: calls past their deadline, lazy answers nobody read, and jobs
for later (``call_later``), all on one thread that sleeps until the earliest of them.

Deadlines are kept per timeout value: calls with the same timeout expire in the order they
were made, so each queue stays sorted by deadline without a heap (arming one is an append,
on every call). ``call_later``'s jobs, rare, keep a heap.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .outbound import Outbound

log = logging.getLogger("rpc_core")

# How long a lazy answer may wait for a waiter to read it before the background reader is
# woken for it. remote()'s acknowledgement only confirms the creator's RRef; the to_here()
# that usually follows reads it on its way to its own answer.
_LAZY_DELAY = 0.005
# The longest the timer sleeps with nothing due: it looks at its queues at least this often.
_IDLE_WAKE = 1.0
# Expired entries of calls answered meanwhile stay queued until they come due; a queue is
# rebuilt from the live ones when it holds more than twice the pending calls plus this.
_STALE_SLACK = 1024


class Deadlines:
    """The timer: ``arm`` a call's deadline, ``arm_kick`` a connection's lazy answers,
    ``call_later`` a job; ``run`` is the thread's body, ``stop`` ends it.

    ``pending`` is the agent's table of unanswered calls (read, never changed here: an
    answered call's deadline is skipped); ``expire(msg_id)`` fails a call past its deadline.
    """

    def __init__(self, pending: dict[int, Any], expire: Callable[[int], None], name: str) -> None:
        self._pending = pending
        self._expire = expire
        self._name = name
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        # Deadlines per timeout value: (when, msg_id), sorted by when (see the module doc).
        self._queues: dict[float, collections.deque[tuple[float, int]]] = {}
        # Outbounds with lazy answers to read by a deadline if no waiter did (see Agent.send_request).
        self._kicks: collections.deque[tuple[float, Outbound]] = collections.deque()
        # call_later's jobs: a heap of (when, sequence number, function).
        self._later: list[tuple[float, int, Callable[[], None]]] = []
        self._later_ids = itertools.count()
        self._next = 0.0  # when the thread plans to wake next (see call_later)

    def arm(self, timeout: float, msg_id: int) -> None:
        """Fail call ``msg_id`` ``timeout`` s from now unless it was answered by then."""
        with self._lock:
            q = self._queues.get(timeout)
            if q is None:
                q = self._queues[timeout] = collections.deque()
            wake = not q  # only a deque that was empty can hold a deadline earlier than all others
            q.append((time.monotonic() + timeout, msg_id))
        if wake:
            self._wake.set()

    def arm_kick(self, link: Outbound) -> None:
        """Have ``link``'s background reader read its lazy answers after ``_LAZY_DELAY``."""
        with self._lock:
            wake = not self._kicks
            self._kicks.append((time.monotonic() + _LAZY_DELAY, link))
        if wake:
            self._wake.set()

    def call_later(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the timer thread at ``when`` (``time.monotonic()``), or a little
        after. ``fn`` must be quick and must not block: it shares the thread that fails calls
        past their deadline. Wakes the timer only if it planned to sleep past ``when``."""
        with self._lock:
            heapq.heappush(self._later, (when, next(self._later_ids), fn))
            wake = when < self._next
        if wake:
            self._wake.set()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    def run(self) -> None:
        """The timer thread: until ``stop``, do what is due, then sleep until the next thing is."""
        pending = self._pending
        while not self._stopped:
            now = time.monotonic()
            expired: list[int] = []
            next_wake = now + _IDLE_WAKE
            kicks: list[Outbound] = []
            due: list[Callable[[], None]] = []
            with self._lock:
                while self._kicks and self._kicks[0][0] <= now:
                    kicks.append(self._kicks.popleft()[1])
                if self._kicks:
                    next_wake = min(next_wake, self._kicks[0][0])
                while self._later and self._later[0][0] <= now:
                    due.append(heapq.heappop(self._later)[2])
                if self._later:
                    next_wake = min(next_wake, self._later[0][0])
                for q in self._queues.values():
                    while q and q[0][0] <= now:
                        expired.append(q.popleft()[1])
                    # Answered calls leave stale entries; drop them when they dominate.
                    if len(q) > 2 * len(pending) + _STALE_SLACK:
                        live = [e for e in q if e[1] in pending]
                        q.clear()
                        q.extend(live)
                    if q:
                        next_wake = min(next_wake, q[0][0])
                self._next = next_wake if not (expired or kicks or due) else now
            for link in kicks:
                link.kick()
            for msg_id in expired:
                if msg_id in pending:
                    self._expire(msg_id)
            for fn in due:
                try:
                    fn()
                except Exception:  # one failing job must not stop the timer (logged)
                    log.exception("rpc_core %s: a timer job failed", self._name)
            if not expired and not kicks and not due:
                self._wake.wait(max(0.0, next_wake - time.monotonic()))
                self._wake.clear()
