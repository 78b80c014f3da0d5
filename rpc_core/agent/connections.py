"""A worker's connections: the table of those it dialled and accepted, and what happens when
one is lost.

Each peer has at most one outgoing connection (``out``, dialled on first use under a
per-peer lock; its answers are read by an ``Outbound``) and any number of incoming ones
(each served by ``Dispatch.read_loop``). Opening them, dialling a peer over the first
transport that reaches it and accepting a peer's dial, is the ``Connector``'s
(``connecting``); this table keeps what was opened.

``Connections`` is a part of ``agent.Agent``: it hands what arrives to the agent's
``Dispatch`` (requests) and ``PendingCalls`` (answers), fails the calls of a peer it lost
there, and asks the ``Roster`` who a peer is. The agent's ``send_request`` looks up ``out``
and ``links`` (the very dicts, never replaced) on every call. The connection to a member
that left gracefully is read until it ends, so the answers it sent before it left are not
lost (``departures``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from .. import transport
from ..errors import ProtocolError, WorkerLeftError, WorkerUnavailableError
from ..options import RpcBackendOptions
from ..protocol import wire
from ..protocol.serialization import loopback
from ..transport import Connection
from .completion import PendingCalls
from .connecting import Connector
from .departures import Departures
from .dispatch import Dispatch
from .outbound import Outbound
from .pool import ThreadGroup
from .roster import Roster
from .worlds import World

log = logging.getLogger("rpc_core")


class ConnectionStats(NamedTuple):
    """Byte counts summed over a worker's open connections (calls to self not included), and
    the requests (calls: each one message out, its answer one back) it sent and served so far,
    its own control messages (heartbeats, handshakes) not counted."""

    bytes_sent: int
    bytes_received: int
    bytes_cma_sent: int  # the part of bytes_sent that the peer copied by cross-memory attach
    bytes_cma_received: int  # the part of bytes_received copied from the peer's memory
    connections: int  # how many connections were summed
    unix_connections: int = 0  # of those, how many are same-host Unix sockets (the rest TCP)
    cma_connections: int = 0  # of those, how many may copy tensors by cross-memory attach, either way
    requests_sent: int = 0  # calls this worker made (rpc_sync/rpc_async/remote, gradient and cleanup calls)
    requests_received: int = 0  # requests it received to serve (calls to self included)
    # Of those, received and not yet answered: running, queued for a thread, or waiting on a
    # future (an @async_execution function's): the worker's queue at this moment.
    requests_in_flight: int = 0


class _Loss(NamedTuple):
    """Why a connection ended."""

    reason: str  # for errors and logs: what happened, with whom
    malformed: bool  # the peer broke the protocol: drop the connection, but it is no news of the peer's death


class _Loopback:
    """A 'connection' to ourselves: calls to self are serialized and dispatched like any other."""

    def __init__(self, me: int, dispatch: Dispatch, pending: PendingCalls) -> None:
        self._me = me
        self._on_request = dispatch.on_request
        self._on_answer = pending.on_answer
        self.bytes_sent = self.bytes_received = 0

    def send(
        self,
        kind: int,
        flags: int,
        msg_id: int,
        head: bytes,
        body: bytes,
        buffers: Sequence[memoryview] = (),
        defer: int = 0,
    ) -> None:
        storages = loopback(buffers)
        h = wire.FrameHeader(kind, flags, len(buffers), len(head), len(body), msg_id)
        if kind == wire.REQUEST:
            self._on_request(self, self._me, h, head, body, storages)
        else:
            self._on_answer(self._me, h, head, body, storages)

    def flush_queued(self) -> None:
        pass  # nothing is ever queued: send delivers at once

    def close(self) -> None:
        pass


class Connections:
    """The connection table of one worker (see the module doc)."""

    def __init__(
        self,
        world: World,
        options: RpcBackendOptions,
        roster: Roster,
        pending: PendingCalls,
        dispatch: Dispatch,
        threads: ThreadGroup,
    ) -> None:
        self.me = world.me
        self._roster = roster
        self._pending = pending
        self._dispatch = dispatch
        self._threads = threads
        # Dials and accepts; rank 0's ``connector.join_handler`` takes join requests (``registry``).
        self.connector = Connector(world, options.auth_secret, roster, pending, threads)
        self._parked: list[Connection] = []  # open but unused (see start)
        self.departures = Departures(pending)  # connections to departed members, read until they end
        self._lock = threading.Lock()
        self._incoming_cv = threading.Condition(self._lock)
        self.out: dict[int, Any] = {self.me.id: _Loopback(self.me.id, dispatch, pending)}
        self.links: dict[int, Outbound] = {}  # who reads each outgoing connection's answers
        self._dial_locks: dict[int, threading.Lock] = {w.id: threading.Lock() for w in world.workers}
        self._incoming: list[Connection] = []
        self._world_connections = world.connections
        self.closing = False
        # Called with (rank, reason) when a peer is lost (its connection ended: see _connection_lost).
        self.on_peer_lost: list[Callable[[int, str], None]] = []

    def start(self) -> None:
        """Take over the rendezvous connections and start accepting."""
        connector = self.connector
        for rank, conn in self._world_connections.items():
            if self.me.id == 0:
                self._incoming.append(conn)
                self._start_reader(conn, rank)
            else:
                # The rendezvous connection stays open but idle: rank 0 watches it for our
                # exit, and only for that (so we may drop the connections our calls use, e.g.
                # when heartbeats go unanswered, without rank 0 taking us for dead). Calls to
                # rank 0 go over a same-host socket when there is one, else over a connection
                # dialled on first use.
                self._parked.append(conn)
                try:
                    local = connector.dial(rank, time.monotonic() + connector.handshake_timeout, same_host_only=True)
                except TimeoutError:
                    local = None  # no answer there in time: the first call dials
                if local is not None:
                    self.out[rank] = local
                    self._start_outbound(local, rank)
        connector.accept(self._serve_accepted)

    def connection(self, dst: int, call_deadline: float | None = None, timeout: float = 0.0) -> Any:
        """The connection to ``dst``, dialled if there is none yet. Dialling gives up at the
        call's deadline (``call_deadline``, for a call of ``timeout`` s; None: no timeout) or
        after the handshake timeout, whichever comes first, waiting for another caller's dial included."""
        conn = self.out.get(dst)
        if conn is not None:
            return conn
        roster = self._roster
        if dst in roster.dead:
            raise WorkerUnavailableError(roster.dead[dst], worker=roster.name_of(dst))
        if dst not in roster.workers:
            roster.worker_info(dst)  # raises: the worker that had this rank left the group
        limit = time.monotonic() + self.connector.handshake_timeout
        by_call = call_deadline is not None and call_deadline <= limit  # whose deadline binds
        deadline = limit if call_deadline is None else min(call_deadline, limit)  # the earlier binds
        lock = self._dial_locks.setdefault(dst, threading.Lock())  # a member that joined later: made here
        if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise self.connector.timed_out(dst, by_call, timeout, "while another call was connecting to it")
        try:
            conn = self.out.get(dst)
            if conn is not None:
                return conn
            conn = self.connector.dial_for_call(dst, deadline, by_call, timeout)
            self._start_outbound(conn, dst)
            self.out[dst] = conn
            return conn
        finally:
            lock.release()

    def _serve_accepted(self, conn: Connection, src: int) -> None:
        """Serve the requests of a connection the connector accepted from ``src``."""
        with self._lock:
            if self.closing:
                conn.close()
                return
            self._incoming.append(conn)
        self._dispatch.read_loop(conn, src)

    def _start_reader(self, conn: Connection, peer: int) -> None:
        """Serve the requests arriving on an incoming connection."""
        self._threads.start(self._dispatch.read_loop, f"rpc-read-{peer}", conn, peer)

    def _start_outbound(self, conn: Connection, peer: int) -> None:
        # Only answers come back on a connection we dialled; a request (none is sent so) would be served.
        on_answer, on_request, request = self._pending.on_answer, self._dispatch.on_request, wire.REQUEST

        def deliver(frame: tuple[Any, ...]) -> None:
            if frame[0].kind == request:
                on_request(conn, peer, *frame)
            else:
                on_answer(peer, *frame)

        def lost(e: BaseException) -> None:
            self._connection_lost(conn, peer, True, self._loss(peer, e))

        self.links[peer] = Outbound(conn, deliver, lost, f"rpc-read-{peer}", self._threads)

    def reader_lost(self, conn: Connection, peer: int, e: BaseException) -> None:
        """The reading loop of an incoming connection from ``peer`` ended with ``e``."""
        self._connection_lost(conn, peer, False, self._loss(peer, e))

    def _loss(self, peer: int, e: BaseException) -> _Loss:
        """Why the connection with ``peer`` ended, from the error that ended it."""
        describe = self._roster.describe
        if isinstance(e, ProtocolError):
            reason = f"malformed bytes from {describe(peer)}: {e}"
            log.warning("rpc_core %s: dropping connection: %s", self.me.name, reason)
        elif isinstance(e, (OSError, transport.PeerClosed)):
            reason = f"{describe(peer)} closed the connection ({e}); it has probably exited or crashed"
        else:
            reason = f"the connection to {describe(peer)} failed on {self.me.name}: {e!r}"
            log.error("rpc_core %s: dropping connection: %s", self.me.name, reason, exc_info=e)
        return _Loss(reason, isinstance(e, ProtocolError))

    def _connection_lost(self, conn: Connection, peer: int, outgoing: bool, loss: _Loss) -> None:
        """Forget ``conn``. An outgoing connection's loss fails the calls made over it; the
        loss of a peer's rendezvous connection tells rank 0 that the peer is gone (it closes
        when the peer exits), unless the peer only sent garbage."""
        conn.close()
        if self.departures.ended(conn):
            return  # a departed member's, read to its end: what still waited on it failed
        with self._lock:
            if conn in self._incoming:
                self._incoming.remove(conn)
                self._incoming_cv.notify_all()
            if self.out.get(peer) is conn:
                del self.out[peer]
            link = self.links.get(peer)
            if link is not None and link.conn is conn:
                del self.links[peer]
                link.close()
        if self.closing or not self._roster.is_member_connection(conn, peer):
            return  # ours, or a member's that left the group (see roster)
        exited = self.me.id == 0 and peer != 0 and not loss.malformed and conn is self._world_connections.get(peer)
        if outgoing or exited:
            self._peer_lost(peer, loss.reason, conn if outgoing else None)

    def _peer_lost(self, peer: int, reason: str, conn: Any) -> None:
        if self.me.id == 0 or peer == 0:
            self._roster.dead.setdefault(peer, reason)
        worker = self._roster.name_of(peer)
        self._pending.fail_to(peer, lambda: WorkerUnavailableError(reason, worker=worker))
        for cb in self.on_peer_lost:
            cb(peer, reason)

    def lost_error(self, dst: int, e: BaseException) -> WorkerUnavailableError:
        """The error of a call whose request could not be written to ``dst`` (``e``)."""
        return WorkerUnavailableError(
            f"sending to {self._roster.describe(dst)} failed ({e}); it has probably exited or crashed",
            worker=self._roster.name_of(dst),
        )

    def forget(self, rank: int, name: str, reason: str, graceful: bool) -> Connection | None:
        """The member of ``rank`` left the group (the roster forgot it). Our connection to it is
        no member's any more: its end is no news (see ``Roster.is_member_connection``). The
        leaver closes it: closing it here would look, to a registry that is still telling the
        others it left, like our own death. After a ``graceful`` leave, the calls pending on it
        wait for the answers still on their way, until it ends (``departures``): the connection
        returned is held so, for the caller to give up on after ``departures.GRACE``. Other
        calls to it fail now."""
        held = None
        with self._lock:
            conn = self.out.pop(rank, None)
            link = self.links.pop(rank, None)
            if conn is not None:
                conn.departed = True
                self._parked.append(conn)  # closed with the agent, if the leaver has not by then
                if (
                    graceful
                    and link is not None
                    and link.conn is conn
                    and self.departures.hold(conn, link, name, reason)
                ):
                    held = conn
        self._pending.fail_to(rank, lambda: WorkerLeftError(reason, worker=name), keep=link if held else None)
        return held

    def drop(self, peer: int, link: Outbound) -> bool:
        """Forget the outgoing connection ``link`` reads (heartbeats found ``peer`` silent);
        False if it was lost or replaced meanwhile. The caller closes it."""
        with self._lock:
            if self.links.get(peer) is not link:
                return False
            del self.links[peer]
            if self.out.get(peer) is link.conn:
                del self.out[peer]
        return True

    def flush_queued(self) -> None:
        """Write the frames (answers, mostly) queued on every connection: before this worker
        leaves the group or closes, what it owes must be on the wire."""
        with self._lock:
            conns = [c for c in [*self.out.values(), *self._incoming, *self._parked] if not isinstance(c, _Loopback)]
        for c in conns:
            try:
                c.flush_queued()
            except OSError:
                pass  # lost: its reader reports it

    def wait_incoming_closed(self, timeout: float) -> None:
        """Rank 0, at the end of graceful shutdown: let peers close first, so our last
        replies are read before our sockets go away."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._incoming and time.monotonic() < deadline:
                self._incoming_cv.wait(max(0.0, deadline - time.monotonic()))

    def connection_stats(self) -> ConnectionStats:
        """Bytes sent and received so far over this worker's open connections, both ways, and
        the requests sent and received."""
        with self._lock:
            conns = {id(c): c for c in [*self.out.values(), *self._incoming] if not isinstance(c, _Loopback)}
        cs: list[Connection] = list(conns.values())
        return ConnectionStats(
            sum(c.bytes_sent for c in cs),
            sum(c.bytes_received for c in cs),
            sum(c.bytes_cma_sent for c in cs),
            sum(c.bytes_cma_received for c in cs),
            len(cs),
            sum(c.kind == "unix" for c in cs),
            sum(c.capabilities.cma_send or c.capabilities.cma_recv for c in cs),
            self._pending.n_sent,
            self._dispatch.n_received,
            max(0, self._dispatch.n_received - self._dispatch.n_answered),
        )

    def close(self) -> None:
        """Close every listener and connection (the agent is closing)."""
        with self._lock:
            self.closing = True
            conns = list(self.out.values()) + list(self._incoming)
            links = list(self.links.values())
        for link in links:
            link.close()
        self.connector.close()  # wakes the threads still in a handshake, and the accept loops
        for c in conns + self._parked:
            c.close()
