"""The transports this process uses, and the order they are tried in: the one place that
chooses between them.

A worker listens on every enabled transport (``listen``); a dial tries the transports that
reach the peer, same-host ones first, TCP last (``dial``). A new transport is a module
beside ``tcp`` and ``unix`` (a ``base.Transport``) plus its line in ``TRANSPORTS``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection

from .base import Address, Connection, Listener, Transport
from .tcp import Tcp
from .unix import Unix

log = logging.getLogger("rpc_core")

# The transport workers advertise their address on and meet on at the rendezvous: it reaches every worker.
TCP = Tcp()
# Tried in this order by ``dial``: those reaching only same-host peers, then TCP.
TRANSPORTS: tuple[Transport, ...] = (Unix(), TCP)


def listen(host: str, port: int) -> list[Listener]:
    """This worker's listeners: TCP's on ``(host, port)`` first (OSError if it cannot bind;
    port 0 picks a free one), then one per other enabled transport that can listen here."""
    primary = TCP.listen((host, port))
    listeners = [primary]
    for t in TRANSPORTS:
        if t is not TCP and t.enabled():
            other = t.listen(primary.address)
            if other is not None:
                listeners.append(other)
    return listeners


def close(listeners: Collection[Listener]) -> None:
    for listener in listeners:
        listener.close()


def dial(
    address: Address,
    secret: bytes,
    deadline: float,
    local_hosts: Collection[str],
    introduce: Callable[[Connection], None],
    same_host_only: bool = False,
) -> Connection | None:
    """A connection to the worker advertised at ``address``, authenticated and introduced
    (``introduce`` sends the first frame), by ``deadline``: over the first transport in
    ``TRANSPORTS`` that reaches it and works. A same-host transport that fails otherwise than
    by the deadline gives way to the next one; one that timed out does not (the peer's kernel
    took the connection but the worker never answered: stopped or frozen, it would not answer
    over TCP either): TimeoutError. None if ``same_host_only`` and no same-host transport
    reached it; a failure of the last transport is raised (OSError, AuthenticationError, ...)."""
    for t in TRANSPORTS:
        if (same_host_only and not t.same_host) or not t.enabled() or not t.reaches(address, local_hosts):
            continue
        conn = None
        try:
            conn = t.dial(address, secret, deadline - time.monotonic())
            introduce(conn)
            return conn
        except TimeoutError:
            if conn is not None:
                conn.close()
            raise
        except Exception as e:
            if conn is not None:
                conn.close()  # before the peer could count it as ours (it has no identity frame)
            if not t.same_host:
                raise
            log.debug(
                "rpc_core: no %s connection to %s (%r); trying the next transport", t.kind, t.describe(address), e
            )
    return None
