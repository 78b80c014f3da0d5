"""Fitting the cost model's constants (``ps_train.scaling.cost_model``) on measured runs: what a
``benchmarks/scale_bench.py`` record tells the model, and the least-squares fit over many.

The fit takes MLP runs only: their shapes are known from the overrides, and the MLP's
arithmetic is small enough that the per-request and per-byte costs show.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ps_train.scaling.cost_model import PACED_BELOW_BPS, Cluster, Constants, predict
from ps_train.scaling.shapes import Workload, mlp, server_loads

__all__ = ["Observation", "DEFAULT_JITTER", "observation_from_run", "fit", "measured_as_cluster"]

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
    link_bps: float = math.inf  # each host's link (inf: loopback), for the CPU of paced bytes


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


def paced(link_bps: float) -> float:
    """1.0 for a link that delivers by the segment (``Constants.paced``), else 0.0."""
    return float(link_bps < PACED_BELOW_BPS)


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


def fit(
    obs: list[Observation], flop_rate: float = 5e9, cluster_of: Callable[[Observation], Cluster] | None = None
) -> Constants:
    """Constants that reproduce ``obs``. ``cluster_of``: the cluster a run was, for the sync
    runs' jitter (default ``measured_as_cluster``: one machine, the cores the run got)."""
    cluster_of = cluster_of or measured_as_cluster
    loads = {id(o): server_loads(o.workload, o.servers) for o in obs}
    pts = [
        (ld, o.server_bytes_per_step[r], o.server_cpu_per_step[r], o.link_bps)
        for o in obs
        for r, ld in enumerate(loads[id(o)])
    ]
    beta, gamma = _lstsq([[p[0].bytes for p in pts], [p[0].messages for p in pts]], [p[1] for p in pts])
    # A byte costs CPU at the server everywhere (b), and more on a paced link (see Constants).
    a, b, bp = _lstsq(
        [[p[0].messages for p in pts], [p[1] for p in pts], [p[1] * paced(p[3]) for p in pts]],
        [cpu - ld.flops / flop_rate for ld, _, cpu, _ in pts],
    )
    msgs = [sum(ld.messages for ld in loads[id(o)]) for o in obs]
    paced_bytes = [sum(o.server_bytes_per_step) * paced(o.link_bps) for o in obs]
    c0, c1, cp = _lstsq(
        [[1.0] * len(obs), [float(m) for m in msgs], paced_bytes], [o.trainer_cpu_per_step for o in obs]
    )
    c = Constants(beta, gamma, a, b, c0, c1, flop_rate, DEFAULT_JITTER, False, bp, cp)
    sync = [o for o in obs if o.mode == "sync" and o.trainers > 1]
    if sync:
        # The jitter that fits the sync runs best (least squared log error), on a grid.
        def error(j: float) -> float:
            cj = Constants(**{**c.__dict__, "jitter": j})
            return sum(
                math.log(predict(cj, o.workload, cluster_of(o)).samples_per_s / o.samples_per_s) ** 2 for o in sync
            )

        best = min((k / 20 for k in range(0, 101)), key=error)  # 0 to 5, coarse, then finer around it
        best = min((max(0.0, best + k / 2000) for k in range(-100, 101)), key=error)
        c = Constants(**{**c.__dict__, "jitter": best, "jitter_fitted": True})
    return c


def measured_as_cluster(o: Observation) -> Cluster:
    """The cluster a loopback run was: one machine whose cores the run got, no link limit."""
    return Cluster(o.trainers, o.servers, math.inf, 0.0, 1.0, 1.0, o.cores_used, o.mode)
