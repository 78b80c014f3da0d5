"""TCP: the transport that reaches every worker, and whose address workers advertise."""

from __future__ import annotations

# getaddrinfo encodes a host name with the idna codec, which imports it (and stringprep,
# unicodedata: milliseconds of CPU) at a process's first dial or listen. Imported with this
# module instead, so a worker forked from a process that imported rpc_core (a launcher's
# fork server, 67 roles) does not import it again in each role.
import encodings.idna  # noqa: F401
import socket
from collections.abc import Collection

from . import handshake, stream
from .base import Address, Capabilities, Connection, Listener, Transport
from .handshake import HandshakeTimeout


class Tcp(Transport):
    kind = "tcp"
    same_host = False

    def listen(self, address: Address) -> Listener:
        """The worker's listener on ``address`` (port 0: a free one); OSError if it cannot bind."""
        host, port = address
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(handshake.LISTEN_BACKLOG)
        except BaseException:
            sock.close()
            raise
        return Listener(self, sock)

    def reaches(self, address: Address, local_hosts: Collection[str]) -> bool:
        return True

    def connect(self, address: Address, timeout: float) -> socket.socket:
        try:
            sock = socket.create_connection(address, timeout=timeout)
        except TimeoutError:
            raise HandshakeTimeout("the connection was not accepted in time", connected=False) from None
        self.tune(sock)
        return sock

    def tune(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        stream.tune_buffers(sock)

    def connection(self, sock: socket.socket, link: handshake.Link, peer: str) -> Connection:
        # Same host only if the peer proved it: its memory was readable (or it read ours).
        same_host = link.send or link.recv
        return stream.Connection(sock, link, self.kind, peer, Capabilities(same_host, link.send, link.recv))
