"""An emulated network for tests: hosts in network namespaces on a bridge, links that can be
shaped (delay and jitter, loss, rate) and cut, all made here and removed here.

    net = Network(3)            # hosts 0..2 at 10.213.0.1..3, each a namespace with eth0
    net.shape(loss=0.01, delay=0.005, jitter=0.001, rate="200mbit")
    net.cut(0, 1); net.heal()   # silently drop everything between hosts 0 and 1, then heal
    net.limit_link(2, "20mbit") # host 2's own link, both ways (a token bucket, no delay)
    net.limit_cpu(1, 0.5)       # host 1 gets half a core; start its programs with net.command(1, ...)
    net.close()

Layout: a switch namespace holds a bridge ``br0``; host i is a namespace whose ``eth0`` is one
end of a veth pair, the other end (``h<i>``) a port of the bridge. The subnet (``SUBNET``)
exists only inside these namespaces: nothing of the caller's namespace is touched. The
kernel here has no ``netem`` (docs/design.md, "Tests on an emulated network"), so delay and
jitter come from a user-space relay in each host (``netns_relay``), loss from iptables'
``statistic`` match on each host's incoming packets, rate from a ``tbf`` qdisc on each host's
eth0, cuts from iptables DROP rules (silent: no error reaches either side) or from taking a
bridge port down. A host's CPU budget is a cgroup v1 ``cpu`` group (``cpu.cfs_quota_us`` per
``cpu.cfs_period_us``) that ``command`` starts the host's programs in.

``tbf``'s ``latency`` is not a delay: it bounds how long a packet may wait in the shaper's
queue (longer waits are dropped). The only true delay here is the relay's (``shape(delay=)``).

Needs root, ``ip`` (iproute2) and ``iptables``; ``unavailable_reason()`` says why not.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from typing import NamedTuple

from tests.netns_relay import MARK, Relay

SUBNET = "10.213.0"  # /24; host i is SUBNET.(i + 1)
RELAY_PORT = 7999  # where each host's relay listens (in the host's namespace)
_PREFIX = "rpcnet"
CPU_CGROUPS = "/sys/fs/cgroup/cpu"  # the cgroup v1 cpu controller's mount
_CMD_TIMEOUT = 20.0
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000


class NetnsError(RuntimeError):
    """A command that builds or changes the emulated network failed."""


def _run(*cmd: str, check: bool = True) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_CMD_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetnsError(f"{' '.join(cmd)}: {e}") from None
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def setns(path: str, nstype: int = CLONE_NEWNET) -> None:
    """Move the calling thread into the namespace at ``path`` (new sockets are made there)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc().setns(fd, nstype) != 0:
            raise OSError(ctypes.get_errno(), f"setns({path})")
    finally:
        os.close(fd)


def unshare(flags: int) -> None:
    if _libc().unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), "unshare")


@functools.cache
def unavailable_reason() -> str | None:
    """Why this machine cannot host the emulated network (None: it can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    for tool, package in (("ip", "iproute2"), ("iptables", "iptables"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (apt-get install -y {package})"
    probe = f"{_PREFIX}{os.getpid()}probe"
    try:
        _run("ip", "netns", "add", probe)
        try:
            _run(
                "ip",
                "netns",
                "exec",
                probe,
                "iptables",
                "-w",
                "-A",
                "INPUT",
                "-m",
                "statistic",
                "--mode",
                "random",
                "--probability",
                "0.5",
                "-j",
                "DROP",
            )
        finally:
            _run("ip", "netns", "del", probe, check=False)
    except NetnsError as e:
        return f"cannot make a network namespace with an iptables statistic rule: {e}"
    return None


class LinkCounters(NamedTuple):
    """A host's eth0 counters (``Network.link_counters``)."""

    tx_bytes: int
    rx_bytes: int
    overlimits: int  # packets its shapers held back


def remove_stale() -> None:
    """Delete namespaces and cpu cgroups this harness left behind in processes that no longer exist."""
    if os.path.isdir(CPU_CGROUPS):
        for name in os.listdir(CPU_CGROUPS):
            m = re.match(rf"{_PREFIX}(\d+)", name)
            if m and not os.path.exists(f"/proc/{m.group(1)}"):
                try:
                    os.rmdir(os.path.join(CPU_CGROUPS, name))
                except OSError:
                    continue  # still has processes: left for the next look
    for line in _run("ip", "netns", "list", check=False).splitlines():
        m = re.match(rf"({_PREFIX}(\d+)\S*)", line)
        if m and not os.path.exists(f"/proc/{m.group(2)}"):
            _run("ip", "netns", "del", m.group(1), check=False)


class Network:
    """``hosts`` emulated hosts on one bridge. ``close`` removes everything (also if building failed)."""

    _count = 0

    def __init__(self, hosts: int) -> None:
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts must be 1..200, got {hosts}")
        Network._count += 1
        tag = f"{_PREFIX}{os.getpid()}n{Network._count}"
        self.switch = f"{tag}sw"
        self.hosts = [f"{tag}h{i}" for i in range(hosts)]
        self._relays: list[Relay] = []
        self._made: list[str] = []
        self._cgroups: dict[int, str] = {}  # host -> its cpu cgroup's folder
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        remove_stale()
        for ns in [self.switch, *self.hosts]:
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.hosts):
            # Both ends made from the switch's namespace: the caller's namespace never sees them.
            _run("ip", "-n", self.switch, "link", "add", f"h{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "-n", self.switch, "link", "set", f"h{i}", "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def path(self, host: int) -> str:
        """The namespace file of ``host`` (for ``setns``)."""
        return f"/run/netns/{self.hosts[host]}"

    def _in(self, host: int, *cmd: str, check: bool = True) -> str:
        return _run("ip", "netns", "exec", self.hosts[host], *cmd, check=check)

    # -- shaping ---------------------------------------------------------------------------------
    def shape(
        self,
        loss: float = 0.0,
        delay: float = 0.0,
        jitter: float = 0.0,
        rate: str | None = None,
        hosts: Sequence[int] | None = None,
    ) -> None:
        """Every packet a host receives is lost with probability ``loss``; every TCP connection a
        host opens to the subnet passes its relay, which holds each byte ``delay`` +- ``jitter``
        seconds in each direction; each host sends at most ``rate`` (tc syntax, e.g. "100mbit")."""
        if not 0 <= loss < 1 or delay < 0 or not 0 <= jitter <= delay:
            raise ValueError(f"need 0 <= loss < 1 and 0 <= jitter <= delay, got {loss}, {delay}, {jitter}")
        for h in range(len(self.hosts)) if hosts is None else hosts:
            if loss:
                self._in(
                    h,
                    "iptables",
                    "-w",
                    "-A",
                    "INPUT",
                    "-i",
                    "eth0",
                    "-m",
                    "statistic",
                    "--mode",
                    "random",
                    "--probability",
                    f"{loss:.6f}",
                    "-j",
                    "DROP",
                )
            if rate:
                self._in(
                    h,
                    "tc",
                    "qdisc",
                    "replace",
                    "dev",
                    "eth0",
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    "256kb",
                    "latency",
                    "200ms",
                )
            if delay:
                relay = Relay(self.path(h), RELAY_PORT, delay, jitter)
                self._relays.append(relay)
                # The host's own connections into the subnet go to its relay (which finds their
                # real destination with SO_ORIGINAL_DST); the relay's own, marked, do not.
                self._in(
                    h,
                    "iptables",
                    "-w",
                    "-t",
                    "nat",
                    "-A",
                    "OUTPUT",
                    "-p",
                    "tcp",
                    "-d",
                    f"{SUBNET}.0/24",
                    "-m",
                    "mark",
                    "!",
                    "--mark",
                    str(MARK),
                    "-j",
                    "REDIRECT",
                    "--to-ports",
                    str(RELAY_PORT),
                )

    # -- cuts ----------------------------------------------------------------------------------
    def cut(self, a: int, b: int | None = None) -> None:
        """Silently drop every packet between hosts ``a`` and ``b`` (``b`` None: between ``a``
        and every other host). Connections stay open on both sides; nothing reports an error."""
        others = [h for h in range(len(self.hosts)) if h != a] if b is None else [b]
        for o in others:
            self._in(a, "iptables", "-w", "-I", "INPUT", "-s", self.address(o), "-j", "DROP")
            self._in(o, "iptables", "-w", "-I", "INPUT", "-s", self.address(a), "-j", "DROP")

    def link_down(self, host: int) -> None:
        """Take ``host``'s bridge port down: its eth0 loses carrier, nothing gets through."""
        _run("ip", "-n", self.switch, "link", "set", f"h{host}", "down")

    def heal(self) -> None:
        """Undo every cut and every link down (shaping stays)."""
        for h in range(len(self.hosts)):
            rules = self._in(h, "iptables", "-w", "-S", "INPUT")
            for rule in rules.splitlines():
                if rule.startswith("-A INPUT -s ") and rule.endswith("-j DROP"):
                    self._in(h, "iptables", "-w", "-D", *rule.split()[1:])
            _run("ip", "-n", self.switch, "link", "set", f"h{h}", "up")

    def reset(self) -> None:
        """Back to a plain, healed network: no cuts, loss, rate limits or relays."""
        self.heal()
        for relay in self._relays:
            relay.close()
        self._relays.clear()
        for h in range(len(self.hosts)):
            self._in(h, "iptables", "-w", "-F", "INPUT")
            self._in(h, "iptables", "-w", "-t", "nat", "-F", "OUTPUT")
            self._in(h, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)  # none: fine

    def relayed_connections(self) -> int:
        """Connections the relays carried so far (0 without delay)."""
        return sum(r.connections for r in self._relays)

    # -- per-host budgets ------------------------------------------------------------------------
    def limit_link(self, host: int, rate: str, burst: str = "32kb", latency: str = "100ms") -> None:
        """Shape ``host``'s link both ways: a token bucket (``tbf``) of ``rate`` and ``burst`` on
        its eth0 (what it sends) and on its bridge port (what it receives). A packet waits at
        most ``latency`` in the bucket's queue, then is dropped (TCP resends it)."""
        shaper = ("root", "tbf", "rate", rate, "burst", burst, "latency", latency)
        self._in(host, "tc", "qdisc", "replace", "dev", "eth0", *shaper)
        _run("ip", "netns", "exec", self.switch, "tc", "qdisc", "replace", "dev", f"h{host}", *shaper)

    def link_counters(self, host: int) -> LinkCounters:
        """Bytes ``host`` sent and received on its eth0 so far, and how often its shapers held a
        packet back (``overlimits`` of both ``tbf``s; 0 without ``limit_link``)."""
        stats = json.loads(self._in(host, "ip", "-j", "-s", "link", "show", "dev", "eth0"))[0]["stats64"]
        over = 0
        for ns, dev in ((self.hosts[host], "eth0"), (self.switch, f"h{host}")):
            for q in json.loads(_run("ip", "netns", "exec", ns, "tc", "-j", "-s", "qdisc", "show", "dev", dev)):
                if q.get("kind") == "tbf":
                    over += int(q.get("overlimits", 0))
        return LinkCounters(int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"]), over)

    def limit_cpu(self, host: int, cores: float, period_us: int = 100_000) -> None:
        """Give the programs ``command(host, ...)`` starts ``cores`` CPUs' worth of time: a cgroup
        whose CFS quota is ``cores`` x ``period_us`` per period."""
        if not os.path.isdir(CPU_CGROUPS):
            raise NetnsError(f"no cgroup v1 cpu controller at {CPU_CGROUPS} (mount | grep cgroup)")
        group = self._cgroups.get(host) or os.path.join(CPU_CGROUPS, self.hosts[host])
        os.makedirs(group, exist_ok=True)
        self._cgroups[host] = group
        for name, value in (("cpu.cfs_period_us", period_us), ("cpu.cfs_quota_us", max(1000, int(cores * period_us)))):
            with open(os.path.join(group, name), "w") as f:
                f.write(str(value))

    def command(self, host: int, *cmd: str) -> list[str]:
        """The argv that runs ``cmd`` on ``host``: in its namespace and, with ``limit_cpu``, in
        its cgroup (the shell joins it, then becomes the program, so nothing runs outside)."""
        inside = ["ip", "netns", "exec", self.hosts[host], *cmd]
        group = self._cgroups.get(host)
        if group is None:
            return inside
        return ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *inside]

    def cpu_throttled(self, host: int) -> int:
        """How many periods the programs of ``host``'s cgroup were held back by its quota."""
        with open(os.path.join(self._cgroups[host], "cpu.stat")) as f:
            return int(dict(line.split() for line in f)["nr_throttled"])

    def close(self) -> None:
        for group in self._cgroups.values():
            try:
                with open(os.path.join(group, "cgroup.procs")) as f:
                    left = f.read().split()
                for pid in left:  # a program still running leaves for the root group, so rmdir works
                    with open(os.path.join(CPU_CGROUPS, "cgroup.procs"), "w") as f:
                        f.write(pid)
                os.rmdir(group)
            except OSError:
                continue  # gone already, or a process exited meanwhile: stale groups are removed below
        self._cgroups.clear()
        for relay in self._relays:
            relay.close()
        self._relays.clear()
        for ns in reversed(self._made):
            _run("ip", "netns", "del", ns, check=False)  # its veths, bridge and rules go with it
        self._made.clear()
