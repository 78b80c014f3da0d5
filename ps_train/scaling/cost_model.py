"""The analytic cost model of a ps_train job: per-step constants fitted on measured runs
(``calibration.json``, with the machine they came from), and the samples/s a cluster reaches
with the resource that binds it. docs/scaling.md derives it.

Per trainer step, with ``m_s`` requests, ``n_s`` payload bytes (both ways, from the model's
shapes) and ``f_s`` flops on server ``s`` (``shapes.server_loads``):

- bytes on the wire at server s:  ``w_s = beta * n_s + gamma * m_s``  (framing, pickling)
- server CPU:                     ``u_s = a * m_s + b * w_s + f_s / F``  (F: FLOP/s, assumed),
  plus ``bp * w_s`` on a paced link (``Constants.paced``)
- trainer CPU:                    ``c = c0 + c1 * sum_s m_s``, plus ``cp * sum_s w_s`` on a paced link
- a trainer's own step (serial):  ``c + sum over its shards' servers of u_s + round trips x
  2 x latency + (its bytes the busier way - the link's bucket) / bandwidth``; round trips =
  2 x shards + 1 (forward and backward through each shard, then the update to all servers at
  once).

Async (and ssp, whose bound only binds with stragglers): each trainer steps at the least of
``1 / serial step``, ``cores_s / (T u_s)`` (server CPU), ``B / (T x server s's bytes the
busier way)`` (server link), ``B / (its own bytes the busier way)`` (trainer link) and, all
ranks on one machine of ``C`` cores,
``C / (T (c + sum_s u_s))``. Sync (and hybrid, whose dense rounds wait for every trainer): a
round waits for all trainers, but the servers work in parallel on their own shards and serve
one trainer while the others compute, so a round takes the longest of the busiest server's
work for all T trainers, the links' bytes, and the slowest trainer's own step: ``serial step
x (1 + jitter x sqrt(2 ln T))`` (the expected maximum of T normal times); in sync that step
is pipelined (no wait for the update's answer: ``c1`` and a round trip less). A process uses
at most one core (Python's interpreter lock), so cores above 1 do not count.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ps_train.scaling.shapes import ServerLoad, Workload, server_loads

__all__ = [
    "Constants",
    "Machine",
    "Calibration",
    "Cluster",
    "Prediction",
    "ServerCosts",
    "MODES",
    "BARRIER_MODES",
    "DEFAULT_CALIBRATION",
    "PACED_BELOW_BPS",
    "load_calibration",
    "save_calibration",
    "server_costs",
    "busier_way",
    "trainer_ways",
    "serial_step",
    "predict",
    "suggest_servers",
]

MODES = ("sync", "async", "ssp", "hybrid")
BARRIER_MODES = ("sync", "hybrid")  # a round per step that waits for every trainer
DEFAULT_CALIBRATION = Path(__file__).with_name("calibration.json")
# Assumed, between the rates measured: 2 Mbit/s delivered messages by the segment, 1 Gbit/s did not.
PACED_BELOW_BPS = 1e8


@dataclass(frozen=True)
class Constants:
    beta: float  # wire bytes per payload byte
    gamma: float  # wire bytes per request
    server_cpu_per_message: float  # a, seconds
    server_cpu_per_byte: float  # b, seconds
    trainer_cpu_base: float  # c0, seconds per step
    trainer_cpu_per_message: float  # c1, seconds per request
    flop_rate: float  # F, FLOP/s of one core on these small ops (assumed, not fitted)
    jitter: float  # coefficient of variation of a step's time (sync)
    jitter_fitted: bool = False
    # On a link slower than ``paced_below_bps`` a message arrives a segment at a time, each
    # read by a wake-up of its own, so its bytes cost CPU at both ends that they do not cost
    # on a fast link (emulated hosts: about 3.5 ms more per 2-server step at 2 Mbit/s than at
    # 1 Gbit/s, on 78 KB). Fitted on the runs whose link is that slow; the threshold is assumed.
    server_cpu_per_paced_byte: float = 0.0  # seconds per wire byte, at the server
    trainer_cpu_per_paced_byte: float = 0.0  # seconds per wire byte, at the trainer
    paced_below_bps: float = PACED_BELOW_BPS

    def paced(self, link_bps: float) -> bool:
        """Whether a link of ``link_bps`` delivers a message by the segment (see above)."""
        return link_bps < self.paced_below_bps


@dataclass(frozen=True)
class Machine:
    """Where and how constants were measured: a prediction holds for machines like it."""

    description: str  # e.g. "shared 2-core VM, loopback"
    cpus: int
    load_average: str  # during the measuring runs, e.g. "23-43"
    date: str
    commit: str
    method: str  # the commands that produced the runs


@dataclass(frozen=True)
class Calibration:
    constants: Constants
    machine: Machine
    # The model's stated error on samples/s: the largest relative error over the runs it was
    # checked on where fitted, and the largest seen on other hosts (a different machine).
    error_where_fitted: float
    error_elsewhere: float
    notes: str = ""

    def stated_error(self) -> str:
        return (
            f"+-{self.error_where_fitted:.0%} on machines like the one it was fitted on "
            f"({self.machine.description}); up to {self.error_elsewhere:.0%} elsewhere until recalibrated"
        )


def load_calibration(path: Path | None = None) -> Calibration:
    """The calibration at ``path`` (default: the one shipped with ps_train)."""
    path = path or DEFAULT_CALIBRATION
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
        return Calibration(
            Constants(**raw["constants"]),
            Machine(**raw["machine"]),
            float(raw["error_where_fitted"]),
            float(raw["error_elsewhere"]),
            str(raw.get("notes", "")),
        )
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"calibration file {path}: {e}; write one with benchmarks/scale_calibrate.py "
            "(keys: constants, machine, error_where_fitted, error_elsewhere)"
        ) from e


def save_calibration(cal: Calibration, path: Path) -> None:
    path.write_text(json.dumps(asdict(cal), indent=2) + "\n")


@dataclass(frozen=True)
class Cluster:
    trainers: int
    servers: int
    link_bps: float  # each host's link, each way, bits/s (math.inf: loopback)
    latency_s: float  # one way
    trainer_cores: float
    server_cores: float
    shared_cores: float | None  # all ranks on one machine with this many cores (None: a host each)
    mode: str  # sync | async | ssp | hybrid
    # A token bucket's depth on every link, each way (a shaped link: ``tc tbf``'s burst): it
    # fills while the link is idle, and a message passes at once for as many bytes as it holds.
    # 0: every message waits its bytes over the rate.
    link_burst_bytes: float = 0.0
    # Cores below 1 as a CFS quota (cgroup ``cpu.cfs_period_us``, in seconds): a host may use
    # ``cores x period`` of one core's time per period, at full speed, then waits for the next
    # period. 0: a slower core. Only the simulator plays it; the model takes a slower core.
    cpu_period_s: float = 0.0

    def __post_init__(self) -> None:
        if self.trainers < 1 or self.servers < 1:
            raise ValueError(f"trainers and servers must be >= 1, got {self.trainers} and {self.servers}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.link_bps > 0 or self.latency_s < 0:
            raise ValueError(
                f"the link needs a rate > 0 and a latency >= 0, got {self.link_bps} b/s and {self.latency_s} s"
            )
        if self.link_burst_bytes < 0 or self.cpu_period_s < 0:
            raise ValueError(
                f"link_burst_bytes and cpu_period_s must be >= 0, got {self.link_burst_bytes}, {self.cpu_period_s}"
            )
        if self.trainer_cores <= 0 or self.server_cores <= 0:
            raise ValueError(f"cores must be > 0, got {self.trainer_cores} (trainer), {self.server_cores} (server)")


@dataclass(frozen=True)
class Prediction:
    samples_per_s: float
    steps_per_s: float  # per trainer
    binding: str
    bounds: dict[str, float] = field(default_factory=dict)  # async: steps/s per trainer each allows


@dataclass(frozen=True)
class ServerCosts:
    """Per server: its loads, wire bytes and CPU seconds per trainer step; and the trainer's CPU."""

    loads: list[ServerLoad]
    wire: list[float]
    cpu: list[float]
    trainer_cpu: float


def server_costs(c: Constants, w: Workload, servers: int, link_bps: float = math.inf) -> ServerCosts:
    loads = server_loads(w, servers)
    wire = [c.beta * ld.bytes + c.gamma * ld.messages for ld in loads]
    per_byte = c.server_cpu_per_byte + (c.server_cpu_per_paced_byte if c.paced(link_bps) else 0.0)
    cpu = [
        c.server_cpu_per_message * ld.messages + per_byte * wb + ld.flops / c.flop_rate
        for ld, wb in zip(loads, wire, strict=True)
    ]
    trainer = c.trainer_cpu_base + c.trainer_cpu_per_message * sum(ld.messages for ld in loads)
    if c.paced(link_bps):
        trainer += c.trainer_cpu_per_paced_byte * sum(wire)  # a trainer's bytes are all its servers' bytes
    return ServerCosts(loads, wire, cpu, trainer)


def busier_way(c: Constants, w: Workload, servers: int) -> list[float]:
    """Each server's wire bytes per trainer step the busier way (in or out): what its link's
    rate bounds. A request's framing counts half each way."""
    return [
        c.beta * max(ld.received, ld.bytes - ld.received) + c.gamma * ld.messages / 2 for ld in server_loads(w, servers)
    ]


def trainer_ways(c: Constants, loads: list[ServerLoad]) -> tuple[float, float]:
    """A trainer's wire bytes per step out (what its servers receive) and in (what they send)."""
    framing = c.gamma * sum(ld.messages for ld in loads) / 2
    out = c.beta * sum(ld.received for ld in loads) + framing
    back = c.beta * sum(ld.bytes - ld.received for ld in loads) + framing
    return out, back


def serial_step(c: Constants, w: Workload, cl: Cluster) -> tuple[float, dict[str, float]]:
    """A trainer's step alone: its total seconds and their parts."""
    sc = server_costs(c, w, cl.servers, cl.link_bps)
    kt, ks = min(cl.trainer_cores, 1.0), min(cl.server_cores, 1.0)
    on_path = sum(u for ld, u in zip(sc.loads, sc.cpu, strict=True) if ld.shard)
    off_path = [u for ld, u in zip(sc.loads, sc.cpu, strict=True) if not ld.shard]  # table shares, in parallel
    shards = sum(ld.shard for ld in sc.loads)
    parts = {
        "trainer CPU": sc.trainer_cpu / kt,
        "server compute on the path": (on_path + max(off_path, default=0.0)) / ks,
        "round trips": (2 * shards + 1 + (1 if w.table_bytes else 0)) * 2 * cl.latency_s,
        # The busier way of the trainer's link (what the servers receive, or what they send),
        # less what its bucket holds: that much passes at once, having refilled while the
        # trainer and the servers worked (the link's rate still bounds the average: ``predict``).
        "trainer link": max(0.0, max(trainer_ways(c, sc.loads)) - cl.link_burst_bytes) * 8 / cl.link_bps,
    }
    return sum(parts.values()), parts


def predict(c: Constants, w: Workload, cl: Cluster) -> Prediction:
    """Samples/s of ``cl`` running ``w``, and the resource that binds."""
    sc = server_costs(c, w, cl.servers, cl.link_bps)
    ks = min(cl.server_cores, 1.0)
    serial, parts = serial_step(c, w, cl)
    t = cl.trainers
    server_cpu = t * max(sc.cpu) / ks  # seconds of the busiest server's CPU per step of every trainer
    server_link = t * max(busier_way(c, w, cl.servers)) * 8 / cl.link_bps
    trainer_link = max(trainer_ways(c, sc.loads)) * 8 / cl.link_bps  # a bucket does not raise the rate
    machine = t * (sc.trainer_cpu + sum(sc.cpu)) / cl.shared_cores if cl.shared_cores else 0.0
    if cl.mode not in BARRIER_MODES:
        times = {
            "server CPU": server_cpu,
            "server link": server_link,
            "trainer link": trainer_link,
            "machine cores": machine,
        }
        slowest = max(times, key=lambda k: times[k])
        step = max(serial, times[slowest])
        binding = max(parts, key=lambda k: parts[k]) if step == serial else slowest
        bounds = {**{k: 1.0 / v for k, v in times.items() if v > 0}, "a trainer's own step": 1.0 / serial}
    else:
        # A round waits for every trainer, but the servers still work in parallel, each on its
        # own shard, and a server serves one trainer's calls while the others compute or send:
        # the round takes the busiest server's work for all T trainers, or the slowest
        # trainer's own step (the expected maximum of T normal step times), whichever is longer.
        if cl.mode == "sync":
            # Pipelined (ps_train/modes/sync.py): a trainer sends its next forward as soon as
            # its update is out; the forward waits on the server for the round, not for the
            # update's answer to come back and be read (one latency each way, and the call's
            # CPU at the trainer: half to read the answer, half to send the forward).
            serial -= c.trainer_cpu_per_message / min(cl.trainer_cores, 1.0) + 2 * cl.latency_s
        barrier = c.jitter * serial * math.sqrt(2 * math.log(t)) if t > 1 else 0.0
        times = {
            "server CPU": server_cpu,
            "server link": server_link,
            "trainer link": trainer_link,
            "machine cores": machine,
            "sync barrier": serial + barrier,
        }
        slowest = max(times, key=lambda k: times[k])
        step = times[slowest]
        if slowest == "sync barrier" and barrier < max(parts.values()):
            binding = max(parts, key=lambda k: parts[k])
        else:
            binding = slowest
        bounds = {k: 1.0 / v for k, v in times.items() if v > 0}
    return Prediction(t * w.batch / step, 1.0 / step, binding, bounds)


def suggest_servers(c: Constants, w: Workload, cl: Cluster, share: float = 0.95) -> tuple[int, Prediction]:
    """The fewest servers with which ``cl``'s trainers reach ``share`` of the most samples/s
    any number of servers gives them (in ``cl``'s mode, on its link and cores). A dense model
    tries up to its number of stages (a server beyond them holds nothing and costs each
    trainer an update request a step); a model with tables, which spread over every server,
    powers of two up to 4096."""
    candidates = [2**k for k in range(13)] if w.table_bytes else list(range(1, len(w.stages) + 1))
    tried = [(s, predict(c, w, replace(cl, servers=s))) for s in candidates]
    best = max(p.samples_per_s for _, p in tried)
    return next((s, p) for s, p in tried if p.samples_per_s >= share * best)
