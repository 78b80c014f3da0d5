"""Side-by-side RPC benchmark: rpc_core vs torch.distributed.rpc (TensorPipe).

    python -m benchmarks.rpc_bench --rounds 2     # both implementations (~1-3 min a round)
    python -m benchmarks.rpc_bench --quick        # fewer iterations (well under a minute)
    python -m benchmarks.rpc_bench --list         # the workloads

For each implementation in turn, two spawned workers (one intra-op thread each) run the same
workloads (``_workloads.py``); every workload warms up, then times repetitions. First the
machine's floor (``_floor.py``: socket ping-pong, memcpy). The table gives each workload's
median per implementation, ratio = rpc_core / torch ("better" says which way is the
improvement), the target and whether it was met, and "x floor": the rpc_core figure as a
multiple of the floor. A second table gives each side's process CPU time per call. A failed or
missing implementation shows its reason under the table. Details: docs/benchmarking.md.
"""

from __future__ import annotations

import argparse
import ast
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from typing import Any

from benchmarks._format import fmt
from benchmarks._results import add_result_option, run_recorded
from benchmarks._rpc_report import build_rows, render, render_cpu, render_floor
from benchmarks._rpc_runs import IMPLS, WORKLOADS, merge_rounds, run_impl, select


def _hog() -> None:
    while True:  # a CPU-bound neighbour, as a browser or a build beside the benchmark
        pass


def start_hogs(n: int) -> list:
    procs = [mp.get_context("spawn").Process(target=_hog, name=f"rpc_bench-hog{i}", daemon=True) for i in range(n)]
    for p in procs:
        p.start()
    return procs


def stop_hogs(procs: list) -> None:
    for p in procs:
        p.kill()
        p.join(5)


def parse_core_options(items):
    extra = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"--core-option expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            extra[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            extra[k] = v
    return extra


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="rpc_core vs torch.distributed.rpc benchmark",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n")[1],
    )
    ap.add_argument("--impl", choices=("both",) + IMPLS, default="both", help="which implementations to run")
    ap.add_argument("--quick", action="store_true", help="reduced iteration counts")
    ap.add_argument(
        "--only", default=None, metavar="NAME,...", help="only these workloads; a name selects those it prefixes"
    )
    ap.add_argument("--json", default=None, metavar="PATH", help="also write every figure and sample as JSON")
    ap.add_argument(
        "--timeout", type=float, default=None, help="limit per implementation run in seconds (default 300, quick 120)"
    )
    ap.add_argument(
        "--core-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra keyword of rpc_core's backend options (repeatable; VALUE a Python literal when it parses)",
    )
    ap.add_argument("--rounds", type=int, default=1, help="runs per implementation, alternating the order (default 1)")
    ap.add_argument("--hog", type=int, default=0, metavar="N", help="N CPU-bound processes beside the benchmark")
    ap.add_argument("--no-floor", action="store_true", help="skip the floor measurements")
    ap.add_argument("--list", action="store_true", help="list the workloads and exit")
    add_result_option(ap, "rpc_bench")
    args = ap.parse_args(argv)

    if args.list:
        for name, label, unit, *_ in WORKLOADS:
            print(f"{name:20s} {unit:8s} {label}")
        return 0

    selected = select(args.only)
    timeout = args.timeout or (120.0 if args.quick else 300.0)
    impls = IMPLS if args.impl == "both" else (args.impl,)
    plan = [
        (w[0], dict(zip(("warmup", "iters", "reps"), w[6] if args.quick else w[5], strict=True)))
        for w in WORKLOADS
        if w[0] in selected
    ]
    core_extra = parse_core_options(args.core_option)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    from benchmarks import _floor

    machine = _floor.machine()
    log(_floor.describe_machine(machine))
    hogs = start_hogs(args.hog)
    per_round: dict[str, list[Any]] = {impl: [] for impl in impls}
    floors: list[dict] = []
    try:
        for rnd in range(args.rounds):
            if not args.no_floor:  # each round: the floor under the load of that moment
                floors.append(_floor.measure())
                log("  floor: " + ", ".join(f"{k} {fmt(v['value'])} {v['unit']}" for k, v in floors[-1].items()))
            # Alternate the order so slow drift in machine load does not favour one side.
            for impl in impls if rnd % 2 == 0 else tuple(reversed(impls)):
                if per_round[impl] and per_round[impl][-1]["status"] == "unavailable":
                    continue
                log(
                    f"running {impl} ({'quick' if args.quick else 'full'}, {len(plan)} workloads, "
                    f"round {rnd + 1}/{args.rounds}, timeout {timeout:.0f} s)"
                )
                per_round[impl].append(run_impl(impl, plan, core_extra if impl == "rpc_core" else {}, timeout, log))
    finally:
        stop_hogs(hogs)
    runs = {impl: merge_rounds(lst) for impl, lst in per_round.items()}
    floor = (
        {k: dict(v, value=statistics.median(f[k]["value"] for f in floors)) for k, v in floors[0].items()}
        if floors
        else None
    )

    rows = build_rows(selected, runs, floor)
    settings = [f"{k}={os.environ[k]}" for k in sorted(os.environ) if k.startswith("RPC_CORE_")]
    if args.hog:
        settings.append(f"{args.hog} CPU hog(s) beside the benchmark")
    if settings:
        print("settings: " + ", ".join(settings))
    if floor:
        print(render_floor(floor, machine))
        print()
    else:
        print(_floor.describe_machine(machine))
    print(render(rows, runs, args.rounds, floor))
    cpu_table = render_cpu(rows, runs)
    if cpu_table:
        print()
        print(cpu_table)

    if args.json:
        import torch

        doc = {
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "quick": args.quick,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "machine": machine,
            "floor": floor,
            "floors_per_round": floors,
            "hogs": args.hog,
            "env": {k: v for k, v in os.environ.items() if k.startswith("RPC_CORE_")},
            "plan": dict(plan),
            "rounds": args.rounds,
            "rows": rows,
            "runs": runs,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        log(f"wrote {args.json}")
    # Non-zero when a run failed (timeout, crash, a workload error); an implementation that
    # is simply not available yet is not a failure.
    failed = any(r["status"] in ("timeout", "crashed") or "error" in r["errors"].values() for r in runs.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_recorded("rpc_bench", main))
