"""End to end: ps_train on rpc_core vs ps_train on torch.distributed.rpc vs one process.

    python -m benchmarks.e2e_bench --rounds 2     # MLP and CNN, 1+1 and 2+2 (~2-4 min a round)
    python -m benchmarks.e2e_bench --quick        # fewer steps: checks that everything runs
    python -m benchmarks.e2e_bench --messages     # requests per step and server, every mode

Trains the same config (synthetic MNIST-sized data, batch 32, SGD, sync) four ways: ps_train on
rpc_core with the update as its own call and riding on the backward
(``cluster.update_in_backward``), ps_train with ``backend=torch``, and plain torch in one process.
The table gives samples/s of the training loop (start-up excluded; for ps_train all trainers'
samples over the longest trainer's loop), the ratios rpc_core/torch and rpc_core/single (higher
is better), the median over rounds (every other round runs in reverse order). Under it: the
requests per trainer step and server, the largest per-step loss difference of the 1+1 runs
against the single process (0: the same computation), each round's ratios (the noise), the load
average, and the targets met or missed. A failed run shows "error" and its reason; the exit
status is then 1. Details: docs/benchmarking.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

from benchmarks._e2e_messages import render_messages, run_messages
from benchmarks._e2e_report import build_rows, evaluate_targets, render
from benchmarks._e2e_runs import BACKENDS, BATCH_SIZE, CLUSTERS, MODELS, STEPS, VARIANTS, run_ps_train, run_single
from benchmarks._results import add_result_option, run_recorded


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="ps_train end to end: rpc_core vs torch backend vs one process",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n")[1],
    )
    ap.add_argument("--quick", action="store_true", help="fewer steps per trainer (mlp 600, cnn 100, not 2000, 400)")
    ap.add_argument("--only", choices=MODELS, default=None, help="run only this model")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run everything N times, reversing the order every other round (default 1)",
    )
    ap.add_argument("--steps", type=int, default=None, help="steps per trainer, every model (--messages: 300)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write every figure, per round, as JSON")
    ap.add_argument("--timeout", type=float, default=None, help="limit per run in seconds (default 300, quick 180)")
    ap.add_argument(
        "--single-threads",
        type=int,
        default=1,
        help="intra-op threads of the one-process run (default 1, as ps_train's)",
    )
    ap.add_argument(
        "--run-root", default=None, metavar="DIR", help="where the run folders go (default: a new folder in /dev/shm)"
    )
    ap.add_argument("--keep-runs", action="store_true", help="keep every run folder (a failed one's is kept)")
    ap.add_argument(
        "--messages",
        action="store_true",
        help="instead: requests per step and server, ps_train on rpc_core, MLP, every mode, both update ways",
    )
    ap.add_argument(
        "--cluster", action="append", default=None, metavar="S+T", help="--messages: servers+trainers (repeatable)"
    )
    add_result_option(ap, "e2e_bench")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.steps is not None and args.steps < 1:
        ap.error("--steps must be >= 1")
    if args.single_threads < 1:
        ap.error("--single-threads must be >= 1")

    models = (args.only,) if args.only else MODELS
    steps = {m: args.steps or STEPS["quick" if args.quick else "full"][m] for m in models}
    timeout = args.timeout or (180.0 if args.quick else 300.0)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    if os.environ.pop("PS_TRAIN_FAULT", None) is not None:  # test-only fault injection: never here
        log("note: ignoring PS_TRAIN_FAULT from the environment (it would kill a role)")
    base = args.run_root
    if base is None and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        base = "/dev/shm"  # the final checkpoint is written inside the timed loop: keep it off disk
    if base:
        os.makedirs(base, exist_ok=True)
    run_root = tempfile.mkdtemp(prefix="ps_train_e2e_", dir=base)
    log(f"run folders under {run_root}")
    loadavg_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    if args.messages:
        n = args.steps or 300
        try:
            pairs = [c.split("+") for c in args.cluster or ()]
            sizes = tuple((int(a), int(b)) for a, b in pairs) if pairs else CLUSTERS
        except ValueError:
            ap.error(f"--cluster takes servers+trainers, e.g. 1+1; got {args.cluster}")
        msg_rows, all_ok = run_messages(n, run_root, timeout, log, sizes)
        end = os.getloadavg() if hasattr(os, "getloadavg") else None
        print(
            render_messages(
                msg_rows, n, [f"{loadavg_start[0]:.2f}", f"{end[0]:.2f}"] if loadavg_start and end else None
            )
        )
        if all_ok and not args.keep_runs:
            shutil.rmtree(run_root, ignore_errors=True)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"command": " ".join(sys.argv), "steps": n, "rows": msg_rows}, f, indent=2)
        return 0 if all_ok else 1

    raw: dict = {}
    for model in models:
        raw[(model, "single")] = []
        for servers, trainers in CLUSTERS:
            for b in BACKENDS:
                raw[(model, servers, trainers, b)] = []
    keep_dirs = []
    t_all = time.monotonic()
    for rnd in range(args.rounds):
        jobs: list[tuple[str, str, tuple[int, int] | None]] = []
        for model in models:
            jobs.append((model, "single", None))
            for size in CLUSTERS:
                for b in BACKENDS:
                    jobs.append((model, b, size))
        if rnd % 2 == 1:  # reverse the order so slow drift in machine load favours no side
            jobs.reverse()
        for model, impl, cluster in jobs:
            n = steps[model]
            if impl == "single":
                log(f"[round {rnd + 1}/{args.rounds}] {model} single-process, {n} steps")
                res = run_single(model, n, args.single_threads, timeout, log)
                raw[(model, "single")].append(res)
            else:
                assert cluster is not None  # every ps_train job names its cluster
                s, t = cluster
                backend, in_backward = VARIANTS[impl]
                log(
                    f"[round {rnd + 1}/{args.rounds}] {model} {s}+{t} ps_train backend={backend} "
                    f"update_in_backward={str(in_backward).lower()}, {n} steps"
                )
                res = run_ps_train(model, s, t, backend, n, run_root, timeout, log, update_in_backward=in_backward)
                raw[(model, s, t, impl)].append(res)
                if res["status"] != "ok" or args.keep_runs:
                    keep_dirs.append(res["run_dir"])
                elif res.get("run_dir"):
                    shutil.rmtree(res["run_dir"], ignore_errors=True)
            if res["samples_per_s"] is not None:
                log(
                    f"    {res['samples_per_s']:,.0f} samples/s (loop {res['wall_time_s']:.2f} s, "
                    f"run {res['elapsed_s']:.1f} s)"
                )
    loadavg_end = os.getloadavg() if hasattr(os, "getloadavg") else None
    if not keep_dirs:
        shutil.rmtree(run_root, ignore_errors=True)
    else:
        log(f"kept run folders (logs): {', '.join(keep_dirs)}")

    rows = build_rows(models, raw)
    targets = evaluate_targets(rows)
    info = {
        "steps": steps,
        "rounds": args.rounds,
        "single_threads": args.single_threads,
        "cpus": os.cpu_count(),
        "loadavg": ([f"{loadavg_start[0]:.2f}", f"{loadavg_end[0]:.2f}"] if loadavg_start and loadavg_end else None),
    }
    print(render(rows, targets, info))
    log(f"total {time.monotonic() - t_all:.0f} s")

    if args.json:
        import torch

        def clean(res):  # per-step losses are long; keep the figures
            return {k: v for k, v in res.items() if k != "losses"}

        doc = {
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "quick": args.quick,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "loadavg_start": loadavg_start,
            "loadavg_end": loadavg_end,
            "batch_size": BATCH_SIZE,
            "steps": steps,
            "rounds": args.rounds,
            "single_threads": args.single_threads,
            "rows": rows,
            "targets": targets,
            "runs": {" ".join(str(x) for x in key): [clean(r) for r in lst] for key, lst in raw.items()},
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        log(f"wrote {args.json}")
    failed = any(r["status"] != "ok" for lst in raw.values() for r in lst)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_recorded("e2e_bench", main))
