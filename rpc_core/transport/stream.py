"""A connection over a stream socket (TCP, or Unix between same-host workers): frames sent
and received. Bytes only. Both socket transports (``tcp``, ``unix``) make theirs with it.

``Connection.send`` writes a frame with one scatter-gather ``sendmsg`` straight from tensor
memory; ``Connection.recv`` reads frames through a small reusable buffer, but receives
large tensor buffers directly into freshly allocated tensor storage.

Between processes that proved they can read each other's memory (``cma``), large buffers
are not streamed at all: the frame names their addresses, the receiver copies them into
its fresh storage with one ``process_vm_readv`` and answers RELEASE, and ``send`` returns
only once that RELEASE arrived, so its caller may reuse the memory as after a plain write.
Whoever waits for a RELEASE while nobody else reads the socket reads it itself, queueing
the frames it meets for ``recv``; readers never block on the send lock (a RELEASE that
cannot be written at once is written by the current sender when it is done), so two
peers sending large frames to each other cannot deadlock.

The connection is put together from one module per concern: ``sending`` (writing frames,
deferral, RELEASE waits), ``polling`` (how a reader waits for bytes), ``buffers`` (the read
buffer and fresh tensor storage); this module holds the reader role and frame parsing.
"""

from __future__ import annotations

import collections
import ctypes
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import torch

from .. import knobs
from ..errors import ProtocolError
from ..protocol import wire
from ..protocol.serialization import storage_view
from . import cma
from .base import Capabilities
from .buffers import READ_CHUNK, ReadBuffer, new_storage
from .handshake import NO_LINK, Link, PeerClosed
from .polling import DONTWAIT, NOTHING, Waiting
from .sending import Sender

_HEADER = wire.FRAME_HEADER.size


_SOCK_BUF = 4 << 20
_ABORT = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets and drops what is queued


def tune_buffers(sock: socket.socket) -> None:
    """Large kernel buffers both ways: a large frame takes fewer wake-ups of either side."""
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)
        except OSError:
            pass


# A fresh, ordinary (resizable) storage holding a copy of a small buffered tensor buffer.
_storage_from = torch.UntypedStorage.from_buffer
_BYTE = torch.uint8


def _same(e: BaseException) -> BaseException:
    return e


def _checked_lens(lens: tuple[int, ...], h: wire.FrameHeader) -> tuple[int, ...]:
    """A frame's buffer lengths, refused (``ProtocolError``) when they do not fit its header."""
    try:
        wire.check_buffer_lens(lens, h)
    except ValueError as e:
        raise ProtocolError(f"malformed frame: {e}") from None
    return lens


def _no_room(n: int, e: BaseException) -> ProtocolError:
    """The error for a tensor buffer of ``n`` bytes that could not be allocated."""
    return ProtocolError(
        f"cannot allocate the {n}-byte tensor buffer the peer announced ({e.__class__.__name__}); "
        "dropping the connection"
    )


class Connection(Sender, Waiting, ReadBuffer):
    """One authenticated stream socket (a ``base.Connection``). ``send`` is thread-safe;
    ``recv`` serves one caller at a time (concurrent callers queue), from any thread.

    ``bytes_sent`` / ``bytes_received`` count frame bytes however they travelled;
    ``bytes_cma_sent`` / ``bytes_cma_received`` the part that went by cross-memory attach.
    ``link``: what the handshake found (``NO_LINK``: no handshake ran, as on tests' socket
    pairs); ``kind``, ``peer``: the transport's name and the peer's, for statistics and messages.
    """

    def __init__(
        self,
        sock: socket.socket,
        link: Link = NO_LINK,
        kind: str = "tcp",
        peer: str = "",
        capabilities: Capabilities | None = None,
    ) -> None:
        self.sock = sock
        self.kind = kind
        self.peer = peer
        name = sock.getsockname()
        self.local_host: str = name[0] if isinstance(name, tuple) else "localhost"
        self._init_sender()
        self._init_read_buffer()
        self.bytes_received = 0
        self.bytes_cma_received = 0
        self.peer_pid = link.peer_pid
        self.cma_send = link.send
        self.cma_recv = link.recv
        self.capabilities = (
            capabilities if capabilities is not None else Capabilities(link.send or link.recv, link.send, link.recv)
        )
        # Reader role and RELEASE bookkeeping, all under _lock. Threads that wait for the role
        # (or a RELEASE, or a frame read by someone else) wait on _state and are counted in
        # _role_waiters: a reader gives the role back once per frame, and waking nobody
        # through Condition.notify_all costs more than the rest of that hand-back.
        self._lock = threading.Lock()
        self._state = threading.Condition(self._lock)
        self._role_waiters = 0
        self._reading = False  # someone is reading the socket (recv, or a sender awaiting RELEASE)
        self._inbox: collections.deque[tuple[Any, ...]] = collections.deque()  # frames a waiting sender read for recv
        # recv's "done" test for _take_role, built once (recv runs for every frame)
        self._next_queued = lambda: self._inbox.popleft() if self._inbox else NOTHING
        self._failed: BaseException | None = None  # the connection is unusable, and why
        self._outstanding: set[int] = set()  # tokens sent, RELEASE not yet read
        self._released: set[int] = set()  # RELEASE read, sender not yet woken
        self._reader_sleeps = False  # a reader is (about to be) blocked in the kernel
        # Read once per connection, not per wait (see polling).
        self._spin = knobs.spin_seconds()
        self._wait_estimate = 0.0  # moving average of recent waits for bytes (s); decides polling
        # Sends whose buffers the peer is copying with several threads: while any is
        # outstanding, readers sleep instead of polling, which would take a core from the
        # peer's copy (16 MB echo: the return copy 1.29 -> 0.88 ms).
        self._no_poll = 0

    def _take_role(self, done: Callable[[], Any], failed: Callable[[BaseException], BaseException]) -> Any:
        """Wait until ``done()`` has a result (returned) or this thread may read the socket
        (``NOTHING`` returned: the reading role is now held, ``_drop_role`` gives it back);
        raise ``failed(reason)`` if the connection failed first."""
        with self._lock:
            while True:
                result = done()
                if result is not NOTHING:
                    return result
                if self._failed is not None:
                    raise failed(self._failed)
                if not self._reading:
                    self._reading = True
                    return NOTHING
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
                k = self.sock.recv_into(self._view[self._end :], 0, DONTWAIT)
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

    def recv(self) -> tuple[wire.FrameHeader, bytes, bytes, list[torch.UntypedStorage]]:
        """Read one frame. Raises PeerClosed on EOF, ProtocolError on malformed bytes.
        RELEASE frames are the transport's own: they are handled here, never returned."""
        queued = self._take_role(self._next_queued, _same)
        if queued is not NOTHING:
            got: tuple[wire.FrameHeader, bytes, bytes, list[torch.UntypedStorage]] = queued
            return got
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

    def _read_frame(self) -> tuple[wire.FrameHeader, bytes, bytes, list[torch.UntypedStorage]] | None:
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
        if not h.flags & wire.REMOTE and h.body_len < READ_CHUNK:
            frame = self._take_buffered(h)
            if frame is not None:
                return frame
        lens: tuple[int, ...] = ()
        if h.nbuf:
            lens = _checked_lens(wire.unpack_buffer_lens(self._read_small(wire.BUFFER_LEN.size * h.nbuf), h.nbuf), h)
        addrs: tuple[int, ...] = ()
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
        if h.body_len < READ_CHUNK:
            body = self._read_small(h.body_len)
        else:
            # Large bodies grow as bytes arrive, so a lying length cannot reserve memory.
            body = self._read_growing(h.body_len)
        storages = []
        for i, n in enumerate(lens):
            try:
                st = new_storage(n)  # uninitialised: pages are only touched as bytes arrive
            except (RuntimeError, MemoryError, OSError) as e:
                raise _no_room(n, e) from None
            if n and addrs and addrs[i]:
                try:
                    cma.read(self.peer_pid, addrs[i], st.data_ptr(), n)
                except OSError as e:
                    raise ProtocolError(
                        f"cannot copy the {n}-byte buffer the peer announced at {addrs[i]:#x}: {e}"
                    ) from None
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

    def _take_buffered(
        self, h: wire.FrameHeader
    ) -> tuple[wire.FrameHeader, bytes, bytes, list[torch.UntypedStorage]] | None:
        """The rest of the frame after header ``h`` (not REMOTE) if the read buffer holds all
        of it (a small frame, as most calls and answers are), else None with nothing consumed.
        Each part is sliced from the buffer where it lies, and each tensor buffer copied into
        its new storage by one torch call: a frame with tensors takes no more Python steps
        than one without, where reading part by part cost a small call ~10% of its time."""
        start = self._start
        avail = self._end - start
        nbuf = h.nbuf
        pos = start + wire.BUFFER_LEN.size * nbuf
        end = pos + h.head_len + h.body_len
        if end - start > avail:
            return None
        lens: tuple[int, ...] = ()
        if nbuf:
            lens = _checked_lens(wire.buffer_lens_struct(nbuf).unpack_from(self._buf, start), h)
            if end + sum(lens) - start > avail:
                return None
        view = self._view
        head = bytes(view[pos : pos + h.head_len]) if h.head_len else b""
        pos += h.head_len
        body = bytes(view[pos : pos + h.body_len])
        pos += h.body_len
        storages = []
        for n in lens:
            try:
                storages.append(_storage_from(view[pos : pos + n], dtype=_BYTE))
            except (RuntimeError, MemoryError) as e:
                raise _no_room(n, e) from None
            pos += n
        self._start = pos
        return h, head, body, storages

    def set_recv_timeout(self, seconds: float | None) -> None:
        self.sock.settimeout(seconds)

    def close(self) -> None:
        self._fail(PeerClosed("connection closed"))
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def abort(self) -> None:
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _ABORT)
        except OSError:
            pass  # not TCP: a plain close
        self.close()
