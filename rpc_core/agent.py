"""The worker: the agent that higher layers call, put together from one part per concern.

    connections.py  dialling and accepting connections, and losing them
    dispatch.py     running the requests that arrive, and answering them
    calls.py        calls this worker made, until each is answered, fails or times out
    deadlines.py    the timer thread: call deadlines, lazy-answer kicks, call_later
    heartbeats.py   noticing peers that went silent while calls wait on them
    middleware.py   the hooks of higher layers (RRefs, distributed autograd, the profiler)
    roster.py       who is in the group (and, in a dynamic group, who joined and left)

Threads: one acceptor; one reader per connection (it parses frames, completes response
futures, and runs requests inline: a request that blocks or runs long moves the reading
to another pool thread); an elastic pool for calls to self, callbacks and deferred
requests; one timer that fails calls past their deadline. Higher layers plug in as
``Middleware`` and never touch sockets.

The request path's parts are mixins of ``Agent`` (every message passes through them, and
a hop through a helper object would cost on each); the timer, with a thread and state of
its own, is a helper object (``Deadlines``).
"""
from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from . import transport, wire
from .completion import Calls, Pending, new_pending
from .connections import Connections, ConnectionStats
from .deadlines import Deadlines
from .dispatch import Dispatch
from .errors import RpcError, RpcNotInitializedError
from .futures import RpcFuture
from .heartbeats import Heartbeats
from .middleware import Middleware
from .options import RpcBackendOptions
from .pool import ElasticPool, ThreadGroup
from .roster import Roster
from .serialization import encode_head, serialize
from .worlds import World

__all__ = ["AGENT_NOT_SET", "Agent", "ConnectionStats", "Middleware", "NOT_INITIALIZED", "connection_stats",
           "current_agent", "set_current_agent"]

log = logging.getLogger("rpc_core")

_agent: Agent | None = None
# Unanswered background-read calls on a connection from which new ones are a burst (see
# send_request).
_BURST_IN_FLIGHT = 16
# How long close() waits for the agent's threads to end.
_CLOSE_GRACE = 1.0


# What torch says when there is no agent: its Python API (rpc_sync, remote, shutdown, ...)
# the first; its C++ core (RRef(), get_rpc_timeout()) the second. Programs match either.
NOT_INITIALIZED = "RPC has not been initialized. Call rpc_core.init_rpc first."
AGENT_NOT_SET = ("Current RPC agent is not set! Did you initialize the RPC framework (e.g. by calling "
                 "`rpc.init_rpc`)? Call rpc_core.init_rpc first.")


def current_agent(message: str = NOT_INITIALIZED) -> Agent:
    """This process's agent; before ``init_rpc`` (or after ``shutdown``) RpcNotInitializedError(message)."""
    if _agent is None:
        raise RpcNotInitializedError(message)
    return _agent


def set_current_agent(agent: Agent | None) -> None:
    global _agent
    _agent = agent


def connection_stats() -> ConnectionStats:
    """Bytes this worker sent and received so far over its open connections (see
    ``Agent.connection_stats``). Raises RpcNotInitializedError before ``init_rpc``."""
    return current_agent().connection_stats()


class Agent(Roster, Connections, Dispatch, Calls, Heartbeats):
    """One worker's RPC agent: ``send_request`` makes calls, the connections' readers serve
    the calls of others; ``start`` begins serving, ``close`` ends everything."""

    def __init__(self, world: World, options: RpcBackendOptions) -> None:
        self.me = world.me
        self.options = options
        self.default_timeout = options.rpc_timeout
        self.middleware: list[Middleware] = []
        self._closing = False
        self._init_calls()
        self._init_connections(world, options)
        self._init_roster(world)
        self._ids = itertools.count(1)
        # Counters for graceful shutdown's quiescence check (user calls only, not CONTROL).
        self.n_sent = self.n_done = self.n_received = self.n_answered = 0
        self._deadlines = Deadlines(self._pending, self._expire, self.me.name)
        # Bound once: send_request arms a deadline per call without a hop through _deadlines.
        self._arm_timer = self._deadlines.arm
        self._arm_kick = self._deadlines.arm_kick
        self.threads = ThreadGroup()  # every thread this agent starts (see close)
        self.pool = ElasticPool(options.num_worker_threads, f"rpc-{self.me.name}", self.threads)
        self.on_peer_lost: list[Callable[[int, str], None]] = []
        # Called with (head extras, error) when a request cannot even be unpickled here.
        self.request_failed_hooks: list[Callable[[dict[str, Any], BaseException], None]] = []
        self._init_heartbeats(options.effective_heartbeat_timeout())

    def start(self) -> None:
        """Start serving. Called once the layers above have plugged in, so no request is
        handled by a half-initialised worker."""
        self.threads.start(self._deadlines.run, "rpc-timer")
        self._start_connections()
        self._start_heartbeats()

    def send_request(self, dst: int, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float,
                     extras: dict[str, Any] | None = None, flags: int = 0,
                     call_extras: dict[str, Any] | None = None, sync: bool = False,
                     lazy: bool = False) -> RpcFuture:
        """Serialize and send ``func(*args, **kwargs)`` to rank ``dst``; the Future holds its result.
        ``sync``: the caller waits on the future at once, so its ``wait()`` reads the answer.
        ``lazy``: nobody needs the answer soon (``remote``'s creation acknowledgement): it is
        read by whoever reads this connection next, or else by the background reader
        within ``deadlines._LAZY_DELAY``, instead of waking that reader now."""
        if self._closing:
            raise RpcError(f"RPC agent of {self.me.name!r} is shut down; cannot send new calls")
        start = time.monotonic()
        timeout = self.default_timeout if timeout is None or timeout < 0 else timeout
        fut = RpcFuture()
        ser = serialize((func, args, kwargs or {}))
        extras = dict(extras) if extras else {}
        for m in self.middleware:
            m.outgoing(dst, ser.tensors, extras, None)
        head = encode_head(ser.metas, extras)
        msg_id = next(self._ids)
        conn = self._out.get(dst)
        dialled = conn is None
        if conn is None:  # dialled: the dial is part of the call, its timeout bounds both
            try:
                conn = self._connection(dst, start + timeout if timeout > 0 else None, timeout)
            except RpcError as e:
                fut.set_exception(e)
                return fut
        link = self._links.get(dst)
        unattended = link is not None and not sync
        # A burst: many unanswered calls. Its answers are read, and its requests written in
        # batches, by this thread every few calls (see outbound). Not for the first few: a
        # caller that sends one and computes (overlapping communication) must not wait.
        burst = unattended and link is not None and not lazy and link.in_flight() >= _BURST_IN_FLIGHT
        self._pending[msg_id] = new_pending(Pending, (fut, dst, call_extras if call_extras is not None else extras,
                                                      timeout, flags, link, unattended))
        if not flags & wire.CONTROL:
            self.n_sent += 1
        if timeout > 0:
            if dialled:
                # Set by when the call began, so out of order with the queues (rare: call_later).
                self.call_later(start + timeout, functools.partial(self._expire, msg_id))
            else:
                self._arm_timer(timeout, msg_id)
        if link is not None:
            # Whoever waits on the future may read its answer (if nobody else is reading).
            fut._reader = link
            if timeout <= 0:
                fut._deadline = None
            else:
                fut._deadline = start + timeout if dialled else time.monotonic() + timeout
            if unattended and link.sent_unattended(lazy, burst):
                self._arm_kick(link)
        try:
            if burst:
                conn.send(wire.REQUEST, flags, msg_id, head, ser.body, ser.buffers, defer=transport.DEFER_BATCH)
                if link is not None and link.burst_read_due():  # never None in a burst
                    link.read_arrived()
            else:
                conn.send(wire.REQUEST, flags, msg_id, head, ser.body, ser.buffers)
        except (OSError, RpcError) as e:
            self._fail(msg_id, e if isinstance(e, RpcError) else self._lost_error(dst, e))
        return fut

    def call_later(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the timer thread at ``when`` (``time.monotonic()``), or a little
        after; ``fn`` must be quick and must not block (see ``Deadlines.call_later``)."""
        self._deadlines.call_later(when, fn)

    def close(self) -> None:
        """Stop: close every connection and thread; calls still pending fail."""
        with self._lock:
            self._closing = True
            conns = list(self._out.values()) + list(self._incoming)
            links = list(self._links.values())
        for link in links:
            link.close()
        self._deadlines.stop()
        self._close_listeners()
        for c in conns + self._parked:
            c.close()
        for msg_id in list(self._pending):
            self._fail(msg_id, RpcError(f"RPC agent of {self.me.name!r} shut down before this call completed"))
        self.pool.close()
        # Let the threads told to stop get out of torch before this process may exit (see
        # ThreadGroup); a thread stuck in a user function is left behind after the grace time.
        stuck = self.threads.join(_CLOSE_GRACE)
        if stuck:
            log.debug("rpc_core %s: threads still running after shutdown: %s", self.me.name, stuck)

