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
from typing import Optional

PROBE_LEN = 16


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load() -> Optional[ctypes._CFuncPtr]:
    try:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):  # not Linux, or a libc without it
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                   ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return fn


_readv = _load()


def enabled() -> bool:
    """Whether this process offers and accepts cross-memory attach (``RPC_CORE_CMA=0`` turns it off)."""
    return _readv is not None and os.environ.get("RPC_CORE_CMA", "1").strip() not in ("0", "false", "no", "off")


def read(pid: int, remote: int, local: int, n: int) -> None:
    """Copy ``n`` bytes at address ``remote`` in process ``pid`` to address ``local`` here.

    ctypes drops the GIL for the call. The kernel may copy less than asked (it stops at the
    first unmapped remote page), so this loops; raises OSError if a call copies nothing.
    """
    if _readv is None:
        raise OSError("process_vm_readv is not available")
    lv, rv = _IoVec(), _IoVec()
    done = 0
    while done < n:
        lv.iov_base, lv.iov_len = local + done, n - done
        rv.iov_base, rv.iov_len = remote + done, n - done
        k = _readv(pid, ctypes.byref(lv), 1, ctypes.byref(rv), 1, 0)
        if k <= 0:
            err = ctypes.get_errno() if k < 0 else 0
            raise OSError(err, f"process_vm_readv from pid {pid} at {remote + done:#x} "
                               f"({n - done} of {n} bytes left): {os.strerror(err) if err else 'no progress'}")
        done += k


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
