"""DLRM benchmark: ps_train's row-sharded tables on rpc_core vs backend=torch vs one process
(plain torch, and TorchRec's DLRM when torchrec is installed).

    python -m benchmarks.ctr_bench --rounds 2       # small 1+1 and 2+2, large 2+2, multihot 2+2
    python -m benchmarks.ctr_bench --quick          # everything once, few steps (~4-6 min)
    python -m benchmarks.ctr_bench --tables         # the tables' lookup + backward + update alone

Trains ``model=dlrm`` on ``data=synthetic_ctr`` in sync mode each way, alternating. The first
table gives samples/s (all trainers' samples over the training loop, start-up excluded; the
median over rounds) and the ratios rpc_core / torch and rpc_core / single (higher is better);
the second each server's bytes per step against the ideal of the scheme
(``ps_train/workloads/ctr/ideal_traffic.py``); then peak RSS per role, the loss check of the 1+1 run
against one process, and the targets PASS/FAIL. A failed run shows "error" and its reason; the
exit status is then 1. ``--tables`` prints ms per step of each table variant against this
run's memcpy floor (``_table_step.py``). Details: docs/benchmarking.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks._ctr_report import render
from benchmarks._ctr_runs import (
    BACKENDS,
    CONFIGS,
    REPO,
    compose,
    overrides_for,
    run_ps_train,
    run_single,
    single_worker,
)
from benchmarks._results import add_result_option, run_recorded
from ps_train.workloads.ctr.ideal_traffic import replay_ideal_bytes


def run_tables(args: argparse.Namespace) -> int:
    """``--tables``: every ``_table_step`` variant in a child process, one after another,
    then the table of figures against the memcpy floor measured here."""
    import statistics

    from benchmarks._floor import _memcpy_gbs
    from benchmarks._table_step import VARIANTS, fbgemm_missing, render_tables

    steps = args.table_steps or (12 if args.quick else 30)
    timeout = args.timeout or 1800.0
    info = {
        **machine(),
        "loadavg_start": os.getloadavg()[0],
        "steps": steps,
        "bag": args.tables_bag,
        "command": " ".join(["python -m benchmarks.ctr_bench", *sys.argv[1:]]),
        "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    memcpy = [statistics.median(_memcpy_gbs())]
    results: dict[str, dict[str, Any]] = {}
    for v in VARIANTS:
        if v == "fbgemm" and fbgemm_missing():
            results[v] = {"skipped": fbgemm_missing()}
            continue
        print(f"[tables] {v}, {steps} steps", file=sys.stderr, flush=True)
        with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
            cmd = [
                sys.executable,
                "-m",
                "benchmarks.ctr_bench",
                "--table-worker",
                v,
                str(steps),
                str(args.tables_bag),
                out.name,
            ]
            try:
                proc = subprocess.run(
                    cmd, cwd=REPO, timeout=timeout, stdout=sys.stderr, stderr=subprocess.PIPE, text=True
                )
            except subprocess.TimeoutExpired:
                results[v] = {"error": f"timeout after {timeout:.0f} s"}
                continue
            if proc.returncode != 0:
                last = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
                results[v] = {"error": f"exit code {proc.returncode}: {last[-1] if last else 'no output'}"}
                continue
            results[v] = json.load(out)
        memcpy.append(statistics.median(_memcpy_gbs()))  # the floor between variants: the load drifts
    info["loadavg_end"] = os.getloadavg()[0]
    text, doc = render_tables(results, statistics.median(memcpy), args.tables_bag)
    print(
        f"{info['cpu']}, {info['cores']} cores, load average {info['loadavg_start']:.1f} -> "
        f"{info['loadavg_end']:.1f}; memcpy GB/s over the run: {', '.join(f'{m:.2f}' for m in memcpy)}"
    )
    print(text)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({**doc, "info": info, "memcpy_samples": memcpy}, f, indent=2)
    return 1 if any("error" in r for r in results.values()) else 0


def machine() -> dict[str, Any]:
    import torch

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or None
        )
        if (
            commit
            and subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
        ):
            commit += " (with uncommitted changes)"
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": commit,
        "memory_gib": _mem_gib(),
    }


def _mem_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal"))
        return round(kib / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="DLRM: ps_train on rpc_core vs backend=torch vs one process",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    ap.add_argument("--quick", action="store_true", help="fewer steps (small 150, large 40 instead of 600, 200)")
    ap.add_argument("--only", choices=tuple(CONFIGS), default=None, help="run one configuration")
    ap.add_argument("--rounds", type=int, default=1, help="runs of everything, reversing the order every other round")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write every figure, per round, as JSON")
    ap.add_argument("--timeout", type=float, default=None, help="limit per run in seconds (default 900, quick 600)")
    ap.add_argument(
        "--run-root", default=None, metavar="DIR", help="where the run folders go (default: a new temp dir)"
    )
    ap.add_argument("--keep-runs", action="store_true", help="keep every run folder (a failed one's is kept)")
    ap.add_argument(
        "--update-in-backward",
        choices=("null", "true", "false"),
        default="null",
        help="cluster.update_in_backward of the rpc_core runs (null: ps_train's default)",
    )
    ap.add_argument("--tables", action="store_true", help="instead: the tables' part of a step alone, per variant")
    ap.add_argument("--tables-bag", type=int, default=1, help="ids per bag for --tables (default 1: one-hot)")
    ap.add_argument("--table-steps", type=int, default=None, help="timed steps per --tables variant (default 30)")
    add_result_option(ap, "ctr_bench")
    ap.add_argument("--single-worker", nargs=3, metavar=("CONFIG", "STEPS", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--torchrec-worker", nargs=3, metavar=("CONFIG", "STEPS", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--table-worker", nargs=4, metavar=("VARIANT", "STEPS", "BAG", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.table_worker:
        from benchmarks._table_step import worker

        variant, steps_, bag, out = args.table_worker
        worker(variant, int(steps_), int(bag), out)
        return 0
    if args.tables:
        return run_tables(args)
    if args.single_worker:
        name, steps, out = args.single_worker
        single_worker(name, int(steps), out)
        return 0
    if args.torchrec_worker:
        from benchmarks._torchrec_dlrm import worker as torchrec_worker

        name, steps, out = args.torchrec_worker
        torchrec_worker(compose(overrides_for(name, 1, 1, "rpc_core", int(steps))), int(steps), out)
        return 0
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    os.environ.pop("PS_TRAIN_FAULT", None)  # test-only fault injection: never in a benchmark
    names = [args.only] if args.only else list(CONFIGS)
    steps = {n: CONFIGS[n][2]["quick" if args.quick else "full"] for n in names}
    timeout = args.timeout or (600.0 if args.quick else 900.0)
    run_root = tempfile.mkdtemp(prefix="ctr_bench_", dir=args.run_root)
    info = {
        **machine(),
        "loadavg_start": os.getloadavg()[0],
        "rounds": args.rounds,
        "update_in_backward": args.update_in_backward,
        "quick": args.quick,
        "steps": steps,
        "command": " ".join(["python -m benchmarks.ctr_bench", *(argv or sys.argv[1:])]),
        "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    log(f"{info['cpu']}, {info['cores']} cores, kernel {info['kernel']}, torch {info['torch']}; runs in {run_root}")

    # The ideal bytes depend only on the batches: replayed once per configuration and cluster.
    ideal = {}
    for n in names:
        for s, t in CONFIGS[n][1]:
            c = compose(overrides_for(n, s, t, "rpc_core", steps[n]))
            ideal[(n, s, t)] = replay_ideal_bytes(c.model, c.data, c.cluster, c.train.batch_size, c.seed, steps[n])
    raw: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    jobs: list[tuple[Any, ...]] = []
    for n in names:
        jobs += [(n, "single"), (n, "torchrec")]
        jobs += [(n, s, t, b) for s, t in CONFIGS[n][1] for b in BACKENDS]
    failed, kept = False, []
    for rnd in range(args.rounds):
        for job in jobs if rnd % 2 == 0 else jobs[::-1]:  # slow drift in load favours no side
            n = job[0]
            log(f"[round {rnd + 1}/{args.rounds}] {' '.join(map(str, job))}, {steps[n]} steps")
            if job[1] in ("single", "torchrec"):
                res = run_single(n, steps[n], timeout, job[1])
            else:
                _, s, t, b = job
                run_dir = tempfile.mkdtemp(prefix=f"{n}_{s}x{t}_{b}_", dir=run_root)
                res = run_ps_train(
                    overrides_for(n, s, t, b, steps[n], in_backward=args.update_in_backward), run_dir, timeout
                )
                if res["status"] != "ok" or args.keep_runs:
                    kept.append(run_dir)
                else:
                    shutil.rmtree(run_dir, ignore_errors=True)
            failed |= res["status"] == "error"
            log(
                f"    {res['samples_per_s']:,.0f} samples/s"
                if res["samples_per_s"]
                else f"    {res.get('error') or res.get('skipped')}"
            )
            raw.setdefault(job, []).append(res)
    if not kept:
        shutil.rmtree(run_root, ignore_errors=True)
    else:
        log(f"kept run folders: {', '.join(kept)}")
    info["loadavg_end"] = os.getloadavg()[0]
    text, doc = render(names, CONFIGS, BACKENDS, raw, ideal, info)
    print(text)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {
                    **doc,
                    "info": info,
                    "runs": {
                        " ".join(map(str, k)): [{x: y for x, y in r.items() if x != "losses"} for r in v]
                        for k, v in raw.items()
                    },
                },
                f,
                indent=2,
            )
        log(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_recorded("ctr_bench", main))
