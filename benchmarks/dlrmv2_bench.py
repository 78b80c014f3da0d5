"""DLRM-DCNv2 at its shape with a disk tier under each server's RAM budget, against the same
job with budgets that evict nothing.

    python -m benchmarks.dlrmv2_bench                       # 300 steps per run (hours on 2 cores)
    python -m benchmarks.dlrmv2_bench --steps 30 --result   # what a loaded machine finishes

``preset=dlrmv2`` (26 tables of 204 M rows, dimension 128, float16 lazy rows, DCN-v2, batch
512) with 2 servers and 2 trainers, sync, ``--steps`` steps, twice: **tiered** with
``--budget`` per server (default: the preset's 1GB) and **in RAM** with ``--large-budget``
(the same lazy rows and dtype, a budget no run of this length fills: nothing is evicted).
No checkpoint is written (``--final-checkpoint``: the one after the last step), so the figures
are training's alone.
Before the runs the disk under the run folders is probed (``benchmarks/_disk_probe.py``).

Reported: samples/s of each run and their ratio (target >= 0.5x); each server's peak RSS
against budget + 1 GB; the rows each server touched (created: rows are lazy) in bytes as the
tier stores them against its budget (target: 4x); the tier's counters (evicted, read back,
bytes written and read, hit rate); the tier's disk traffic per second of training against
the disk's own bandwidth; the load average around each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._ctr_job import ROOT, load1
from benchmarks._disk_probe import DiskBandwidth, measure
from benchmarks._results import add_result_option, run_recorded
from ps_train.config.model import parse_size

GB = 1 << 30
BATCH = 512  # the preset's batch per trainer
TRAINERS = SERVERS = 2


@dataclass(frozen=True)
class Run:
    name: str
    budget: str  # model.table_memory_budget
    metrics: dict[str, Any] | None  # trainer0's metrics.json (None: failed)
    stderr: str
    load_before: float
    load_after: float
    seconds: float  # the whole job, start-up and final checkpoint included


def run_job(name: str, budget: str, args: argparse.Namespace, run_dir: Path) -> Run:
    samples = int(args.steps * BATCH * TRAINERS / 0.9) + 4 * BATCH  # 10% is held out for the test
    cmd = [
        sys.executable, "-m", "ps_train", "preset=dlrmv2",
        f"train.steps={args.steps}", f"data.num_samples={samples}",
        f"cluster.num_servers={SERVERS}", f"cluster.num_trainers={TRAINERS}", "mode=sync",
        f"model.table_memory_budget={budget}", "train.eval_every=0", "checkpoint.every=0",
        f"checkpoint.final={'true' if args.final_checkpoint else 'false'}",
        "logging.progress=false", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    before, t0 = load1(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    seconds, after = time.perf_counter() - t0, load1()
    metrics = None
    if proc.returncode == 0:
        metrics = json.loads((run_dir / "metrics.json").read_text())
    return Run(name, budget, metrics, proc.stderr, before, after, seconds)


def stored_row_bytes(tier: dict[str, Any], dim: int) -> float:
    """A row's bytes as the store holds them: measured (bytes written per row written), or
    float16 values and row-wise Adagrad's one float32 when nothing was written."""
    if tier.get("rows_written"):
        return tier["bytes_written"] / tier["rows_written"]
    return dim * 2 + 4


def mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def report(runs: list[Run], disk: DiskBandwidth, args: argparse.Namespace) -> int:
    print(
        f"\npreset=dlrmv2, {SERVERS} servers + {TRAINERS} trainers, sync, {args.steps} steps of batch {BATCH} "
        f"per trainer; disk under {args.dir}: write+fsync {disk.write_mb_s:,.0f} MB/s, random 4 KiB reads "
        f"{disk.read_mb_s:,.1f} MB/s ({disk.read_iops:,.0f}/s), probe {mb(disk.probe_bytes)}"
    )
    failed = [r for r in runs if r.metrics is None]
    for r in failed:
        print(f"{r.name}: error (budget {r.budget}): {r.stderr[-1500:]!r}")
    ok = {r.name: r for r in runs if r.metrics is not None}
    print("\n| run | budget / server | samples/s | x in RAM | job s | load before / after |")
    print("|---|---|---|---|---|---|")
    base = ok["in RAM"].metrics["samples_per_s"] if "in RAM" in ok else None  # type: ignore[index]
    for r in ok.values():
        m = r.metrics or {}
        ratio = f"{m['samples_per_s'] / base:.2f}x" if base else "-"
        print(
            f"| {r.name} | {r.budget} | {m['samples_per_s']:.1f} | {ratio} | {r.seconds:.0f} | "
            f"{r.load_before:.1f} / {r.load_after:.1f} |"
        )
    print(
        "\n| run | server | peak RSS | budget + 1 GB | rows touched | touched bytes / budget | in RAM | evicted "
        "| read back | written | read | hit rate | tier write MB/s (of disk) | tier read MB/s (of disk) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in ok.values():
        m = r.metrics or {}
        wall = max(m["trainer_wall_time_s"].values())
        for s in range(SERVERS):
            ps = f"ps{s}"
            tier = m.get("tier", {}).get(ps, {})
            budget = parse_size(r.budget)
            rss = m["peak_rss_bytes"][ps]
            touched = tier.get("rows_created", 0)
            row_b = stored_row_bytes(tier, args.dim)
            w_s, r_s = tier.get("bytes_written", 0) / wall / 1e6, tier.get("bytes_read", 0) / wall / 1e6
            print(
                f"| {r.name} | {ps} | {rss / GB:.2f} GiB | {(budget + GB) / GB:.2f} GiB"
                f"{' (over)' if rss > budget + GB else ''} | {touched:,} | "
                f"{touched * row_b / budget:.2f}x ({row_b:.0f} B/row) | {tier.get('rows_in_ram', 0):,} | "
                f"{tier.get('rows_evicted', 0):,} | {tier.get('rows_read_back', 0):,} | "
                f"{mb(tier.get('bytes_written', 0))} | {mb(tier.get('bytes_read', 0))} | "
                f"{tier.get('hit_rate', 0):.3f} | {w_s:.1f} ({w_s / disk.write_mb_s:.1%}) | "
                f"{r_s:.1f} ({r_s / disk.read_mb_s:.1%}) |"
            )
    print(
        "\ntouched bytes / budget: rows created (first touched) x the bytes a row takes in the store, over one "
        "server's budget; tier MB/s: the tier's bytes over the slowest trainer's training loop; "
        "'of disk': against the probe's write+fsync and random-read bandwidth"
    )
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="training steps per trainer in each run")
    ap.add_argument("--budget", default="1GB", help="model.table_memory_budget of the tiered run (the preset's)")
    ap.add_argument(
        "--large-budget", default="64GB", help="the in-RAM run's budget: more than its rows take (nothing evicted)"
    )
    ap.add_argument(
        "--final-checkpoint",
        action="store_true",
        help="also write the checkpoint after the last step (its flush and memory count in the figures)",
    )
    ap.add_argument("--only", choices=["tiered", "ram"], nargs="*", help="run only these (default: both)")
    ap.add_argument("--dir", default=None, help="where the run folders (and the tier's stores) go; default: a temp dir")
    ap.add_argument("--probe-mb", type=int, default=256, help="the disk probe's file size (MiB)")
    ap.add_argument("--timeout", type=float, default=4 * 3600, help="seconds per run")
    ap.add_argument("--json", help="also write the runs' metrics here")
    add_result_option(ap, "dlrmv2_bench")
    args = ap.parse_args()
    args.dim = 128  # the preset's embedding_dim
    for name in ("budget", "large_budget"):
        parse_size(getattr(args, name))  # a clear error for a malformed size before any run
    if args.steps < 1:
        raise SystemExit(f"--steps {args.steps}: must be >= 1")
    print(f"final checkpoint: {'yes' if args.final_checkpoint else 'no'}")
    print(f"load average at start: {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        args.dir = args.dir or tempfile.gettempdir()
        disk = measure(Path(tmp), size_mb=args.probe_mb)
        plan = [("tiered", args.budget), ("in RAM", args.large_budget)]
        wanted = {"tiered": "tiered", "in RAM": "ram"}
        runs = []
        for name, budget in plan:
            if args.only and wanted[name] not in args.only:
                continue
            runs.append(run_job(name, budget, args, Path(tmp) / name.replace(" ", "_")))
            r = runs[-1]
            print(f"{name}: {'ok' if r.metrics else 'error'} in {r.seconds:.0f} s", flush=True)
    code = report(runs, disk, args)
    print(f"\nload average at end: {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in runs], indent=1, default=str))
    return code


if __name__ == "__main__":
    sys.exit(run_recorded("dlrmv2_bench", main))
