"""Connections: authenticated sockets (TCP, or Unix between same-host workers) that send and receive frames. Bytes only.

``dial`` and ``accept`` (from ``handshake``) run the handshake of ``wire``; ``Connection.send`` writes a frame
with one scatter-gather ``sendmsg`` straight from tensor memory; ``Connection.recv`` reads
frames through a small reusable buffer, but receives large tensor buffers directly into
freshly allocated tensor storage.

Between processes that proved they can read each other's memory (``cma``), large buffers
are not streamed at all: the frame names their addresses, the receiver copies them into
its fresh storage with one ``process_vm_readv`` and answers RELEASE, and ``send`` returns
only once that RELEASE arrived, so its caller may reuse the memory as after a plain write.
Whoever waits for a RELEASE while nobody else reads the socket reads it itself, queueing
the frames it meets for ``recv``; readers never block on the send lock (a RELEASE that
cannot be written at once is written by the current sender when it is done), so two
peers sending large frames to each other cannot deadlock.
"""
from __future__ import annotations

import collections
import ctypes
import itertools
import mmap
import os
import select
import socket
import threading
import time
from typing import Any, Callable, Deque, List, Optional, Sequence, Set, Tuple

import torch

from . import cma, handshake, knobs, wire
from .handshake import PeerClosed, accept, dial, tune  # noqa: F401 (re-exported: the transport's public face)
from .errors import ProtocolError
from .serialization import storage_view

_READ_CHUNK = 256 << 10
_DIRECT_READ = 64 << 10  # buffers at least this large are received straight into storage
_IOV_MAX = 512
# Buffers at least this large go by address when the connection allows it. Echo round
# trips of one float32 tensor, CMA vs TCP (GB/s, two runs): 64 KB 0.27-0.32 vs 0.31-0.38,
# 128 KB 0.57-0.63 vs 0.57, 256 KB 1.17-1.19 vs 0.88-1.00, 512 KB 1.91-2.19 vs 1.61-1.69:
# below ~128 KB the RELEASE frame and the remote page pinning cost more than TCP's copies.
_CMA_MIN = 256 << 10


# Busy-polling before blocking: a thread that sleeps in recv and is woken when bytes arrive
# pays a wake-up of tens of µs on a small VM (bare TCP ping-pong between two processes here:
# 59 µs blocking, 9 µs polling). So a reader whose recent waits on this socket were shorter
# than this budget polls the socket (yielding the CPU between polls) for up to the budget
# before it blocks. A reader whose waits are longer (an idle peer, a long computation on
# the other side) blocks at once, and so does one whose yield shows that another task
# wants the CPU (an oversubscribed machine). The budget covers a call whose callee
# computes for a millisecond or two (a small model's forward): ps_train's MLP 1+1 trained
# 15-16k samples/s with 200 µs and 18-20k with 2000 µs (e2e_bench --quick, alternating).
# RPC_CORE_SPIN_US=0 turns polling off; each connection reads it when it is made (knobs).
# A yield that took this long ran another task: the CPU is wanted, so stop polling.
_CONTENDED = 50e-6
_NOTHING = object()
_DONTWAIT = int(socket.MSG_DONTWAIT)  # plain ints: or-ing the enum flags costs µs per poll
_PEEK = _DONTWAIT | int(socket.MSG_PEEK)
_HUGE_ALLOC = 1 << 20  # buffers this large are advised for transparent huge pages
_HEADER = wire.FRAME_HEADER.size

# How a small tensor-free frame may wait in the queue instead of being written at once
# (``send``'s ``defer``); whoever next reads the socket writes the queue first, in one go.
DEFER_BATCH = 1  # the sender writes it with its next few (``flush_queued``/``frame_waiting``)
DEFER_ANSWER = 2  # an answer, while the reader has the next frame's bytes buffered already


def _same(e: BaseException) -> BaseException:
    return e


def _poll(end: float, attempt: Callable[[], Any]) -> Any:
    """Retry the non-blocking ``attempt`` until it stops raising BlockingIOError and return
    its result; ``_NOTHING`` once past ``end`` (perf_counter) or once a yield between tries
    shows that another task was waiting for this CPU (polling would take its time)."""
    while True:
        now = time.perf_counter()
        if now > end:
            return _NOTHING
        os.sched_yield()
        if time.perf_counter() - now > _CONTENDED:
            return _NOTHING
        try:
            return attempt()
        except BlockingIOError:
            pass


def _load_madvise() -> Optional[Callable[[int, int, int], int]]:
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


_madvise = _load_madvise()
_HUGE_PAGE = 2 << 20


def new_storage(n: int) -> torch.UntypedStorage:
    """Fresh storage for ``n`` received bytes: an ordinary torch storage (resizable, like any
    tensor's), never initialised, so its pages are only touched as bytes arrive.

    A large receive is dominated by page faults on fresh memory, not by the copy: advising
    the storage's 2 MiB-aligned interior for transparent huge pages takes one fault per
    2 MiB instead of one per 4 KiB (about 3x faster here for 64 MB).
    """
    st = torch.UntypedStorage(n)
    if n >= _HUGE_ALLOC and _madvise is not None:
        start = st.data_ptr()
        lo = -(-start // _HUGE_PAGE) * _HUGE_PAGE
        hi = (start + n) // _HUGE_PAGE * _HUGE_PAGE
        if hi > lo:
            _madvise(lo, hi - lo, mmap.MADV_HUGEPAGE)  # best effort: THP may be off
    return st


def _address(b: memoryview) -> int:
    """Where a buffer's bytes live, or 0 if it cannot go by address (read-only or not
    contiguous: rpc_core's own tensor views never are)."""
    if b.readonly or not b.c_contiguous:
        return 0
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(b))
    except (TypeError, ValueError):
        return 0


class Connection:
    """One authenticated socket. ``send`` is thread-safe; ``recv`` serves one caller at a
    time (concurrent callers queue), from any thread.

    ``bytes_sent`` / ``bytes_received`` count frame bytes however they travelled;
    ``bytes_cma_sent`` / ``bytes_cma_received`` the part that went by cross-memory attach.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self._buf = bytearray(_READ_CHUNK)
        self._view = memoryview(self._buf)
        # The read buffer's address, for copying a small buffered tensor into its storage in
        # one memmove (the bytearray is never resized; the ctypes export pins it).
        self._buf_export = ctypes.c_char.from_buffer(self._buf)
        self._buf_addr = ctypes.addressof(self._buf_export)
        self._start = 0
        self._end = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.bytes_cma_sent = 0
        self.bytes_cma_received = 0
        link = handshake.take_link(sock)
        self.peer_pid = link.peer_pid if link else 0
        self.cma_send = bool(link and link.send)
        self.cma_recv = bool(link and link.recv)
        # Reader role and RELEASE bookkeeping, all under _lock. Threads that wait for the role
        # (or a RELEASE, or a frame read by someone else) wait on _state and are counted in
        # _role_waiters: a reader gives the role back once per frame, and waking nobody
        # through Condition.notify_all costs more than the rest of that hand-back.
        self._lock = threading.Lock()
        self._state = threading.Condition(self._lock)
        self._role_waiters = 0
        self._reading = False  # someone is reading the socket (recv, or a sender awaiting RELEASE)
        self._inbox: Deque[tuple] = collections.deque()  # frames a waiting sender read for recv
        # recv's "done" test for _take_role, built once (recv runs for every frame)
        self._next_queued = lambda: self._inbox.popleft() if self._inbox else _NOTHING
        self._failed: Optional[BaseException] = None  # the connection is unusable, and why
        self._tokens = itertools.count(1)
        self._outstanding: Set[int] = set()  # tokens sent, RELEASE not yet read
        self._released: Set[int] = set()  # RELEASE read, sender not yet woken
        # Small whole frames waiting to be written by whoever next can: RELEASEs (a reader
        # must not wait for the send lock) and deferred requests (see send).
        self._small_q: Deque[bytes] = collections.deque()
        self._reader_sleeps = False  # a reader is (about to be) blocked in the kernel
        self._spin = knobs.spin_seconds()  # the polling budget (s), read once per connection
        self._wait_estimate = 0.0  # moving average of recent waits for bytes (s); decides polling
        # Sends whose buffers the peer is copying with several threads: while any is
        # outstanding, readers sleep instead of polling, which would take a core from the
        # peer's copy (16 MB echo: the return copy 1.29 -> 0.88 ms).
        self._no_poll = 0

    # -- send ---------------------------------------------------------------------------
    def send(self, kind: int, flags: int, msg_id: int, head: bytes, body: bytes, buffers: Sequence[memoryview] = (),
             defer: int = 0) -> None:
        """Write one frame. ``defer`` (a ``DEFER_*`` mode): a small tensor-free frame may
        instead be queued, and whoever next reads the socket writes everything queued in one
        go before it waits for bytes (a burst of ``rpc_async`` calls, or of their answers,
        then costs a few writes, not one each). The caller promises that some thread keeps
        reading this connection until the frame's answer arrives (``DEFER_BATCH``: or that
        it writes the queue itself soon); frames keep their order either way."""
        if not buffers and len(body) < _DIRECT_READ:
            # The common small message (no tensors): one write of one bytes object.
            data = wire.pack_header(kind, flags, len(head), len(body), msg_id, ()) + head + body
            # A batched frame is written at once if a reader sleeps in the kernel: it would
            # not write the queue before the frame's answer came, which needs the frame.
            if defer and ((self._end - self._start >= _HEADER) if defer == DEFER_ANSWER else not self._reader_sleeps):
                self._small_q.append(data)
                if self._reader_sleeps and defer != DEFER_ANSWER:
                    self._flush_small()  # a reader went to sleep meanwhile: write it ourselves
                return
            with self._send_lock:
                if self._small_q:
                    data = self._take_small() + data  # queued frames first: order is kept
                self.sock.sendall(data)
                self.bytes_sent += len(data)
            if self._small_q:
                self._flush_small()
            return
        addrs = [_address(b) if len(b) >= _CMA_MIN else 0 for b in buffers] if self.cma_send else ()
        if not any(addrs):
            header = wire.pack_header(kind, flags, len(head), len(body), msg_id, [len(b) for b in buffers])
            self._write(header, head, body, buffers)
            return
        token = next(self._tokens)
        remote = sum(len(b) for b, a in zip(buffers, addrs) if a)
        quiet = cma.parallel(remote)
        with self._lock:
            if self._failed is not None:
                raise PeerClosed(f"connection failed earlier: {self._failed}")
            self._outstanding.add(token)
            self._no_poll += quiet
        try:
            header = wire.pack_header(kind, flags | wire.REMOTE, len(head), len(body), msg_id,
                                      [len(b) for b in buffers]) + wire.pack_remote_table(token, addrs)
            self._write(header, head, body, [b for b, a in zip(buffers, addrs) if not a])
            self._await_release(token)
        finally:
            with self._lock:
                self._outstanding.discard(token)
                self._released.discard(token)
                self._no_poll -= quiet
        with self._send_lock:
            self.bytes_sent += remote
            self.bytes_cma_sent += remote

    def _write(self, header: bytes, head: bytes, body: bytes, buffers: Sequence[memoryview]) -> None:
        small = len(body) + sum(len(b) for b in buffers) < _DIRECT_READ
        if small:
            # One contiguous write: copying a few KB costs less than a gather write, whose
            # segments loopback TCP delivers (and wakes the reader for) one by one.
            parts: List[memoryview] = [memoryview(b"".join([header, head, body, *buffers]))]
        else:
            parts = [memoryview(header + head), memoryview(body)] if len(body) >= _DIRECT_READ else [
                memoryview(header + head + body)]
            parts.extend(b for b in buffers if len(b))
        with self._send_lock:
            if self._small_q:
                parts.insert(0, memoryview(self._take_small()))  # queued frames first: order is kept
            total = sum(len(p) for p in parts)
            if len(parts) == 1:
                self.sock.sendall(parts[0])
            else:
                self._sendmsg_all(parts)
            self.bytes_sent += total
        if self._small_q:
            self._flush_small()

    def _sendmsg_all(self, parts: List[memoryview]) -> None:
        i = 0
        while i < len(parts):
            sent = self.sock.sendmsg(parts[i : i + _IOV_MAX])
            while sent:
                n = len(parts[i])
                if sent >= n:
                    sent -= n
                    i += 1
                else:
                    parts[i] = parts[i][sent:]
                    sent = 0

    def _take_small(self) -> bytes:
        """All queued small frames, in order (send lock held)."""
        q = self._small_q
        return q.popleft() if len(q) == 1 else b"".join([q.popleft() for _ in range(len(q))])

    def flush_queued(self) -> None:
        """Write the queued small frames now (unless another thread is writing: it does)."""
        if self._small_q:
            self._flush_small()

    def _flush_small(self) -> None:
        """Write the queued small frames if the send lock is free; if it is not, its holder
        calls this again after its frame (it checks the queue after letting go of the lock,
        so nothing queued is left behind). Never waits for the lock: readers call this."""
        while self._small_q:
            if not self._send_lock.acquire(blocking=False):
                return
            try:
                data = self._take_small()
                self.sock.sendall(data)
                self.bytes_sent += len(data)
            except OSError as e:
                # The stream is broken (maybe mid-frame): make sure both ends see it closed.
                self._fail(PeerClosed(f"could not write queued frames: {e}"))
                try:
                    self.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return
            finally:
                self._send_lock.release()

    def _await_release(self, token: int) -> None:
        """Return once the peer released ``token``; raise PeerClosed if the connection fails
        first. Reads the socket itself while nobody else does."""
        if self._take_role(lambda: True if token in self._released else _NOTHING, lambda e: PeerClosed(
                f"the connection failed before the peer copied our buffers: {e}")) is not _NOTHING:
            return
        try:
            while True:
                frame = self._read_frame()
                with self._lock:
                    if frame is not None:
                        self._inbox.append(frame)
                        self._wake_waiters()
                    if token in self._released:
                        return
        except BaseException as e:
            self._fail(e)
            if isinstance(e, (OSError, ProtocolError)):
                raise PeerClosed(f"the connection failed before the peer copied our buffers: {e}") from e
            raise
        finally:
            self._drop_role()

    def _take_role(self, done: Callable[[], Any], failed: Callable[[BaseException], BaseException]) -> Any:
        """Wait until ``done()`` has a result (returned) or this thread may read the socket
        (``_NOTHING`` returned: the reading role is now held, ``_drop_role`` gives it back);
        raise ``failed(reason)`` if the connection failed first."""
        with self._lock:
            while True:
                result = done()
                if result is not _NOTHING:
                    return result
                if self._failed is not None:
                    raise failed(self._failed)
                if not self._reading:
                    self._reading = True
                    return _NOTHING
                self._role_waiters += 1
                try:
                    self._state.wait()
                finally:
                    self._role_waiters -= 1

    def _drop_role(self) -> None:
        with self._lock:
            self._reading = False
            self._wake_waiters()

    def _wake_waiters(self) -> None:
        # _lock held.
        if self._role_waiters:
            self._state.notify_all()

    def _fail(self, e: BaseException) -> None:
        with self._lock:
            if self._failed is None:
                self._failed = e
            self._state.notify_all()

    # -- recv ---------------------------------------------------------------------------
    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            # Move the partial frame to the front to make room.
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start : self._end]
            self._start, self._end = 0, n
        k = self._recv_into(self._view[self._end :])
        if k == 0:
            raise PeerClosed("peer closed the connection")
        self._end += k
        self.bytes_received += k

    def _read_into(self, dst: memoryview) -> None:
        n = len(dst)
        have = self._end - self._start
        take = min(have, n)
        if take:
            dst[:take] = self._view[self._start : self._start + take]
            self._start += take
        pos = take
        while pos < n:
            if n - pos >= _DIRECT_READ:
                k = self._recv_into(dst[pos:])
                if k == 0:
                    raise PeerClosed("peer closed the connection mid-frame (truncated frame)")
                self.bytes_received += k
                pos += k
            else:
                self._fill()
                take = min(self._end - self._start, n - pos)
                dst[pos : pos + take] = self._view[self._start : self._start + take]
                self._start += take
                pos += take

    def _recv_into(self, view: memoryview) -> int:
        """``sock.recv_into(view)``; polls first when recent waits were short (see self._spin).
        Queued frames go out first: their answers may be what this read waits for."""
        if self._small_q:
            self._flush_small()
        if self.sock.gettimeout() is not None:  # a timed socket: the handshake's, not ours
            return self.sock.recv_into(view)
        if not self._spin:
            self._before_sleep()  # queued frames go out before this thread blocks
            try:
                return self.sock.recv_into(view)
            finally:
                self._reader_sleeps = False
        try:
            return self.sock.recv_into(view, 0, _DONTWAIT)
        except BlockingIOError:
            pass
        start = time.perf_counter()
        k = _NOTHING
        if self._may_poll():
            k = _poll(start + self._spin, lambda: self._try_recv_into(view))
        if k is _NOTHING:
            self._before_sleep()
            try:
                k = self.sock.recv_into(view)
            finally:
                self._reader_sleeps = False
        self._note_wait(time.perf_counter() - start)
        return k

    def _may_poll(self) -> bool:
        """Whether a reader polls before it sleeps: recent waits were short, and no peer is
        copying our buffers with several threads."""
        return self._wait_estimate < self._spin and not self._no_poll

    def _try_recv_into(self, view: memoryview) -> int:
        if self._small_q:
            self._flush_small()  # queued requests may be what the awaited answers wait for
        return self.sock.recv_into(view, 0, _DONTWAIT)

    def _before_sleep(self) -> None:
        # Flag first, then look at the queue: a deferring sender that queued after this look
        # sees the flag and writes its frame itself.
        self._reader_sleeps = True
        if self._small_q:
            self._flush_small()

    def _note_wait(self, seconds: float) -> None:
        # An exponential moving average: a few long waits in a row switch polling off, a
        # few short ones switch it back on.
        self._wait_estimate += (seconds - self._wait_estimate) * 0.25

    def _poll_spin(self, start: float, timeout: float) -> bool:
        """Whether bytes arrived while polling for up to ``min(self._spin, timeout)`` seconds."""
        if not self._spin or self.sock.gettimeout() is not None or not self._may_poll():
            return False
        try:
            if _poll(start + min(self._spin, timeout), self._try_peek) is _NOTHING:
                return False
        except OSError:
            return True  # broken: recv says how
        self._note_wait(time.perf_counter() - start)
        return True

    def _try_peek(self) -> bytes:
        if self._small_q:
            self._flush_small()
        return self.sock.recv(1, _PEEK)

    def _read_small(self, n: int) -> bytes:
        while self._end - self._start < n:
            if len(self._buf) - self._start < n:
                out = bytearray(n)
                self._read_into(memoryview(out))
                return bytes(out)
            self._fill()
        out = bytes(self._view[self._start : self._start + n])
        self._start += n
        return out

    def frame_waiting(self) -> bool:
        """Whether ``recv`` can start on a frame without waiting for bytes: one is read or
        buffered, or bytes arrived (this reads them into the buffer, never blocking). Writes
        the queued frames first. False while another thread reads this connection."""
        if self._inbox or self._end - self._start >= _HEADER:
            return True
        self.flush_queued()
        with self._lock:
            if self._reading:
                return False
            self._reading = True
        try:
            if self._start == self._end:
                self._start = self._end = 0
            elif self._end == len(self._buf):
                return True  # a partial frame fills the buffer: recv makes room
            try:
                k = self.sock.recv_into(self._view[self._end :], 0, _DONTWAIT)
            except BlockingIOError:
                return False
            except OSError:
                return True  # broken: recv says how
            if k:
                self._end += k
                self.bytes_received += k
            return True  # k == 0 is the peer's end: recv raises PeerClosed
        finally:
            self._drop_role()

    def poll(self, timeout: Optional[float]) -> bool:
        """Whether ``recv`` may have a frame to start on within ``timeout`` seconds: bytes
        are buffered or queued, or the socket became readable (or broke: ``recv`` says how)."""
        if self._inbox or self._end > self._start:
            return True
        start = time.perf_counter()
        if timeout and self._poll_spin(start, timeout):
            return True
        try:
            if timeout:
                self._before_sleep()
            readable, _, _ = select.select([self.sock], [], [], timeout)
        except (OSError, ValueError):
            return True
        finally:
            self._reader_sleeps = False
        if readable and timeout:
            self._note_wait(time.perf_counter() - start)
        return bool(readable)

    def recv(self) -> Tuple[wire.FrameHeader, bytes, bytes, List[torch.UntypedStorage]]:
        """Read one frame. Raises PeerClosed on EOF, ProtocolError on malformed bytes.
        RELEASE frames are the transport's own: they are handled here, never returned."""
        queued = self._take_role(self._next_queued, _same)
        if queued is not _NOTHING:
            return queued
        try:
            while True:
                frame = self._read_frame()
                if frame is not None:
                    return frame
        except TimeoutError:
            raise  # the caller's socket timeout: its call, not a broken connection
        except BaseException as e:
            self._fail(e)
            raise
        finally:
            self._drop_role()

    def _read_frame(self) -> Optional[Tuple[wire.FrameHeader, bytes, bytes, List[torch.UntypedStorage]]]:
        """Read the next frame off the socket; None if it was a RELEASE (handled here)."""
        h = wire.unpack_header(self._read_small(wire.FRAME_HEADER.size))
        try:
            wire.check_header(h)
        except ValueError as e:
            raise ProtocolError(f"malformed frame header: {e}") from None
        if h.kind == wire.RELEASE:
            with self._lock:
                if h.msg_id not in self._outstanding:
                    raise ProtocolError(f"RELEASE of token {h.msg_id}, which names no frame we sent by address")
                self._outstanding.discard(h.msg_id)
                self._released.add(h.msg_id)
                self._wake_waiters()
            return None
        lens: tuple = ()
        if h.nbuf:
            lens = wire.unpack_buffer_lens(self._read_small(wire.BUFFER_LEN.size * h.nbuf), h.nbuf)
            try:
                wire.check_buffer_lens(lens, h)
            except ValueError as e:
                raise ProtocolError(f"malformed frame: {e}") from None
        addrs: tuple = ()
        token = 0
        if h.flags & wire.REMOTE:
            if not self.cma_recv:
                raise ProtocolError("frame sends buffers by address, but this connection cannot read the peer's memory")
            token, addrs = wire.unpack_remote_table(self._read_small(wire.TOKEN.size * (1 + h.nbuf)), h.nbuf)
            try:
                wire.check_remote_table(addrs, lens)
            except ValueError as e:
                raise ProtocolError(f"malformed frame: {e}") from None
            h = h._replace(flags=h.flags & ~wire.REMOTE)  # how the buffers came is our business
        head = self._read_small(h.head_len) if h.head_len else b""
        if h.body_len < _READ_CHUNK:
            body = self._read_small(h.body_len)
        else:
            # Large bodies grow as bytes arrive, so a lying length cannot reserve memory.
            body = self._read_growing(h.body_len)
        storages = []
        for i, n in enumerate(lens):
            try:
                st = new_storage(n)  # uninitialised: pages are only touched as bytes arrive
            except (RuntimeError, MemoryError, OSError) as e:
                raise ProtocolError(
                    f"cannot allocate the {n}-byte tensor buffer the peer announced ({e.__class__.__name__}); "
                    "dropping the connection"
                ) from None
            if n and addrs and addrs[i]:
                try:
                    cma.read(self.peer_pid, addrs[i], st.data_ptr(), n)
                except OSError as e:
                    raise ProtocolError(f"cannot copy the {n}-byte buffer the peer announced at {addrs[i]:#x}: {e}") from None
                self.bytes_received += n
                self.bytes_cma_received += n
            elif n:
                if self._end - self._start >= n:  # already in the read buffer (a small frame)
                    ctypes.memmove(st.data_ptr(), self._buf_addr + self._start, n)
                    self._start += n
                else:
                    self._read_into(storage_view(st))
            storages.append(st)
        if addrs:
            self._small_q.append(wire.pack_header(wire.RELEASE, 0, 0, 0, token, []))
            self._flush_small()
        return h, head, body, storages

    def _read_growing(self, n: int) -> bytes:
        parts = []
        remaining = n
        while remaining:
            chunk = bytearray(min(remaining, 16 << 20))
            self._read_into(memoryview(chunk))
            parts.append(chunk)
            remaining -= len(chunk)
        return b"".join(parts)

    def close(self) -> None:
        self._fail(PeerClosed("connection closed"))
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
