"""The worker: the agent that higher layers call, put together from one part per concern.

    roster.py       who is in the group (and, in a dynamic group, who joined and left)
    completion.py   calls this worker made, until each is answered, fails or times out
    dispatch.py     running the requests that arrive, and answering them
    connections.py  dialling and accepting connections, and losing them (departures.py: one
                    to a member that left is read until its last answers arrive)
    heartbeats.py   noticing peers that went silent while calls wait on them
    deadlines.py    the timer thread: call deadlines, lazy-answer kicks, call_later
    middleware.py   the hooks of higher layers (RRefs, distributed autograd, the profiler)

Each part is an object the agent owns and made, bottom-up, handing each what it needs: the
parts below it, or a callable where a part must reach one made after it (``Dispatch``
tells ``Connections`` of a lost reader, ``Roster`` tells it of a departed member,
``Heartbeats`` sends through ``send_request``). So the imports between the parts are the
real dependencies, and ``_LAYERS`` orders them.

Threads: one acceptor per transport; one reader per connection (it parses frames, completes
response futures, and runs requests inline: a request that blocks or runs long moves the
reading to another pool thread); an elastic pool for calls to self, callbacks and deferred
requests; one timer that fails calls past their deadline. Higher layers plug in as
``Middleware`` and never touch sockets.

The per-message path costs no extra hop for being split into parts: ``send_request`` files
a call in the very dicts of its parts (bound once here), answers go from the connection
that read them straight to ``PendingCalls.on_answer``, requests to ``Dispatch``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from .. import transport
from ..errors import RpcError, RpcNotInitializedError
from ..options import RpcBackendOptions
from ..protocol import wire
from ..protocol.serialization import encode_head, serialize
from . import departures
from .completion import Pending, PendingCalls, new_pending
from .connections import Connections
from .deadlines import Deadlines
from .dispatch import Dispatch
from .futures import RpcFuture
from .heartbeats import Heartbeats
from .middleware import Middleware
from .pool import ElasticPool, ThreadGroup
from .roster import Roster
from .worlds import World

__all__ = [
    "AGENT_NOT_SET",
    "Agent",
    "Middleware",
    "NOT_INITIALIZED",
    "current_agent",
    "current_agent_or_none",
    "set_current_agent",
]

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
AGENT_NOT_SET = (
    "Current RPC agent is not set! Did you initialize the RPC framework (e.g. by calling "
    "`rpc.init_rpc`)? Call rpc_core.init_rpc first."
)


def current_agent(message: str = NOT_INITIALIZED) -> Agent:
    """This process's agent; before ``init_rpc`` (or after ``shutdown``) RpcNotInitializedError(message)."""
    if _agent is None:
        raise RpcNotInitializedError(message)
    return _agent


def current_agent_or_none() -> Agent | None:
    """This process's agent, or None when it is no worker (before ``init_rpc``, after ``shutdown``):
    for the paths that have nothing to do then (releases, profiling) instead of failing."""
    return _agent


def set_current_agent(agent: Agent | None) -> None:
    global _agent
    _agent = agent


class Agent:
    """One worker's RPC agent: ``send_request`` makes calls, the connections' readers serve
    the calls of others; ``start`` begins serving, ``close`` ends everything. Its parts:
    ``roster``, ``pending`` (calls made), ``dispatch`` (requests served), ``connections``,
    ``heartbeats``."""

    def __init__(self, world: World, options: RpcBackendOptions) -> None:
        self.me = world.me
        self.options = options
        self.default_timeout = options.rpc_timeout
        self.middleware: list[Middleware] = []
        # Called with (head extras, error) when a request cannot even be unpickled here.
        self.request_failed_hooks: list[Callable[[dict[str, Any], BaseException], None]] = []
        self._closing = False
        self._ids = itertools.count(1)
        self.threads = ThreadGroup()  # every thread this agent starts (see close)
        self.pool = ElasticPool(options.num_worker_threads, f"rpc-{self.me.name}", self.threads)
        self.roster = Roster(world, self._forget)
        self.pending = PendingCalls(self.roster, self.pool, self.middleware)
        self.dispatch = Dispatch(
            self.roster,
            self.pool,
            self.middleware,
            self.request_failed_hooks,
            self.pending.on_answer,
            self._reader_lost,
        )
        self.connections = Connections(world, options, self.roster, self.pending, self.dispatch, self.threads)
        self._deadlines = Deadlines(self.pending.pending, self.pending.expire, self.me.name)
        self.heartbeats = Heartbeats(
            options.effective_heartbeat_timeout(),
            self.roster,
            self.pool,
            self.pending,
            self.connections,
            self.send_request,
            self._deadlines.call_later,
        )
        # Bound once: send_request uses these on every call without a hop through the parts.
        self._out = self.connections.out
        self._links = self.connections.links
        self._unanswered = self.pending.pending
        self._arm_timer = self._deadlines.arm
        self._arm_kick = self._deadlines.arm_kick
        # The roster's lookups, as torch's agent has them (``get_worker_info(s)``); calls resolve
        # their destination with ``worker_info``.
        self.worker_info = self.roster.worker_info
        self.get_worker_info = self.roster.get_worker_info
        self.get_worker_infos = self.roster.get_worker_infos

    # -- what a part reaches in a part made after it -------------------------------------------------
    def _forget(self, rank: int, name: str, reason: str, graceful: bool) -> None:
        held = self.connections.forget(rank, name, reason, graceful)
        if held is not None:  # its answers may still be on their way: wait for them, for a while
            give_up = functools.partial(self.connections.departures.give_up, held)
            self._deadlines.call_later(time.monotonic() + departures.GRACE, give_up)

    def _reader_lost(self, conn: transport.Connection, peer: int, e: BaseException) -> None:
        self.connections.reader_lost(conn, peer, e)

    @property
    def closing(self) -> bool:
        """``close`` began: no new call may be sent."""
        return self._closing

    def start(self) -> None:
        """Start serving. Called once the layers above have plugged in, so no request is
        handled by a half-initialised worker."""
        self.threads.start(self._deadlines.run, "rpc-timer")
        self.connections.start()
        self.heartbeats.start()

    def send_request(
        self,
        dst: int,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float,
        extras: dict[str, Any] | None = None,
        flags: int = 0,
        call_extras: dict[str, Any] | None = None,
        sync: bool = False,
        lazy: bool = False,
    ) -> RpcFuture:
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
                conn = self.connections.connection(dst, start + timeout if timeout > 0 else None, timeout)
            except RpcError as e:
                fut.set_exception(e)
                return fut
        link = self._links.get(dst)
        unattended = link is not None and not sync
        # A burst: many unanswered calls. Its answers are read, and its requests written in
        # batches, by this thread every few calls (see outbound). Not for the first few: a
        # caller that sends one and computes (overlapping communication) must not wait.
        burst = unattended and link is not None and not lazy and link.in_flight() >= _BURST_IN_FLIGHT
        self._unanswered[msg_id] = new_pending(
            Pending, (fut, dst, call_extras if call_extras is not None else extras, timeout, flags, link, unattended)
        )
        if not flags & wire.CONTROL:
            self.pending.n_sent += 1
        if timeout > 0:
            if dialled:
                # Set by when the call began, so out of order with the queues (rare: call_later).
                self._deadlines.call_later(start + timeout, functools.partial(self.pending.expire, msg_id))
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
            self.pending.fail(msg_id, e if isinstance(e, RpcError) else self.connections.lost_error(dst, e))
        return fut

    def call_later(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the timer thread at ``when`` (``time.monotonic()``), or a little
        after; ``fn`` must be quick and must not block (see ``Deadlines.call_later``)."""
        self._deadlines.call_later(when, fn)

    def get_debug_info(self) -> dict[str, Any]:
        """The agent's counters under torch's keys (``RpcAgent.get_debug_info``); the pool's
        size is the configured ``num_worker_threads`` (or more, once it grew) as torch's, the
        threads started so far (they start lazily) under ``agent.threads_started``."""
        return {
            "agent.thread_pool_size": self.pool.capacity,
            "agent.threads_started": self.pool.size,
            "agent.num_pending_requests": self.pending.in_flight(),
            "agent.num_idle_threads": self.pool.idle,
        }

    def close(self) -> None:
        """Stop: close every connection and thread; calls still pending fail."""
        self._closing = self.dispatch.closing = self.heartbeats.closing = True
        self._deadlines.stop()
        self.connections.close()
        self.pending.fail_all(lambda: RpcError(f"RPC agent of {self.me.name!r} shut down before this call completed"))
        self.pool.close()
        # Let the threads told to stop get out of torch before this process may exit (see
        # ThreadGroup); a thread stuck in a user function is left behind after the grace time.
        stuck = self.threads.join(_CLOSE_GRACE)
        if stuck:
            log.debug("rpc_core %s: threads still running after shutdown: %s", self.me.name, stuck)
