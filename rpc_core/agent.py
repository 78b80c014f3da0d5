"""The worker: connections, pending calls, request dispatch, timeouts, shutdown.

Threads: one acceptor; one reader per connection (it parses frames, completes response
futures, and runs requests inline: a request that blocks or runs long moves the reading
to another pool thread); an elastic pool for calls to self, callbacks and deferred
requests; one timer that fails calls past their deadline. Higher layers (RRefs, distributed autograd,
the profiler) plug in as ``Middleware`` and never touch sockets.
"""
from __future__ import annotations

import collections
import functools
import heapq
import itertools
import logging
import pickle
import socket
import threading
import time
import traceback
from typing import Any, Callable, Deque, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import handshake, transport, wire
from .outbound import Outbound
from .errors import ProtocolError, RpcError, RpcNotInitializedError, RpcTimeoutError, WorkerUnavailableError
from .options import RpcBackendOptions
from .futures import RpcFuture, rebuild_exception
from .pool import ElasticPool, ThreadGroup, init_torch_thread
from .rendezvous import World, WorkerInfo
from .serialization import decode_head, deserialize, deserialize_decoded, encode_head, loopback, serialize

log = logging.getLogger("rpc_core")

_agent: Optional["Agent"] = None
_HELLO_ID = 0  # msg_id of the identity frame a dialer sends first
# How long a lazy answer may wait for a waiter to read it before the background reader is
# woken for it. remote()'s acknowledgement only confirms the creator's RRef; the to_here()
# that usually follows reads it on its way to its own answer.
_LAZY_DELAY = 0.005
# Unanswered background-read calls on a connection from which new ones are a burst (see
# send_request).
_BURST_IN_FLIGHT = 16
# The request-extras key under which a request's reply notes (serialization.note_for_reply)
# wait for its response.
_REPLY_NOTES = "_reply"
# How long close() waits for the agent's threads to end.
_CLOSE_GRACE = 1.0
# torch.futures.Future.set_result is a Python wrapper around this: one frame less per answer.
_set_result = torch._C.Future.set_result


class _Head(NamedTuple):
    """A request's decoded frame head, as ``_admit`` left it for ``_run_request``."""

    metas: Sequence[Any]
    extras: Dict[str, Any]
    error: Optional[BaseException]  # the head could not be decoded (the request fails with it)


# The connection whose reading loop this thread serves (its answers may wait in the queue
# while the next request's bytes are buffered: see _send_answer).
_loop = threading.local()


def current_agent() -> "Agent":
    if _agent is None:
        raise RpcNotInitializedError("RPC has not been initialized. Call rpc_core.init_rpc first.")
    return _agent


def set_current_agent(agent: Optional["Agent"]) -> None:
    global _agent
    _agent = agent


class Middleware:
    """Hooks for higher layers; every method is optional and may be left as is.

    A request passes ``admit`` (in arrival order), ``incoming``, ``enter_call``, ``exit_call``,
    then ``outgoing`` and ``response_extras`` for its answer, and ``finish`` once, just
    before the answer (or error) is sent."""

    def admit(self, src: int, extras: Dict[str, Any]) -> None:
        """A request from ``src`` arrived. Called on the thread that read it, before any later
        message from ``src`` is looked at: what a request says here is in effect for every
        message that came after it, however threads run the requests themselves."""

    def finish(self, extras: Dict[str, Any]) -> None:
        """The request is answered (its answer or error leaves next); called once."""

    def outgoing(self, dst: int, tensors: List[torch.Tensor], extras: Dict[str, Any], request_extras: Optional[Dict[str, Any]]) -> None:
        """Before a message leaves: add entries to ``extras`` (request_extras is set for responses)."""

    def incoming(self, src: int, tensors: List[torch.Tensor], extras: Dict[str, Any], is_response: bool) -> List[torch.Tensor]:
        """After a message's tensors are rebuilt, before the body is unpickled."""
        return tensors

    def enter_call(self, src: int, extras: Dict[str, Any]) -> Any:
        """Around a user function on the callee; returns a token for ``exit_call``."""

    def exit_call(self, token: Any, extras: Dict[str, Any], result_future: Optional[torch.futures.Future]) -> None:
        """After the function returned (result_future is set for async execution)."""

    def response_extras(self, extras: Dict[str, Any], response: Dict[str, Any]) -> None:
        """Add entries to a response's extras from the request's extras."""

    def on_response(self, extras: Optional[Dict[str, Any]], call_extras: Dict[str, Any]) -> None:
        """On the caller, when a response with extras arrives."""


class _Loopback:
    """A 'connection' to ourselves: calls to self are serialized and dispatched like any other."""

    def __init__(self, agent: "Agent") -> None:
        self.agent = agent
        self.bytes_sent = self.bytes_received = 0

    def send(self, kind: int, flags: int, msg_id: int, head: bytes, body: bytes, buffers: Sequence[memoryview] = (),
             defer: int = 0) -> None:
        storages = loopback(buffers)
        h = wire.FrameHeader(kind, flags, len(buffers), len(head), len(body), msg_id)
        self.agent._on_frame(self, self.agent.me.id, h, head, body, storages)

    def close(self) -> None:
        pass


class Agent:
    def __init__(self, world: World, options: RpcBackendOptions) -> None:
        self.me: WorkerInfo = world.me
        self.workers = world.workers
        self.by_name = {w.name: w for w in world.workers}
        self.addresses = world.addresses
        self.options = options
        self.default_timeout = options.rpc_timeout
        self.middleware: List[Middleware] = []
        self._secret = options.auth_secret
        # Read once per worker: every dial and accept of this worker uses the same limit.
        self._handshake_timeout = handshake.handshake_timeout()
        self._listener = world.listener
        self._local_listener = world.local_listener  # same-host peers dial this (handshake.listen_local)
        # Hosts that name this machine: a peer advertised under one of them is dialled locally.
        self._local_hosts = {"localhost", "::1", self._listener.getsockname()[0]}
        self._parked: List[transport.Connection] = []  # open but unused (see start)
        self._lock = threading.Lock()
        self._incoming_cv = threading.Condition(self._lock)
        self._out: Dict[int, Any] = {self.me.id: _Loopback(self)}
        self._links: Dict[int, Outbound] = {}  # who reads each outgoing connection's answers
        self._dial_locks: Dict[int, threading.Lock] = {w.id: threading.Lock() for w in world.workers}
        self._admission = handshake.Admission(self.me.name)  # incoming connections in their handshake
        self._incoming: List[transport.Connection] = []
        # msg_id -> (future, destination rank, extras for response middleware, timeout, flags,
        #            the connection's Outbound (None for calls to self), unattended)
        self._pending: Dict[int, Tuple[RpcFuture, int, Dict[str, Any], float, int, Optional[Outbound], bool]] = {}
        self._ids = itertools.count(1)
        self._closing = False
        self.dead: Dict[int, str] = {}
        # Counters for graceful shutdown's quiescence check (user calls only, not CONTROL).
        self.n_sent = self.n_done = self.n_received = self.n_answered = 0
        # Deadlines per timeout value: calls with the same timeout expire in the order they
        # were made, so each deque stays sorted by deadline without a heap.
        self._deadlines: Dict[float, Deque[Tuple[float, int]]] = {}
        self._deadlines_lock = threading.Lock()
        self._timer_wake = threading.Event()
        # Outbounds with lazy answers to read by a deadline if no waiter did (see send_request).
        self._kicks: Deque[Tuple[float, Outbound]] = collections.deque()
        # call_later's jobs: a heap of (when, sequence number, function).
        self._later: List[Tuple[float, int, Callable[[], None]]] = []
        self._later_ids = itertools.count()
        self._timer_next = 0.0  # when the timer thread plans to wake next (see call_later)
        self.threads = ThreadGroup()  # every thread this agent starts (see close)
        self.pool = ElasticPool(options.num_worker_threads, f"rpc-{self.me.name}", self.threads)
        self.on_peer_lost: List[Callable[[int, str], None]] = []
        # Called with (head extras, error) when a request cannot even be unpickled here.
        self.request_failed_hooks: List[Callable[[Dict[str, Any], BaseException], None]] = []
        self._world_connections = world.connections

    def start(self) -> None:
        """Start serving. Called once the layers above have plugged in, so no request is
        handled by a half-initialised worker."""
        self.threads.start(self._timer_loop, "rpc-timer")
        for rank, conn in self._world_connections.items():
            if self.me.id == 0:
                self._incoming.append(conn)
                self._start_reader(conn, rank)
            else:
                # Calls to rank 0 go over a same-host socket when there is one; the
                # rendezvous connection stays open (rank 0 watches it for our exit) but idle.
                try:
                    local = self._dial_local(rank, time.monotonic() + self._handshake_timeout)
                except TimeoutError:
                    local = None  # no answer there in time: the rendezvous connection will do
                if local is not None:
                    self._parked.append(conn)
                    conn = local
                self._out[rank] = conn
                self._start_outbound(conn, rank)
        self.threads.start(self._accept_loop, "rpc-accept", self._listener)
        if self._local_listener is not None:
            self.threads.start(self._accept_loop, "rpc-accept-local", self._local_listener)

    # -- naming ---------------------------------------------------------------------------
    def worker_info(self, to: Any) -> WorkerInfo:
        if isinstance(to, WorkerInfo):
            return to
        if isinstance(to, str):
            info = self.by_name.get(to)
            if info is None:
                raise RpcError(f"could not find destination worker {to!r}; known workers: {sorted(self.by_name)}")
            return info
        if isinstance(to, int) and not isinstance(to, bool):
            if not 0 <= to < len(self.workers):
                raise RpcError(f"could not find destination rank {to}; ranks are 0..{len(self.workers) - 1}")
            return self.workers[to]
        raise ValueError(f"Cannot get WorkerInfo from name {to!r} (type {type(to).__name__}); pass a name, WorkerInfo or rank")

    def describe(self, rank: int) -> str:
        return f"worker {self.workers[rank].name!r} (rank {rank})"

    # -- sending ---------------------------------------------------------------------------
    def send_request(self, dst: int, func: Any, args: tuple, kwargs: dict, timeout: float,
                     extras: Optional[Dict[str, Any]] = None, flags: int = 0,
                     call_extras: Optional[Dict[str, Any]] = None, sync: bool = False,
                     lazy: bool = False) -> RpcFuture:
        """Serialize and send ``func(*args, **kwargs)`` to rank ``dst``; the Future holds its result.
        ``sync``: the caller waits on the future at once, so its ``wait()`` reads the answer.
        ``lazy``: nobody needs the answer soon (``remote``'s creation acknowledgement): it is
        read by whoever reads this connection next, or else by the background reader
        within ``_LAZY_DELAY``, instead of waking that reader now."""
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
        if dialled:  # the dial is part of the call: its timeout bounds both
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
        burst = unattended and not lazy and link.in_flight() >= _BURST_IN_FLIGHT
        self._pending[msg_id] = (fut, dst, call_extras if call_extras is not None else extras, timeout, flags,
                                 link, unattended)
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
                if link.burst_read_due():
                    link.read_arrived()
            else:
                conn.send(wire.REQUEST, flags, msg_id, head, ser.body, ser.buffers)
        except (OSError, RpcError) as e:
            self._fail(msg_id, e if isinstance(e, RpcError) else self._lost_error(dst, e))
        return fut

    def _connection(self, dst: int, call_deadline: Optional[float] = None, timeout: float = 0.0) -> Any:
        """The connection to ``dst``, dialled if there is none yet. Dialling gives up at the
        call's deadline (``call_deadline``, for a call of ``timeout`` s; None: no timeout) or
        after the handshake timeout, whichever comes first, waiting for another caller's dial included."""
        conn = self._out.get(dst)
        if conn is not None:
            return conn
        if dst in self.dead:
            raise WorkerUnavailableError(self.dead[dst])
        limit = time.monotonic() + self._handshake_timeout
        by_call = call_deadline is not None and call_deadline <= limit  # whose deadline binds
        deadline = call_deadline if by_call else limit
        lock = self._dial_locks[dst]
        if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise self._dial_timed_out(dst, by_call, timeout, "while another call was connecting to it")
        try:
            conn = self._out.get(dst)
            if conn is not None:
                return conn
            try:
                conn = self._dial(dst, deadline)
            except TimeoutError as e:
                connected = getattr(e, "connected", True)
                raise self._dial_timed_out(dst, by_call, timeout, "" if connected else "(the connection was not even accepted)") from None
            except OSError as e:  # refused, reset, closed: nobody there any more
                host, port = self.addresses[dst]
                raise WorkerUnavailableError(
                    f"cannot reach {self.describe(dst)} at {host}:{port} ({e.__class__.__name__}: {e}); "
                    "it has probably exited or crashed"
                ) from None
            self._start_outbound(conn, dst)
            self._out[dst] = conn
            return conn
        finally:
            lock.release()

    def _dial_timed_out(self, dst: int, by_call: bool, timeout: float, detail: str) -> RpcError:
        """The error of a call whose dial ran out of time: its own timeout (RpcTimeoutError,
        like any call that ran too long), or the handshake limit (the worker is there but mute)."""
        host, port = self.addresses[dst]
        what = f"{self.describe(dst)} at {host}:{port} did not answer the connection handshake"
        if detail:
            what += " " + detail
        if by_call:
            return RpcTimeoutError(f"{self._timeout_message(timeout, dst)}: {what}; it may be stopped, frozen "
                                   "or overloaded")
        return WorkerUnavailableError(
            f"cannot reach {what} within {self._handshake_timeout:g} s (RPC_CORE_HANDSHAKE_TIMEOUT); "
            "it is probably stopped, frozen or overloaded, or its host is unreachable"
        )

    def _dial(self, dst: int, deadline: float) -> transport.Connection:
        """Dial ``dst`` by ``deadline``: over its same-host socket if it has one, else TCP. Both
        share the deadline, and a same-host dial that timed out (the peer's kernel took the
        connection but the worker never answered: it is stopped or frozen) is not tried again
        over TCP: the same process would not answer there either."""
        conn = self._dial_local(dst, deadline)
        if conn is not None:
            return conn
        host, port = self.addresses[dst]
        sock = transport.dial((host, port), self._secret, deadline - time.monotonic())
        try:
            return self._introduce(sock)
        except BaseException:
            sock.close()
            raise

    def _dial_local(self, dst: int, deadline: float) -> Optional[transport.Connection]:
        """A connection to ``dst`` over its same-host socket, or None (remote host, none
        there, or anything but a timeout going wrong: the caller then dials TCP). Raises
        TimeoutError if ``dst`` did not answer by ``deadline``."""
        host, port = self.addresses[dst]
        if not handshake.local_enabled() or not (host in self._local_hosts or host.startswith("127.")):
            return None
        sock = None
        try:
            sock = transport.dial(handshake.local_address(port), self._secret, deadline - time.monotonic())
            return self._introduce(sock)
        except TimeoutError:
            if sock is not None:
                sock.close()
            raise
        except Exception as e:  # noqa: BLE001 - TCP is always there to fall back on
            if sock is not None:
                sock.close()  # before the peer could count it as ours (it has no identity frame)
            log.debug("rpc_core %s: no same-host connection to %s (%r); using TCP", self.me.name, self.describe(dst), e)
            return None

    def _introduce(self, sock: socket.socket) -> transport.Connection:
        conn = transport.Connection(sock)
        conn.send(wire.REQUEST, wire.CONTROL, _HELLO_ID, b"", pickle.dumps(self.me.id))
        return conn

    # -- timeouts --------------------------------------------------------------------------
    def _arm_timer(self, timeout: float, msg_id: int) -> None:
        with self._deadlines_lock:
            q = self._deadlines.get(timeout)
            if q is None:
                q = self._deadlines[timeout] = collections.deque()
            wake = not q  # only a deque that was empty can hold a deadline earlier than all others
            q.append((time.monotonic() + timeout, msg_id))
        if wake:
            self._timer_wake.set()

    def _arm_kick(self, link: Outbound) -> None:
        with self._deadlines_lock:
            wake = not self._kicks
            self._kicks.append((time.monotonic() + _LAZY_DELAY, link))
        if wake:
            self._timer_wake.set()

    def call_later(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the timer thread at ``when`` (``time.monotonic()``), or a little
        after. ``fn`` must be quick and must not block: it shares the thread that fails calls
        past their deadline. Wakes the timer only if it planned to sleep past ``when``."""
        with self._deadlines_lock:
            heapq.heappush(self._later, (when, next(self._later_ids), fn))
            wake = when < self._timer_next
        if wake:
            self._timer_wake.set()

    def _timer_loop(self) -> None:
        while not self._closing:
            now = time.monotonic()
            expired: List[int] = []
            next_wake = now + 1.0
            kicks: List[Outbound] = []
            due: List[Callable[[], None]] = []
            with self._deadlines_lock:
                while self._kicks and self._kicks[0][0] <= now:
                    kicks.append(self._kicks.popleft()[1])
                if self._kicks:
                    next_wake = min(next_wake, self._kicks[0][0])
                while self._later and self._later[0][0] <= now:
                    due.append(heapq.heappop(self._later)[2])
                if self._later:
                    next_wake = min(next_wake, self._later[0][0])
                for q in self._deadlines.values():
                    while q and q[0][0] <= now:
                        expired.append(q.popleft()[1])
                    # Answered calls leave stale entries; drop them when they dominate.
                    if len(q) > 2 * len(self._pending) + 1024:
                        live = [e for e in q if e[1] in self._pending]
                        q.clear()
                        q.extend(live)
                    if q:
                        next_wake = min(next_wake, q[0][0])
                self._timer_next = next_wake if not (expired or kicks or due) else now
            for link in kicks:
                link.kick()
            for msg_id in expired:
                if msg_id in self._pending:
                    self._expire(msg_id)
            for fn in due:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - one failing job must not stop the timer
                    log.exception("rpc_core %s: a timer job failed", self.me.name)
            if not expired and not kicks and not due:
                self._timer_wake.wait(max(0.0, next_wake - time.monotonic()))
                self._timer_wake.clear()

    def _expire(self, msg_id: int) -> None:
        # A method of its own, so no local outlives the call: the timer thread then sleeps
        # without pinning the call's record (and the RRef a proxy call keeps alive in it).
        rec = self._pending.get(msg_id)
        if rec is not None:
            self._fail(msg_id, RpcTimeoutError(
                f"{self._timeout_message(rec[3], rec[1])}; raise the timeout per call "
                "(timeout=...) or in RpcBackendOptions(rpc_timeout=...), 0 means none"))

    def _timeout_message(self, timeout: float, dst: int) -> str:
        return (f"RPC ran for more than set timeout ({int(timeout * 1000)} ms) and will now be marked "
                f"with an error (call to {self.describe(dst)})")

    # -- completing calls ---------------------------------------------------------------------
    def _complete(self, fut: RpcFuture, value: Any = None, error: Optional[BaseException] = None, inline: bool = True,
                  counted: bool = False) -> None:
        if fut._has_callbacks and not inline:
            self.pool.submit(self._settle, fut, value, error, counted)
        else:
            self._settle(fut, value, error, counted)

    def _settle(self, fut: RpcFuture, value: Any, error: Optional[BaseException], counted: bool) -> None:
        try:
            if error is not None:
                fut.set_exception(error)
            else:
                _set_result(fut, value)
        except RuntimeError:
            pass  # already completed (e.g. timed out first)
        if counted:
            # Only now, after its callbacks ran: calls they made are counted as sent
            # before this one counts as done, so shutdown cannot see a false quiet moment.
            self.n_done += 1

    def _fail(self, msg_id: int, error: BaseException, inline: bool = True) -> None:
        rec = self._pending.pop(msg_id, None)
        if rec is not None:
            rec[0]._answered = True
            self._complete(rec[0], error=error, inline=inline, counted=not rec[4] & wire.CONTROL)
            if rec[5] is not None:
                rec[5].answered(rec[6])

    # -- receiving -----------------------------------------------------------------------------
    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._closing:
            try:
                sock, peer = listener.accept()
            except OSError:
                return
            if not isinstance(peer, tuple):
                peer = ("local", 0)  # a Unix socket's peer has no address
            deadline = time.monotonic() + self._handshake_timeout
            if not self._admission.admit(sock, peer):
                sock.close()  # shutting down
                return
            self.threads.start(self._serve_incoming, "rpc-in", sock, peer, deadline)

    def _serve_incoming(self, sock: socket.socket, peer: Tuple[str, int], deadline: float) -> None:
        """Authenticate an accepted connection and read its identity frame, all by ``deadline``,
        then serve its requests."""
        from .errors import AuthenticationError

        try:
            transport.accept(sock, self._secret, deadline - time.monotonic(), self._admission)
            h, body = handshake.read_intro(sock, deadline)
            if h.msg_id != _HELLO_ID:
                raise ProtocolError("first frame is not an identity frame")
            src = pickle.loads(body)
            if not isinstance(src, int) or not 0 <= src < len(self.workers):
                raise ProtocolError(f"bad identity {src!r}")
            conn = transport.Connection(sock)
        except AuthenticationError:
            log.warning("rpc_core %s: rejected a connection from %s:%s: wrong or missing auth secret",
                        self.me.name, peer[0], peer[1])
            sock.close()
            return
        except (ProtocolError, OSError, transport.PeerClosed, pickle.UnpicklingError, ValueError, EOFError) as e:
            log.warning("rpc_core %s: dropped a connection from %s:%s: %s", self.me.name, peer[0], peer[1], e)
            sock.close()
            return
        with self._lock:
            if self._closing:
                conn.close()
                return
            self._incoming.append(conn)
        self._read_loop(conn, src)

    def _start_reader(self, conn: transport.Connection, peer: int) -> None:
        """Serve the requests arriving on an incoming connection."""
        self.threads.start(self._read_loop, f"rpc-read-{peer}", conn, peer)

    def _start_outbound(self, conn: transport.Connection, peer: int) -> None:
        def deliver(frame: tuple) -> None:
            self._on_frame(conn, peer, *frame)

        def lost(e: BaseException) -> None:
            self._connection_lost(conn, peer, True, self._loss_reason(peer, e))

        self._links[peer] = Outbound(conn, deliver, lost, f"rpc-read-{peer}", self.threads)

    def _read_loop(self, conn: transport.Connection, peer: int) -> None:
        init_torch_thread()  # readers rebuild tensors and run recv nodes
        resume = None
        _loop.conn = conn
        try:
            while True:
                h, head, body, storages = conn.recv()
                if h.kind != wire.REQUEST:
                    self._on_frame(conn, peer, h, head, body, storages)
                    continue
                # The request runs here, on the thread that read it: no hand-over to another
                # thread. If it blocks or runs long, another thread reads on (see pool).
                if not h.flags & wire.CONTROL:
                    self.n_received += 1
                req = self._admit(peer, head)
                if resume is None:
                    def resume() -> None:
                        self._read_loop(conn, peer)

                    def waiting() -> bool:
                        return conn.poll(0)
                if not self.pool.run_inline(resume, self._run_request, conn, peer, h, req, body, storages,
                                            waiting=waiting, stalled=conn.flush_queued):
                    return  # the loop goes on in another thread
        except Exception as e:  # never leave a dead reader behind an open socket
            self._connection_lost(conn, peer, False, self._loss_reason(peer, e))
        finally:
            _loop.conn = None

    def _loss_reason(self, peer: int, e: BaseException) -> str:
        if isinstance(e, ProtocolError):
            reason = f"malformed bytes from {self.describe(peer)}: {e}"
            log.warning("rpc_core %s: dropping connection: %s", self.me.name, reason)
        elif isinstance(e, (OSError, transport.PeerClosed)):
            reason = f"{self.describe(peer)} closed the connection ({e}); it has probably exited or crashed"
        else:
            reason = f"the connection to {self.describe(peer)} failed on {self.me.name}: {e!r}"
            log.error("rpc_core %s: dropping connection: %s", self.me.name, reason, exc_info=e)
        return reason

    def _connection_lost(self, conn: transport.Connection, peer: int, outgoing: bool, reason: str) -> None:
        conn.close()
        with self._lock:
            if conn in self._incoming:
                self._incoming.remove(conn)
                self._incoming_cv.notify_all()
            if self._out.get(peer) is conn:
                del self._out[peer]
            link = self._links.get(peer)
            if link is not None and link.conn is conn:
                del self._links[peer]
                link.close()
        if self._closing:
            return
        if outgoing or (self.me.id == 0 and peer != 0 and "malformed" not in reason):
            self._peer_lost(peer, reason, conn if outgoing else None)

    def _peer_lost(self, peer: int, reason: str, conn: Any) -> None:
        if self.me.id == 0 or peer == 0:
            self.dead.setdefault(peer, reason)
        for msg_id, rec in list(self._pending.items()):
            if rec[1] == peer:
                self._fail(msg_id, WorkerUnavailableError(reason), inline=False)
        for cb in self.on_peer_lost:
            cb(peer, reason)

    def _lost_error(self, dst: int, e: BaseException) -> WorkerUnavailableError:
        return WorkerUnavailableError(f"sending to {self.describe(dst)} failed ({e}); it has probably exited or crashed")

    def _on_frame(self, conn: Any, src: int, h: wire.FrameHeader, head: bytes, body: bytes, storages: list) -> None:
        if h.kind == wire.REQUEST:
            if not h.flags & wire.CONTROL:
                self.n_received += 1
            self.pool.submit(self._run_request, conn, src, h, self._admit(src, head), body, storages)
            return
        rec = self._pending.pop(h.msg_id, None)
        if rec is None:  # timed out or failed already: the late answer is dropped, but not its news
            try:
                extras = decode_head(head)[1]
            except Exception:
                return
            self._response_extras(extras, {})
            return
        fut, dst, call_extras = rec[:3]
        fut._answered = True  # its completion may still be on its way through the pool
        counted = not rec[4] & wire.CONTROL
        if rec[5] is not None:
            rec[5].answered(rec[6])
        try:
            if h.kind == wire.RESPONSE:
                value, extras = deserialize(head, body, storages, self._incoming_hook(src, True))
                self._response_extras(extras, call_extras)
                self._complete(fut, value, inline=False, counted=counted)
            else:
                info, extras = deserialize(head, body, storages)
                self._response_extras(extras, call_extras)
                self._complete(fut, error=rebuild_exception(info), inline=False, counted=counted)
        except BaseException as e:  # a response we cannot decode fails its call, not the reader
            self._complete(fut, error=RpcError(f"could not decode the response from {self.describe(src)}: {e!r}"),
                           inline=False, counted=counted)

    def _response_extras(self, extras: Optional[Dict[str, Any]], call_extras: Dict[str, Any]) -> None:
        if extras:
            for m in self.middleware:
                m.on_response(extras, call_extras)

    def _incoming_hook(self, src: int, is_response: bool):
        if not self.middleware:
            return None

        def hook(tensors, metas, extras):
            for m in self.middleware:
                tensors = m.incoming(src, tensors, extras, is_response)
            return tensors

        return hook

    # -- executing requests ----------------------------------------------------------------------
    def _admit(self, src: int, head: bytes) -> _Head:
        """Decode a request's head and let the middleware see it, in arrival order: the
        thread that read the request runs this before it reads the next message."""
        try:
            metas, extras = decode_head(head)
        except Exception as e:  # the request fails with it (see _run_request)
            return _Head((), {}, e)
        extras = extras or {}
        for m in self.middleware:
            m.admit(src, extras)
        return _Head(metas, extras, None)

    def _run_request(self, conn: Any, src: int, h: wire.FrameHeader, req: _Head, body: bytes, storages: list) -> None:
        extras = req.extras
        notes: Dict[str, list] = {}  # from the arguments to the caller, in the response's extras
        try:
            try:
                if req.error is not None:
                    raise req.error
                waits: List[torch.futures.Future] = []
                func, args, kwargs = deserialize_decoded(req.metas, extras, body, storages,
                                                         self._incoming_hook(src, False), waits, notes)
            except BaseException as e:
                if isinstance(e, (AttributeError, ModuleNotFoundError, ImportError)):
                    e = RpcError(
                        f"{self.me.name} could not load the function or arguments of a call from "
                        f"{self.describe(src)}: {e}. The RPC pickler does not serialize function code: define "
                        "the function in a module that both caller and callee can import."
                    )
                if self.request_failed_hooks:
                    for hook in self.request_failed_hooks:
                        hook(extras, e)
                raise e from None
            finally:
                if notes:  # the response, or the error response, carries them
                    extras[_REPLY_NOTES] = notes
            if waits:  # RRef forks in the arguments must be confirmed by their owners first
                torch.futures.collect_all(waits).add_done_callback(
                    lambda _: self.pool.submit(self._execute, conn, src, h, func, args, kwargs, extras))
                return
            self._execute(conn, src, h, func, args, kwargs, extras)
        except BaseException as e:
            self._respond_error(conn, h, e, extras)

    def _execute(self, conn: Any, src: int, h: wire.FrameHeader, func: Any, args: tuple, kwargs: dict, extras: Dict[str, Any]) -> None:
        tokens = [m.enter_call(src, extras) for m in self.middleware] if self.middleware else ()
        fut = None
        try:
            if getattr(func, "_wrapped_async_rpc_function", None) is not None:
                fut = func(*args, **kwargs)
                if not isinstance(fut, torch._C.Future):
                    raise TypeError(
                        "Functions decorated with @rpc.async_function must return a torch.futures.Future "
                        f"object, but got {type(fut)}"
                    )
                if fut.done():  # finished already (a value that was ready): answer without a callback
                    self._respond_future(conn, src, h, fut, extras)
                else:
                    fut.add_done_callback(lambda f: self._respond_future(conn, src, h, f, extras))
            else:
                result = func(*args, **kwargs)
                self._respond(conn, src, h, result, extras)
        except BaseException as e:
            self._respond_error(conn, h, e, extras)
        finally:
            for m, tok in zip(self.middleware, tokens):
                m.exit_call(tok, extras, fut)

    def _respond_future(self, conn: Any, src: int, h: wire.FrameHeader, f: torch.futures.Future, extras: Dict[str, Any]) -> None:
        try:
            value = f.value()
        except BaseException as e:
            self._respond_error(conn, h, e, extras)
            return
        self._respond(conn, src, h, value, extras)

    def _respond(self, conn: Any, src: int, h: wire.FrameHeader, value: Any, extras: Dict[str, Any]) -> None:
        try:
            ser = serialize(value)
            resp: Dict[str, Any] = extras.pop(_REPLY_NOTES, None) or {}
            for m in self.middleware:
                m.outgoing(src, ser.tensors, resp, extras)
                m.response_extras(extras, resp)
            head = encode_head(ser.metas, resp)
        except BaseException as e:
            self._respond_error(conn, h, RpcError(f"{self.me.name} could not serialize the result: {e!r}"), extras)
            return
        self._send_answer(conn, h, extras, wire.RESPONSE, head, ser.body, ser.buffers)

    def _respond_error(self, conn: Any, h: wire.FrameHeader, e: BaseException, extras: Dict[str, Any]) -> None:
        info = wire.ExceptionInfo(
            type(e).__module__, type(e).__qualname__,
            f"{e}\n\nRemote traceback (on {self.me.name}):\n{''.join(traceback.format_exception(e))}",
            self.me.name,
        )
        ser = serialize(info)
        resp: Dict[str, Any] = extras.pop(_REPLY_NOTES, None) or {}
        for m in self.middleware:
            m.response_extras(extras, resp)
        self._send_answer(conn, h, extras, wire.EXCEPTION, encode_head(ser.metas, resp), ser.body, [])

    def _send_answer(self, conn: Any, h: wire.FrameHeader, extras: Dict[str, Any], kind: int, head: bytes,
                     body: bytes, buffers: list) -> None:
        for m in self.middleware:
            m.finish(extras)
        if not h.flags & wire.CONTROL:
            self.n_answered += 1
        # On the connection's reading loop, with the next request's bytes buffered, the answer
        # waits for the loop's next read of the socket (or the watchdog, if that request runs
        # long): a burst of requests is answered in a few writes. The callee's CPU per no-op
        # call fell from 16 to 11 µs.
        defer = transport.DEFER_ANSWER if getattr(_loop, "conn", None) is conn else 0
        try:
            conn.send(kind, h.flags & wire.CONTROL, h.msg_id, head, body, buffers, defer)
        except OSError as e:
            if not self._closing:
                log.warning("rpc_core %s: could not send a response: %s", self.me.name, e)

    # -- teardown ----------------------------------------------------------------------------------
    def in_flight(self) -> int:
        return sum(1 for rec in list(self._pending.values()) if not rec[4] & wire.CONTROL)

    def wait_idle(self, deadline: Optional[float]) -> None:
        """Wait until no user call made by this worker is pending (or the deadline passes)."""
        while True:
            futs = [rec[0] for rec in list(self._pending.values()) if not rec[4] & wire.CONTROL]
            if not futs:
                return
            done = threading.Event()
            torch.futures.collect_all(futs).add_done_callback(lambda _: done.set())
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0 or not done.wait(remaining):
                return

    def wait_incoming_closed(self, timeout: float) -> None:
        """Rank 0, at the end of graceful shutdown: let peers close first, so our last
        replies are read before our sockets go away."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._incoming and time.monotonic() < deadline:
                self._incoming_cv.wait(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        with self._lock:
            self._closing = True
            conns = list(self._out.values()) + list(self._incoming)
            links = list(self._links.values())
        for link in links:
            link.close()
        self._timer_wake.set()
        self._admission.close()  # wakes the threads still in a handshake
        for listener in (self._listener, self._local_listener):
            if listener is None:
                continue
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop (close alone does not)
            except OSError:
                pass
            try:
                listener.close()
            except OSError:
                pass
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
