"""Where received bytes go: a connection's small reusable read buffer, and fresh tensor
storage that large buffers are received straight into.

Headers, heads and small bodies are parsed out of one reusable buffer of ``READ_CHUNK``
bytes; a tensor buffer of at least ``DIRECT_READ`` bytes is received directly into its
new storage, so its bytes are copied once, by the kernel.
"""

from __future__ import annotations

import ctypes
import mmap
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .handshake import PeerClosed

READ_CHUNK = 256 << 10
DIRECT_READ = 64 << 10  # buffers at least this large are received straight into storage
_HUGE_ALLOC = 1 << 20  # buffers this large are advised for transparent huge pages
_HUGE_PAGE = 2 << 20
_GROW_STEP = 16 << 20  # a large body grows by this much at a time (see _read_growing)


def _load_madvise() -> Callable[[int, int, int], int] | None:
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


_madvise = _load_madvise()


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


class ReadBuffer:
    """A connection's read buffer (a mixin of ``stream.Connection``, whose state it shares,
    and whose ``_recv_into`` (``polling.Waiting``) it reads the socket with)."""

    sock: socket.socket
    bytes_received: int

    if TYPE_CHECKING:  # polling.Waiting's

        def _recv_into(self, view: memoryview) -> int: ...

    def _init_read_buffer(self) -> None:
        self._buf = bytearray(READ_CHUNK)
        self._view = memoryview(self._buf)
        # The read buffer's address, for copying a small buffered tensor into its storage in
        # one memmove (the bytearray is never resized; the ctypes export pins it).
        self._buf_export = ctypes.c_char.from_buffer(self._buf)
        self._buf_addr = ctypes.addressof(self._buf_export)
        self._start = 0  # unread bytes are _buf[_start:_end]
        self._end = 0

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
            if n - pos >= DIRECT_READ:
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

    def _read_small(self, n: int) -> bytes:
        while self._end - self._start < n:
            if len(self._buf) - self._start < n:
                out = bytearray(n)
                self._read_into(memoryview(out))
                return bytes(out)
            self._fill()
        data = bytes(self._view[self._start : self._start + n])
        self._start += n
        return data

    def _read_growing(self, n: int) -> bytes:
        """``n`` bytes of a large body, allocated as they arrive, so a lying length cannot
        reserve memory."""
        parts = []
        remaining = n
        while remaining:
            chunk = bytearray(min(remaining, _GROW_STEP))
            self._read_into(memoryview(chunk))
            parts.append(chunk)
            remaining -= len(chunk)
        return b"".join(parts)
