"""The arithmetic of ``scale_model.py``: per-step constants fitted on measured runs, and the
samples/s a cluster reaches with the resource that binds it. docs/scaling.md derives it.

Per trainer step, with ``m_s`` requests, ``n_s`` payload bytes (both ways, from the model's
shapes) and ``f_s`` flops on server ``s`` (``shapes.server_loads``):

- bytes on the wire at server s:  ``w_s = beta * n_s + gamma * m_s``  (framing, pickling)
- server CPU:                     ``u_s = a * m_s + b * w_s + f_s / F``  (F: FLOP/s, assumed)
- trainer CPU:                    ``c = c0 + c1 * sum_s m_s``
- a trainer's own step (serial):  ``c + sum over its shards' servers of u_s + round trips x
  2 x latency + its bytes the busier way / bandwidth``; round
  trips = 2 x shards + 1 (forward and backward through each shard, then the update to all
  servers at once).

Async: each trainer steps at the least of ``1 / serial step``, ``cores_s / (T u_s)`` (server
CPU), ``B / (T x server s's bytes the busier way)`` (server link) and, all ranks on one machine of ``C`` cores,
``C / (T (c + sum_s u_s))``. Sync: a step waits for all trainers, so the servers' work for
the T trainers adds to the trainer's instead of overlapping it, plus the slowest of T
trainers: ``jitter x serial step x sqrt(2 ln T)`` (the expected maximum of T normal times).
A process uses at most one core (Python's interpreter lock), so cores above 1 do not count.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ps_train.scaling.shapes import ServerLoad, Workload, mlp, server_loads

__all__ = [
    "Observation",
    "Constants",
    "Cluster",
    "Prediction",
    "observation_from_run",
    "fit",
    "predict",
    "measured_as_cluster",
    "busier_way",
]

DEFAULT_JITTER = 0.1  # coefficient of variation of a trainer's step time, when no sync run fits it


@dataclass(frozen=True)
class Observation:
    """What one measured run tells the model (a ``scale_bench.py`` record)."""

    mode: str
    trainers: int
    servers: int
    steps: int  # per trainer
    samples_per_s: float
    trainer_cpu_per_step: float  # seconds
    server_cpu_per_step: tuple[float, ...]  # seconds per trainer step, per server
    server_bytes_per_step: tuple[float, ...]  # sent + received per trainer step, per server
    cores_used: float  # all roles' CPU while training / training wall time
    load: float  # the machine's load average during the run
    workload: Workload  # what the run trained (an MLP: its hidden sizes and batch)


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


@dataclass(frozen=True)
class Cluster:
    trainers: int
    servers: int
    link_bps: float  # each host's link, each way, bits/s (math.inf: loopback)
    latency_s: float  # one way
    trainer_cores: float
    server_cores: float
    shared_cores: float | None  # all ranks on one machine with this many cores (None: a host each)
    mode: str  # async | sync


@dataclass(frozen=True)
class Prediction:
    samples_per_s: float
    steps_per_s: float  # per trainer
    binding: str
    bounds: dict[str, float] = field(default_factory=dict)  # async: steps/s per trainer each allows


def observation_from_run(run: dict[str, Any]) -> Observation | None:
    """A ``scale_bench.py`` record as the model sees it; None if the run has no figures.

    Its steady window (``steady``: between trainer0's first and last progress line) when it
    has one; else the whole run since all ranks joined, where trainer0's final evaluation
    counts too, so a trainer's CPU is taken from the others when there are others."""
    cpu, per, steady = run.get("role_cpu") or {}, run.get("server_bytes_per_step"), run.get("steady")
    if not run.get("samples_per_s") or not per or not cpu or not run.get("cores_used"):
        return None
    t, s = int(run["trainers"]), int(run["servers"])
    workload = _mlp_of(run)
    if workload is None:
        return None
    load = run.get("load_mean") or run.get("load_before") or 0.0
    nbytes = tuple(per[f"ps{r}"]["sent"] + per[f"ps{r}"]["received"] for r in range(s))
    if steady and steady["steps"] > 0:
        d, steps = steady["cpu_s"], steady["steps"]
        trainer = statistics.mean(d[f"trainer{k}"] for k in range(t)) / steps
        servers = tuple(d[f"ps{r}"] / (t * steps) for r in range(s))
        rate, cores = float(steady["samples_per_s"]), float(steady["cores_used"])
    else:
        steps = int(run["steps"])
        names = [f"trainer{k}" for k in range(1 if t > 1 else 0, t)]
        trainer = statistics.mean(cpu[n]["training_s"] for n in names) / steps
        servers = tuple(cpu[f"ps{r}"]["training_s"] / (t * steps) for r in range(s))
        rate, cores = float(run["samples_per_s"]), float(run["cores_used"])
    return Observation(run["mode"], t, s, steps, rate, trainer, servers, nbytes, cores, load, workload)


def _mlp_of(run: dict[str, Any]) -> Workload | None:
    """The MLP a run trained, from its overrides and its samples per trainer step; None for
    another model (the fit takes MLP runs only)."""
    hidden: tuple[int, ...] = (128, 64)
    for o in run.get("overrides") or []:
        key, _, value = o.partition("=")
        if key == "model" and value != "mlp":
            return None
        if key == "model.hidden_sizes":
            hidden = tuple(int(v) for v in value.strip("[]").split(",") if v.strip())
    steps = run.get("steps") or 0
    batch = run["samples"] // (run["trainers"] * steps) if run.get("samples") and steps else 32
    return mlp(hidden, batch)


def _lstsq(columns: list[list[float]], y: list[float]) -> list[float]:
    """Least-squares coefficients, none negative (a negative one is dropped and the rest refitted)."""
    a, target = np.array(columns, dtype=float).T, np.array(y, dtype=float)
    coef = np.linalg.lstsq(a, target, rcond=None)[0]
    if (coef < 0).any() and len(columns) > 1:
        keep = [i for i in range(len(columns)) if coef[i] >= 0] or [int(np.argmax(coef))]
        sub = _lstsq([columns[i] for i in keep], y)
        full = [0.0] * len(columns)
        for i, v in zip(keep, sub, strict=True):
            full[i] = v
        return full
    return [max(float(v), 0.0) for v in coef]


def fit(obs: list[Observation], flop_rate: float = 5e9) -> Constants:
    """Constants that reproduce ``obs``."""
    loads = {id(o): server_loads(o.workload, o.servers) for o in obs}
    pts = [(ld, o.server_bytes_per_step[r], o.server_cpu_per_step[r]) for o in obs for r, ld in enumerate(loads[id(o)])]
    beta, gamma = _lstsq([[ld.bytes for ld, _, _ in pts], [ld.messages for ld, _, _ in pts]], [b for _, b, _ in pts])
    a, b = _lstsq(
        [[ld.messages for ld, _, _ in pts], [wb for _, wb, _ in pts]],
        [cpu - ld.flops / flop_rate for ld, _, cpu in pts],
    )
    msgs = [sum(ld.messages for ld in loads[id(o)]) for o in obs]
    c0, c1 = _lstsq([[1.0] * len(obs), [float(m) for m in msgs]], [o.trainer_cpu_per_step for o in obs])
    c = Constants(beta, gamma, a, b, c0, c1, flop_rate, DEFAULT_JITTER)
    sync = [o for o in obs if o.mode == "sync" and o.trainers > 1]
    if sync:
        # The jitter that fits the sync runs best (least squared log error), on a grid.
        def error(j: float) -> float:
            cj = Constants(**{**c.__dict__, "jitter": j})
            return sum(
                math.log(predict(cj, o.workload, measured_as_cluster(o)).samples_per_s / o.samples_per_s) ** 2
                for o in sync
            )

        best = min((k / 20 for k in range(0, 101)), key=error)  # 0 to 5, coarse, then finer around it
        best = min((max(0.0, best + k / 2000) for k in range(-100, 101)), key=error)
        c = Constants(**{**c.__dict__, "jitter": best, "jitter_fitted": True})
    return c


def measured_as_cluster(o: Observation) -> Cluster:
    """The cluster a loopback run was: one machine whose cores the run got, no link limit."""
    return Cluster(o.trainers, o.servers, math.inf, 0.0, 1.0, 1.0, o.cores_used, o.mode)


def _costs(c: Constants, w: Workload, servers: int) -> tuple[list[ServerLoad], list[float], list[float], float]:
    """Per server: loads, wire bytes and CPU seconds per trainer step; the trainer's CPU."""
    loads = server_loads(w, servers)
    wire = [c.beta * ld.bytes + c.gamma * ld.messages for ld in loads]
    cpu = [
        c.server_cpu_per_message * ld.messages + c.server_cpu_per_byte * wb + ld.flops / c.flop_rate
        for ld, wb in zip(loads, wire, strict=True)
    ]
    trainer = c.trainer_cpu_base + c.trainer_cpu_per_message * sum(ld.messages for ld in loads)
    return loads, wire, cpu, trainer


def busier_way(c: Constants, w: Workload, servers: int) -> list[float]:
    """Each server's wire bytes per trainer step the busier way (in or out): what its link's
    rate bounds. A request's framing counts half each way."""
    return [
        c.beta * max(ld.received, ld.bytes - ld.received) + c.gamma * ld.messages / 2 for ld in server_loads(w, servers)
    ]


def _trainer_ways(c: Constants, loads: list[ServerLoad]) -> tuple[float, float]:
    """A trainer's wire bytes per step out (what its servers receive) and in (what they send)."""
    framing = c.gamma * sum(ld.messages for ld in loads) / 2
    out = c.beta * sum(ld.received for ld in loads) + framing
    back = c.beta * sum(ld.bytes - ld.received for ld in loads) + framing
    return out, back


def _serial(c: Constants, w: Workload, cl: Cluster) -> tuple[float, dict[str, float]]:
    """A trainer's step alone: its total seconds and their parts."""
    loads, wire, cpu, trainer = _costs(c, w, cl.servers)
    kt, ks = min(cl.trainer_cores, 1.0), min(cl.server_cores, 1.0)
    on_path = sum(u for ld, u in zip(loads, cpu, strict=True) if ld.shard)
    off_path = [u for ld, u in zip(loads, cpu, strict=True) if not ld.shard]  # table shares, in parallel
    shards = sum(ld.shard for ld in loads)
    parts = {
        "trainer CPU": trainer / kt,
        "server compute on the path": (on_path + max(off_path, default=0.0)) / ks,
        "round trips": (2 * shards + 1 + (1 if w.table_bytes else 0)) * 2 * cl.latency_s,
        # The busier way of the trainer's link: what the servers receive, or what they send.
        "trainer link": max(_trainer_ways(c, loads)) * 8 / cl.link_bps,
    }
    return sum(parts.values()), parts


def predict(c: Constants, w: Workload, cl: Cluster) -> Prediction:
    """Samples/s of ``cl`` running ``w``, and the resource that binds."""
    if cl.trainers < 1 or cl.servers < 1:
        raise ValueError(f"trainers and servers must be >= 1, got {cl.trainers} and {cl.servers}")
    if cl.mode not in ("async", "sync"):
        raise ValueError(f"mode must be async or sync, got {cl.mode!r}")
    _, wire, cpu, trainer = _costs(c, w, cl.servers)
    ks = min(cl.server_cores, 1.0)
    serial, parts = _serial(c, w, cl)
    t = cl.trainers
    server_cpu = t * max(cpu) / ks  # seconds of the busiest server's CPU per step of every trainer
    server_link = t * max(busier_way(c, w, cl.servers)) * 8 / cl.link_bps
    machine = t * (trainer + sum(cpu)) / cl.shared_cores if cl.shared_cores else 0.0
    if cl.mode == "async":
        times = {"server CPU": server_cpu, "server link": server_link, "machine cores": machine}
        slowest = max(times, key=lambda k: times[k])
        step = max(serial, times[slowest])
        binding = max(parts, key=lambda k: parts[k]) if step == serial else slowest
        bounds = {**{k: 1.0 / v for k, v in times.items() if v > 0}, "a trainer's own step": 1.0 / serial}
    else:
        # The servers serve every trainer's step before any trainer goes on: their time adds.
        server = max(parts["server compute on the path"], server_cpu, server_link)
        barrier = c.jitter * serial * math.sqrt(2 * math.log(t)) if t > 1 else 0.0
        terms = {
            "trainer CPU": parts["trainer CPU"],
            "round trips": parts["round trips"] + parts["trainer link"],
            "server CPU" if server > server_link else "server link": server,
            "sync barrier": barrier,
        }
        step = max(sum(terms.values()), machine)
        binding = "machine cores" if machine > sum(terms.values()) else max(terms, key=lambda k: terms[k])
        bounds = {}
    return Prediction(t * w.batch / step, 1.0 / step, binding, bounds)
