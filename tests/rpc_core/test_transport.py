"""Connections (rpc_core/transport/: handshake.py, stream.py, tcp.py): the authentication
handshake, framing, and what a connection does with malformed bytes. Real TCP sockets on
127.0.0.1, in this process.

One module, though past 400 lines: one test module per module under test (here the
transport), sharing its socket-pair helpers."""

import os
import resource
import socket
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rpc_core import transport
from rpc_core.errors import AuthenticationError, ProtocolError
from rpc_core.protocol import wire
from rpc_core.protocol.serialization import storage_view
from rpc_core.transport import handshake, polling, stream

IO_TIMEOUT = 30.0  # bounds every blocking step; a hang fails instead of stalling


@pytest.fixture
def pool():
    with ThreadPoolExecutor(2) as ex:
        yield ex


@pytest.fixture
def listener():
    s = transport.TCP.listen(("127.0.0.1", 0))
    s.sock.settimeout(IO_TIMEOUT)
    yield s
    s.close()


def _accept(listener, secret):
    sock, peer = listener.accept()
    try:
        link = handshake.run_acceptor(sock, secret, timeout=IO_TIMEOUT)
    except BaseException:
        sock.close()
        raise
    return transport.TCP.connection(sock, link, transport.TCP.describe(peer))


def _connected_pair(pool, listener, secret=b"s3cret"):
    accepted = pool.submit(_accept, listener, secret)
    dialed = transport.TCP.dial(listener.address, secret, timeout=IO_TIMEOUT)
    return dialed, accepted.result(IO_TIMEOUT)


@pytest.fixture
def pair(pool, listener):
    """A connected (dialer, acceptor) pair of Connections, closed after the test."""
    a, b = _connected_pair(pool, listener)
    yield a, b
    a.close()
    b.close()


def _raw_pair():
    a, b = socket.socketpair()
    b.settimeout(IO_TIMEOUT)
    return a, stream.Connection(b)


# -- handshake -------------------------------------------------------------------------------------
def test_same_secret_authenticates_both_sides_and_frames_flow_both_ways(pool, listener):
    c, a = _connected_pair(pool, listener)
    c.send(wire.REQUEST, 0, 5, b"", b"ping")
    h, head, body, bufs = a.recv()
    assert (h.kind, h.msg_id, head, body, bufs) == (wire.REQUEST, 5, b"", b"ping", [])
    a.send(wire.RESPONSE, 0, 5, b"", b"pong")
    assert c.recv()[2] == b"pong"
    c.close()
    a.close()


@pytest.mark.parametrize("dial_secret", [b"wrong", b""], ids=["wrong", "missing"])
def test_wrong_or_missing_secret_is_rejected_with_a_clear_error_on_the_connecting_side(pool, listener, dial_secret):
    accepted = pool.submit(_accept, listener, b"s3cret")
    with pytest.raises(AuthenticationError, match="rejected our authentication.*same secret"):
        transport.TCP.dial(listener.address, dial_secret, timeout=IO_TIMEOUT)
    with pytest.raises(AuthenticationError, match="failed the shared-secret challenge"):
        accepted.result(IO_TIMEOUT)


def test_acceptor_that_does_not_know_the_secret_cannot_impersonate_a_worker(pool, listener):
    def impostor():
        sock, _ = listener.accept()
        with sock:
            sock.sendall(wire.HELLO.pack(wire.MAGIC, wire.VERSION, wire.new_nonce()))
            handshake._recv_exact(sock, wire.PROOF.size)
            sock.sendall(wire.VERDICT.pack(1, os.urandom(wire.MAC_LEN)))  # "ok", but a forged MAC
            sock.recv(1)  # hold the connection until the dialer gives up

    done = pool.submit(impostor)
    with pytest.raises(AuthenticationError, match="could not prove it knows the shared secret"):
        transport.TCP.dial(listener.address, b"s3cret", timeout=IO_TIMEOUT)
    done.result(IO_TIMEOUT)


def test_dialing_something_that_is_not_an_rpc_core_worker_is_a_protocol_error(pool, listener):
    def other_server():
        sock, _ = listener.accept()
        with sock:
            sock.sendall(b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n".ljust(wire.HELLO.size, b"\0"))
            sock.recv(1)

    done = pool.submit(other_server)
    with pytest.raises(ProtocolError, match="is not an rpc_core worker"):
        transport.TCP.dial(listener.address, b"s3cret", timeout=IO_TIMEOUT)
    done.result(IO_TIMEOUT)


def test_acceptor_rejects_garbage_in_place_of_a_proof(pool, listener):
    accepted = pool.submit(_accept, listener, b"s3cret")
    with socket.create_connection(listener.address, timeout=IO_TIMEOUT) as s:
        handshake._recv_exact(s, wire.HELLO.size)
        s.sendall(os.urandom(wire.PROOF.size))
        with pytest.raises(ProtocolError, match="bad handshake magic"):
            accepted.result(IO_TIMEOUT)


def test_acceptor_rejects_a_forged_proof_and_says_so_to_the_peer(pool, listener):
    accepted = pool.submit(_accept, listener, b"s3cret")
    with socket.create_connection(listener.address, timeout=IO_TIMEOUT) as s:
        handshake._recv_exact(s, wire.HELLO.size)
        s.sendall(wire.PROOF.pack(wire.MAGIC, os.urandom(wire.MAC_LEN), wire.new_nonce()))
        with pytest.raises(AuthenticationError):
            accepted.result(IO_TIMEOUT)
        ok, _ = wire.VERDICT.unpack(handshake._recv_exact(s, wire.VERDICT.size))
        assert ok == 0


def test_acceptor_gives_up_on_a_peer_that_never_answers(listener):
    with socket.create_connection(listener.address, timeout=IO_TIMEOUT):
        sock, _ = listener.accept()
        with sock, pytest.raises(OSError):
            handshake.run_acceptor(sock, b"s3cret", timeout=0.2)


# -- the transports and the registry -----------------------------------------------------------------
def _intro(conn):
    conn.send(wire.REQUEST, wire.CONTROL, 0, b"", b"hello")


def _accept_on(listener, secret):
    sock, peer = listener.accept()
    try:
        return listener.transport.accept(sock, peer, secret, time.monotonic() + IO_TIMEOUT)
    except BaseException:
        sock.close()
        raise


@pytest.mark.parametrize("uds", ["1", "0"])
def test_a_same_host_worker_is_dialled_over_the_first_transport_that_reaches_it(pool, monkeypatch, uds):
    monkeypatch.setenv("RPC_CORE_UDS", uds)
    listeners = transport.listen("127.0.0.1", 0)
    try:
        assert [lis.transport.kind for lis in listeners] == (["tcp", "unix"] if uds == "1" else ["tcp"])
        by_kind = {lis.transport.kind: lis for lis in listeners}
        want = "unix" if uds == "1" else "tcp"
        accepted = pool.submit(_accept_on, by_kind[want], b"s3cret")
        conn = transport.dial(listeners[0].address, b"s3cret", time.monotonic() + IO_TIMEOUT, {"localhost"}, _intro)
        incoming = accepted.result(IO_TIMEOUT)
        assert conn.kind == incoming.conn.kind == want
        assert (incoming.intro.msg_id, incoming.body) == (0, b"hello")
        assert conn.capabilities.same_host == (want == "unix" or conn.capabilities.cma_send)
        conn.send(wire.RESPONSE, 0, 1, b"", b"over " + want.encode())
        assert incoming.conn.recv()[2] == b"over " + want.encode()
        # Only same-host transports: none left when they are off.
        second = pool.submit(_accept_on, by_kind["unix"], b"s3cret") if uds == "1" else None
        only_local = transport.dial(
            listeners[0].address, b"s3cret", time.monotonic() + IO_TIMEOUT, {"localhost"}, _intro, same_host_only=True
        )
        if second is not None:
            assert only_local.kind == "unix"
            only_local.close()
            second.result(IO_TIMEOUT).conn.close()
        else:
            assert only_local is None
        conn.close()
        incoming.conn.close()
    finally:
        transport.close(listeners)


def test_a_peer_on_another_host_is_dialled_over_tcp_only(pool, listener):
    accepted = pool.submit(_accept_on, listener, b"s3cret")
    # Advertised under a name that is not this host's: the Unix transport does not try it.
    conn = transport.dial(listener.address, b"s3cret", time.monotonic() + IO_TIMEOUT, {"some-other-host"}, _intro)
    assert conn.kind == "tcp" and conn.peer == f"127.0.0.1:{listener.address[1]}"
    accepted.result(IO_TIMEOUT).conn.close()
    conn.close()


# -- frames --------------------------------------------------------------------------------------
def _buffers(sizes):
    out = []
    for i, n in enumerate(sizes):
        t = torch.arange(n, dtype=torch.uint8) ^ (i & 0xFF)
        out.append(t)
    return out


@pytest.mark.parametrize(
    "head, body_size, buffer_sizes",
    [
        (b"", 0, []),
        (b"head", 100, [10, 0, 3]),
        (b"", 1 << 20, []),  # body large enough to be read in growing chunks
        (b"h" * 1000, 10, [3 << 20, 7]),  # buffer received straight into storage
        (b"", 5, [1] * 600),  # more buffers than one sendmsg takes
    ],
    ids=["empty", "small", "large-body", "large-buffer", "many-buffers"],
)
def test_frames_round_trip_exactly(pool, listener, head, body_size, buffer_sizes):
    c, a = _connected_pair(pool, listener)
    body = os.urandom(body_size)
    tensors = _buffers(buffer_sizes)
    views = [storage_view(t.untyped_storage()) for t in tensors]
    sent = pool.submit(c.send, wire.RESPONSE, wire.CONTROL, 2**63, head, body, views)
    h, got_head, got_body, storages = a.recv()
    sent.result(IO_TIMEOUT)
    assert (h.kind, h.flags, h.msg_id, h.nbuf) == (wire.RESPONSE, wire.CONTROL, 2**63, len(buffer_sizes))
    assert got_head == head and got_body == body
    assert [s.nbytes() for s in storages] == buffer_sizes
    for t, st in zip(tensors, storages, strict=True):
        assert torch.equal(torch.empty(0, dtype=torch.uint8).set_(st), t)
    c.close()
    a.close()


def test_back_to_back_frames_keep_their_boundaries(pool, listener):
    c, a = _connected_pair(pool, listener)
    payloads = [os.urandom(n) for n in (0, 1, 24, 70_000, 3, 300_000, 5)]

    def send_all():
        for i, p in enumerate(payloads):
            c.send(wire.REQUEST, 0, i, b"", p, [memoryview(p)])

    sent = pool.submit(send_all)
    for i, p in enumerate(payloads):
        h, _, body, storages = a.recv()
        assert h.msg_id == i and body == p and bytes(storage_view(storages[0])) == p
    sent.result(IO_TIMEOUT)
    c.close()
    a.close()


# -- malformed bytes --------------------------------------------------------------------------------
def _header(kind=wire.REQUEST, head_len=0, body_len=0, buffer_lens=()):
    return wire.pack_header(kind, 0, head_len, body_len, 1, list(buffer_lens))


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"\xff" * 64, "unknown frame kind 255"),
        (_header(kind=7), "unknown frame kind 7"),
        (_header(body_len=2**63), "body length"),
        (_header(head_len=2**32 - 1), "head length"),
        (_header(buffer_lens=[2**62]), "buffer length"),
        (_header(buffer_lens=[wire.MAX_BUFFER_BYTES] * 2), "frame of"),
    ],
    ids=["garbage", "bad-kind", "absurd-body", "absurd-head", "absurd-buffer", "absurd-total"],
)
def test_malformed_header_is_a_protocol_error_before_any_allocation(raw, message):
    peer, conn = _raw_pair()
    with peer:
        peer.sendall(raw)
        with pytest.raises(ProtocolError, match=message):
            conn.recv()
    conn.close()


@pytest.mark.parametrize(
    "raw",
    [
        _header()[:10],
        _header(body_len=1000) + b"x" * 10,
        _header(head_len=50, body_len=5) + b"h" * 50,
        _header(body_len=1, buffer_lens=[100_000]) + b"b" + b"\0" * 5000,
    ],
    ids=["in-header", "in-body", "after-head", "in-buffer"],
)
def test_truncated_frame_is_reported_as_the_peer_closing(raw):
    peer, conn = _raw_pair()
    peer.sendall(raw)
    peer.close()
    with pytest.raises(transport.PeerClosed):
        conn.recv()
    conn.close()


def _maxrss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _send_and_close(sock, data):
    with sock:
        sock.sendall(data)


def test_lying_body_length_does_not_reserve_the_memory_it_claims(pool):
    peer, conn = _raw_pair()
    sent = pool.submit(_send_and_close, peer, _header(body_len=wire.MAX_BODY_BYTES - 1) + os.urandom(1 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(transport.PeerClosed):
            conn.recv()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    sent.result(IO_TIMEOUT)
    conn.close()
    assert peak < 64 << 20, f"receiving a 1 MB frame that claims 4 GB allocated {peak >> 20} MB"


def test_lying_buffer_length_is_dropped_without_touching_the_memory_it_claims(pool):
    # 60 GB is under the absurdity bound (64 GB) but far more than this machine has: the
    # connection must fail cleanly (allocation refused, or peer closed) and memory stay put.
    before = _maxrss_mb()
    peer, conn = _raw_pair()
    sent = pool.submit(_send_and_close, peer, _header(buffer_lens=[60 << 30]) + os.urandom(1 << 16))
    with pytest.raises((ProtocolError, transport.PeerClosed)):
        conn.recv()
    sent.result(IO_TIMEOUT)
    conn.close()
    assert _maxrss_mb() - before < 256


# -- polling before blocking -----------------------------------------------------------------------
@pytest.fixture
def yields(monkeypatch):
    """Counts the reader's polls (each poll yields the CPU once)."""
    calls = []
    real = os.sched_yield
    monkeypatch.setattr(os, "sched_yield", lambda: (calls.append(1), real())[1])
    return calls


def _recv_after_gap(pool, sender, receiver, gap):
    """The receiver starts waiting, the frame is sent ``gap`` seconds later."""
    started = threading.Event()

    def wait():
        started.set()
        return receiver.recv()

    got = pool.submit(wait)
    assert started.wait(IO_TIMEOUT)
    time.sleep(gap)  # the long wait under test, not a synchronisation
    sender.send(wire.REQUEST, 0, 1, b"", b"after the gap")
    return got.result(IO_TIMEOUT)


@pytest.fixture
def spare_core(monkeypatch):
    """The machine has a core to spare for polling, whatever else runs on it now."""
    monkeypatch.setattr(polling, "spare_core", lambda: True)


@pytest.fixture
def no_spare_core(monkeypatch):
    """Every core is taken: the run queue holds more tasks than this process has cores."""
    monkeypatch.setattr(polling, "_LOADAVG", "/nonexistent")  # never read: the look below holds
    monkeypatch.setattr(polling._RunQueue, "at", time.monotonic() + 3600)
    monkeypatch.setattr(polling._RunQueue, "spare", False)


def test_the_run_queue_is_read_from_loadavg_and_unknown_text_counts_as_spare():
    assert polling.runnable_tasks(b"0.52 0.61 0.70 3/456 12345\n") == 3
    assert polling.runnable_tasks(b"garbage") is None
    assert polling.runnable_tasks(b"") is None
    assert isinstance(polling.spare_core(), bool)  # the real file, read once


def test_the_spare_core_gate_averages_its_looks(tmp_path, monkeypatch):
    """On 2 cores: a third task in some looks (a helper thread waking) keeps polling on; a
    third task in every look (a CPU hog beside a busy pair) turns it off within a few
    looks, and its going away turns it on again."""
    loadavg = tmp_path / "loadavg"
    monkeypatch.setattr(polling, "_LOADAVG", str(loadavg))
    monkeypatch.setattr(polling, "_RUN_QUEUE_TTL", 0.0)  # every call looks
    monkeypatch.setattr(polling._RunQueue, "at", -1.0)
    monkeypatch.setattr(polling._RunQueue, "average", -1.0)
    monkeypatch.setattr(polling._RunQueue, "cores", 2)

    def look(runnable: int) -> bool:
        loadavg.write_text(f"0.52 0.61 0.70 {runnable}/456 12345\n")
        return polling.spare_core()

    assert [look(n) for n in (2, 3, 2, 3, 2, 2, 3, 2, 3, 2)] == [True] * 10
    assert [look(3) for _ in range(6)][-1] is False  # a task more in every look: closed within a few
    assert [look(2) for _ in range(6)][-1] is True  # open again once the extra tasks are gone
    assert look(4) is True  # one crowded look alone does not close it


def test_a_reader_on_a_machine_without_a_spare_core_blocks_without_polling(pool, pair, yields, no_spare_core):
    a, b = pair
    assert _recv_after_gap(pool, a, b, 0.01)[2] == b"after the gap"
    assert not yields


def test_a_reader_polls_while_its_waits_are_short_and_blocks_at_once_after_long_ones(pool, pair, yields, spare_core):
    a, b = pair
    # Fresh connection: no long waits seen, so the first wait starts by polling, gives
    # up after the budget, blocks, and still gets the frame whole.
    assert _recv_after_gap(pool, a, b, 0.05)[2] == b"after the gap"
    assert yields
    # That wait (>= 50 ms) pushed the estimate far past the budget: the next wait
    # blocks without a single poll.
    assert b._wait_estimate > b._spin
    yields.clear()
    assert _recv_after_gap(pool, a, b, 0.05)[2] == b"after the gap"
    assert not yields
    # Short waits bring polling back: the estimate decays toward the recent waits.
    for _ in range(40):
        b._note_wait(b._spin / 10)
    assert b._wait_estimate < b._spin
    a.send(wire.REQUEST, 0, 2, b"", b"ready at once")
    assert b.recv()[2] == b"ready at once"  # bytes already there: no wait, no poll
    assert not yields


def test_a_reader_stops_polling_as_soon_as_another_task_wants_its_cpu(pool, pair, monkeypatch, spare_core):
    yields = []

    def busy_cpu():  # a yield that ran another task for a while
        yields.append(1)
        time.sleep(0.001)

    monkeypatch.setattr(os, "sched_yield", busy_cpu)
    a, b = pair
    assert _recv_after_gap(pool, a, b, 0.05)[2] == b"after the gap"
    assert len(yields) == 1  # one poll, then it blocked for the rest of the 50 ms


@pytest.fixture
def no_spin_pair(pool, listener, monkeypatch):
    """Like ``pair``, made while RPC_CORE_SPIN_US=0 (a connection reads it when it is made)."""
    monkeypatch.setenv("RPC_CORE_SPIN_US", "0")
    a, b = _connected_pair(pool, listener)
    assert a._spin == b._spin == 0.0
    yield a, b
    a.close()
    b.close()


def test_with_polling_switched_off_a_reader_only_blocks(pool, no_spin_pair, yields):
    a, b = no_spin_pair
    assert _recv_after_gap(pool, a, b, 0.01)[2] == b"after the gap"
    assert not b.poll(0.01)  # nothing more to read: poll waits its timeout out
    assert not yields


# -- deferred frames -------------------------------------------------------------------------------
def _frame(conn, n, defer):
    conn.send(wire.REQUEST, 0, n, b"", f"frame {n}".encode(), defer=defer)


def test_deferred_frames_wait_for_the_reader_and_go_out_together_in_order(pair):
    a, b = pair
    a._reading = True  # as while a thread is inside a.recv(), between two waits
    for n in (1, 2, 3):
        _frame(a, n, defer=transport.DEFER_BATCH)
    assert not b.poll(0.05)  # nothing written yet: the reader writes them
    sent = a.bytes_sent
    a.poll(0.01)  # a reader about to wait for bytes writes the queue first
    assert a.bytes_sent > sent
    assert [b.recv()[2] for _ in range(3)] == [b"frame 1", b"frame 2", b"frame 3"]


def test_a_direct_send_writes_the_queued_frames_before_its_own(pair):
    a, b = pair
    a._reading = True
    _frame(a, 1, defer=transport.DEFER_BATCH)
    _frame(a, 2, defer=transport.DEFER_BATCH)
    _frame(a, 3, defer=False)
    a.send(wire.REQUEST, 0, 4, b"", b"", [memoryview(b"tensor bytes")])  # the tensor path too
    got = [b.recv() for _ in range(4)]
    assert [h.msg_id for h, *_ in got] == [1, 2, 3, 4]
    assert bytes(storage_view(got[3][3][0])) == b"tensor bytes"


def test_small_frames_with_tensors_are_batched_too_and_each_gets_storage_of_its_own(pair):
    a, b = pair
    a._reading = True  # a reader between two waits: the frames are queued for it
    t1, t2 = torch.arange(100, dtype=torch.float32), torch.ones(3, dtype=torch.int64)
    a.send(wire.REQUEST, 0, 1, b"h1", b"b1", [storage_view(t1.untyped_storage())], defer=transport.DEFER_BATCH)
    a.send(wire.REQUEST, 0, 2, b"", b"b2", [storage_view(t2.untyped_storage())], defer=transport.DEFER_BATCH)
    t1.zero_()  # the queued frame holds a copy: the sender may reuse the tensor's memory at once
    assert not b.poll(0.05)
    a.flush_queued()  # one write: b's first read takes both frames
    first, second = b.recv(), b.recv()
    assert (first[0].msg_id, first[1], first[2], second[0].msg_id, second[2]) == (1, b"h1", b"b1", 2, b"b2")
    got1 = torch.empty(0).set_(first[3][0])
    assert torch.equal(got1, torch.arange(100, dtype=torch.float32))
    assert torch.equal(torch.empty(0, dtype=torch.int64).set_(second[3][0]), t2)
    first[3][0].resize_(800)  # an ordinary storage, not a window on the read buffer
    assert torch.equal(got1[:100], torch.arange(100, dtype=torch.float32))


def test_a_batching_sender_writes_at_once_when_the_reader_sleeps_and_takes_the_queue_along(pair):
    a, b = pair
    _frame(a, 1, defer=transport.DEFER_BATCH)  # nobody is reading: queued for the next batch
    a._reading, a._reader_sleeps = True, True  # the reader is blocked in recv
    _frame(a, 2, defer=transport.DEFER_BATCH)
    assert [b.recv()[2] for _ in range(2)] == [b"frame 1", b"frame 2"]
    assert not a._small_q


def test_with_polling_switched_off_a_reader_writes_the_queued_frames_before_it_blocks(pool, no_spin_pair):
    a, b = no_spin_pair
    a._reading = True  # a reader between two waits: the frame is queued for it
    _frame(a, 1, defer=transport.DEFER_BATCH)
    a._reading = False
    reader = pool.submit(a.recv)  # it finds no bytes and blocks in the kernel
    assert b.poll(IO_TIMEOUT), "the queued frame never left: the reader blocked without writing it"
    assert b.recv()[2] == b"frame 1"
    b.send(wire.REQUEST, 0, 2, b"", b"wake up")
    assert reader.result(IO_TIMEOUT)[2] == b"wake up"


def test_a_batched_frame_waits_until_its_sender_flushes_unless_a_reader_sleeps(pair):
    a, b = pair
    _frame(a, 1, defer=transport.DEFER_BATCH)  # nobody reads a: the sender writes it later
    assert not b.poll(0.05)
    a.flush_queued()
    assert b.recv()[2] == b"frame 1"
    a._reading, a._reader_sleeps = True, True  # a reader blocked in the kernel would not write it
    _frame(a, 2, defer=transport.DEFER_BATCH)
    assert b.poll(IO_TIMEOUT) and b.recv()[2] == b"frame 2"


def test_an_answer_waits_only_while_the_next_frame_is_buffered_and_leaves_with_the_next_read(pair):
    a, b = pair
    _frame(a, 9, defer=transport.DEFER_ANSWER)  # nothing buffered on a: written at once
    assert b.poll(IO_TIMEOUT) and b.recv()[2] == b"frame 9"
    for n in (1, 2):
        b.send(wire.REQUEST, 0, n, b"", b"request", defer=transport.DEFER_BATCH)
    b.flush_queued()  # one write: a's first read takes both
    assert a.recv()[0].msg_id == 1  # request 2 is now buffered
    _frame(a, 1, defer=transport.DEFER_ANSWER)
    assert not b.poll(0.05)  # held: the reader reads on without touching the socket
    assert a.recv()[0].msg_id == 2
    b.send(wire.REQUEST, 0, 3, b"", b"request")
    assert a.recv()[0].msg_id == 3  # a read of the socket writes the queue first
    assert b.poll(IO_TIMEOUT) and b.recv()[2] == b"frame 1"


def test_frame_waiting_never_blocks_and_says_whether_recv_can_start(pair):
    a, b = pair
    assert not a.frame_waiting()
    b.send(wire.REQUEST, 0, 1, b"", b"x")
    deadline = time.monotonic() + IO_TIMEOUT
    while not a.frame_waiting():  # the bytes cross the socket; poll for them, bounded
        assert time.monotonic() < deadline, "the frame never arrived"
    assert a.recv()[2] == b"x"
    a._reading = True  # another thread reads: frame_waiting leaves the socket to it
    b.send(wire.REQUEST, 0, 2, b"", b"y")
    assert a.poll(IO_TIMEOUT)
    assert not a.frame_waiting()
