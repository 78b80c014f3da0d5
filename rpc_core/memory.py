"""Keep freed tensor memory in the process: glibc's malloc thresholds for RPC workers.

A worker's large tensors (activations, their gradients, received buffers) are made and
freed on several threads, and a distributed autograd context keeps a step's graph until
the next step releases it. With glibc's default, adaptive thresholds that pattern hands
megabytes back to the kernel (``munmap`` / heap trimming) every step and takes them back
as fresh zeroed pages: a CNN server measured ~2,500 page faults per training step and a
backward pass 30% slower than the same computation in one process.

``tune()`` (called by ``init_rpc``) fixes glibc's thresholds instead: allocations up to
``MMAP_THRESHOLD`` come from the heap and are reused, and a heap keeps up to
``TRIM_THRESHOLD`` of free memory at its top instead of trimming it. The price is a
resident size that stays near its peak (up to ``TRIM_THRESHOLD`` above the live data per
malloc arena), so it also caps the arenas at ``arena_max()`` (one per core, at least 2)
where glibc allows eight per core: a worker's threads mostly take turns on the GIL, so more
arenas buy little parallelism, while each keeps its own free memory and fragments. A DLRM-DCNv2
parameter server with 22 threads held 0.9 GiB in 23 arena heaps; with 2 arenas its peak RSS
fell from 3.75 to 2.26 GiB, its step no slower. ``RPC_CORE_MALLOC_TUNE=0`` leaves malloc alone, and so does any malloc
setting of the user's own (``MALLOC_*_`` variables, ``GLIBC_TUNABLES``). Other C
libraries (musl, macOS) are left alone.

Those thresholds suit workers whose tensors are small next to their RAM. A process whose
step makes and frees tensors of tens of MB and whose resident size must stay near its data
(a parameter server holding tables under a RAM budget) passes lower ones to ``tune`` before
``init_rpc``: tensors from ``mmap_threshold`` up are then mapped for themselves and handed
back when freed, instead of being carved out of a heap whose free gaps stay resident. A
DLRM-DCNv2 table server's step (seconds long) pays a few page faults per MB for that.

This module is the one owner of that policy in a process running rpc_core: applications
built on it (ps_train included) do not call ``mallopt`` themselves, since ``init_rpc``
would override what they set and ``RPC_CORE_MALLOC_TUNE`` would then switch nothing. To
change the thresholds, pass them to the first ``tune`` (``rpc_core.tune_malloc``), set
glibc's own variables (which make ``tune`` step aside) or turn this off with
``RPC_CORE_MALLOC_TUNE=0``.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
from typing import NamedTuple

from . import knobs

# glibc's own ceiling for its adaptive mmap threshold on 64-bit (4 MiB * sizeof(long)), and
# twice that for trimming, as glibc's adaptive rule keeps them.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20
MIN_THRESHOLD = 128 << 10  # glibc's default mmap threshold: lower ones only add system calls
_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_USER_SETTINGS = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
    "MALLOC_ARENA_MAX",
)


class Thresholds(NamedTuple):
    """What ``tune`` set: bytes."""

    mmap_threshold: int
    trim_threshold: int


_lock = threading.Lock()
_done = False
_thresholds: Thresholds | None = None


def arena_max() -> int:
    """The most malloc arenas ``tune`` lets glibc make: one per core, at least 2."""
    return max(2, os.cpu_count() or 2)


def tune(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Set glibc's malloc thresholds for this process, once: the first call's thresholds
    stay (``init_rpc``'s call after a launcher's keeps the launcher's). Returns whether
    they are set. Bytes, each at least 128 KiB and at most ``MMAP_THRESHOLD`` /
    ``TRIM_THRESHOLD`` (a higher mmap threshold than glibc's own ceiling is not adaptive)."""
    global _done, _thresholds
    for name, value, top in (
        ("mmap_threshold", mmap_threshold, MMAP_THRESHOLD),
        ("trim_threshold", trim_threshold, TRIM_THRESHOLD),
    ):
        if not MIN_THRESHOLD <= value <= top:
            raise ValueError(f"rpc_core.memory.tune: {name}={value} is outside [{MIN_THRESHOLD}, {top}] bytes")
    with _lock:
        if _done:
            return True
        if not knobs.malloc_tune():
            return False
        if any(k in os.environ for k in _USER_SETTINGS) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
            return False
        if platform.libc_ver()[0] != "glibc":
            return False
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):
            return False
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        # The mmap threshold first: setting either one ends glibc's adaptive adjustment.
        _done = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
        # Threads started from here on share these arenas (those made before keep theirs).
        _done = _done and bool(mallopt(_M_ARENA_MAX, arena_max()))
        if _done:
            _thresholds = Thresholds(mmap_threshold, trim_threshold)
        return _done


def thresholds() -> Thresholds | None:
    """The thresholds ``tune`` set in this process (None: it set none)."""
    return _thresholds
