"""Waiting for bytes: a connection's reader polls its socket briefly, then sleeps.

A thread that sleeps in recv and is woken when bytes arrive pays a wake-up of tens of µs
on a small VM (bare TCP ping-pong between two processes here: 59 µs blocking, 9 µs
polling). So a reader whose recent waits on this socket were shorter than its budget
(``RPC_CORE_SPIN_US``, read when the connection is made) polls the socket, yielding the
CPU between polls, for up to the budget before it blocks. A reader whose waits are longer
(an idle peer, a long computation on the other side) blocks at once, and so does one
whose yield shows that another task wants the CPU (an oversubscribed machine). The budget
covers a call whose callee computes for a millisecond or two (a small model's forward):
ps_train's MLP 1+1 trained 15-16k samples/s with 200 µs and 18-20k with 2000 µs
(e2e_bench --quick, alternating). A budget of 0 turns polling off.

Polling only pays while a core is free for it: a reader that polls on a machine whose
cores are all taken takes a core from the very process that is to answer it (or from
another task that then preempts that process). Bare 64-byte socket ping-pong on the
shared 2-core development machine, with other jobs running: 5-11 µs blocking, 16-146 µs
polling. So a reader polls only while the machine's run queue (``/proc/loadavg``: tasks
running or ready to run, the reader and its polling peer included) is, on average over
the last few looks, not much longer than the cores this process may use; the count is
read at most every ``_RUN_QUEUE_TTL`` seconds, by whichever reader asks (``spare_core``).
An average, not the last look: a busy pair of processes on 2 cores shows a third runnable
task (a helper thread, a kernel worker) in about a third of the looks, and a gate that
closed for each of those kept a trainer from polling in 40% of its waits (ps_train MLP
1+1: 8% fewer samples/s than with no gate), while tasks that keep every core busy (CPU
hogs, more workers than cores) hold the average above the limit within a few looks.

``Waiting`` is the part of ``stream.Connection`` that does this; it only reads the
socket and the connection's queue of small frames (which it writes before it waits:
their answers may be what it waits for).
"""

from __future__ import annotations

import enum
import os
import select
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar


class _Nothing(enum.Enum):
    NOTHING = "NOTHING"


# What a non-blocking attempt or a wait returns when there is nothing (yet): an enum member,
# so a type checker narrows ``x is NOTHING`` like ``x is None``.
NOTHING: Final = _Nothing.NOTHING
# A yield that took this long ran another task: the CPU is wanted, so stop polling.
_CONTENDED = 50e-6
DONTWAIT = int(socket.MSG_DONTWAIT)  # plain ints: or-ing the enum flags costs µs per poll
_PEEK = DONTWAIT | int(socket.MSG_PEEK)


T = TypeVar("T")

# How long a look at the run queue holds (s): a reader asks before every wait it might poll
# in, and reading /proc/loadavg costs a few µs.
_RUN_QUEUE_TTL = 0.01
_LOADAVG = "/proc/loadavg"


def runnable_tasks(text: bytes) -> int | None:
    """Tasks running or ready to run, from ``/proc/loadavg``'s text (its 4th field is
    "runnable/total"); None if the text does not say."""
    try:
        return int(text.split()[3].split(b"/")[0])
    except (IndexError, ValueError):
        return None


# Weight of the newest look in the run queue's average (an exponential moving average).
_RUN_QUEUE_WEIGHT = 0.25
# A core counts as spare while the average run queue is at most this much above the cores:
# an extra task in up to about three looks of four keeps it spare, one in every look does not.
_RUN_QUEUE_SLACK = 0.75


class _RunQueue:
    """The last look at the machine's run queue (shared by every reader of the process)."""

    at = -1.0  # time.monotonic() of the look; < 0: never looked
    spare = True
    cores = 0  # cores this process may use, read at the first look
    average = -1.0  # moving average of the looks' run queue; < 0: no look yet


def spare_core() -> bool:
    """Whether the machine has a core for a reader to poll on: the tasks running or ready
    to run, averaged over the recent looks, are not much more than the cores this process
    may use (see the module doc; True when that cannot be read)."""
    now = time.monotonic()
    q = _RunQueue
    if now - q.at < _RUN_QUEUE_TTL and q.at >= 0:
        return q.spare
    if not q.cores:
        q.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open(_LOADAVG, "rb") as f:
            n = runnable_tasks(f.read())
    except OSError:
        n = None
    if n is None:
        q.spare = True
    else:
        q.average = n if q.average < 0 else q.average + (n - q.average) * _RUN_QUEUE_WEIGHT
        q.spare = q.average <= q.cores + _RUN_QUEUE_SLACK
    q.at = now
    return q.spare


def poll_until(end: float, attempt: Callable[[], T]) -> T | Literal[_Nothing.NOTHING]:
    """Retry the non-blocking ``attempt`` until it stops raising BlockingIOError and return
    its result; ``NOTHING`` once past ``end`` (perf_counter) or once a yield between tries
    shows that another task was waiting for this CPU (polling would take its time)."""
    while True:
        now = time.perf_counter()
        if now > end:
            return NOTHING
        os.sched_yield()
        if time.perf_counter() - now > _CONTENDED:
            return NOTHING
        try:
            return attempt()
        except BlockingIOError:
            pass


class Waiting:
    """A connection's waits for bytes (a mixin of ``stream.Connection``, whose state it
    shares, and whose ``_flush_small`` (``sending.Sender``) it calls: a mixin rather than a
    helper object, as this runs for every frame)."""

    sock: socket.socket
    _spin: float  # polling budget (s): knobs.spin_seconds() when the connection was made
    _wait_estimate: float  # moving average of recent waits for bytes (s); decides polling
    _no_poll: int  # sends whose buffers the peer copies with several threads (see send)
    _reader_sleeps: bool  # a reader is (about to be) blocked in the kernel
    _small_q: deque[bytes]
    _inbox: deque[tuple[Any, ...]]
    _start: int
    _end: int

    if TYPE_CHECKING:  # sending.Sender's

        def _flush_small(self) -> None: ...

    def _recv_into(self, view: memoryview) -> int:
        """``sock.recv_into(view)``; polls first when recent waits were short (see module doc).
        Queued frames go out first: their answers may be what this read waits for."""
        if self._small_q:
            self._flush_small()
        if self.sock.gettimeout() is not None:  # a timed socket: the handshake's, not ours
            return self.sock.recv_into(view)
        spin = self._spin
        if not spin:
            self._before_sleep()  # queued frames go out before this thread blocks
            try:
                return self.sock.recv_into(view)
            finally:
                self._reader_sleeps = False
        try:
            return self.sock.recv_into(view, 0, DONTWAIT)
        except BlockingIOError:
            pass
        start = time.perf_counter()
        k: int | Literal[_Nothing.NOTHING] = NOTHING
        if self._may_poll():
            k = poll_until(start + spin, lambda: self._try_recv_into(view))
        if k is NOTHING:
            self._before_sleep()
            try:
                k = self.sock.recv_into(view)
            finally:
                self._reader_sleeps = False
        self._note_wait(time.perf_counter() - start)
        return k

    def _may_poll(self) -> bool:
        """Whether a reader polls before it sleeps: recent waits were short, no peer is
        copying our buffers with several threads, and a core is free (see module doc)."""
        return self._wait_estimate < self._spin and not self._no_poll and spare_core()

    def _try_recv_into(self, view: memoryview) -> int:
        if self._small_q:
            self._flush_small()  # queued requests may be what the awaited answers wait for
        return self.sock.recv_into(view, 0, DONTWAIT)

    def _before_sleep(self) -> None:
        # Flag first, then look at the queue: a deferring sender that queued after this look
        # sees the flag and writes its frame itself.
        self._reader_sleeps = True
        if self._small_q:
            self._flush_small()

    def _note_wait(self, seconds: float) -> None:
        # An exponential moving average: a few long waits in a row switch polling off, a
        # few short ones switch it back on.
        self._wait_estimate += (seconds - self._wait_estimate) * 0.25

    def _poll_spin(self, start: float, timeout: float) -> bool:
        """Whether bytes arrived while polling for up to ``min(budget, timeout)`` seconds."""
        if not self._spin or self.sock.gettimeout() is not None or not self._may_poll():
            return False
        try:
            if poll_until(start + min(self._spin, timeout), self._try_peek) is NOTHING:
                return False
        except OSError:
            return True  # broken: recv says how
        self._note_wait(time.perf_counter() - start)
        return True

    def _try_peek(self) -> bytes:
        if self._small_q:
            self._flush_small()
        return self.sock.recv(1, _PEEK)

    def poll(self, timeout: float | None) -> bool:
        """Whether ``recv`` may have a frame to start on within ``timeout`` seconds: bytes
        are buffered or queued, or the socket became readable (or broke: ``recv`` says how)."""
        if self._inbox or self._end > self._start:
            return True
        start = time.perf_counter()
        if timeout and self._poll_spin(start, timeout):
            return True
        try:
            if timeout:
                self._before_sleep()
            readable, _, _ = select.select([self.sock], [], [], timeout)
        except (OSError, ValueError):
            return True
        finally:
            self._reader_sleeps = False
        if readable and timeout:
            self._note_wait(time.perf_counter() - start)
        return bool(readable)
