"""Who reads the answers on an outgoing connection: preferably the caller waiting for one.

Handing an answer from a reader thread to the thread blocked in ``rpc_sync`` costs a
thread wake-up, and on a small VM a wake-up is a large part of a small call's round trip.
So an outgoing connection has no thread that reads it all the time. A thread waiting on a
call's future reads frames off the socket itself (when nobody else is reading) until its
answer is there, completing the futures of any other calls it meets on the way. A
background thread reads only while some call is *unattended*: an ``rpc_async`` nobody
promised to wait on, so callbacks, ``wait_all`` and ``then`` chains work as before (a
*lazy* unattended call, ``remote``'s acknowledgement, wakes it only after a delay). Calls
whose caller waits at once (``rpc_sync``, ``to_here``, the proxies' ``rpc_sync``, the
gradient calls of a distributed backward's root) never wake the background thread.

A thread issuing a *burst* (``rpc_async`` after ``rpc_async``, many unanswered) reads the
answers that have arrived itself, every few calls and without waiting, and queues its
requests to write them in batches; the background thread stands by until the burst
stops. Two threads taking turns at the GIL for each call cost more than the call: the
caller's work per call was 1.7x what it is on one thread.

One thread reads at a time (the "reading role"); the others wait for the role or for
their answer, whichever comes first. Only requests and their answers travel on these
connections, so nothing unsolicited is left unread for long: a late answer to a call that
timed out waits in the socket for the next reader, who drops it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import transport
from .pool import ThreadGroup, init_torch_thread

log = logging.getLogger("rpc_core")

# How long a waiter whose call has no deadline waits for the reading role before looking
# at its future again (a future can also be completed by a timeout or a lost peer).
_RECHECK_SECONDS = 0.05
# A waiter whose call has a deadline waits this much past it: by then the timer has failed the call.
_PAST_DEADLINE = 0.002
# The background thread takes over a burst's answers once no burst call was sent while
# it stood by for this long (the issuer has stopped, e.g. to wait for them all). The
# time doubles, up to the limit, while the burst goes on: each look costs the issuer two
# hand-overs of the GIL, and the last one delays the end of the burst.
_STANDBY_SECONDS = 0.0002
_STANDBY_LIMIT = 0.0016
# A thread issuing a burst reads the arrived answers (and writes its queued requests)
# after this many calls.
BURST_READ_EVERY = 32


class Outbound:
    def __init__(
        self,
        conn: transport.Connection,
        deliver: Callable[[tuple[Any, ...]], None],
        lost: Callable[[BaseException], None],
        name: str,
        threads: ThreadGroup | None = None,
    ) -> None:
        self.conn = conn
        self._deliver = deliver  # gets (header, head, body, storages) of each frame read
        self._lost = lost  # called once, when reading fails (peer gone, malformed bytes)
        self._lock = lock = threading.Lock()
        # Two conditions on one lock, so that ending a read wakes the background thread only
        # when there is something for it to read: a needless wake-up costs as much as a call.
        # Each is notified only when someone waits on it (_waiters, _bg_idle): this runs for
        # every frame, and Condition.notify_all costs a few µs even when it wakes nobody.
        self._cv = threading.Condition(lock)  # waiters for the reading role or their answer
        self._bg_cv = threading.Condition(lock)  # the background thread
        self._waiters = 0
        self._bg_idle = False
        self._unattended = 0
        self._kick_armed = False
        self._reading = False
        self._burst = 0  # burst calls sent so far (their issuer reads the answers)
        self._handover = False  # an issuer asks the background thread for the role
        self.read_by_waiters = 0  # frames read by callers waiting for an answer
        self.read_by_issuers = 0  # frames read by threads issuing a burst
        self.read_in_background = 0
        self._closed = False
        (threads if threads is not None else ThreadGroup()).start(self._background, name)

    # -- bookkeeping called by the agent ------------------------------------------------------
    def sent_unattended(self, lazy: bool = False, burst: bool = False) -> bool:
        """A call was sent whose answer nobody is reading for (yet). A ``lazy`` one does not
        wake the background thread: the next waiter reads it on its way, else a ``kick``
        does. A ``burst`` one: its issuer calls ``read_arrived`` every ``BURST_READ_EVERY``
        such calls. Returns whether the caller must arrange that kick (one at a time is armed)."""
        with self._lock:
            self._unattended += 1
            if burst:
                self._burst += 1
            if not lazy:
                if not self._reading and self._bg_idle:
                    self._wake_background()
                return False
            if self._kick_armed:
                return False
            self._kick_armed = True
            return True

    def _wake_background(self) -> None:
        # _lock held. Not idle from now on: until the thread runs (it needs the GIL, which
        # a caller issuing a burst holds for a switch interval), later calls skip the notify.
        self._bg_idle = False
        self._bg_cv.notify()

    def burst_read_due(self) -> bool:
        return self._burst % BURST_READ_EVERY == 0

    def read_arrived(self) -> None:
        """For a thread issuing a burst: read the answers that have arrived, on this thread,
        without waiting for more, after writing the queued requests. If another thread is
        reading, the requests are written and the background thread is asked to hand over."""
        with self._lock:
            busy = self._reading or self._closed
            if busy:
                self._handover = True
            else:
                self._reading = True
        if busy:
            self.conn.flush_queued()
            return
        try:
            while not self._closed and self.conn.frame_waiting():  # a dead socket stays "ready"
                self.read_by_issuers += 1
                self._read_one()
        finally:
            self._end_read()  # wakes the background thread only if it is idle, not standing by

    def in_flight(self) -> int:
        """Calls sent whose answers only the background thread is sure to read."""
        return self._unattended

    def kick(self) -> None:
        """Lazy answers waited long enough: the background thread reads whatever is left."""
        with self._lock:
            self._kick_armed = False
            if self._unattended > 0 and not self._reading and self._bg_idle:
                self._wake_background()

    def answered(self, unattended: bool) -> None:
        """A call on this connection completed (answer, timeout or failure)."""
        with self._lock:
            if unattended:
                self._unattended -= 1
            if self._waiters:
                self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            self._bg_cv.notify()

    # -- reading ----------------------------------------------------------------------------------
    def read_until(self, fut: Any, deadline: float | None) -> None:
        """Read frames on this thread until ``fut``'s answer arrived (its completion may
        still be queued for a pool thread when it has callbacks: the caller then waits on
        the future itself) or the connection is closed."""
        while not (fut._answered or fut.done()):
            with self._lock:
                while self._reading and not (fut._answered or fut.done() or self._closed):
                    self._waiters += 1
                    try:
                        self._cv.wait(_wait_time(deadline))
                    finally:
                        self._waiters -= 1
                if fut._answered or fut.done() or self._closed:
                    return
                self._reading = True
            try:
                if self.conn.poll(_wait_time(deadline)):
                    self.read_by_waiters += 1
                    self._read_one()
            finally:
                self._end_read()

    def _background(self) -> None:
        init_torch_thread()  # received tensors are rebuilt on the reading thread
        burst_seen = 0
        while True:
            with self._lock:
                standby = _STANDBY_SECONDS
                while not self._closed:
                    if self._reading or self._unattended <= 0:
                        burst_seen = self._burst
                        standby = _STANDBY_SECONDS
                        self._bg_idle = True
                        try:
                            self._bg_cv.wait()
                        finally:
                            self._bg_idle = False
                    elif self._burst != burst_seen:
                        # A burst is being sent, and its issuer reads the answers: stand by
                        # (nobody needs to notify us) until no burst call came for a while.
                        burst_seen = self._burst
                        self._bg_cv.wait(standby)
                        standby = min(standby * 2, _STANDBY_LIMIT)
                    else:
                        break
                if self._closed:
                    return
                self._reading = True
                self._handover = False
            try:
                # Keep the role while unattended calls remain: a burst of answers costs one
                # hand-over, not one per frame (waiters still get theirs through answered()).
                while True:
                    self.read_in_background += 1
                    self._read_one()
                    if self._unattended <= 0 or self._closed or self._handover:
                        break
            except Exception:  # a bug while delivering must not leave the calls unread
                log.exception("rpc_core: error while delivering an answer")
            finally:
                self._end_read()

    def _end_read(self) -> None:
        with self._lock:
            self._reading = False
            if self._waiters:
                self._cv.notify_all()
            if self._unattended > 0 and self._bg_idle:
                self._wake_background()

    def _read_one(self) -> None:
        try:
            frame = self.conn.recv()
        except BaseException as e:  # noqa: BLE001 - any failure to read loses the connection, failing its calls with it
            with self._cv:
                if self._closed:
                    return
                self._closed = True
                self._cv.notify_all()
                self._bg_cv.notify()
            self._lost(e)
            return
        self._deliver(frame)


def _wait_time(deadline: float | None) -> float:
    if deadline is None:
        return _RECHECK_SECONDS
    return min(max(0.0, deadline - time.monotonic()) + _PAST_DEADLINE, _RECHECK_SECONDS)
