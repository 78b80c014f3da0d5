"""Writing files so that a crash leaves the old file or the whole new one, never half of it.

Every file a run writes in its folder (checkpoints, ``metrics.json``, ``provenance.json``,
``restarts.json``, ...) is written to a temporary name next to it, flushed to disk, and moved
into place with ``os.replace`` (atomic on POSIX), hashed as it is written (the caller picks
the hash: checkpoints use ``ps_train.checkpoint.checksums``). Standard library only.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Protocol

__all__ = [
    "Hasher",
    "HashingWriter",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "file_digest",
    "fsync_dir",
]


class Hasher(Protocol):
    """What ``hashlib``'s and ``xxhash``'s hash objects have in common."""

    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one."""
    atomic_write(Path(path), lambda f: f.write(data))


class HashingWriter:
    """A write-only file that hashes what goes through it (``size``, ``hexdigest``)."""

    def __init__(self, f: BinaryIO, hasher: Callable[[], Hasher] = hashlib.sha256) -> None:
        self._f, self._h, self.size = f, hasher(), 0

    def write(self, data: bytes | memoryview) -> int:
        self._h.update(data)
        self.size += memoryview(data).nbytes
        return self._f.write(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def atomic_write(
    path: Path,
    write: Callable[[BinaryIO], object],
    sequential: Callable[[HashingWriter], object] | None = None,
    hasher: Callable[[], Hasher] = hashlib.sha256,
) -> tuple[int, str]:
    """Write ``path`` through ``write(file)`` into a temporary file, fsync it, rename it over
    ``path`` (readers see the old file or the whole new one); the new file's size and its
    ``hasher`` hex digest. ``sequential`` instead of ``write``: a writer that only appends,
    hashed as it writes (no second pass over a file of gigabytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            hashing = HashingWriter(f, hasher) if sequential is not None else None
            if hashing is not None and sequential is not None:
                sequential(hashing)
            else:
                write(f)
            f.flush()
            os.fsync(f.fileno())  # contents on disk before the rename makes them visible
        size, digest = (hashing.size, hashing.hexdigest()) if hashing is not None else file_digest(tmp, hasher)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return size, digest


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable."""
    # Makes the rename itself durable; not possible on every platform, hence best effort.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def file_digest(path: str | os.PathLike[str], hasher: Callable[[], Hasher] = hashlib.sha256) -> tuple[int, str]:
    """``(size, hex digest)`` of a file by ``hasher``, read in chunks."""
    h, size = hasher(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()
