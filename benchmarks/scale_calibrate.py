"""Fit the cost model's constants on emulated hosts and write them, with the machine they came
from, as a calibration file (``ps_train.scaling.cost_model.load_calibration``,
``python -m ps_train.plan calibration=FILE``).

    sudo python -m benchmarks.scale_calibrate --out calib.json [--cores 0.25] [--steps 60 240] \
        [--grid 2x1 4x1 8x2 16x2] [--modes async sync] [--links-kbit 1000000 20000] \
        [--machine "idle 8-core VM"] [--records records.json] [--dry-run]
    python -m benchmarks.scale_calibrate --out calib.json --from-records records.json

Each grid point ``TxS`` (one rank per emulated host: ``scale_hosts.py``, each held to
``--cores`` by a CPU quota) runs for each mode and link at two lengths (``--steps SHORT LONG``):
the per-step CPU is the difference of a rank's whole CPU between them over the difference in
steps; samples/s and bytes per step come from the long run's ``metrics.json``. After the fit
(``ps_train.scaling.fit``) every run is predicted and the largest error becomes the stated
error. ``--records`` keeps the raw runs; ``--from-records`` refits them (no root needed). Keep
the machine quiet and ``--cores`` x (T + S) within its cores, or the load binds, not the quota.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.scale_hosts import CPU_PERIOD_S, LINK_BURST_BYTES
from ps_train.scaling.cost_model import Calibration, Cluster, Machine, predict, save_calibration
from ps_train.scaling.fit import Observation, fit
from ps_train.scaling.shapes import mlp

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Point:
    trainers: int
    servers: int
    mode: str
    rate_kbit: float


@dataclass(frozen=True)
class Record:
    """One grid point measured at two lengths: what the fit and the validation need."""

    point: Point
    cores: float
    steps: tuple[int, int]  # per trainer: the short and the long run
    rank_cpu_s: tuple[tuple[float, ...], tuple[float, ...]]  # each rank's CPU seconds, per run
    samples_per_s: float  # the long run's
    server_bytes_per_step: tuple[float, ...]  # the long run's, sent + received, per server
    load: tuple[float, float]  # 1-minute load average before and after


def grid(points: list[str], modes: list[str], links: list[float]) -> list[Point]:
    out = []
    for text in points:
        t, _, s = text.partition("x")
        if not (t.isdigit() and s.isdigit() and int(t) >= 1 and int(s) >= 1):
            raise SystemExit(f"--grid: {text!r} is not TxS (trainers x servers, e.g. 4x1)")
        out += [Point(int(t), int(s), m, r) for m in modes for r in links]
    return out


def measure(point: Point, cores: float, steps: tuple[int, int], timeout: float) -> Record:
    from benchmarks.scale_hosts import run  # needs root and network namespaces: imported when measuring

    before = os.getloadavg()[0]
    runs = [run(point.trainers, point.servers, n, point.rate_kbit, timeout, cores, point.mode) for n in steps]
    per = runs[1].get("server_bytes_per_step") or {}
    nbytes = tuple(float(per[f"ps{r}"]["sent"] + per[f"ps{r}"]["received"]) for r in range(point.servers))
    return Record(
        point,
        cores,
        steps,
        (tuple(runs[0]["rank_cpu_s"]), tuple(runs[1]["rank_cpu_s"])),
        float(runs[1]["samples_per_s"]),
        nbytes,
        (before, os.getloadavg()[0]),
    )


def observation(rec: Record) -> Observation:
    """The per-step figures of a record: the long run's CPU minus the short one's, per step."""
    p, (short, long) = rec.point, rec.steps
    extra = long - short
    cpu = [b - a for a, b in zip(*rec.rank_cpu_s, strict=True)]
    servers = tuple(cpu[r] / (p.trainers * extra) for r in range(p.servers))
    trainer = sum(cpu[p.servers :]) / (p.trainers * extra)
    load = sum(rec.load) / 2
    return Observation(
        p.mode, p.trainers, p.servers, long, rec.samples_per_s, trainer, servers, rec.server_bytes_per_step,
        rec.cores * (p.trainers + p.servers), load, mlp(), p.rate_kbit * 1e3,
    )  # fmt: skip


def cluster_of(rec: Record) -> Cluster:
    p = rec.point
    link, cores = p.rate_kbit * 1e3, rec.cores
    return Cluster(p.trainers, p.servers, link, 0.0, cores, cores, None, p.mode, LINK_BURST_BYTES, CPU_PERIOD_S)


def calibrate(records: list[Record], machine: str, command: str) -> tuple[Calibration, list[str]]:
    """Fit on ``records``, check every one, and the calibration with its stated error."""
    pairs = [(observation(r), r) for r in records]

    def host_cluster(o: Observation) -> Cluster:  # the fit hands back the observations it was given
        return next(cluster_of(r) for seen, r in pairs if seen is o)

    c = fit([o for o, _ in pairs], cluster_of=host_cluster)
    rows, worst = [], 0.0
    for r in records:
        p = predict(c, mlp(), cluster_of(r))
        err = (p.samples_per_s - r.samples_per_s) / r.samples_per_s
        worst = max(worst, abs(err))
        rows.append(
            f"| {r.point.mode} | {r.point.trainers} | {r.point.servers} | {r.point.rate_kbit:g} | {r.cores:g} | "
            f"{r.samples_per_s:,.0f} | {p.samples_per_s:,.0f} | {err:+.0%} | {p.binding} |"
        )
    loads = [x for r in records for x in r.load]
    cal = Calibration(
        c,
        Machine(
            machine,
            os.cpu_count() or 0,
            f"{min(loads):.1f}-{max(loads):.1f}",
            time.strftime("%Y-%m-%d"),
            _commit(),
            command,
        ),
        error_where_fitted=worst,
        error_elsewhere=max(worst, 0.58),  # until other machines are checked: the largest seen so far
        notes=f"fitted on {len(records)} emulated-host grid points, one rank per host at {records[0].cores:g} cores",
    )
    header = ["| mode | T | S | link kbit/s | cores/host | measured samples/s | predicted | error | binds |"]
    return cal, [*header, "|---|---|---|---|---|---|---|---|---|", *rows, f"largest error {worst:.0%}"]


def _commit() -> str:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def record_from(doc: dict[str, Any]) -> Record:
    p = Point(**doc["point"])
    cpu = doc["rank_cpu_s"]
    return Record(
        p, float(doc["cores"]), tuple(doc["steps"]), (tuple(cpu[0]), tuple(cpu[1])), float(doc["samples_per_s"]),
        tuple(doc["server_bytes_per_step"]), tuple(doc["load"]),
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the calibration file to write")
    ap.add_argument("--grid", nargs="+", default=["2x1", "4x1", "8x2", "16x2"], help="TxS points")
    ap.add_argument("--modes", nargs="+", choices=("async", "sync"), default=["async", "sync"])
    ap.add_argument("--links-kbit", nargs="+", type=float, default=[1_000_000.0, 20_000.0], help="fast and slow")
    ap.add_argument("--cores", type=float, default=0.25, help="CPU budget of every host")
    ap.add_argument("--steps", nargs=2, type=int, default=[60, 240], metavar=("SHORT", "LONG"))
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    ap.add_argument("--machine", default=f"{platform.node()}, {os.cpu_count()} cores, emulated hosts")
    ap.add_argument("--records", type=Path, default=None, help="also keep the raw runs here")
    ap.add_argument("--from-records", type=Path, default=None, help="refit these raw runs; run nothing")
    ap.add_argument("--dry-run", action="store_true", help="print the runs it would make and stop")
    args = ap.parse_args()
    short, long = args.steps
    if not 0 < short < long:
        raise SystemExit(f"--steps: need 0 < SHORT < LONG, got {short} {long}")
    if args.cores <= 0:
        raise SystemExit(f"--cores must be > 0, got {args.cores}")
    if args.from_records:
        records = [record_from(d) for d in json.loads(args.from_records.read_text())]
    else:
        points = grid(args.grid, args.modes, args.links_kbit)
        for pt in points:
            print(f"[calibrate] {pt.mode} T={pt.trainers} S={pt.servers} at {pt.rate_kbit:g} kbit/s, "
                  f"{args.cores:g} cores a host, {short} and {long} steps")  # fmt: skip
        if args.dry_run:
            return
        records = []
        for pt in points:
            records.append(measure(pt, args.cores, (short, long), args.timeout))
            if args.records:  # after every point: a failed or stopped grid keeps the runs it made
                args.records.write_text(json.dumps([asdict(r) for r in records], indent=1) + "\n")
    if not records:
        raise SystemExit("no runs to fit")
    cal, table = calibrate(records, args.machine, " ".join(["python -m benchmarks.scale_calibrate", *sys.argv[1:]]))
    print("\n".join(table))
    save_calibration(cal, args.out)
    print(f"wrote {args.out}: {cal.stated_error()}")


if __name__ == "__main__":
    main()
