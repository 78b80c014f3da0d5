"""How a worker's connections come to be: dialling a peer, and accepting a peer's dial.

A dial goes over the first transport that reaches the peer (same-host socket first, then
TCP; ``transport.dial``), authenticated, and the dialler introduces itself with an identity
frame (``HELLO_ID``) right after the handshake. An accepted connection is authenticated and
read up to that frame, all within the handshake timeout, before anything else of it is
served; on rank 0 a first frame that is a join request instead goes to the group's registry
(``join_handler``), which admits the newcomer or tells it why not. A dial that ran out of
time becomes the error its call sees (``timed_out``).

``Connector`` is a part of ``connections.Connections``, which keeps the table of the
connections opened here (who they are with, who reads them, what their loss means): this
module only opens them and hands each accepted one, with its peer's rank, to the table.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable

from .. import transport
from ..errors import AuthenticationError, ProtocolError, RpcError, RpcTimeoutError, WorkerUnavailableError
from ..protocol import wire
from ..protocol.safe_decoding import loads_plain
from ..protocol.safe_encoding import dumps_plain
from ..transport import Connection, Listener
from .completion import PendingCalls
from .pool import ThreadGroup
from .roster import Roster
from .worlds import World

log = logging.getLogger("rpc_core")

HELLO_ID = 0  # msg_id of the identity frame a dialer sends first

# Rank 0's taker of a connection whose first frame is a join request (``group.registry``):
# handler(conn, msg_id, body) -> the admitted rank, or None (it answered and refused).
JoinHandler = Callable[[Connection, int, bytes], int | None]


class Connector:
    """Dials the peers of one worker and accepts their dials (see the module doc)."""

    def __init__(
        self, world: World, secret: bytes, roster: Roster, pending: PendingCalls, threads: ThreadGroup
    ) -> None:
        self.me = world.me
        self._roster = roster
        self._pending = pending
        self._threads = threads
        self._secret = secret
        # Read once per worker: every dial and accept of this worker uses the same limit.
        self.handshake_timeout = transport.handshake_timeout()
        self._listeners = world.listeners  # one per transport (transport.listen)
        # Hosts that name this machine: a peer advertised under one of them may be dialled
        # over a same-host transport.
        self._local_hosts = {"localhost", "::1", self._listeners[0].address[0]}
        self._admission = transport.Admission(self.me.name)  # incoming connections in their handshake
        self._world_connections = world.connections
        self.closing = False
        self.join_handler: JoinHandler | None = None  # rank 0: set by ``group.registry``

    # -- dialling ---------------------------------------------------------------------------------
    def dial(self, dst: int, deadline: float, same_host_only: bool = False) -> Connection | None:
        """Dial ``dst`` by ``deadline`` over the first transport that reaches it (see
        ``transport.dial``); only over a same-host one if ``same_host_only`` (None if none did)."""
        return transport.dial(
            self._roster.addresses[dst], self._secret, deadline, self._local_hosts, self._introduce, same_host_only
        )

    def dial_for_call(self, dst: int, deadline: float, by_call: bool, timeout: float) -> Connection:
        """Dial ``dst`` for a call (of ``timeout`` s) by ``deadline``, the call's own if
        ``by_call``; a dial that fails raises the error the call sees."""
        try:
            conn = self.dial(dst, deadline)
            if conn is None:  # cannot happen: TCP reaches every worker (or raises)
                raise OSError("no transport reaches it")
        except TimeoutError as e:
            connected = getattr(e, "connected", True)
            raise self.timed_out(
                dst, by_call, timeout, "" if connected else "(the connection was not even accepted)"
            ) from None
        except OSError as e:  # refused, reset, closed: nobody there any more
            roster = self._roster
            host, port = roster.addresses[dst]
            raise WorkerUnavailableError(
                f"cannot reach {roster.describe(dst)} at {host}:{port} ({e.__class__.__name__}: {e}); "
                "it has probably exited or crashed",
                worker=roster.name_of(dst),
            ) from None
        return conn

    def timed_out(self, dst: int, by_call: bool, timeout: float, detail: str) -> RpcError:
        """The error of a call whose dial ran out of time: its own timeout (RpcTimeoutError,
        like any call that ran too long), or the handshake limit (the worker is there but mute)."""
        roster = self._roster
        host, port = roster.addresses[dst]
        what = f"{roster.describe(dst)} at {host}:{port} did not answer the connection handshake"
        if detail:
            what += " " + detail
        if by_call:
            return RpcTimeoutError(
                f"{self._pending.timeout_message(timeout, dst)}: {what}; it may be stopped, frozen or overloaded",
                worker=roster.name_of(dst),
            )
        return WorkerUnavailableError(
            f"cannot reach {what} within {self.handshake_timeout:g} s (RPC_CORE_HANDSHAKE_TIMEOUT); "
            "it is probably stopped, frozen or overloaded, or its host is unreachable",
            worker=roster.name_of(dst),
        )

    def _introduce(self, conn: Connection) -> None:
        conn.send(wire.REQUEST, wire.CONTROL, HELLO_ID, b"", dumps_plain(self.me.id))

    # -- accepting --------------------------------------------------------------------------------
    def accept(self, serve: Callable[[Connection, int], None]) -> None:
        """Start accepting on every listener: ``serve(conn, rank)`` runs, on the connection's
        own thread, once a connection is authenticated and its peer known."""
        for listener in self._listeners:
            self._threads.start(self._accept_loop, f"rpc-accept-{listener.transport.kind}", listener, serve)

    def _accept_loop(self, listener: Listener, serve: Callable[[Connection, int], None]) -> None:
        while not self.closing:
            try:
                sock, peer = listener.accept()
            except OSError:
                return
            deadline = time.monotonic() + self.handshake_timeout
            if not self._admission.admit(sock, peer):
                sock.close()  # shutting down
                return
            self._threads.start(self._serve_incoming, "rpc-in", listener.transport, sock, peer, deadline, serve)

    def _serve_incoming(
        self,
        via: transport.Transport,
        sock: socket.socket,
        peer: tuple[str, int],
        deadline: float,
        serve: Callable[[Connection, int], None],
    ) -> None:
        """Authenticate an accepted connection and read its identity frame, all by ``deadline``,
        then hand it to ``serve``."""
        conn = None
        try:
            conn, h, body = via.accept(sock, peer, self._secret, deadline, self._admission)
            if h.msg_id != HELLO_ID and self.join_handler is not None:
                # A worker asking to join the group (see registry): admitted, it becomes a member
                # and this its connection to us, as after a rendezvous; refused, it was told why.
                src = self.join_handler(conn, h.msg_id, body)
                if src is None:
                    conn.close()
                    return
                # Its loss is the member's exit, as a rendezvous connection's is (see Connections._connection_lost).
                self._world_connections[src] = conn
            else:
                if h.msg_id != HELLO_ID:
                    raise ProtocolError("first frame is not an identity frame")
                src = loads_plain(body)
                if not isinstance(src, int) or src not in self._roster.workers:
                    raise ProtocolError(f"bad identity {src!r}")
            self._roster.tag_connection(conn, src)
        except AuthenticationError:
            log.warning(
                "rpc_core %s: rejected a connection from %s:%s: wrong or missing auth secret",
                self.me.name,
                peer[0],
                peer[1],
            )
            sock.close()
            return
        except (ProtocolError, OSError, transport.PeerClosed, ValueError, EOFError) as e:
            log.warning("rpc_core %s: dropped a connection from %s:%s: %s", self.me.name, peer[0], peer[1], e)
            if conn is not None:
                conn.close()
            else:
                sock.close()
            return
        serve(conn, src)

    def close(self) -> None:
        """Stop accepting: wake the threads still in a handshake and the accept loops."""
        self.closing = True
        self._admission.close()
        transport.close(self._listeners)
