"""The machine's floor, measured in the same run as the RPC figures, and what machine it is.

An RPC round trip cannot beat two processes bouncing a few bytes over a socket, and a
tensor cannot travel faster than memcpy. These figures are measured by ``rpc_bench.py``
right before the RPC workloads, so each RPC figure can be read as a multiple of what this
machine, loaded as it was at that moment, can do at all:

- ping-pong: two processes (fork) bounce 64 bytes over a Unix socketpair and over TCP
  loopback (``TCP_NODELAY``); *blocking* sleeps in ``recv`` (each message wakes the peer
  through the scheduler), *polling* retries a non-blocking ``recv`` with a ``sched_yield``
  between tries, never sleeping (no wake-up, but it wants a core per process; the yield
  lets other jobs of a loaded machine run). µs per round trip, median of repetitions.
- memcpy: ``ctypes.memmove`` of 64 MB between two buffers already touched, GB/s
  (GB = 1e9 bytes, counting the bytes copied once).

``machine()`` records the CPU model, the cores this process may use, the kernel, whether a
hypervisor is reported, and the load average when the run started (the development
machine is shared: a load above 0 means other jobs ran beside the benchmark).
"""

from __future__ import annotations

import ctypes
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

_MSG = b"x" * 64
ROUNDS = 2000  # round trips per repetition
REPS = 5


def _recv_exact_blocking(s: socket.socket, n: int) -> None:
    got = 0
    while got < n:
        k = len(s.recv(n - got))
        if k == 0:
            raise EOFError("peer closed")
        got += k


def _recv_exact_polling(s: socket.socket, n: int) -> None:
    got = 0
    while got < n:
        try:
            k = len(s.recv(n - got, socket.MSG_DONTWAIT))
        except BlockingIOError:
            os.sched_yield()  # as rpc_core's readers poll: a loaded machine runs others meanwhile
            continue
        if k == 0:
            raise EOFError("peer closed")
        got += k


def _pingpong(pair: Callable[[], tuple[socket.socket, socket.socket]], polling: bool) -> list[float]:
    """µs per round trip, one figure per repetition, between this process and a forked child."""
    recv = _recv_exact_polling if polling else _recv_exact_blocking
    a, b = pair()
    total = ROUNDS * (REPS + 1)  # the first repetition warms up
    pid = os.fork()
    if pid == 0:  # the echoing child: only os / socket calls, then _exit (no atexit, no flush)
        try:
            a.close()
            for _ in range(total):
                recv(b, len(_MSG))
                b.sendall(_MSG)
        finally:
            os._exit(0)
    b.close()
    samples = []
    try:
        for rep in range(REPS + 1):
            t0 = time.perf_counter()
            for _ in range(ROUNDS):
                a.sendall(_MSG)
                recv(a, len(_MSG))
            if rep:
                samples.append((time.perf_counter() - t0) / ROUNDS * 1e6)
    finally:
        a.close()
        os.waitpid(pid, 0)
    return samples


def _unix_pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return a, b


def _memcpy_gbs(nbytes: int = 64 << 20, reps: int = 7) -> list[float]:
    src = ctypes.create_string_buffer(b"\x01" * 16, nbytes)  # touched: pages are resident
    dst = ctypes.create_string_buffer(nbytes)
    ctypes.memset(dst, 0, nbytes)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        ctypes.memmove(dst, src, nbytes)
        out.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return out


# name, label, unit, how to measure (samples)
FLOORS: list[tuple[str, str, str, Callable[[], list[float]]]] = [
    ("unix_blocking", "ping-pong Unix socketpair, blocking", "us/rt", lambda: _pingpong(_unix_pair, False)),
    ("unix_polling", "ping-pong Unix socketpair, polling", "us/rt", lambda: _pingpong(_unix_pair, True)),
    ("tcp_blocking", "ping-pong TCP loopback, blocking", "us/rt", lambda: _pingpong(_tcp_pair, False)),
    ("tcp_polling", "ping-pong TCP loopback, polling", "us/rt", lambda: _pingpong(_tcp_pair, True)),
    ("memcpy", "memcpy 64 MB", "GB/s", _memcpy_gbs),
]


def measure() -> dict[str, dict[str, Any]]:
    """Every floor figure: {name: {"label", "unit", "value" (median), "samples"}}."""
    out = {}
    for name, label, unit, fn in FLOORS:
        samples = fn()
        out[name] = {"label": label, "unit": unit, "value": statistics.median(samples), "samples": samples}
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _hypervisor() -> str:
    """The hypervisor's vendor when the kernel names one, "yes" if only the CPU flag says so,
    else "none reported"."""
    for path in ("/sys/hypervisor/type", "/sys/class/dmi/id/sys_vendor"):
        try:
            with open(path) as f:
                text = f.read().strip()
            if text and path.endswith("type"):
                return text
            if text and text.lower() in (
                "qemu",
                "kvm",
                "xen",
                "microsoft corporation",
                "vmware, inc.",
                "amazon ec2",
                "google",
            ):
                return text
        except OSError:
            pass
    try:
        with open("/proc/cpuinfo") as f:
            if " hypervisor" in f.read():
                return "yes"
    except OSError:
        pass
    return "none reported"


def machine() -> dict[str, Any]:
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "kernel": platform.release(),
        "hypervisor": _hypervisor(),
        "python": platform.python_version(),
        "load_avg_1m": os.getloadavg()[0],
    }


def describe_machine(m: dict[str, Any]) -> str:
    return (
        f"machine: {m['cpu']}, {m['usable_cores']} of {m['cores']} cores usable, kernel {m['kernel']}, "
        f"hypervisor {m['hypervisor']}, Python {m['python']}, load average {m['load_avg_1m']:.2f} at start"
    )
