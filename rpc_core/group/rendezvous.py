"""How workers find each other: names, ranks and addresses.

Rank 0 listens on the rendezvous address (``env://`` reads MASTER_ADDR/MASTER_PORT,
``tcp://host:port`` names it); its listening socket then serves as its RPC port. Every other
rank opens its own listening socket, dials rank 0, authenticates, and sends
(name, rank, world_size, address). Rank 0 validates the world (ranks in range, names valid
and unique, same world_size), then sends everyone the full table. The join connection stays
open: it becomes the worker's connection to rank 0, which is how rank 0 notices a dead worker.

Rank 0 runs each joiner's handshake on a thread of its own (``_Joiners``), so a connection
that stays silent holds up nobody but itself, and collects the validated joiners on the
thread that called ``init_rpc``.

A dynamic group (``world_size=None``) has no table to wait for: rank 0 returns at once, as a
world of one, and a joiner's request (the same, with world_size None) is answered later by
the registry on rank 0's running agent (``registry``) with the roster and generations.

While it waits, every worker logs whom it waits for, every ``RPC_CORE_RENDEZVOUS_LOG_INTERVAL``
seconds (``_Waiting``): rank 0 the ranks that have not arrived, the others rank 0 (not
reachable yet, or reached and answering once the world is complete or the group admitted
them). So a rank cut off from the others says so long before ``init_timeout`` ends its wait.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time

from .. import knobs, transport
from ..agent.worlds import MAX_NAME_LEN, WorkerInfo, World, validate_name  # noqa: F401 (re-exported)
from ..errors import AuthenticationError, RendezvousError
from ..protocol import wire
from ..protocol.safe_decoding import loads_plain
from ..protocol.safe_encoding import dumps_plain
from ..transport import Connection, Listener

log = logging.getLogger("rpc_core")

# How long the end of a rendezvous waits for the joiners' handshake threads it stopped.
_STOP_GRACE = 2.0
# Rank 0 forgets its ended handshake threads once it holds this many (or twice as many as
# after the last time it did).
_PRUNE_FIRST = 64
# A joiner retries reaching rank 0 (which may not be listening yet) after this, doubling
# up to _RETRY_MAX, and gives each attempt at least _MIN_ATTEMPT even at its deadline.
_RETRY_FIRST = 0.02
_RETRY_MAX = 0.5
_MIN_ATTEMPT = 0.1
# Rank 0 answers a join once the world is complete: a joiner waits for that until its
# deadline, plus this for the answer of a world that filled just in time to travel.
_ANSWER_SLACK = 5.0
# A waiting line is logged at INFO, and at WARNING once this share of init_timeout is gone.
_WARN_AFTER = 0.5
# torch's words for a join that mixes world_size=None with a static group, or the reverse.
MIXED_GROUP = "RPC group mixes statically and dynamically initialized members which is not supported."


class _Waiting:
    """The lines a rendezvous logs while it waits (one per interval: at most init_timeout /
    RPC_CORE_RENDEZVOUS_LOG_INTERVAL of them)."""

    def __init__(self, timeout: float) -> None:
        self._interval = knobs.rendezvous_log_interval()
        self._start = time.monotonic()
        self._timeout = timeout
        self._next = self._start + self._interval if self._interval > 0 else float("inf")

    def bound(self, seconds: float) -> float:
        """``seconds`` to wait, cut so that the wait ends when the next line is due."""
        return max(0.0, min(seconds, self._next - time.monotonic()))

    def log(self, what: str) -> None:
        """Log ``what`` (whom this worker waits for) if a line is due."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self._interval
        waited = now - self._start
        level = logging.WARNING if waited >= _WARN_AFTER * self._timeout else logging.INFO
        log.log(level, "rpc_core rendezvous: %s, %.1f s of %g s (init_timeout)", what, waited, self._timeout)


def resolve_init_method(init_method: str) -> tuple[str, int]:
    if init_method.startswith("env://"):
        addr = os.environ.get("MASTER_ADDR")
        port = os.environ.get("MASTER_PORT")
        missing = [k for k, v in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if not v]
        if missing:
            raise RendezvousError(
                f"init_method 'env://' needs {' and '.join(missing)} in the environment: export "
                "MASTER_ADDR=<rank 0 host> MASTER_PORT=<free port>, or pass init_method='tcp://HOST:PORT'"
            )
        where = "MASTER_PORT"
    else:
        rest = init_method[len("tcp://") :].rstrip("/")
        addr, sep, port = rest.rpartition(":")
        addr = addr.strip("[]")
        where = f"init_method {init_method!r}"
        if not sep or rest.endswith("]"):
            raise RendezvousError(f"{where} has no port: use 'tcp://HOST:PORT'")
        if not addr:
            raise RendezvousError(f"{where} has no host: use 'tcp://HOST:PORT'")
    try:
        port_n = int(port)  # type: ignore[arg-type]
    except ValueError:
        raise RendezvousError(f"{where}: port {port!r} is not a number") from None
    if not 0 < port_n < 65536:
        raise RendezvousError(f"{where}: port {port_n} is out of range 1-65535")
    return addr, port_n  # type: ignore[return-value]


def rendezvous(name: str, rank: int, world_size: int | None, init_method: str, secret: bytes, timeout: float) -> World:
    """Find the group. ``world_size=None``: a dynamic group, founded by rank 0 alone (it
    returns at once); any other rank joins it through rank 0's registry (``registry``)."""
    knobs.check()
    validate_name(name)
    if world_size is None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(
                f"rank parameter missing or invalid: a worker of a dynamic group (world_size=None) "
                f"needs its rank, an int >= 0 (0 founds the group), got {rank!r}"
            )
        host, port = resolve_init_method(init_method)
        if rank == 0:
            world = _host(name, 1, host, port, secret, timeout)
            world.dynamic = True
            world.generations = {0: 0}
            return world
        return _join(name, rank, None, host, port, secret, timeout)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    host, port = resolve_init_method(init_method)
    if rank == 0:
        return _host(name, world_size, host, port, secret, timeout)
    return _join(name, rank, world_size, host, port, secret, timeout)


def _host(name: str, world_size: int, host: str, port: int, secret: bytes, timeout: float) -> World:
    # Every transport's listener is bound before anyone learns our address, so a same-host
    # peer never finds its socket missing.
    try:
        listeners = transport.listen(host, port)
    except OSError as e:
        raise RendezvousError(
            f"rank 0 cannot listen on {host}:{port} for the rendezvous: {e.strerror or e}. "
            "If the port is in use (another program or an earlier run), choose another MASTER_PORT "
            "or stop the process holding it; if the host is wrong, fix MASTER_ADDR."
        ) from None
    me = WorkerInfo(name, 0)
    joined: dict[int, tuple[WorkerInfo, tuple[str, int], Connection, int]] = {}
    deadline = time.monotonic() + timeout
    joiners = _Joiners(listeners[0], world_size, secret, f"rendezvous at {host}:{port}")
    waiting = _Waiting(timeout)
    try:
        while len(joined) < world_size - 1:
            remaining = deadline - time.monotonic()
            waiting.log(
                f"rank 0 ({name!r}) at {host}:{port} is waiting for ranks "
                f"{sorted(set(range(1, world_size)) - set(joined))} ({len(joined) + 1} of {world_size} "
                "arrived)"
            )
            if remaining <= 0:
                missing = sorted(set(range(1, world_size)) - set(joined))
                raise RendezvousError(
                    f"only {len(joined) + 1} of {world_size} workers joined the rendezvous at "
                    f"{host}:{port} within {timeout:g} s (missing ranks {missing}); start the missing "
                    "workers, check their MASTER_ADDR/MASTER_PORT and world_size, or raise init_timeout",
                    missing_ranks=missing,
                )
            for c, info, address, msg_id in joiners.collect(waiting.bound(remaining)):
                err = _check_joiner(info, me, joined)
                if err and len(joined) == world_size - 1:
                    _reply(c, msg_id, err)  # one too many, after the world was complete: only it fails
                    c.close()
                    continue
                if err:
                    _reply(c, msg_id, err)
                    c.close()
                    raise RendezvousError(err)
                joined[info.id] = (info, address, c, msg_id)
    except BaseException as exc:
        message = str(exc) if isinstance(exc, RendezvousError) else f"rank 0 failed: {exc!r}"
        joiners.close(message)
        for _, _, c, msg_id in joined.values():
            _reply(c, msg_id, message)
            c.close()
        transport.close(listeners)
        raise
    joiners.close(
        f"rank 0 completed the rendezvous at {host}:{port} without this worker: the world of "
        f"{world_size} was full. Check the ranks and world_size given to each worker."
    )
    listeners[0].setblocking(True)
    workers = [me] + [joined[r][0] for r in range(1, world_size)]
    addresses = {0: (host, port)}
    addresses.update({r: joined[r][1] for r in joined})
    # Encoded once for every joiner: the table grows with the world, and encoding it per
    # joiner made rank 0's answer quadratic in the world size (66 joiners x 67 entries).
    table = _dumps(([(w.name, w.id) for w in workers], addresses))
    for _, _, c, msg_id in joined.values():
        c.send(wire.RESPONSE, 0, msg_id, b"", table)
    return World(me, workers, addresses, listeners, {r: joined[r][2] for r in joined})


class _Joiners:
    """Rank 0's side of the joiners' handshakes: ``collect`` (on the rendezvous thread)
    accepts connections and returns the joiners whose handshake and join request came in;
    each handshake runs on a thread of its own, bounded by handshake_timeout(), and at most
    MAX_PENDING_HANDSHAKES at once are unauthenticated (``transport.Admission``)."""

    def __init__(self, listener: Listener, world_size: int, secret: bytes, where: str) -> None:
        self._listener = listener
        self._world_size = world_size
        self._secret = secret
        self._admission = transport.Admission(where)
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()  # in a handshake thread
        self._done: list[tuple[Connection, WorkerInfo, tuple[str, int], int]] = []
        self._threads: list[threading.Thread] = []
        self._prune_at = _PRUNE_FIRST
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()  # a finished handshake wakes collect
        listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)

    def collect(self, timeout: float) -> list[tuple[Connection, WorkerInfo, tuple[str, int], int]]:
        """Accept what is connecting; return the joiners ready so far, waiting up to ``timeout``
        seconds for something to happen if none is."""
        for key, _ in self._selector.select(timeout):
            if key.fileobj is self._wake_r:
                self._wake_r.recv(4096)
            else:
                self._accept()
        with self._lock:
            done, self._done = self._done, []
        return done

    def _accept(self) -> None:
        try:
            sock, peer = self._listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return  # gone before we took it
        if not self._admission.admit(sock, peer):
            sock.close()
            return
        with self._lock:
            self._socks.add(sock)
        if len(self._threads) >= self._prune_at:  # not per joiner: a pass over all of them each time is quadratic
            self._threads = [t for t in self._threads if t.is_alive()]
            self._prune_at = max(_PRUNE_FIRST, 2 * len(self._threads))
        t = threading.Thread(
            target=self._run,
            args=(sock, peer, time.monotonic() + transport.handshake_timeout()),
            name="rpc-rendezvous-join",
            daemon=True,
        )
        self._threads.append(t)
        t.start()

    def _run(self, sock: socket.socket, peer: tuple[str, int], deadline: float) -> None:
        joiner = None
        try:
            joiner = _accept_joiner(
                self._listener.transport, sock, peer, self._world_size, self._secret, deadline, self._admission
            )
        finally:
            with self._lock:
                self._socks.discard(sock)  # before it may be closed (see close)
                kept = joiner is not None and not self._closed
                if kept and joiner is not None:
                    self._done.append(joiner)
        if kept:
            try:
                self._wake_w.send(b"\0")
            except OSError:
                pass
        elif joiner is not None:
            c, _, _, msg_id = joiner
            _reply(c, msg_id, "rank 0 ended the rendezvous before this worker's join request came in")
            c.close()
        else:
            sock.close()

    def close(self, message: str) -> None:
        """Stop: end the handshakes in progress, answer the joiners nobody collected with
        ``message``, and wait (bounded) for the threads."""
        self._admission.close()
        with self._lock:
            self._closed = True
            for sock in self._socks:  # wakes its thread, which then closes it
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            left, self._done = self._done, []
        for c, _, _, msg_id in left:
            _reply(c, msg_id, message)
            c.close()
        end = time.monotonic() + _STOP_GRACE
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        stuck = [t for t in self._threads if t.is_alive()]
        if stuck:
            log.debug("rpc_core rendezvous: %d handshake threads still running after the rendezvous", len(stuck))
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()


def _dumps(obj: object) -> bytes:
    # Rendezvous messages are plain values (names, ranks, addresses): never a pickle, so
    # nothing a joiner sends is unpickled, whatever the serializer.
    return dumps_plain(obj)


def _reply(c: Connection, msg_id: int, err: str) -> None:
    try:
        c.send(wire.EXCEPTION, 0, msg_id, b"", _dumps(err))
    except OSError:
        pass


def _accept_joiner(
    via: transport.Transport,
    sock: socket.socket,
    peer: tuple[str, int],
    world_size: int,
    secret: bytes,
    deadline: float,
    admission: transport.Admission,
) -> tuple[Connection, WorkerInfo, tuple[str, int], int] | None:
    """Authenticate a joiner and read its join request, all by ``deadline``; None if it is
    turned away (the caller closes ``sock`` then)."""
    try:
        c, h, body = via.accept(sock, peer, secret, deadline, admission)
        name, rank, ws, address = loads_plain(body)
        if ws is None:
            _reply(c, h.msg_id, MIXED_GROUP)
            return None
        if ws != world_size:
            _reply(
                c, h.msg_id, f"world_size mismatch: worker {name!r} (rank {rank}) says {ws}, rank 0 says {world_size}"
            )
            return None
        return c, WorkerInfo(name, rank), tuple(address), h.msg_id
    except AuthenticationError:
        log.warning("rpc_core rendezvous: rejected a connection from %s:%s: wrong or missing auth secret", *peer[:2])
    except Exception as e:  # noqa: BLE001 - ProtocolError, OSError (timeouts included), a malformed message...
        log.warning("rpc_core rendezvous: dropped a bad connection from %s:%s: %r", peer[0], peer[1], e)
    return None


def _check_joiner(
    info: WorkerInfo, me: WorkerInfo, joined: dict[int, tuple[WorkerInfo, tuple[str, int], Connection, int]]
) -> str | None:
    if info.id in joined or info.id == 0:
        other = me if info.id == 0 else joined[info.id][0]
        return f"rank {info.id} is not unique: both {other.name!r} and {info.name!r} claim it"
    names = {me.name: 0} | {j[0].name: r for r, j in joined.items()}
    if info.name in names:
        return f"worker name {info.name!r} is not unique: ranks {names[info.name]} and {info.id} both use it"
    return None


def _join(name: str, rank: int, world_size: int | None, host: str, port: int, secret: bytes, timeout: float) -> World:
    deadline = time.monotonic() + timeout
    delay = _RETRY_FIRST
    waiting = _Waiting(timeout)
    who = f"worker {name!r} (rank {rank})"
    while True:
        try:
            c = transport.TCP.dial(
                (host, port),
                secret,
                timeout=max(_MIN_ATTEMPT, min(transport.handshake_timeout(), deadline - time.monotonic())),
            )
            break
        except (TimeoutError, ConnectionRefusedError, transport.PeerClosed, ConnectionResetError, socket.gaierror) as e:
            if time.monotonic() + delay > deadline:
                raise RendezvousError(
                    f"worker {name!r} (rank {rank}) could not reach the rendezvous at {host}:{port} "
                    f"within {timeout:g} s ({e}); is rank 0 running, and are MASTER_ADDR/MASTER_PORT "
                    "(or the tcp:// init_method) right?"
                ) from None
            waiting.log(f"{who} is waiting for rank 0 at {host}:{port}, which it cannot reach yet ({e})")
            time.sleep(delay)  # retry backoff while rank 0 starts; not a test wait
            delay = min(delay * 2, _RETRY_MAX)
    local_ip = c.local_host
    try:
        listeners = transport.listen(local_ip, 0)
    except OSError as e:
        c.close()
        raise RendezvousError(f"worker {name!r} cannot open a listening socket on {local_ip}: {e}") from None
    try:
        c.send(wire.REQUEST, 0, 1, b"", _dumps((name, rank, world_size, listeners[0].address)))
        end = deadline + _ANSWER_SLACK
        what = (
            f"{who} is waiting for rank 0 at {host}:{port} to admit it to the group (once every member knows it)"
            if world_size is None
            else f"{who} has reached rank 0 at {host}:{port} and is waiting for the "
            f"roster, which rank 0 sends once all {world_size} workers have arrived"
        )
        while time.monotonic() < end and not c.poll(waiting.bound(end - time.monotonic())):
            waiting.log(what)
        c.set_recv_timeout(max(_MIN_ATTEMPT, end - time.monotonic()))
        h, _, body, _ = c.recv()
        c.set_recv_timeout(None)
    except (OSError, transport.PeerClosed) as e:
        transport.close(listeners)
        c.close()
        raise RendezvousError(
            f"worker {name!r} (rank {rank}): rendezvous with rank 0 at {host}:{port} failed: {e}"
        ) from None
    if h.kind == wire.EXCEPTION:
        transport.close(listeners)
        c.close()
        raise RendezvousError(loads_plain(body))
    # A static world's table: (names, addresses); a dynamic group's adds the generations.
    table = loads_plain(body)
    workers = [WorkerInfo(n, r) for n, r in table[0]]
    me = next(w for w in workers if w.id == rank)
    if world_size is None:
        return World(me, workers, table[1], listeners, {0: c}, dynamic=True, generations=table[2])
    return World(me, workers, table[1], listeners, {0: c})
