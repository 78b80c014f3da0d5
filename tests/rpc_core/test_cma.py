"""Large tensor buffers by cross-memory attach (rpc_core/transport/cma.py, the REMOTE frames of
rpc_core/transport/stream.py): real processes on 127.0.0.1, with RPC_CORE_CMA on and off; a peer
that dies while we wait for its RELEASE; two peers sending large frames to each other at
once; and descriptors a lying peer could send."""

import ctypes
import mmap
import os
import resource
import selectors
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import rpc_core
from rpc_core import transport
from rpc_core.errors import ProtocolError
from rpc_core.protocol import wire
from rpc_core.protocol.serialization import storage_view
from rpc_core.transport import cma, handshake, sending, stream
from tests._world import run_world

IO_TIMEOUT = 30.0
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIN = sending.CMA_MIN

pytestmark = pytest.mark.skipif(not cma.enabled(), reason="process_vm_readv unavailable or RPC_CORE_CMA=0")


# -- helpers run on the workers -------------------------------------------------------------------
def _echo(*tensors):
    return tensors


def _cma_counters():
    """(bytes_cma_sent, bytes_cma_received) over this worker's connections."""
    stats = rpc_core.connection_stats()
    return stats.bytes_cma_sent, stats.bytes_cma_received


def _bits(t):
    """The tensor's elements as integers of the same width (so NaN payloads compare too)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _random(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    width = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * width,), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def _tensors():
    """Sizes across the threshold, views at offsets, non-contiguous views, shared storages,
    and (last) many buffers in one message."""
    out = [
        _random(n // 4, torch.float32, i) for i, n in enumerate([MIN // 2, MIN - 4, MIN, MIN + 4, 3 << 20, 20 << 20])
    ]
    big = _random(6 << 20, torch.float64, 10)
    out.append(big[1001:])  # a view at an odd offset, shipping the whole storage
    out.append(_random(1 << 20, torch.int16, 11).view(1024, 1024)[3:, 5:].t())  # non-contiguous
    out.append(_random(4 << 20, torch.uint8, 12)[7::3])  # strided
    shared = _random(2 << 20, torch.int32, 13)
    out += [shared[: 1 << 20], shared[1 << 20 :].view(1024, 1024), shared.view(torch.float32)[5:]]
    out.append(_random(MIN // 8, torch.float32, 14)[10:])  # small storage, one view
    return tuple(out), tuple(_random(MIN // 4 + 100, torch.float32, 100 + i) for i in range(40))


def _check_same(sent, got):
    assert len(sent) == len(got)
    for a, b in zip(sent, got, strict=True):
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride())
        assert torch.equal(_bits(a), _bits(b))


def _body_round_trip(ctx):
    if ctx.rank == 1:
        return None
    tensors, many = _tensors()
    got = rpc_core.rpc_sync(1, _echo, args=tensors, timeout=60)
    _check_same(tensors, got)
    # Views of one storage arrive as views of one storage.
    ptrs = [t.untyped_storage().data_ptr() for t in got[9:12]]
    assert ptrs[0] == ptrs[1] == ptrs[2]
    got_many = rpc_core.rpc_sync(1, _echo, args=many, timeout=60)
    _check_same(many, got_many)
    # Several calls in flight at once, each message with large buffers.
    futs = [rpc_core.rpc_async(1, _echo, args=(t,)) for t in tensors[3:8]]
    for t, f in zip(tensors[3:8], futs, strict=True):
        _check_same((t,), f.wait())
    return _cma_counters(), rpc_core.rpc_sync(1, _cma_counters)


def _large_bytes(tensors):
    """Bytes of the buffers at least the threshold that the messages of _body_round_trip ship."""
    total = 0
    for t in tensors:
        n = t.untyped_storage().nbytes()
        total += n if n >= MIN else 0
    return total


@pytest.mark.timeout(180)
@pytest.mark.parametrize("enabled", ["1", "0"], ids=["cma", "RPC_CORE_CMA=0"])
def test_large_tensors_round_trip_bit_exactly(enabled):
    (sent0, recv0), (sent1, recv1) = run_world(_body_round_trip, 2, env={"RPC_CORE_CMA": enabled}, timeout=150)[0]
    if enabled == "0":
        assert (sent0, recv0, sent1, recv1) == (0, 0, 0, 0)
        return
    tensors, many = _tensors()
    shared = {t.untyped_storage().data_ptr(): t for t in tensors}.values()  # each storage once
    expected = _large_bytes(shared) + _large_bytes(many) + _large_bytes(tensors[3:8])
    # Every large buffer went by address, both ways; the smaller ones did not.
    assert sent0 == recv1 == expected
    assert sent1 == recv0 == expected


def _body_both_ways(ctx):
    other = 1 - ctx.rank
    tensors = [_random((3 << 20) + 4 * i + ctx.rank, torch.float32, 7 * i + ctx.rank) for i in range(4)]
    errors = []

    def loop(t):
        try:
            for _ in range(5):
                _check_same((t,), rpc_core.rpc_sync(other, _echo, args=(t,), timeout=60))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=loop, args=(t,)) for t in tensors]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return _cma_counters()


@pytest.mark.timeout(180)
def test_two_workers_echo_large_tensors_to_each_other_at_the_same_time():
    results = run_world(_body_both_ways, 2, timeout=150)
    for sent, received in results:
        assert sent > 0 and received > 0


# -- a peer that dies while we wait for its RELEASE ---------------------------------------------------
_STUCK_PEER = """
import socket, sys
sys.path.insert(0, sys.argv[3])
from rpc_core import transport
from rpc_core.protocol import wire
conn = transport.TCP.dial(("127.0.0.1", int(sys.argv[1])), sys.argv[2].encode(), timeout=30)
assert conn.cma_recv, "the peer cannot read our memory"
header = wire.FrameHeader(*wire.FRAME_HEADER.unpack(conn._read_small(wire.FRAME_HEADER.size)))
sys.stdout.write("got %d\\n" % header.nbuf)  # a frame by address arrived; never answer it
sys.stdout.flush()
sys.stdin.read()
"""


def _wait_line(proc, timeout):
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    assert sel.select(timeout), "the peer process did not report in time"
    return proc.stdout.readline()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reader", [False, True], ids=["sender-reads", "reader-thread"])
def test_sender_waiting_for_release_fails_promptly_when_the_peer_is_killed(reader):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(IO_TIMEOUT)
    proc = subprocess.Popen(
        [sys.executable, "-c", _STUCK_PEER, str(listener.getsockname()[1]), "s3cret", ROOT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        sock, _ = listener.accept()
        conn = stream.Connection(sock, handshake.run_acceptor(sock, b"s3cret", timeout=IO_TIMEOUT))
        assert conn.cma_send
        data = torch.ones(4 << 20, dtype=torch.uint8)
        with ThreadPoolExecutor(2) as pool:
            received = pool.submit(conn.recv) if reader else None  # like an agent's reader thread
            sent = pool.submit(conn.send, wire.REQUEST, 0, 1, b"", b"body", [storage_view(data.untyped_storage())])
            assert _wait_line(proc, IO_TIMEOUT) == "got 1\n"
            assert not sent.done()  # it waits for a RELEASE that never comes
            proc.kill()
            with pytest.raises(transport.PeerClosed, match="before the peer copied our buffers"):
                sent.result(IO_TIMEOUT)
            if reader:
                with pytest.raises(transport.PeerClosed):
                    received.result(IO_TIMEOUT)
        assert conn.bytes_cma_sent == 0
        conn.close()
    finally:
        proc.kill()
        proc.wait(IO_TIMEOUT)
        listener.close()


# -- descriptors from a lying peer ----------------------------------------------------------------------
@pytest.fixture
def pair():
    """Two ends of an authenticated connection in this process (which can read itself): the
    dialer's (whose socket the tests also write raw bytes to) and the acceptor's."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(IO_TIMEOUT)
    with ThreadPoolExecutor(1) as pool:

        def accept():
            s, _ = listener.accept()
            return stream.Connection(s, handshake.run_acceptor(s, b"k", timeout=IO_TIMEOUT))

        accepted = pool.submit(accept)
        dialed = transport.TCP.dial(listener.getsockname(), b"k", timeout=IO_TIMEOUT)
        a = accepted.result(IO_TIMEOUT)
    listener.close()
    assert a.cma_recv
    yield dialed, a
    dialed.close()
    a.close()


def _remote_frame(lens, addrs, token=1, body=b"b"):
    return (
        wire.pack_header(wire.REQUEST, wire.REMOTE, 0, len(body), 1, list(lens))
        + wire.pack_remote_table(token, list(addrs))
        + body
    )


def _maxrss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _guarded(n):
    """The address of ``n`` mapped bytes followed by a page nobody can read."""
    region = mmap.mmap(-1, n + mmap.PAGESIZE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    mprotect = ctypes.CDLL(None, use_errno=True).mprotect
    mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert mprotect(address + n, mmap.PAGESIZE, 0) == 0  # PROT_NONE
    return region, address


_region, _mapped = _guarded(1 << 20)  # 1 MB the "peer" really has, then nothing


@pytest.mark.parametrize(
    "lens, addrs, message",
    [
        ([1 << 20], [4096], "cannot copy the 1048576-byte buffer"),  # unmapped page
        ([100], [2**64 - 10], "wraps the address space"),
        ([60 << 30], [_mapped], "cannot (allocate|copy)"),  # 60 GB claimed, 1 MB there
        ([1 << 30], [_mapped], "cannot copy"),  # 1 GB claimed, 1 MB there
        ([2**62], [4096], "buffer length"),  # the stream's bounds hold for remote buffers
        ([wire.MAX_BUFFER_BYTES] * 2, [4096, 4096], "frame of"),
    ],
    ids=["unmapped", "wrapping", "absurd-length", "beyond-the-mapping", "over-the-bound", "total-over-the-bound"],
)
def test_lying_descriptor_is_a_protocol_error_and_allocates_nothing_lasting(pair, lens, addrs, message):
    raw, conn = pair
    before = _maxrss_mb()
    raw.sock.sendall(_remote_frame(lens, addrs))
    with pytest.raises(ProtocolError, match=message):
        conn.recv()
    assert conn.bytes_cma_received == 0
    assert _maxrss_mb() - before < 256
    # The connection is dead for good: a second recv does not read on from a broken stream.
    with pytest.raises(ProtocolError):
        conn.recv()


def test_frame_by_address_on_a_connection_that_cannot_read_the_peer_is_malformed():
    a, b = socket.socketpair()  # no handshake: nothing was proved
    conn = stream.Connection(b)
    with a:
        a.sendall(_remote_frame([1 << 20], [_mapped]))
        with pytest.raises(ProtocolError, match="cannot read the peer's memory"):
            conn.recv()
    conn.close()


@pytest.mark.parametrize(
    "raw, message",
    [
        (wire.pack_header(wire.RELEASE, 0, 0, 0, 12345, []), "RELEASE of token 12345"),
        (wire.pack_header(wire.RELEASE, 0, 0, 5, 1, []) + b"xxxxx", "RELEASE frame carries nothing"),
        (wire.pack_header(wire.RELEASE, 0, 0, 0, 1, [8]), "RELEASE frame carries nothing"),
    ],
    ids=["unknown-token", "with-body", "with-buffer"],
)
def test_unexpected_release_is_a_protocol_error(pair, raw, message):
    dialed, conn = pair
    dialed.sock.sendall(raw)
    with pytest.raises(ProtocolError, match=message):
        conn.recv()


def test_release_frames_are_consumed_by_the_transport_and_counters_count(pair):
    sender, conn = pair
    small = torch.arange(100, dtype=torch.uint8)
    large = _random((MIN + 1) // 4 * 4 + 4, torch.uint8, 5)
    views = [storage_view(t.untyped_storage()) for t in (small, large)]
    with ThreadPoolExecutor(1) as pool:
        # Nobody calls sender.recv(): the waiting send reads its RELEASE itself.
        sent = pool.submit(sender.send, wire.RESPONSE, wire.CONTROL, 7, b"h", b"body", views)
        h, head, body, storages = conn.recv()
        sent.result(IO_TIMEOUT)
        # The frame looks as if its buffers had been streamed; the next frame follows.
        assert (h.kind, h.flags, h.msg_id, head, body) == (wire.RESPONSE, wire.CONTROL, 7, b"h", b"body")
        assert [bytes(storage_view(s)) for s in storages] == [bytes(v) for v in views]
        assert sender.bytes_cma_sent == conn.bytes_cma_received == len(views[1])
        assert sender.bytes_sent >= len(views[0]) + len(views[1])
        # Frames the waiting sender read while it waited reach recv() in order.
        conn.send(wire.REQUEST, 0, 8, b"", b"first")
        sent = pool.submit(sender.send, wire.RESPONSE, 0, 9, b"", b"", [views[1]])
        assert conn.recv()[0].msg_id == 9
        sent.result(IO_TIMEOUT)
        assert sender.recv()[2] == b"first"
    assert sender.bytes_cma_sent == 2 * len(views[1])


# -- waiting for a parallel copy -----------------------------------------------------------------------
def _sender_yields_while_the_peer_copies(pair, monkeypatch, nbytes):
    """(How often the sending thread polled (each poll yields once) while it waited for the
    peer to copy an ``nbytes`` buffer, whether its connection's readers were told not to
    poll); the peer starts reading only once the sender waits."""
    sender, conn = pair
    tensor = _random(nbytes, torch.uint8, 3)  # keeps the memory the peer reads alive
    buf = storage_view(tensor.untyped_storage())
    yields, waiting, sender_thread, quiet = [], threading.Event(), [], []
    real_yield, real_await = os.sched_yield, sender._await_release
    monkeypatch.setattr(os, "sched_yield", lambda: (yields.append(threading.get_ident()), real_yield())[1])

    def await_release(token):
        sender_thread.append(threading.get_ident())
        quiet.append(sender._no_poll > 0)
        waiting.set()
        return real_await(token)

    sender._await_release = await_release
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(sender.send, wire.REQUEST, 0, 1, b"", b"", [buf])
        assert waiting.wait(IO_TIMEOUT)
        assert bytes(storage_view(conn.recv()[3][0])) == bytes(buf)
        sent.result(IO_TIMEOUT)
    return yields.count(sender_thread[0]), quiet[0]


@pytest.mark.skipif(not cma.parallel(8 << 20), reason="a single core: no copy is split across threads")
def test_a_sender_sleeps_rather_than_polls_while_the_peer_copies_its_buffer_with_several_threads(pair, monkeypatch):
    # Polling would hold a core the peer's second copy thread needs.
    assert _sender_yields_while_the_peer_copies(pair, monkeypatch, 8 << 20) == (0, True)


def test_a_sender_may_poll_while_the_peer_copies_a_buffer_one_thread_copies(pair, monkeypatch):
    assert not cma.parallel(MIN)
    # Whether it actually polls depends on who runs first; that it is allowed to does not.
    assert _sender_yields_while_the_peer_copies(pair, monkeypatch, MIN)[1] is False
