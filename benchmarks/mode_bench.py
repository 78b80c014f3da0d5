"""DLRM under two update modes, side by side: samples/s and test AUC (default: sync vs hybrid).

Usage (from the repo root)::

    python -m benchmarks.mode_bench                          # sync vs hybrid, 4 trainers, 2 rounds
    python -m benchmarks.mode_bench --modes sync hybrid async --rounds 3 --json out.json
    python -m benchmarks.mode_bench --extra mode.staleness=2  # overrides for every run
    python -m benchmarks.mode_bench --trainers 2 4 8          # at which trainer count a mode wins

Each run is ``python -m ps_train model=dlrm data=synthetic_ctr`` with each of ``--trainers``
trainer counts and 2 servers, one pass over ``--samples`` synthetic samples (steps = 0.9 x
samples / (trainers x 256)), no periodic evaluation; the modes alternate within a round (and
a trainer count) so a change in the machine's load hits both. Figures per run:
``samples_per_s`` (all trainers' samples over the longest training loop, from
``metrics.json``), ``test_auc`` and the 1-minute load average before and after it
(``/proc/loadavg``). Printed as a Markdown table, a row per trainer count and mode; "x first
mode" is each round's samples/s over the first mode's in the same round (the two runs back to
back), so a load that drifts between rounds cancels out of it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from typing import Any

from benchmarks._ctr_job import run_dlrm_job
from benchmarks._results import add_result_option, run_recorded


def one_run(mode: str, trainers: int, args: argparse.Namespace, run_dir: str) -> dict[str, Any]:
    steps = int(0.9 * args.samples / (trainers * 256))
    overrides = [
        f"data.num_samples={args.samples}",
        f"cluster.num_trainers={trainers}",
        "cluster.num_servers=2",
        f"train.steps={steps}",
        f"mode={mode}",
        *(args.extra if mode in args.extra_modes else []),
    ]
    job = run_dlrm_job(run_dir, overrides, args.timeout)
    m = job.metrics
    if m is None:
        return {"mode": mode, "trainers": trainers, "status": "error", "stderr": job.stderr[-2000:]}
    return {
        "mode": mode,
        "trainers": trainers,
        "status": "ok",
        "steps": steps,
        "samples_per_s": m["samples_per_s"],
        "test_auc": m["test_auc"],
        "test_best_auc": m.get("test_best_auc"),
        "max_staleness": m["max_staleness"],
        "load1_before": job.load1_before,
        "load1_after": job.load1_after,
        "total_s": job.seconds,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=["sync", "hybrid"])
    p.add_argument("--trainers", type=int, nargs="+", default=[4], help="trainer counts, each run in turn")
    p.add_argument("--samples", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--extra", nargs="*", default=["mode.staleness=1"], help="overrides for --extra-modes")
    p.add_argument("--extra-modes", nargs="*", default=["hybrid"])
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default=None)
    add_result_option(p, "mode_bench")
    args = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="mode_bench_") as root:
        for trainers in args.trainers:
            for r in range(args.rounds):
                for mode in args.modes:
                    res = one_run(mode, trainers, args, os.path.join(root, f"{mode}_{trainers}_{r}"))
                    res["round"] = r
                    print(json.dumps(res), file=sys.stderr, flush=True)
                    results.append(res)
    first = args.modes[0]
    print(
        f"| trainers | mode | runs | samples/s (each) | median | x {first} (each round) | test AUC (each) "
        "| max staleness | load1 before/after |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for trainers in args.trainers:
        base = {
            r["round"]: r["samples_per_s"]
            for r in results
            if r["trainers"] == trainers and r["mode"] == first and r["status"] == "ok"
        }
        for mode in args.modes:
            ok = [r for r in results if r["trainers"] == trainers and r["mode"] == mode and r["status"] == "ok"]
            if not ok:
                print(f"| {trainers} | {mode} | 0 | error | | | | | |")
                continue
            rates = ", ".join(f"{r['samples_per_s']:,.0f}" for r in ok)
            median = statistics.median(r["samples_per_s"] for r in ok)
            ratios = [r["samples_per_s"] / base[r["round"]] for r in ok if r["round"] in base]
            vs = ", ".join(f"{x:.2f}" for x in ratios)
            if ratios:
                vs += f" (median {statistics.median(ratios):.2f})"
            aucs = ", ".join(f"{r['test_auc']:.4f}" for r in ok)
            loads = ", ".join(f"{r['load1_before']:.1f}/{r['load1_after']:.1f}" for r in ok)
            stale = max(r["max_staleness"] for r in ok)
            print(f"| {trainers} | {mode} | {len(ok)} | {rates} | {median:,.0f} | {vs} | {aucs} | {stale} | {loads} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": results}, f, indent=1)
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(run_recorded("mode_bench", main))
