"""What the agent needs of a connection and of a transport, and nothing of how they do it.

A *transport* is a way to reach a worker (TCP, a same-host Unix socket; shared memory or
RDMA would be others): it listens, dials and accepts, and turns an authenticated socket
into a ``Connection``, the one object the agent sends and receives frames on. Every
transport starts a connection on a stream socket, where the common handshake runs
(``handshake``: authentication, then the cross-memory-attach probe); what it carries
afterwards is its own business. ``registry`` holds the transports and the order they are
tried in: a new transport is one module here plus one line there.

Workers advertise one address, ``(host, port)``, the TCP listener's; every other transport
derives its endpoint from it (the Unix one names its socket after the port).
"""

from __future__ import annotations

import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from typing import NamedTuple, Protocol

import torch

from ..protocol import wire
from . import handshake
from .handshake import HandshakeTimeout

Address = tuple[str, int]  # a worker's advertised (host, port)
# How a small tensor-free frame may wait in a queue instead of being written at once
# (``Connection.send``'s ``defer``); whoever next reads the connection writes the queue first.
DEFER_BATCH = 1  # the sender writes it with its next few (``flush_queued``/``frame_waiting``)
DEFER_ANSWER = 2  # an answer, while the reader has the next frame's bytes buffered already
# A received frame: (header, head, body, one fresh storage per tensor buffer).
Frame = tuple[wire.FrameHeader, bytes, bytes, list[torch.UntypedStorage]]


class Capabilities(NamedTuple):
    """What one connection may do beyond carrying bytes, as proven at its handshake."""

    same_host: bool  # the peer runs on this host (a same-host transport, or its memory proved readable)
    cma_send: bool  # the peer copies our large buffers out of our memory (cross-memory attach)
    cma_recv: bool  # we copy the peer's large buffers out of its memory


class Connection(Protocol):
    """One authenticated connection, as the agent uses it. ``send`` is thread-safe; ``recv``
    serves one caller at a time (concurrent callers queue), from any thread."""

    kind: str  # the transport's name ("tcp", "unix"): connection_stats counts by it
    peer: str  # who is at the other end, for messages ("host:port")
    local_host: str  # the host this end is reached at (a joiner advertises it)
    capabilities: Capabilities
    # Frame bytes however they travelled; the cma counts are the part copied by cross-memory attach.
    bytes_sent: int
    bytes_received: int
    bytes_cma_sent: int
    bytes_cma_received: int

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
        """Write one frame (``defer``: may queue a small one, see ``sending``); OSError if broken."""

    def recv(self) -> Frame:
        """Read one frame; PeerClosed at the peer's end, ProtocolError on malformed bytes."""

    def poll(self, timeout: float | None) -> bool:
        """Whether ``recv`` may have a frame to start on within ``timeout`` seconds."""

    def frame_waiting(self) -> bool:
        """Whether ``recv`` can start on a frame without waiting for bytes (never blocks)."""

    def flush_queued(self) -> None:
        """Write the frames ``send`` queued (``defer``) now."""

    def set_recv_timeout(self, seconds: float | None) -> None:
        """The longest ``recv`` waits for bytes (TimeoutError past it); None: no limit."""

    def close(self) -> None:
        """End the connection: the peer sees it closed once what was written arrived."""

    def abort(self) -> None:
        """End the connection at once, dropping what is queued (a reset): a sender blocked
        on it is released and nothing written is delivered later."""


class Listener:
    """A listening socket of one transport. What it accepts has not run the handshake yet."""

    def __init__(self, transport: Transport, sock: socket.socket) -> None:
        self.transport = transport
        self.sock = sock

    @property
    def address(self) -> Address:
        """Where it listens (for TCP the worker's advertised address)."""
        name = self.sock.getsockname()
        return (name[0], name[1]) if isinstance(name, tuple) else ("localhost", 0)

    def fileno(self) -> int:
        return self.sock.fileno()

    def setblocking(self, flag: bool) -> None:
        self.sock.setblocking(flag)

    def accept(self) -> tuple[socket.socket, Address]:
        """The next connecting socket, and where it comes from (OSError once closed)."""
        sock, peer = self.sock.accept()
        sock.setblocking(True)
        self.transport.tune(sock)
        return sock, (peer[0], peer[1]) if isinstance(peer, tuple) else ("local", 0)  # a Unix peer has no address

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread in accept (close alone does not)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass


class Transport(ABC):
    """One way of reaching workers (see the module doc)."""

    kind: str  # its name in connection_stats and logs
    same_host: bool  # reaches only peers on this host: tried before the transports that reach every peer

    def enabled(self) -> bool:
        """Whether this process uses it (a knob may turn it off)."""
        return True

    @abstractmethod
    def listen(self, address: Address) -> Listener | None:
        """Listen for workers that dial ``address`` (the worker's TCP address) over this
        transport; None if it cannot here (the name is taken, the system lacks it)."""

    @abstractmethod
    def reaches(self, address: Address, local_hosts: Collection[str]) -> bool:
        """Whether the worker advertised at ``address`` may be dialled over this transport
        (``local_hosts``: the names this host goes by)."""

    @abstractmethod
    def connect(self, address: Address, timeout: float) -> socket.socket:
        """A connected, tuned stream socket to ``address``, within ``timeout`` seconds
        (HandshakeTimeout with ``connected=False`` past it); the handshake is yet to run."""

    @abstractmethod
    def connection(self, sock: socket.socket, link: handshake.Link, peer: str) -> Connection:
        """The connection over ``sock``, on which the handshake found ``link``."""

    @abstractmethod
    def tune(self, sock: socket.socket) -> None:
        """Set the socket options this transport wants, on every socket it connects or accepts."""

    def describe(self, address: Address) -> str:
        return f"{address[0]}:{address[1]}"

    def dial(self, address: Address, secret: bytes, timeout: float) -> Connection:
        """Connect to ``address`` and run the dialer's side of the handshake, all within
        ``timeout`` seconds (HandshakeTimeout past it); AuthenticationError if the peer
        rejects us or cannot prove it knows the secret itself."""
        if timeout <= 0:
            raise HandshakeTimeout("no time left to connect", connected=False)
        deadline = time.monotonic() + timeout
        sock = self.connect(address, timeout)
        peer = self.describe(address)
        try:
            return self.connection(sock, handshake.run_dialer(sock, secret, deadline, peer), peer)
        except BaseException:
            sock.close()
            raise

    def accept(
        self,
        sock: socket.socket,
        peer: Address,
        secret: bytes,
        deadline: float,
        admission: handshake.Admission | None = None,
    ) -> Incoming:
        """Run the acceptor's side of the handshake on ``sock`` (from ``listen``'s listener)
        and read the dialer's first frame, all by ``deadline``. Raises AuthenticationError /
        ProtocolError / PeerClosed / OSError; the caller closes ``sock`` then."""
        link = handshake.run_acceptor(sock, secret, deadline - time.monotonic(), admission)
        intro, body = handshake.read_intro(sock, deadline)
        return Incoming(self.connection(sock, link, self.describe(peer)), intro, body)


class Incoming(NamedTuple):
    """An accepted, authenticated connection and the first frame its dialer sent (an identity
    or a join request: a REQUEST with a small body, read under the handshake's deadline)."""

    conn: Connection
    intro: wire.FrameHeader
    body: bytes
