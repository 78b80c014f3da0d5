"""Connections between workers: authenticated connections that carry frames. Bytes only.

What the agent and the rendezvous use is here, in this package's face: the interface
(``Connection``, ``Transport``, ``Listener``), the registry's ``listen`` and ``dial``, and
the handshake's errors and limits. Inside, bottom-up:

    cma.py        cross-memory attach: copying a same-host peer's buffers in one step
    polling.py    how a reader waits for bytes (polls briefly while a core is free)
    handshake.py  mutual authentication and the cross-memory-attach probe (every transport's)
    base.py       the interface: what a connection and a transport offer
    buffers.py    where received bytes go (a reusable buffer, fresh tensor storage)
    sending.py    writing frames (scatter-gather, batching, buffers handed over by address)
    stream.py     ``Connection`` over a stream socket, put together from the three above
    tcp.py        the TCP transport (reaches every worker; its address is the advertised one)
    unix.py       the same-host Unix-socket transport
    registry.py   the transports in use and the order they are tried in

A new transport (shared memory, RDMA) is one module beside ``tcp`` and ``unix`` and one
line in ``registry.TRANSPORTS``; the handshake stays common.
"""

from .base import DEFER_ANSWER, DEFER_BATCH, Address, Capabilities, Connection, Frame, Incoming, Listener, Transport
from .handshake import Admission, HandshakeTimeout, PeerClosed, handshake_timeout
from .registry import TCP, TRANSPORTS, close, dial, listen

__all__ = [
    "Address",
    "Admission",
    "Capabilities",
    "Connection",
    "DEFER_ANSWER",
    "DEFER_BATCH",
    "Frame",
    "HandshakeTimeout",
    "Incoming",
    "Listener",
    "PeerClosed",
    "TCP",
    "TRANSPORTS",
    "Transport",
    "close",
    "dial",
    "handshake_timeout",
    "listen",
]
