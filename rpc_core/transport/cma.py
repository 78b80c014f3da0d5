"""Cross-memory attach: copy bytes straight out of a peer process's memory (Linux
``process_vm_readv``). Same-host connections use it for large tensor buffers, which then
cost one copy (sender memory -> receiver's fresh tensor) instead of TCP's two plus its
syscalls; see ``wire`` for how a connection finds out whether it may.

Reading another process's memory needs ptrace rights over it (same user, and a Yama
``ptrace_scope`` / seccomp policy that allows it); the handshake proves them with a probe
rather than guessing, so every failure here just means "use TCP".
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Callable

from .. import knobs

PROBE_LEN = 16


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):  # not Linux, or a libc without it
        return None
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    fn.restype = ctypes.c_ssize_t
    return fn


_readv = _load()


def enabled() -> bool:
    """Whether this process offers and accepts cross-memory attach (``RPC_CORE_CMA=0`` turns it off)."""
    return _readv is not None and knobs.cma()


def _read_span(pid: int, remote: int, local: int, n: int) -> None:
    """One thread's copy. The kernel may copy less than asked (it stops at the first
    unmapped remote page), so this loops; raises OSError if a call copies nothing."""
    readv = _readv
    if readv is None:  # callers check enabled() first
        raise OSError("process_vm_readv is not available")
    lv, rv = _IoVec(), _IoVec()
    done = 0
    while done < n:
        lv.iov_base, lv.iov_len = local + done, n - done
        rv.iov_base, rv.iov_len = remote + done, n - done
        k = readv(pid, ctypes.byref(lv), 1, ctypes.byref(rv), 1, 0)
        if k <= 0:
            err = ctypes.get_errno() if k < 0 else 0
            raise OSError(
                err,
                f"process_vm_readv from pid {pid} at {remote + done:#x} "
                f"({n - done} of {n} bytes left): {os.strerror(err) if err else 'no progress'}",
            )
        done += k


# A large copy is split into chunks that the calling thread and idle helper threads take
# in turn: pinning the sender's pages and faulting in the fresh receive pages is per-page
# kernel work that scales with cores (16 MB from 4 KiB-page memory on 2 cores: 6.0 ->
# 12.0 GB/s; from huge pages 14.8 -> 22.9). Busy helpers just leave the caller more chunks,
# so the copy never waits for a thread that is not already working on it.
_CHUNK = 2 << 20
_HUGE_PAGE = 2 << 20
try:
    _HELPERS = max(0, min(len(os.sched_getaffinity(0)), 4) - 1)
except (AttributeError, OSError):
    _HELPERS = max(0, min(os.cpu_count() or 1, 4) - 1)


class _Copy:
    def __init__(self, pid: int, remote: int, local: int, n: int) -> None:
        self.pid, self.remote, self.local, self.n = pid, remote, local, n
        self.cv = threading.Condition(threading.Lock())
        self.next = 0
        self.active = 0
        self.error: OSError | None = None

    def work(self) -> None:
        while True:
            with self.cv:
                off = self.next
                if off >= self.n or self.error is not None:
                    return
                # Chunks end on huge-page boundaries of the receive memory, so no two
                # threads fault in the same 2 MiB page.
                end = (self.local + off + _CHUNK) // _HUGE_PAGE * _HUGE_PAGE - self.local
                end = min(self.n, end if end > off else off + _CHUNK)
                self.next = end
                self.active += 1
            try:
                _read_span(self.pid, self.remote + off, self.local + off, end - off)
            except OSError as e:
                with self.cv:
                    self.error = self.error or e
            finally:
                with self.cv:
                    self.active -= 1
                    self.cv.notify_all()

    def wait(self) -> None:
        """Until no thread writes into the receive memory any more (the caller may free it)."""
        with self.cv:
            while self.active or (self.next < self.n and self.error is None):
                self.cv.wait()
        if self.error is not None:
            raise self.error


_jobs: queue.SimpleQueue[_Copy] = queue.SimpleQueue()
_helpers_pid = 0
_helpers_lock = threading.Lock()


def _helper() -> None:
    while True:
        _jobs.get().work()


def _start_helpers() -> None:
    global _helpers_pid
    with _helpers_lock:
        if _helpers_pid != os.getpid():  # first use in this process (threads do not survive fork)
            for i in range(_HELPERS):
                threading.Thread(target=_helper, name=f"rpc-cma-{i}", daemon=True).start()
            _helpers_pid = os.getpid()


def parallel(n: int) -> bool:
    """Whether a copy of ``n`` bytes is split across helper threads (so it wants every core)."""
    return n >= 2 * _CHUNK and _HELPERS > 0


def read(pid: int, remote: int, local: int, n: int) -> None:
    """Copy ``n`` bytes at address ``remote`` in process ``pid`` to address ``local`` here;
    raise OSError if any of it cannot be read. ctypes drops the GIL for every call."""
    if _readv is None:
        raise OSError("process_vm_readv is not available")
    if not parallel(n):
        _read_span(pid, remote, local, n)
        return
    if _helpers_pid != os.getpid():
        _start_helpers()
    job = _Copy(pid, remote, local, n)
    for _ in range(min(_HELPERS, n // _CHUNK - 1)):
        _jobs.put(job)
    job.work()
    job.wait()


class Probe:
    """Random bytes this process keeps in memory so a peer can prove it can read them."""

    def __init__(self) -> None:
        self.data = os.urandom(PROBE_LEN)
        self._buf = ctypes.create_string_buffer(self.data, PROBE_LEN)
        self.address = ctypes.addressof(self._buf)


def can_read(pid: int, address: int, expected: bytes) -> bool:
    """True if ``expected`` is what lies at ``address`` in process ``pid`` (the peer's probe):
    only then is this the peer's memory (another host or pid namespace may have an unrelated
    process under that pid, or none)."""
    if _readv is None or pid <= 0 or address <= 0 or len(expected) != PROBE_LEN:
        return False
    out = ctypes.create_string_buffer(PROBE_LEN)
    try:
        read(pid, address, ctypes.addressof(out), PROBE_LEN)
    except OSError:
        return False
    return out.raw == expected
