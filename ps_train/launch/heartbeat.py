"""Heartbeats from the roles to the local launcher: how it tells a frozen role from a busy one.

Each role process runs a daemon thread that bumps the role's counter in a shared-memory
array (one 64-bit slot per rank) every ``interval`` seconds. The thread needs only the CPU
and, briefly, the GIL, so it keeps beating while the role computes, waits for a peer or
sits in a long RPC; it stops when the whole process does: SIGSTOP, a hung machine or VM,
a C call that holds the GIL. The launcher notes when each counter last moved; a role whose
counter has not moved for ``cluster.role_timeout`` seconds is unresponsive, and the launcher
treats it like a dead one (stops the run, restarts it if ``cluster.max_restarts`` allows).

Counters rather than timestamps: the launcher measures the silence on its own clock, so
nothing assumes the processes share one. Until a role's first beat the allowance is
``startup_grace`` instead, never less than the timeout, counted from when the launcher
started that role's process (``started``), not from the launch: the first process a launcher
starts waits for its fork server, which imports what roles need first (seconds on a busy
machine), and that time is nobody's silence.

A dead role is not this module's business: the launcher sees its process exit at once.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = ["HeartbeatBoard", "start_heartbeat", "process_state"]

MIN_STARTUP_GRACE = 60.0  # seconds before a role's first beat, at least


class HeartbeatBoard:
    """Launcher side: one counter per rank, and when each last moved."""

    def __init__(self, ctx: Any, num_roles: int, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        # ctx: the multiprocessing context the roles are started with (its heap is shareable).
        self.timeout = timeout
        self.counters = ctx.RawArray(ctypes.c_uint64, num_roles)
        self.startup_grace = max(MIN_STARTUP_GRACE, 3 * timeout)
        self._clock = clock  # the launcher's own clock (a test's, to step time)
        now = clock()
        self._seen = [0] * num_roles
        self._moved = [now] * num_roles

    @property
    def enabled(self) -> bool:
        return self.timeout > 0

    @property
    def interval(self) -> float:
        """How often a role beats: several beats per timeout, at most one a second."""
        return min(1.0, self.timeout / 5) if self.enabled else 1.0

    def check_every(self) -> float | None:
        """How long the launcher may wait between checks (None: no checks)."""
        return self.interval if self.enabled else None

    def restart(self, rank: int) -> None:
        """A new process is about to take ``rank`` (an elastic run's replacement trainer): the
        dead one's count must not pass for the new one's first beat (``started`` follows)."""
        self.counters[rank] = 0
        self.started(rank)

    def started(self, rank: int) -> None:
        """The process for ``rank`` exists now (the launcher's ``Process.start`` returned: with
        the fork server, once it forked it): its startup allowance counts from now. It may have
        beaten already; then its silence counts from now, with the usual timeout."""
        self._seen[rank], self._moved[rank] = self.counters[rank], self._clock()

    def silent(self, ranks: Iterable[int]) -> list[tuple[int, float]]:
        """``(rank, seconds since its last beat)`` for each of ``ranks`` over its allowance."""
        if not self.enabled:
            return []
        now = self._clock()
        late = []
        for rank in ranks:
            value = self.counters[rank]
            if value != self._seen[rank]:
                self._seen[rank], self._moved[rank] = value, now
                continue
            allowance = self.timeout if value else self.startup_grace
            if now - self._moved[rank] > allowance:
                late.append((rank, now - self._moved[rank]))
        return late


def start_heartbeat(counters: Any, rank: int, interval: float) -> threading.Thread:
    """Role side: bump ``counters[rank]`` every ``interval`` seconds for the life of the process."""
    stop = threading.Event()  # never set: the thread dies with the process

    def beat() -> None:
        while True:
            counters[rank] += 1  # only this process writes this slot
            stop.wait(interval)

    t = threading.Thread(target=beat, name="ps_train-heartbeat", daemon=True)
    t.start()
    return t


_STATES = {
    "T": "stopped by a signal (SIGSTOP)",
    "t": "stopped by a debugger",
    "D": "in uninterruptible I/O",
    "Z": "a zombie",
    "R": "running",
    "S": "sleeping",
}


def process_state(pid: int) -> str | None:
    """What the kernel says the process is doing (``/proc/<pid>/stat``), or None off Linux."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ')'.
    state = stat.rsplit(")", 1)[-1].split()[0] if ")" in stat else "?"
    return _STATES.get(state, f"in state {state}")
