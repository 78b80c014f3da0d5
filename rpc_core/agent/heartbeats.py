"""Heartbeats: noticing that a peer we wait on went silent (frozen, stopped, unreachable).

A dead peer is noticed at once: its kernel closes the connection. A peer that is alive at
the TCP level but does not answer (a stopped or frozen process, a link that silently drops
packets) closes nothing, and a call without a timeout would wait on it forever. So while
calls to a peer are pending on an outgoing connection, the agent's timer looks at that
connection every quarter of ``heartbeat_timeout``:

- any byte received since the last look is proof of life (the count ``bytes_received``
  that the connection keeps anyway: nothing is added to the per-message path);
- after a quarter without a byte, a heartbeat call goes out (a CONTROL request of ``beat``,
  which the peer's reader answers like any call; one at a time per connection), so an idle
  connection carries one small message per quarter and a busy one none;
- after ``heartbeat_timeout`` without a byte, every call pending on that connection fails
  with ``WorkerUnavailableError`` saying what was observed, the connection is dropped (reset,
  so a sender blocked on a full socket is released and nothing queued is delivered later),
  and the next call to that peer dials afresh. A peer that answers before the deadline
  loses nothing.

So a silent peer is reported between ``heartbeat_timeout`` and 1.5 x ``heartbeat_timeout``
after its last byte. Higher layers that wait on peers without a call of their own (rank 0's
coordinator, while a barrier round is open) ask for every peer to be watched
(``liveness_wanted``) and hear of silent ones through ``on_peer_unreachable``.

``Heartbeats`` is a part of ``agent.Agent``: it reads the agent's connection table
(``Connections``) and call table (``PendingCalls``), sends its heartbeats with the agent's
``send_request`` and schedules its looks with ``call_later`` (callables it was made with). Its
work runs on the agent's timer thread and, for sends, on the pool.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from ..errors import WorkerUnavailableError
from ..protocol import allowlist, wire
from .completion import PendingCalls
from .connections import Connections
from .futures import RpcFuture
from .outbound import Outbound
from .pool import ElasticPool
from .roster import Roster

log = logging.getLogger("rpc_core")

# The timer looks at the watched connections this many times per heartbeat timeout.
TICKS_PER_TIMEOUT = 4


def beat() -> None:
    """The heartbeat call: its answer (like any byte from the peer) proves the peer alive."""
    return None


class _Watch:
    """What the timer knows of one watched outgoing connection."""

    __slots__ = ("seen", "since", "beating")

    def __init__(self, seen: int, since: float) -> None:
        self.seen = seen  # the connection's bytes_received at the last look
        self.since = since  # when that count last changed (or the watch began)
        self.beating = False  # a heartbeat call is out and unanswered


class Heartbeats:
    """The liveness watch (see the module doc). ``send(dst, func, args, kwargs, timeout,
    flags=, call_extras=)`` makes a call (``Agent.send_request``); ``call_later(when, fn)``
    runs ``fn`` on the timer thread at ``when``."""

    def __init__(
        self,
        timeout: float,
        roster: Roster,
        pool: ElasticPool,
        pending: PendingCalls,
        connections: Connections,
        send: Callable[..., RpcFuture],
        call_later: Callable[[float, Callable[[], None]], None],
    ) -> None:
        self.me = roster.me
        self._roster = roster
        self._pool = pool
        self._pending = pending
        self._connections = connections
        self._send = send
        self._call_later = call_later
        self.closing = False
        self.heartbeat_timeout = timeout  # s; 0: off
        self._tick = timeout / TICKS_PER_TIMEOUT
        self._watches: dict[Outbound, _Watch] = {}
        self._last_look = time.monotonic()
        self._dialling: set[int] = set()  # peers a heartbeat is dialling (watch-all only)
        # Called with (rank, what was observed) when a watched peer stays silent too long.
        self.on_peer_unreachable: list[Callable[[int, str], None]] = []
        # While any of these returns True, every peer is watched, with calls pending or not.
        self.liveness_wanted: list[Callable[[], bool]] = []

    def start(self) -> None:
        if self.heartbeat_timeout > 0:
            self._last_look = time.monotonic()
            self._call_later(self._last_look + self._tick, self._heartbeat_tick)

    def _heartbeat_tick(self) -> None:
        """On the timer thread, every tick: look at the watched connections."""
        if self.closing:
            return
        now = time.monotonic()
        if now - self._last_look > 2 * self._tick:
            # This process did not run for a while (stopped, suspended, starved): the silence
            # was ours, and answers may wait unread in our sockets. Start the watches afresh.
            self._watches = {}
        self._last_look = now
        try:
            self._look(now)
        finally:
            if not self.closing:
                self._call_later(time.monotonic() + self._tick, self._heartbeat_tick)

    def _look(self, now: float) -> None:
        waiting: dict[Outbound, int] = {}  # connection -> user and bookkeeping calls pending on it
        for rec in list(self._pending.pending.values()):
            if rec.link is not None and wire.LOCAL_HEARTBEAT not in rec.call_extras:
                waiting[rec.link] = waiting.get(rec.link, 0) + 1
        watch_all = any(wanted() for wanted in self.liveness_wanted)
        links = dict(self._connections.links)
        watches: dict[Outbound, _Watch] = {}
        for peer, link in links.items():
            n = waiting.get(link, 0)
            if not n and not watch_all:
                continue  # nobody waits on it: nothing to lose, no heartbeat (the watch restarts later)
            w = self._watches.get(link)
            received = link.conn.bytes_received
            if w is None:
                w = _Watch(received, now)
            elif w.seen != received:
                w.seen, w.since = received, now
            watches[link] = w
            silent = now - w.since
            if silent >= self.heartbeat_timeout:
                del watches[link]
                self._unreachable(peer, link, silent, n)
            elif silent >= self._tick * 0.999 and not w.beating:
                w.beating = True
                self._pool.submit(self._send_beat, peer, link, w)
        self._watches = watches
        if watch_all:
            for peer in list(self._roster.workers):  # ranks of the members (a dynamic group's may have gaps)
                if peer != self.me.id and peer not in links and peer not in self._dialling:
                    self._dialling.add(peer)
                    self._pool.submit(self._send_beat, peer, None, None)

    def _send_beat(self, peer: int, link: Outbound | None, w: _Watch | None) -> None:
        """On a pool thread (a send may block): a heartbeat call to ``peer`` over ``link``, or
        (``link`` None, watch-all) over a connection dialled for it."""
        if self.closing or (link is not None and self._connections.links.get(peer) is not link):
            if w is not None:
                w.beating = False
            self._dialling.discard(peer)
            return
        # Over a watched connection the watch bounds the call; one dialled for it gets the
        # heartbeat timeout (dial included) as its own.
        timeout = 0 if link is not None else self.heartbeat_timeout
        fut = self._send(peer, beat, (), {}, timeout, flags=wire.CONTROL, call_extras={wire.LOCAL_HEARTBEAT: True})
        fut.add_done_callback(lambda f: self._beat_done(peer, w, f))

    def _beat_done(self, peer: int, w: _Watch | None, fut: torch.futures.Future[Any]) -> None:
        if w is not None:
            w.beating = False
            return  # a failure here is the connection's loss or expiry, each reported where it happens
        self._dialling.discard(peer)
        try:
            fut.wait()
        except Exception as e:  # noqa: BLE001 - any failure to reach a watched peer is news
            if not self.closing:
                reason = (
                    f"{self._roster.describe(peer)} did not answer a heartbeat of {self.me.name} within "
                    f"{self.heartbeat_timeout:g} s (heartbeat_timeout, RPC_CORE_HEARTBEAT_TIMEOUT): {e}"
                )
                for cb in self.on_peer_unreachable:
                    cb(peer, reason)  # on a pool thread already (the future has a callback)

    def _unreachable(self, peer: int, link: Outbound, silent: float, n: int) -> None:
        """``peer`` sent nothing on ``link`` for ``silent`` s: fail what waits on it, drop the connection."""
        reason = (
            f"{self._roster.describe(peer)} sent nothing for {silent:.1f} s while this worker "
            f"({self.me.name}) waited on it ({n} call(s) pending), heartbeats unanswered (heartbeat_timeout "
            f"{self.heartbeat_timeout:g} s, RPC_CORE_HEARTBEAT_TIMEOUT): it is stopped, frozen or overloaded, "
            "or the network to it drops packets or is cut. The connection was dropped; the next call to it "
            "reconnects"
        )
        if not self._connections.drop(peer, link):
            return  # lost or replaced meanwhile
        log.warning("rpc_core %s: %s", self.me.name, reason)
        for msg_id, rec in list(self._pending.pending.items()):
            if rec.link is link:  # the reset below may drop its request before it arrives
                self._pending.fail(
                    msg_id, WorkerUnavailableError(reason, worker=self._roster.name_of(peer)), inline=False, unsent=True
                )
        link.close()  # before the connection: its reader then takes the error as expected, not as news
        link.conn.abort()
        for cb in self.on_peer_unreachable:
            self._pool.submit(cb, peer, reason)  # not on the timer: a callback may answer calls, i.e. write


# The heartbeat call: called by name under serializer='safe'.
allowlist.internal(beat)
