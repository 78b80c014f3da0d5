"""What each role process of a running job holds, read from /proc (Linux): threads, resident
memory (peak), CPU time so far, and its connections, each attributed to the role at its other
end.

A connection is an established TCP or Unix stream socket. Its other end is found by the
socket's peer: for TCP the process that holds the socket with the swapped ports
(/proc/net/tcp), for Unix sockets the peer inode that ``ss -x`` reports. Sockets to
processes that are not roles (the launcher's pipes are not sockets; nothing else is
expected) count under ``"other"``.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["RoleSample", "sample_roles", "role_kind", "cpu_seconds"]

_SOCKET = re.compile(r"socket:\[(\d+)\]")


@dataclass
class RoleSample:
    """One look at one role process."""

    threads: int
    rss_peak_kb: int  # VmHWM: the most it was resident so far
    cpu_s: float = 0.0  # user + kernel CPU seconds of all its threads so far
    peers: Counter[str] = field(default_factory=Counter)  # role at the other end -> connections


def role_kind(role: str) -> str:
    return "server" if role.startswith("ps") else "trainer" if role.startswith("trainer") else "other"


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.split(":", 1) for line in f if ":" in line)


def cpu_seconds(pid: int) -> float:
    """utime + stime of /proc/<pid>/stat (fields 14 and 15), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _socket_inodes(pid: int) -> set[int]:
    found: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            m = _SOCKET.match(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue  # closed meanwhile
        if m:
            found.add(int(m.group(1)))
    return found


def _tcp_established() -> dict[int, tuple[int, int]]:
    """inode -> (local port, remote port) of every established TCP socket (v4 and v6)."""
    out: dict[int, tuple[int, int]] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] != "01":  # ESTABLISHED
                        continue
                    out[int(cols[9])] = (int(cols[1].rsplit(":", 1)[1], 16), int(cols[2].rsplit(":", 1)[1], 16))
        except OSError:
            continue
    return out


def _unix_peers() -> dict[int, int]:
    """inode -> peer inode of every connected Unix stream socket (``ss -x``)."""
    try:
        text = subprocess.run(["ss", "-xn"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    out: dict[int, int] = {}
    for line in text.splitlines()[1:]:
        cols = line.split()
        # Netid State Recv-Q Send-Q Local Port Peer Port (an unnamed local address is "*")
        if len(cols) >= 8 and cols[0] == "u_str" and cols[1] == "ESTAB":
            try:
                out[int(cols[5])] = int(cols[7])
            except ValueError:
                continue
    return out


def sample_roles(pids: dict[str, int]) -> dict[str, RoleSample]:
    """Look at every live role of ``pids`` (role -> pid) once."""
    inodes = {role: _socket_inodes(pid) for role, pid in pids.items()}
    owner = {ino: role for role, s in inodes.items() for ino in s}
    tcp, unix = _tcp_established(), _unix_peers()
    by_ports = {ports: ino for ino, ports in tcp.items()}
    samples: dict[str, RoleSample] = {}
    for role, pid in pids.items():
        try:
            st = _status(pid)
            cpu = cpu_seconds(pid)
        except OSError:
            continue  # exited
        s = RoleSample(int(st["Threads"]), int(st.get("VmHWM", "0 kB").split()[0]), cpu)
        for ino in inodes[role]:
            if ino in tcp:
                lp, rp = tcp[ino]
                other = by_ports.get((rp, lp))
            elif ino in unix:
                other = unix[ino]
            else:
                continue  # a listener or an unconnected socket
            s.peers[owner.get(other, "other") if other is not None else "other"] += 1
        samples[role] = s
    return samples
