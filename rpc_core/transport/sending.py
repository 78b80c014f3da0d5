"""Writing frames: one scatter-gather write straight from tensor memory, small frames
batched, and large buffers handed over by address between processes that may read each
other's memory.

A small tensor-free frame may wait in a queue (``send``'s ``defer``) instead of being
written at once; whoever next reads the socket writes the queue first, in one go, so a
burst of calls or answers costs a few writes, not one each. Readers never block on the
send lock: a RELEASE (or any queued frame) that cannot be written at once is written by
the current sender when it is done, so two peers sending large frames to each other
cannot deadlock.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import socket
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ProtocolError
from ..protocol import wire
from . import cma
from .base import DEFER_ANSWER
from .buffers import DIRECT_READ
from .handshake import PeerClosed
from .polling import NOTHING

if TYPE_CHECKING:
    import torch

_IOV_MAX = 512
_HEADER = wire.FRAME_HEADER.size
# Buffers at least this large go by address when the connection allows it. Echo round
# trips of one float32 tensor, CMA vs TCP (GB/s, two runs): 64 KB 0.27-0.32 vs 0.31-0.38,
# 128 KB 0.57-0.63 vs 0.57, 256 KB 1.17-1.19 vs 0.88-1.00, 512 KB 1.91-2.19 vs 1.61-1.69:
# below ~128 KB the RELEASE frame and the remote page pinning cost more than TCP's copies.
CMA_MIN = 256 << 10


def _address(b: memoryview) -> int:
    """Where a buffer's bytes live, or 0 if it cannot go by address (read-only or not
    contiguous: rpc_core's own tensor views never are)."""
    if b.readonly or not b.c_contiguous:
        return 0
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(b))
    except (TypeError, ValueError):
        return 0


class Sender:
    """A connection's sending side (a mixin of ``stream.Connection``, whose state it
    shares, and whose reader role (``_take_role``, ``_read_frame``) a sender takes while it
    waits for a RELEASE: a mixin rather than a helper object, as this runs for every frame)."""

    sock: socket.socket
    bytes_sent: int
    bytes_cma_sent: int
    cma_send: bool
    _start: int
    _end: int
    _reader_sleeps: bool
    _no_poll: int
    _lock: threading.Lock
    _inbox: collections.deque[tuple[Any, ...]]
    _failed: BaseException | None
    _outstanding: set[int]
    _released: set[int]

    if TYPE_CHECKING:  # stream.Connection's: its reader role and failure

        def _take_role(self, done: Callable[[], Any], failed: Callable[[BaseException], BaseException]) -> Any: ...
        def _read_frame(self) -> tuple[wire.FrameHeader, bytes, bytes, list[torch.UntypedStorage]] | None: ...
        def _drop_role(self) -> None: ...
        def _wake_waiters(self) -> None: ...
        def _fail(self, e: BaseException) -> None: ...

    def _init_sender(self) -> None:
        self._send_lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_cma_sent = 0
        self._tokens = itertools.count(1)
        # Small whole frames waiting to be written by whoever next can: RELEASEs (a reader
        # must not wait for the send lock) and deferred requests (see send).
        self._small_q: collections.deque[bytes] = collections.deque()

    def send(
        self,
        kind: int,
        flags: int,
        msg_id: int,
        head: bytes,
        body: bytes,
        buffers: Sequence[memoryview] = (),
        defer: int = 0,
    ) -> None:
        """Write one frame. ``defer`` (a ``DEFER_*`` mode): a small frame may
        instead be queued, and whoever next reads the socket writes everything queued in one
        go before it waits for bytes (a burst of ``rpc_async`` calls, or of their answers,
        then costs a few writes, not one each). The caller promises that some thread keeps
        reading this connection until the frame's answer arrives (``DEFER_BATCH``: or that
        it writes the queue itself soon); frames keep their order either way."""
        if not buffers:
            small = len(body) < DIRECT_READ
            data = wire.pack_header(kind, flags, len(head), len(body), msg_id, ()) + head + body if small else b""
        else:
            # A few small tensors (below DIRECT_READ, so none goes by address): copied into the
            # frame's one bytes object like a tensor-free message. Copying a few KB costs less
            # than a gather write, and the frame may then wait in the queue as any other.
            lens = [len(b) for b in buffers]
            small = len(body) + sum(lens) < DIRECT_READ
            header = wire.pack_header(kind, flags, len(head), len(body), msg_id, lens) if small else b""
            data = b"".join([header, head, body, *buffers]) if small else b""
        if small:
            # The common small message: one write of one bytes object.
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
        addrs = [_address(b) if len(b) >= CMA_MIN else 0 for b in buffers] if self.cma_send else ()
        if not any(addrs):
            header = wire.pack_header(kind, flags, len(head), len(body), msg_id, [len(b) for b in buffers])
            self._write(header, head, body, buffers)
            return
        token = next(self._tokens)
        remote = sum(len(b) for b, a in zip(buffers, addrs, strict=True) if a)
        quiet = cma.parallel(remote)
        with self._lock:
            if self._failed is not None:
                raise PeerClosed(f"connection failed earlier: {self._failed}")
            self._outstanding.add(token)
            self._no_poll += quiet
        try:
            header = wire.pack_header(
                kind, flags | wire.REMOTE, len(head), len(body), msg_id, [len(b) for b in buffers]
            ) + wire.pack_remote_table(token, addrs)
            self._write(header, head, body, [b for b, a in zip(buffers, addrs, strict=True) if not a])
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
        small = len(body) + sum(len(b) for b in buffers) < DIRECT_READ
        if small:
            # One contiguous write: copying a few KB costs less than a gather write, whose
            # segments loopback TCP delivers (and wakes the reader for) one by one.
            parts: list[memoryview] = [memoryview(b"".join([header, head, body, *buffers]))]
        else:
            parts = (
                [memoryview(header + head), memoryview(body)]
                if len(body) >= DIRECT_READ
                else [memoryview(header + head + body)]
            )
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

    def _sendmsg_all(self, parts: list[memoryview]) -> None:
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
        if (
            self._take_role(
                lambda: True if token in self._released else NOTHING,
                lambda e: PeerClosed(f"the connection failed before the peer copied our buffers: {e}"),
            )
            is not NOTHING
        ):
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
