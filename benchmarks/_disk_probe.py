"""The disk's own bandwidth under a folder, as the disk tier meets it: a sequential write of
large blocks ended by ``fsync`` (what RocksDB's flushes and compactions do) and random reads
of 4 KiB blocks from a file dropped from the page cache (what reading evicted rows back
does). Bounded in bytes and reads; the probe file is removed."""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

_BLOCK = 1 << 20  # the write's block: 1 MiB
_PAGE = 4096  # the random read's block: what one row read costs the disk at least


@dataclass(frozen=True)
class DiskBandwidth:
    write_mb_s: float  # sequential write + fsync, MB/s (10^6 bytes)
    read_mb_s: float  # random 4 KiB reads of uncached blocks, MB/s
    read_iops: float  # those reads per second
    probe_bytes: int  # the probe file's size


def measure(folder: Path, size_mb: int = 256, reads: int = 4000, seed: int = 0) -> DiskBandwidth:
    """Write ``size_mb`` MiB to a file under ``folder`` and fsync it, drop it from the page
    cache (``posix_fadvise(DONTNEED)``), then time ``reads`` random 4 KiB reads of it."""
    if size_mb < 1 or reads < 1:
        raise ValueError(f"disk probe: size_mb={size_mb} and reads={reads} must be >= 1")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "disk_probe.bin"
    block = os.urandom(_BLOCK)  # incompressible, as rows are
    size = size_mb * _BLOCK
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        for _ in range(size_mb):
            os.write(fd, block)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
        rng = random.Random(seed)
        offsets = [rng.randrange(size // _PAGE) * _PAGE for _ in range(reads)]
        t0 = time.perf_counter()
        for off in offsets:
            os.pread(fd, _PAGE, off)
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()
    return DiskBandwidth(
        write_mb_s=size / write_s / 1e6,
        read_mb_s=reads * _PAGE / read_s / 1e6,
        read_iops=reads / read_s,
        probe_bytes=size,
    )
