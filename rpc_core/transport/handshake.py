"""The connection handshake, common to every transport: mutual authentication, then the
cross-memory-attach probe.

``run_dialer`` (the connecting side) and ``run_acceptor`` (the accepting side) run the steps
that ``wire`` lays out, on a connected stream socket, with fixed-size messages only: nothing
from a peer is unpickled before it proved it knows the shared secret. They return what the
probe found (a ``Link``), which the transport's connection takes along.

Each side runs its whole handshake against one deadline (``handshake_timeout()`` unless the
caller has less time): every receive gets only the time that is left, so a peer that
trickles bytes cannot keep a connection half-open. An acceptor also bounds how many
connections may be unauthenticated at once (``Admission``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import NamedTuple

from .. import knobs
from ..errors import AuthenticationError, ProtocolError
from ..protocol import wire
from . import cma

log = logging.getLogger("rpc_core")


def handshake_timeout() -> float:
    """The longest a whole handshake may take, either side: connect, HELLO..VERDICT,
    OFFER/RESULT and the first frame (the identity or join request). A live peer needs a
    few round trips; one that is stopped, frozen or trickling bytes is cut off here.
    ``RPC_CORE_HANDSHAKE_TIMEOUT`` (seconds, default 10), read at each call (see ``knobs``)."""
    return knobs.handshake_timeout()


# The most accepted connections one worker (or rank 0's rendezvous) keeps while they have
# not proven they know the secret. One more waits for a slot, or evicts a stale one (see Admission).
MAX_PENDING_HANDSHAKES = 64


def eviction_grace() -> float:
    """How long a connection in its handshake keeps its slot against a newcomer once all
    MAX_PENDING_HANDSHAKES are taken: a quarter of handshake_timeout() (2.5 s by default),
    long enough for a real peer on a loaded host, short enough that silent clients cannot
    keep real ones waiting past their own handshake deadline."""
    return handshake_timeout() / 4


# How many connections a listener lets the kernel queue before they are accepted: a flood of
# peers dialling at once (see Admission) waits there instead of having its SYNs dropped and
# retried seconds later. The kernel caps it at net.core.somaxconn (4096 on current Linux).
LISTEN_BACKLOG = 4096
# The largest first frame read under the handshake deadline (an identity or join request).
MAX_INTRO_BYTES = 64 << 10


class PeerClosed(ConnectionError):
    """The peer closed the connection (EOF) or it was reset."""


class HandshakeTimeout(TimeoutError):
    """The handshake's deadline passed. ``connected``: the peer had accepted the connection
    (it is there, but did not answer: stopped, frozen or overloaded), or not even that."""

    def __init__(self, message: str, connected: bool) -> None:
        super().__init__(message)
        self.connected = connected


def _left(deadline: float) -> float:
    """Seconds until ``deadline``; HandshakeTimeout once it passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise HandshakeTimeout("the handshake did not complete in time", connected=True)
    return left


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes; each receive waits only for what is left until ``deadline`` (None: the
    socket's own timeout per receive)."""
    out = bytearray(n)
    view = memoryview(out)
    got = 0
    while got < n:
        if deadline is not None:
            sock.settimeout(_left(deadline))
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError:
            if deadline is None:
                raise
            raise HandshakeTimeout("the handshake did not complete in time", connected=True) from None
        if k == 0:
            raise PeerClosed("connection closed during handshake")
        got += k
    return bytes(out)


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(_left(deadline))
    try:
        sock.sendall(data)
    except TimeoutError:
        raise HandshakeTimeout("the handshake did not complete in time", connected=True) from None


class Link(NamedTuple):
    """What the cross-memory-attach step of the handshake found for one connection."""

    peer_pid: int
    send: bool  # the peer proved it can read our memory
    recv: bool  # we proved we can read the peer's memory


NO_LINK = Link(0, False, False)  # a socket that ran no handshake (tests' socket pairs)


def _exchange_cma(sock: socket.socket, deadline: float) -> Link:
    """The OFFER/RESULT step of the handshake (see ``wire``); both sides run the same code."""
    probe = cma.Probe() if cma.enabled() else None
    if probe is not None:
        _send(sock, wire.OFFER.pack(os.getpid(), probe.address, probe.data), deadline)
    else:
        _send(sock, wire.OFFER.pack(0, 0, bytes(cma.PROBE_LEN)), deadline)
    pid, address, data = wire.OFFER.unpack(_recv_exact(sock, wire.OFFER.size, deadline))
    readable = probe is not None and cma.can_read(pid, address, data)
    _send(sock, wire.RESULT.pack(int(readable)), deadline)
    (peer_reads,) = wire.RESULT.unpack(_recv_exact(sock, wire.RESULT.size, deadline))
    if peer_reads not in (0, 1):
        raise ProtocolError(f"bad cross-memory-attach result {peer_reads}")
    # The probe had to stay alive until the peer reported on it, i.e. until here.
    link = Link(pid if readable else 0, probe is not None and peer_reads == 1, readable)
    del probe
    return link


def run_dialer(sock: socket.socket, secret: bytes, deadline: float, peer: str) -> Link:
    """On a socket just connected to ``peer`` (for messages: "host:port"), prove we know the
    secret and check that the peer does, by ``deadline`` (HandshakeTimeout past it); raise
    AuthenticationError if the peer rejects us (or cannot prove it knows the secret itself).
    The caller closes ``sock`` on any error."""
    magic, version, nonce_a = wire.HELLO.unpack(_recv_exact(sock, wire.HELLO.size, deadline))
    if magic != wire.MAGIC or version != wire.VERSION:
        raise ProtocolError(
            f"{peer} is not an rpc_core worker of protocol version "
            f"{wire.VERSION} (got magic {magic!r}, version {version})"
        )
    nonce_c = wire.new_nonce()
    _send(sock, wire.PROOF.pack(wire.MAGIC, wire.connector_mac(secret, nonce_a, nonce_c), nonce_c), deadline)
    try:
        ok, mac_a = wire.VERDICT.unpack(_recv_exact(sock, wire.VERDICT.size, deadline))
    except PeerClosed:
        # Not a rejection (that comes as a VERDICT of 0): closed to make room for newer
        # connections (see Admission), or the worker went away.
        raise PeerClosed(f"{peer} closed the connection before its verdict on our authentication") from None
    if not ok:
        raise AuthenticationError(
            f"worker at {peer} rejected our authentication: the shared "
            "secret differs. Give every worker the same secret (RpcBackendOptions(auth_secret=...) "
            "or the RPC_CORE_AUTH_SECRET environment variable)."
        )
    if not wire.macs_equal(mac_a, wire.acceptor_mac(secret, nonce_c, nonce_a)):
        raise AuthenticationError(
            f"worker at {peer} could not prove it knows the shared secret; refusing to talk to it"
        )
    link = _exchange_cma(sock, deadline)
    sock.settimeout(None)
    return link


def run_acceptor(sock: socket.socket, secret: bytes, timeout: float, admission: Admission | None = None) -> Link:
    """Run the acceptor side of the handshake on a freshly accepted socket, all within
    ``timeout`` seconds. With ``admission`` (which admitted ``sock``), the peer leaves it once
    it proved it knows the secret; if it was closed to make room before, PeerClosed.
    Raises AuthenticationError / ProtocolError / OSError; the caller closes the socket."""
    deadline = time.monotonic() + timeout
    try:
        nonce_a = wire.new_nonce()
        _send(sock, wire.HELLO.pack(wire.MAGIC, wire.VERSION, nonce_a), deadline)
        magic, mac_c, nonce_c = wire.PROOF.unpack(_recv_exact(sock, wire.PROOF.size, deadline))
        if magic != wire.MAGIC:
            raise ProtocolError(f"bad handshake magic {magic!r}")
        if not wire.macs_equal(mac_c, wire.connector_mac(secret, nonce_a, nonce_c)):
            try:
                _send(sock, wire.VERDICT.pack(0, b"\0" * wire.MAC_LEN), deadline)
            except OSError:
                pass
            raise AuthenticationError("peer failed the shared-secret challenge (wrong or missing secret)")
        if admission is not None and not admission.authenticated(sock):
            raise PeerClosed("closed during its handshake to make room for newer connections")
        _send(sock, wire.VERDICT.pack(1, wire.acceptor_mac(secret, nonce_c, nonce_a)), deadline)
        link = _exchange_cma(sock, deadline)
    finally:
        if admission is not None:
            admission.discard(sock)
    sock.settimeout(None)
    return link


def read_intro(sock: socket.socket, deadline: float) -> tuple[wire.FrameHeader, bytes]:
    """The first frame on a freshly authenticated connection (a dialer's identity, a joiner's
    request), read by ``deadline``: a REQUEST with a small body, no head, no buffers.
    Raises ProtocolError / PeerClosed / HandshakeTimeout; leaves the socket blocking."""
    h = wire.unpack_header(_recv_exact(sock, wire.FRAME_HEADER.size, deadline))
    if h.kind != wire.REQUEST or h.nbuf or h.head_len or h.flags & wire.REMOTE or h.body_len > MAX_INTRO_BYTES:
        raise ProtocolError(f"the first frame is not an identity or join request ({h})")
    body = _recv_exact(sock, h.body_len, deadline)
    sock.settimeout(None)
    return h, body


class Admission:
    """The accepted connections of one listener's owner whose peer has not yet proven it
    knows the secret: at most MAX_PENDING_HANDSHAKES (read at each admission) at once.

    One more waits (the accepting thread blocks, later dials queue in the listener's backlog)
    until a handshake ends or the oldest has been pending for ``eviction_grace()``; then that
    oldest is closed (a warning says so) to make room. Real peers arriving all at once (a
    thousand ranks dialling rank 0 at the rendezvous or at shutdown, on a loaded host) so
    complete at the rate rank 0 can serve them instead of evicting each other, and a client
    that opens connections and stays silent still cannot lock real peers out: it holds a slot
    for the grace at most. Closing means shutting the socket down, which wakes the thread in
    its handshake; that thread closes it."""

    def __init__(self, where: str) -> None:
        self._where = where
        self._lock = threading.Lock()
        self._slot_freed = threading.Condition(self._lock)
        # insertion order = age; the value: the peer, and when it was admitted (monotonic)
        self._pending: dict[socket.socket, tuple[tuple[str, int], float]] = {}
        self._evicted = 0
        self._closed = False

    def admit(self, sock: socket.socket, peer: tuple[str, int]) -> bool:
        """Count ``sock`` as in its handshake, waiting for a slot if all are taken (see the
        class); False once closed (the caller closes ``sock``)."""
        victims = []
        with self._lock:
            while not self._closed and len(self._pending) >= MAX_PENDING_HANDSHAKES:
                oldest, (oldest_peer, since) = next(iter(self._pending.items()))
                wait = since + eviction_grace() - time.monotonic()
                if wait <= 0:
                    del self._pending[oldest]
                    victims.append(oldest_peer)
                    _hang_up(oldest)  # under the lock: its thread cannot have closed it yet (see discard)
                else:
                    self._slot_freed.wait(wait)
            if self._closed:
                return False
            self._pending[sock] = (peer, time.monotonic())
            self._evicted += len(victims)
            evicted = self._evicted
        for peer_host, peer_port in victims:
            if evicted & (evicted - 1) == 0:  # the 1st, 2nd, 4th, 8th, ...: a flood does not flood the log
                log.warning(
                    "rpc_core %s: %d unauthenticated connections (handshake in progress) at once; closed the "
                    "oldest, from %s:%s, to make room (%d so far). Something connects and does not complete "
                    "the handshake: a port scanner, a client of another protocol, or a stopped process.",
                    self._where,
                    MAX_PENDING_HANDSHAKES,
                    peer_host,
                    peer_port,
                    evicted,
                )
        return True

    def authenticated(self, sock: socket.socket) -> bool:
        """``sock``'s peer proved it knows the secret; False if it was closed to make room."""
        with self._lock:
            self._slot_freed.notify()
            return self._pending.pop(sock, None) is not None

    def discard(self, sock: socket.socket) -> None:
        """``sock`` leaves (before its owner closes it)."""
        with self._lock:
            if self._pending.pop(sock, None) is not None:
                self._slot_freed.notify()

    def close(self) -> None:
        """Close every connection still in its handshake, and admit no more."""
        with self._lock:
            self._closed = True
            for sock in self._pending:
                _hang_up(sock)
            self._pending.clear()
            self._slot_freed.notify_all()


def _hang_up(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
