"""The connection handshake: mutual authentication, then the cross-memory-attach probe.

``dial`` (the connecting side) and ``accept`` (the accepting side) run the steps that
``wire`` lays out, on a plain socket, with fixed-size messages only: nothing from a peer is
unpickled before it proved it knows the shared secret. They return the socket ready for
``transport.Connection``, which picks up what the probe found (``take_link``).
"""
from __future__ import annotations

import os
import socket
import sys
import weakref
from typing import NamedTuple, Optional, Tuple, Union

from . import cma, wire
from .errors import AuthenticationError, ProtocolError

_SOCK_BUF = 4 << 20
# Same-host peers talk over a Unix socket instead of TCP loopback: the kernel does far less
# per message (bare Python ping-pong, polling: 64 B 10.8 -> 7.8 µs, 64 KB 37 -> 19 µs per
# round trip). Linux's abstract namespace names it after the worker's TCP port, so it
# needs no file and no new field in the rendezvous. RPC_CORE_UDS=0 keeps them on TCP.


def local_enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get("RPC_CORE_UDS", "1") != "0"


class PeerClosed(ConnectionError):
    """The peer closed the connection (EOF) or it was reset."""


def local_address(port: int) -> str:
    """The abstract Unix socket on which the worker listening on TCP ``port`` also accepts
    (in one network namespace both names belong to one process, or the handshake fails)."""
    return f"\0rpc_core.{port}"


def listen_local(port: int) -> Optional[socket.socket]:
    """The same-host listener for TCP ``port``, or None (not Linux, RPC_CORE_UDS=0, name taken)."""
    if not local_enabled():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(local_address(port))
        sock.listen(128)
    except OSError:
        sock.close()
        return None
    return sock


def tune(sock: socket.socket) -> None:
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)
        except OSError:
            pass


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray(n)
    view = memoryview(out)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise PeerClosed("connection closed during handshake")
        got += k
    return bytes(out)


class _Link(NamedTuple):
    """What the cross-memory-attach step of the handshake found for one socket."""

    peer_pid: int
    send: bool  # the peer proved it can read our memory
    recv: bool  # we proved we can read the peer's memory


# dial/accept return plain sockets (callers wrap them in Connection themselves), so the
# handshake's findings wait here for the Connection made from that socket.
_links: "weakref.WeakKeyDictionary[socket.socket, _Link]" = weakref.WeakKeyDictionary()


def _exchange_cma(sock: socket.socket) -> None:
    """The OFFER/RESULT step of the handshake (see ``wire``); both sides run the same code."""
    probe = cma.Probe() if cma.enabled() else None
    if probe is not None:
        sock.sendall(wire.OFFER.pack(os.getpid(), probe.address, probe.data))
    else:
        sock.sendall(wire.OFFER.pack(0, 0, bytes(cma.PROBE_LEN)))
    pid, address, data = wire.OFFER.unpack(_recv_exact(sock, wire.OFFER.size))
    readable = probe is not None and cma.can_read(pid, address, data)
    sock.sendall(wire.RESULT.pack(int(readable)))
    (peer_reads,) = wire.RESULT.unpack(_recv_exact(sock, wire.RESULT.size))
    if peer_reads not in (0, 1):
        raise ProtocolError(f"bad cross-memory-attach result {peer_reads}")
    # The probe had to stay alive until the peer reported on it, i.e. until here.
    _links[sock] = _Link(pid if readable else 0, probe is not None and peer_reads == 1, readable)
    del probe


def dial(address: Union[Tuple[str, int], str], secret: bytes, timeout: float) -> socket.socket:
    """Connect (to a TCP ``(host, port)``, or a ``local_address``) and prove we know the
    secret; raise AuthenticationError if the peer rejects us (or cannot prove it knows the
    secret itself)."""
    if isinstance(address, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(address)
        except BaseException:
            sock.close()
            raise
        address = ("localhost", int(address.rsplit(".", 1)[1]))  # for messages
    else:
        sock = socket.create_connection(address, timeout=timeout)
    try:
        tune(sock)
        magic, version, nonce_a = wire.HELLO.unpack(_recv_exact(sock, wire.HELLO.size))
        if magic != wire.MAGIC or version != wire.VERSION:
            raise ProtocolError(
                f"{address[0]}:{address[1]} is not an rpc_core worker of protocol version "
                f"{wire.VERSION} (got magic {magic!r}, version {version})"
            )
        nonce_c = wire.new_nonce()
        sock.sendall(wire.PROOF.pack(wire.MAGIC, wire.connector_mac(secret, nonce_a, nonce_c), nonce_c))
        try:
            ok, mac_a = wire.VERDICT.unpack(_recv_exact(sock, wire.VERDICT.size))
        except PeerClosed:
            ok, mac_a = 0, b""
        if not ok:
            raise AuthenticationError(
                f"worker at {address[0]}:{address[1]} rejected our authentication: the shared "
                "secret differs. Give every worker the same secret (RpcBackendOptions(auth_secret=...) "
                "or the RPC_CORE_AUTH_SECRET environment variable)."
            )
        if not wire.macs_equal(mac_a, wire.acceptor_mac(secret, nonce_c, nonce_a)):
            raise AuthenticationError(
                f"worker at {address[0]}:{address[1]} could not prove it knows the shared secret; "
                "refusing to talk to it"
            )
        _exchange_cma(sock)
        sock.settimeout(None)
        return sock
    except BaseException:
        sock.close()
        raise


def accept(sock: socket.socket, secret: bytes, timeout: float) -> None:
    """Run the acceptor side of the handshake on a freshly accepted socket.
    Raises AuthenticationError / ProtocolError / OSError; the caller closes the socket."""
    sock.settimeout(timeout)
    tune(sock)
    nonce_a = wire.new_nonce()
    sock.sendall(wire.HELLO.pack(wire.MAGIC, wire.VERSION, nonce_a))
    magic, mac_c, nonce_c = wire.PROOF.unpack(_recv_exact(sock, wire.PROOF.size))
    if magic != wire.MAGIC:
        raise ProtocolError(f"bad handshake magic {magic!r}")
    if not wire.macs_equal(mac_c, wire.connector_mac(secret, nonce_a, nonce_c)):
        try:
            sock.sendall(wire.VERDICT.pack(0, b"\0" * wire.MAC_LEN))
        except OSError:
            pass
        raise AuthenticationError("peer failed the shared-secret challenge (wrong or missing secret)")
    sock.sendall(wire.VERDICT.pack(1, wire.acceptor_mac(secret, nonce_c, nonce_a)))
    _exchange_cma(sock)
    sock.settimeout(None)


def take_link(sock: socket.socket) -> Optional[_Link]:
    """What the handshake found about cross-memory attach for ``sock`` (once)."""
    return _links.pop(sock, None)
