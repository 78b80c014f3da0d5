"""Writing a large file around the page cache (``O_DIRECT``), durably and atomically.

A checkpoint's rows are gigabytes written once and not read again by this run. Written the
ordinary way, every byte is first copied into the page cache by the writing process's CPU,
then written back by the kernel's flusher threads (more CPU), and the dirty pages push
other processes' memory out. With ``O_DIRECT`` the disk reads the bytes straight from the
writer's buffer: the only CPU left is filling that buffer (a copy at memory speed) and
hashing it. ``O_DIRECT`` wants the buffer, the file offset and the length aligned to the
disk's block: bytes go through an aligned staging buffer (``mmap``: page-aligned), written
whenever it is full; the last, partial block is padded and the file truncated to its size.

Where ``O_DIRECT`` is refused (tmpfs, some network and overlay filesystems, macOS) the file
is written through the page cache instead, and ``DirectFile.direct`` says which happened.
Either way the file is fsynced before it is renamed into place (``ps_train.files``).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from ps_train.files import Hasher, fsync_dir

__all__ = ["ALIGN", "DirectFile", "write_file_direct"]

ALIGN = 4096  # the largest logical block size of common disks: every O_DIRECT write is a multiple
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux, FreeBSD; 0 elsewhere


class DirectFile:
    """A new file ``path`` written by appending (``write``), hashed by ``hasher`` as it goes,
    with ``O_DIRECT`` where the filesystem takes it; ``close`` makes it durable."""

    def __init__(self, path: Path, hasher: Callable[[], Hasher], buffer_bytes: int = 8 << 20) -> None:
        if buffer_bytes % ALIGN:
            raise ValueError(f"buffer_bytes={buffer_bytes} must be a multiple of {ALIGN}")
        self.path = path
        self.direct = bool(_O_DIRECT)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        try:
            self._fd = os.open(path, flags | _O_DIRECT, 0o644)
        except OSError as e:
            if not _O_DIRECT or e.errno != errno.EINVAL:
                raise
            self.direct = False  # the filesystem refuses O_DIRECT (e.g. tmpfs): through the page cache
            self._fd = os.open(path, flags, 0o644)
        self._buffer = mmap.mmap(-1, buffer_bytes)  # anonymous: page-aligned, as O_DIRECT needs
        self._view = memoryview(self._buffer)
        self._fill = 0  # bytes staged in the buffer
        self._hash = hasher()
        self.size = 0  # bytes written so far

    def write(self, data: bytes | memoryview) -> None:
        src = memoryview(data).cast("B")
        self._hash.update(src)
        self.size += len(src)
        capacity = len(self._view)
        while len(src):
            n = min(len(src), capacity - self._fill)
            self._view[self._fill : self._fill + n] = src[:n]
            self._fill += n
            src = src[n:]
            if self._fill == capacity:
                self._write_out(capacity)
                self._fill = 0

    def _write_out(self, length: int) -> None:
        """Write the buffer's first ``length`` bytes (a multiple of ALIGN while direct)."""
        done = 0
        while done < length:
            try:
                done += os.write(self._fd, self._view[done:length])
            except OSError as e:
                if not self.direct or e.errno != errno.EINVAL:
                    raise
                # Some filesystems open with O_DIRECT and refuse the write: go on through the page cache.
                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~_O_DIRECT)
                self.direct = False

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def close(self) -> None:
        """Write what is staged, fsync: the file is on disk. Pads the tail to the block and
        truncates back to ``size``."""
        try:
            if self._fill:
                padded = -(-self._fill // ALIGN) * ALIGN if self.direct else self._fill
                self._view[self._fill : padded] = bytes(padded - self._fill)
                self._write_out(padded)
                if padded != self._fill:  # the padding's zeros go
                    os.ftruncate(self._fd, self.size)
                self._fill = 0
            os.fsync(self._fd)
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Release the file and the buffer (after ``close``, or on failure)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._view.release()
        if not self._buffer.closed:
            self._buffer.close()


def write_file_direct(
    path: Path, pieces: Iterable[bytes | memoryview], hasher: Callable[[], Hasher]
) -> tuple[int, str, bool]:
    """Write ``pieces`` into ``path`` atomically (a temporary name, fsync, rename, fsync of
    the folder): readers see the old file or the whole new one. Returns its size, ``hasher``
    hex digest, and whether it went around the page cache."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # a leftover of a writer that died with this pid
    out = None
    try:
        out = DirectFile(tmp, hasher)
        for piece in pieces:
            out.write(piece)
        out.close()
        os.replace(tmp, path)
    except BaseException:
        if out is not None:
            out.abandon()
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return out.size, out.hexdigest(), out.direct
