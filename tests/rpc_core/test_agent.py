"""The worker (rpc_core/agent/agent.py, api.py shutdown): graceful shutdown waits for all work in
flight, dead peers are reported quickly and by name, and a worker's port survives wrong
secrets and malformed bytes. Bodies run on worker processes (tests/_world.py).

One module, though past 400 lines: one test module per module under test (here the worker),
its sections the worker's concerns."""

import logging
import os
import resource
import signal
import socket
import threading
import time

import pytest
import torch

import rpc_core
from rpc_core import WorkerUnavailableError, transport
from rpc_core.agent import agent as agent_mod
from rpc_core.errors import AuthenticationError
from rpc_core.protocol import wire
from rpc_core.protocol.safe_encoding import dumps_plain
from rpc_core.transport import unix
from tests._world import run_world, stop_process

IO_TIMEOUT = 30.0


def _whoami():
    return rpc_core.get_worker_info().name


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


_signal = threading.Event()


def _set_signal():
    _signal.set()


def _wait_signal():
    if not _signal.wait(60):
        raise TimeoutError("the driving worker never signalled")


# -- graceful shutdown with uneven workloads -----------------------------------------------------
_work = {"slow": 0, "nested": 0, "from_callback": 0}
_work_lock = threading.Lock()


def _count(kind):
    with _work_lock:
        _work[kind] += 1


def _slow(seconds, nested_to):
    """Sleeps (uneven per caller), then leaves nested work in flight without waiting for it."""
    time.sleep(seconds)
    _count("slow")
    rpc_core.rpc_async(nested_to, _nested, args=(seconds,))
    return seconds


def _nested(seconds):
    time.sleep(seconds / 2)
    _count("nested")


def _body_uneven_shutdown(ctx):
    n = ctx.world_size
    futs = []
    for peer in range(n):
        if peer == ctx.rank:
            continue
        # rank r sends r calls of 0.1*r s to each peer: rank 0 has nothing to wait for itself
        for _ in range(ctx.rank):
            fut = rpc_core.rpc_async(peer, _slow, args=(0.1 * ctx.rank, (peer + 1) % n))
            # work started from a callback, after the call completed
            futs.append(fut.then(lambda f, to=(peer + 2) % n: rpc_core.rpc_async(to, _count, args=("from_callback",))))
    rpc_core.shutdown()  # no wait on the futures: shutdown must wait for all of it, everywhere
    assert all(f.done() for f in futs)
    for f in futs:
        f.wait()  # the callback's own call was sent before shutdown let go
    return dict(_work)


def test_graceful_shutdown_waits_for_all_work_in_flight_on_every_worker():
    results = run_world(_body_uneven_shutdown, 4)
    n = 4
    calls = sum(r * (n - 1) for r in range(n))  # rank r sent r calls to each of the n-1 others
    totals = {k: sum(r[k] for r in results) for k in ("slow", "nested", "from_callback")}
    assert totals == {"slow": calls, "nested": calls, "from_callback": calls}


def _sleep(seconds):
    time.sleep(seconds)  # work that outlasts the shutdown timeout below


def _body_shutdown_timeout(ctx):
    if ctx.rank == 0:
        rpc_core.rpc_async(1, _sleep, args=(3.0,))
        with pytest.raises(
            RuntimeError,
            # Which round of the shutdown runs out of the 0.5 s depends on the machine's load
            # (the final round, or the quiesce before it with what is left): both name the
            # timeout the program gave, not what was left of it.
            match=r"graceful shutdown of 'worker0' failed.*timed out after 0\.5 s",
        ):
            rpc_core.shutdown(timeout=0.5)
    else:
        # worker0 gave up and left: this worker's shutdown then fails naming it, promptly
        with pytest.raises(RuntimeError, match=r"(?s)graceful shutdown of 'worker1' failed.*worker0"):
            rpc_core.shutdown()
    with pytest.raises(rpc_core.RpcNotInitializedError):
        rpc_core.rpc_sync(1 - ctx.rank, _whoami)
    return True


def test_shutdown_with_a_timeout_gives_up_on_work_still_in_flight_saying_so():
    assert run_world(_body_shutdown_timeout, 2) == [True, True]


def _body_local_shutdown(ctx):
    if ctx.rank == 0:
        assert rpc_core.rpc_sync(1, _whoami) == "worker1"
        rpc_core.rpc_async(1, _set_signal)  # not waited for: it may be cut off by the shutdowns
    else:
        _wait_signal()
    rpc_core.shutdown(graceful=False)  # local: waits for nobody
    with pytest.raises(rpc_core.RpcNotInitializedError):
        rpc_core.get_worker_info()
    return True


def test_non_graceful_shutdown_is_local():
    assert run_world(_body_local_shutdown, 2) == [True, True]


def _ones():
    return torch.ones(4)


def _body_threads_after_shutdown(ctx):
    ctx.init()
    peer = 1 - ctx.rank
    # Work that starts every kind of thread: readers, background readers (unattended calls),
    # pool threads (callbacks), the timer (lazy acknowledgements of remote()).
    futs = [rpc_core.rpc_async(peer, torch.add, args=(torch.ones(2), i)) for i in range(200)]
    done = []
    futs[0].then(lambda f: done.append(1))
    torch.futures.wait_all(futs)
    for _ in range(20):
        assert torch.equal(rpc_core.remote(peer, _ones).to_here(), torch.ones(4))
    rpc_core.shutdown()
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("rpc-"))


def test_no_worker_thread_outlives_shutdown():
    # A daemon thread still inside torch when the interpreter finalizes aborts the process
    # ("terminate called without an active exception"), so shutdown waits for its threads.
    assert run_world(_body_threads_after_shutdown, 2, init=False) == [[], []]


# -- dead peers ---------------------------------------------------------------------------------
def _call_dead_peer(rank):
    with pytest.raises(WorkerUnavailableError, match=f"worker{rank}") as info:
        rpc_core.rpc_sync(rank, _whoami)
    return str(info.value)


def _body_dead_peer(ctx):
    if ctx.rank == 2:
        _wait_signal()  # killed by worker0 meanwhile
        return None
    if ctx.rank == 0:
        with pytest.raises(WorkerUnavailableError, match=r"worker 'worker2' \(rank 2\)"):
            rpc_core.rpc_async(2, _die).wait()
        with pytest.raises(WorkerUnavailableError, match="worker2"):
            rpc_core.rpc_sync("worker2", _whoami)
        with pytest.raises(WorkerUnavailableError, match="worker2"):
            rpc_core.remote(2, _whoami).to_here()
        # a worker that never talked to worker2 learns it is gone when it tries
        message = rpc_core.rpc_sync(1, _call_dead_peer, args=(2,))
        assert "worker2" in message
        assert rpc_core.rpc_sync(1, _whoami) == "worker1"  # the living keep serving
        # Not waited for: worker1's shutdown fails at once (worker2 is dead) and may close
        # its connections before this call's answer is out.
        rpc_core.rpc_async(1, _set_signal)
    else:
        _wait_signal()  # worker0 drove worker1's failed call to worker2
    with pytest.raises(RuntimeError, match=r"(?s)graceful shutdown of 'worker\d' failed.*worker2"):
        rpc_core.shutdown()
    return True


def test_dead_peer_calls_fail_fast_by_name_and_shutdown_ends_naming_it():
    assert run_world(_body_dead_peer, 3, may_die={2}) == [True, True, None]


def _body_peer_dies_mid_burst(ctx):
    if ctx.rank == 1:
        _wait_signal()  # killed by its own _die call meanwhile
        return None
    rpc_core.rpc_sync(1, _whoami)
    # A burst (its issuer reads the answers and writes the requests in batches) with the
    # callee killed part-way: every future must end, answered or failed naming the worker.
    futs = [rpc_core.rpc_async(1, _die if i == 500 else _whoami) for i in range(3000)]
    answered = []
    for i, f in enumerate(futs):
        try:
            assert f.wait() == "worker1"
            answered.append(i)
        except WorkerUnavailableError as e:
            assert "worker1" in str(e)
    with pytest.raises(RuntimeError, match=r"(?s)graceful shutdown of 'worker0' failed.*worker1"):
        rpc_core.shutdown()
    return answered


def test_a_peer_dying_mid_burst_fails_the_unanswered_calls_naming_it_and_nothing_hangs():
    answered, _ = run_world(_body_peer_dies_mid_burst, 2, may_die={1})
    # One connection runs its requests in order: nothing after the fatal call ran. Answers
    # to calls just before it may be lost with the process, as with any crash after a call
    # ran and before its answer left.
    assert answered == list(range(len(answered)))
    assert len(answered) <= 500


def _body_dead_rank0(ctx):
    if ctx.rank == 0:
        _wait_signal()  # killed by worker1
        return None
    with pytest.raises(WorkerUnavailableError, match=r"worker 'worker0' \(rank 0\)"):
        rpc_core.rpc_sync(0, _die)
    with pytest.raises(WorkerUnavailableError, match="worker0"):
        rpc_core.rpc_sync(0, _whoami)
    with pytest.raises(RuntimeError, match=r"(?s)graceful shutdown of 'worker1' failed.*worker0"):
        rpc_core.shutdown()
    return True


def test_shutdown_ends_naming_rank_0_when_rank_0_died():
    assert run_world(_body_dead_rank0, 2, may_die={0}) == [None, True]


# -- a worker's port under attack ------------------------------------------------------------
class _Recorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []
        self.seen = threading.Condition()

    def emit(self, record):
        with self.seen:
            self.messages.append(record.getMessage())
            self.seen.notify_all()


_recorder = _Recorder()


def _install_recorder():
    logging.getLogger("rpc_core").addHandler(_recorder)


def _log_messages(n):
    """The first ``n`` warnings this worker logged (waits for them to be logged)."""
    with _recorder.seen:
        if not _recorder.seen.wait_for(lambda: len(_recorder.messages) >= n, timeout=30):
            raise TimeoutError(f"only {len(_recorder.messages)} warnings were logged: {_recorder.messages}")
        return list(_recorder.messages)


def _maxrss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _dropped(sock):
    """True once the worker closed ``sock`` (reads to EOF; the socket timeout bounds the wait)."""
    sock.settimeout(IO_TIMEOUT)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def _send_ignoring_reset(sock, data):
    try:
        sock.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the worker already hung up: that is the point


def _body_wrong_secret(ctx):
    if ctx.rank == 1:
        _install_recorder()
        rpc_core._barrier(["worker0", "worker1"])
        _wait_signal()
        return None
    rpc_core._barrier(["worker0", "worker1"])
    address = tuple(rpc_core.api.current_agent().roster.addresses[1])
    for secret in (b"wrong", b""):
        with pytest.raises(AuthenticationError, match="rejected our authentication.*same secret"):
            transport.TCP.dial(address, secret, timeout=IO_TIMEOUT)
    # the worker logged both and keeps accepting and serving everyone else
    logged = rpc_core.rpc_sync(1, _log_messages, args=(2,))
    assert all("wrong or missing auth secret" in m for m in logged[:2]), logged
    transport.TCP.dial(address, ctx.secret.encode(), timeout=IO_TIMEOUT).close()
    assert rpc_core.rpc_sync(1, _whoami) == "worker1"
    rpc_core.rpc_sync(1, _set_signal)
    return True


def test_wrong_secret_is_rejected_clearly_while_the_worker_keeps_serving():
    assert run_world(_body_wrong_secret, 2) == [True, None]


def _identity_frame(identity):
    """The first frame of a connection: which rank is calling."""
    body = dumps_plain(identity)
    return wire.pack_header(wire.REQUEST, wire.CONTROL, 0, len(body), 0, []) + body


def _body_garbage(ctx):
    if ctx.rank == 1:
        _wait_signal()
        return None
    address = tuple(rpc_core.api.current_agent().roster.addresses[1])
    secret = ctx.secret.encode()
    rss_before = rpc_core.rpc_sync(1, _maxrss_mb)

    # Before authentication: nothing the peer sends is parsed beyond the fixed-size proof.
    with socket.create_connection(address, timeout=IO_TIMEOUT):
        pass  # connect and leave
    with socket.create_connection(address, timeout=IO_TIMEOUT) as s:
        _send_ignoring_reset(s, os.urandom(wire.PROOF.size))
        assert _dropped(s)
    with socket.create_connection(address, timeout=IO_TIMEOUT) as s:
        _send_ignoring_reset(s, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + os.urandom(1 << 20))
        assert _dropped(s)
    with socket.create_connection(address, timeout=IO_TIMEOUT) as s:
        _send_ignoring_reset(s, wire.MAGIC + b"\0" * 20)  # truncated proof, then silence
        s.shutdown(socket.SHUT_WR)
        assert _dropped(s)

    # After authentication: malformed frames drop the connection.
    bad_frames = [
        b"\xff" * wire.FRAME_HEADER.size,  # garbage header instead of the identity frame
        _identity_frame(0) + b"\x07" * 64,  # unknown kind
        _identity_frame(0) + wire.pack_header(wire.REQUEST, 0, 0, 2**63, 1, []),  # absurd body
        _identity_frame(0) + wire.pack_header(wire.REQUEST, 0, 0, 0, 1, [2**62]),  # absurd buffer
        _identity_frame(0) + wire.pack_header(wire.REQUEST, 0, 0, 0, 1, [60 << 30]) + b"x" * 100,  # 60 GB claim
        _identity_frame(0) + wire.pack_header(wire.REQUEST, 0, 0, 3 << 30, 1, []) + b"x" * 100,  # truncated 3 GB body
        _identity_frame(99),  # identity out of range
    ]
    for raw in bad_frames:
        with transport.TCP.dial(address, secret, timeout=IO_TIMEOUT).sock as s:
            _send_ignoring_reset(s, raw)
            s.shutdown(socket.SHUT_WR)
            assert _dropped(s)

    # A well-formed request whose body is not a pickle gets an error answer, not a crash.
    conn = transport.TCP.dial(address, secret, timeout=IO_TIMEOUT)
    with conn.sock:
        conn.sock.sendall(_identity_frame(0) + wire.pack_header(wire.REQUEST, 0, 0, 11, 42, []) + b"not pickled")
        conn.set_recv_timeout(IO_TIMEOUT)
        h, _, _, _ = conn.recv()
        assert (h.kind, h.msg_id) == (wire.EXCEPTION, 42)

    # The worker still serves, and did not allocate what the frames claimed.
    assert rpc_core.rpc_sync(1, _whoami) == "worker1"
    assert torch.equal(rpc_core.rpc_sync(1, torch.add, args=(torch.ones(3), 1)), torch.full((3,), 2.0))
    assert rpc_core.rpc_sync(1, _maxrss_mb) - rss_before < 256
    rpc_core.rpc_sync(1, _set_signal)
    return True


def test_garbage_truncated_frames_and_absurd_lengths_are_dropped_and_the_worker_keeps_serving():
    assert run_world(_body_garbage, 2) == [True, None]


# -- requests run inline on the connection's reader --------------------------------------------------
_gate = threading.Event()


def _thread_name():
    return threading.current_thread().name


def _wait_for_gate():
    """Blocks on a plain Event (not an RPC future): only the stall watchdog can move the
    reading loop away from this thread, and the request that opens the gate arrives behind it."""
    if not _gate.wait(60):
        raise TimeoutError("the gate was never opened: the request behind this one did not run")
    return threading.current_thread().name


def _open_gate():
    _gate.set()
    return threading.current_thread().name


def _body_inline(ctx):
    if ctx.rank != 0:
        return None
    # Sequential calls: each runs on the thread that read it off the socket, the reader of
    # the incoming connection, not on a pool thread.
    names = {rpc_core.rpc_sync(1, _thread_name) for _ in range(20)}
    # A call blocked in a lock wait must not hold up the call behind it on the same connection.
    blocked = rpc_core.rpc_async(1, _wait_for_gate)
    opener = rpc_core.rpc_sync(1, _open_gate, timeout=30)
    return names, blocked.wait(), opener


def test_requests_run_on_the_reader_and_a_blocked_one_does_not_hold_up_the_next():
    (names, blocked_on, opened_on), _ = run_world(_body_inline, 2)
    assert names == {"rpc-in"}, names  # the accepting worker's reader thread for this peer
    assert blocked_on == "rpc-in"
    assert opened_on != "rpc-in" and opened_on.startswith("rpc-worker1"), opened_on


def _long_run():
    time.sleep(0.05)  # the workload: a run well past the 2 ms stall limit, nothing queued behind it
    return threading.current_thread().name


def _body_long_run_alone(ctx):
    if ctx.rank != 0:
        return None
    return [rpc_core.rpc_sync(1, _long_run) for _ in range(3)] + [rpc_core.rpc_sync(1, _thread_name)]


def test_a_long_request_alone_on_its_connection_keeps_the_reader_thread():
    names, _ = run_world(_body_long_run_alone, 2)
    # No request waited behind the long ones, so the reading loop never moved to a pool thread.
    assert names == ["rpc-in"] * 4, names


# -- same-host sockets ------------------------------------------------------------------------------
def _families():
    agent = agent_mod.current_agent()
    return sorted({str(c.sock.family.name) for k, c in agent.connections.out.items() if k != agent.me.id})


def _body_families(ctx):
    ctx.init()
    peer = 1 - ctx.rank
    # Both directions: rank 1's calls to rank 0 (first over the rendezvous connection) and
    # rank 0's calls to rank 1 (dialled on first use).
    assert torch.equal(rpc_core.rpc_sync(peer, torch.add, args=(torch.ones(3), 1)), torch.full((3,), 2.0))
    assert rpc_core.remote(peer, _ones).to_here().sum().item() == 4.0
    families = _families()
    rpc_core.shutdown()
    return families


def test_same_host_workers_talk_over_unix_sockets():
    assert run_world(_body_families, 2, init=False) == [["AF_UNIX"], ["AF_UNIX"]]


def test_with_unix_sockets_off_same_host_workers_use_tcp():
    assert run_world(_body_families, 2, init=False, env={"RPC_CORE_UDS": "0"}) == [["AF_INET"], ["AF_INET"]]


def _body_impostor(ctx):
    if ctx.rank == 1:
        os.environ["RPC_CORE_UDS"] = "0"  # rank 1 opens no same-host socket ...
    ctx.init()
    if ctx.rank == 1:
        return None
    # ... and another program holds the name rank 0 would dial for it: it answers garbage.
    port = agent_mod.current_agent().roster.addresses[1][1]
    impostor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    impostor.bind(unix.address(port))
    impostor.listen(8)

    def serve():
        while True:
            try:
                sock, _ = impostor.accept()
            except OSError:
                return
            sock.sendall(b"not an rpc_core worker " * 8)
            sock.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        got = rpc_core.rpc_sync(1, torch.add, args=(torch.ones(2), 1))
        families = _families()
    finally:
        impostor.shutdown(socket.SHUT_RDWR)
        impostor.close()
    return got.tolist(), families


def test_a_same_host_socket_that_fails_falls_back_to_tcp():
    got, _ = run_world(_body_impostor, 2, init=False)
    assert got == ([2.0, 2.0], ["AF_INET"])


# -- a frozen peer: the first call to it is bounded by the call's timeout -------------------------------
def _pid():
    return os.getpid()


def _timed(fn):
    """(exception type name, message, seconds) of a call expected to fail."""
    start = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the caller checks the type
        return type(e).__name__, str(e), time.monotonic() - start
    return None, "no error", time.monotonic() - start


def _call_frozen_peer(dst):
    """On worker1, which never talked to worker2 (stopped meanwhile): each call's own timeout
    bounds it, dialling included, and a caller does not wait for another caller's dial."""
    sync = _timed(lambda: rpc_core.rpc_sync(dst, _whoami, timeout=2))
    start = time.monotonic()
    fut = rpc_core.rpc_async(dst, _whoami, timeout=1)
    issued = time.monotonic() - start  # rpc_async dials too, and must not block past the timeout
    late = _timed(fut.wait)
    # One caller without a timeout (bounded by the handshake limit, shortened on this worker)
    # dials; a second one with a 1 s timeout gives up after its own second, not after the first's dial.
    slow = {}
    t = threading.Thread(target=lambda: slow.update(r=_timed(lambda: rpc_core.rpc_sync(dst, _whoami, timeout=0))))
    t.start()
    quick = _timed(lambda: rpc_core.rpc_sync(dst, _whoami, timeout=1))
    t.join(60)
    return sync, (issued, late), quick, slow.get("r")


def _body_frozen_peer(ctx):
    if ctx.rank == 1:
        os.environ["RPC_CORE_HANDSHAKE_TIMEOUT"] = "6"  # bounds the call without a timeout (default 10 s)
    ctx.init()
    if ctx.rank == 2:
        _wait_signal()  # stopped and resumed by worker0 meanwhile
        return None
    if ctx.rank == 1:
        _wait_signal()
        return None
    pid = rpc_core.rpc_sync(2, _pid)
    stop_process(pid)
    try:
        got = rpc_core.rpc_sync(1, _call_frozen_peer, args=(2,), timeout=60)
    finally:
        os.kill(pid, signal.SIGCONT)
    rpc_core.rpc_sync(2, _set_signal)
    rpc_core.rpc_sync(1, _set_signal)
    return got


def test_first_call_to_a_frozen_peer_fails_within_its_own_timeout_dialling_included():
    (sync, (issued, late), quick, slow), _, _ = run_world(_body_frozen_peer, 3, init=False, timeout=90)
    for kind, message, _seconds in (sync, late, quick):
        assert kind == "RpcTimeoutError", (kind, message)
        assert "RPC ran for more than" in message and "worker 'worker2' (rank 2)" in message, message
        assert "did not answer the connection handshake" in message, message
    # Generous margins for a loaded machine; before, each took 20 s (two 10 s dials).
    assert sync[2] < 2 + 3, sync
    assert issued < 1 + 3 and late[2] < 1 + 3, (issued, late)
    assert quick[2] < 1 + 3, quick  # not held up by the other caller's dial (6 s)
    kind, message, seconds = slow
    assert kind == "WorkerUnavailableError", (kind, message)
    assert "did not answer the connection handshake within 6 s" in message and "worker2" in message, message
    assert seconds < 6 + 4, slow


# -- connection statistics --------------------------------------------------------------------------
def _echo(t):
    return t


def _body_connection_stats(ctx):
    if ctx.rank != 0:
        return None
    rpc_core.rpc_sync(1, _echo, args=(torch.zeros(1),))  # dials: the counts below are one call's
    before = rpc_core.connection_stats()
    tensor = torch.ones(1 << 18)  # 1 MB of float32, there and back
    assert torch.equal(rpc_core.rpc_sync(1, _echo, args=(tensor,)), tensor)
    after = rpc_core.connection_stats()
    assert after == agent_mod.current_agent().connections.connection_stats()
    return before, after


def test_connection_stats_count_the_bytes_and_the_requests_of_a_call():
    before, after = run_world(_body_connection_stats, 2)[0]
    assert after.connections >= 1 and after.connections == before.connections
    assert after.bytes_sent - before.bytes_sent >= 1 << 20, (before, after)
    assert after.bytes_received - before.bytes_received >= 1 << 20, (before, after)
    # By cross-memory attach or through the socket, both count (cma is the part that went by address).
    assert after.bytes_cma_sent - before.bytes_cma_sent <= after.bytes_sent - before.bytes_sent
    # One call: one request sent, none served here.
    assert (after.requests_sent - before.requests_sent, after.requests_received - before.requests_received) == (1, 0)


_held: "torch.futures.Future[int] | None" = None


@rpc_core.functions.async_execution
def _hold() -> "torch.futures.Future[int]":
    global _held
    _held = torch.futures.Future()
    return _held


def _release() -> None:
    assert _held is not None
    _held.set_result(7)


def _in_flight() -> int:
    return rpc_core.connection_stats().requests_in_flight


def _body_requests_in_flight(ctx):
    if ctx.rank != 0:
        return None
    rpc_core.rpc_sync(1, _in_flight)  # dials first
    held = rpc_core.rpc_async(1, _hold)
    while_held = rpc_core.rpc_sync(1, _in_flight)  # _hold waits on its future; this call runs
    rpc_core.rpc_sync(1, _release)
    assert held.wait() == 7
    # The answer may reach us a moment before the callee counts it as sent: ask a few times.
    after = [rpc_core.rpc_sync(1, _in_flight) for _ in range(50)]
    return while_held, after


def test_requests_in_flight_count_the_calls_a_worker_has_not_answered_yet():
    while_held, after = run_world(_body_requests_in_flight, 2)[0]
    assert while_held == 2  # the held call and the asking one
    assert after[-1] == 1 and set(after) <= {1, 2}  # only the asking one


def test_connection_stats_need_an_initialised_worker():
    with pytest.raises(rpc_core.RpcNotInitializedError):
        rpc_core.connection_stats()
