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
import queue as queue_mod
import statistics
import sys
import time
from typing import Any

from benchmarks._format import fmt
from benchmarks._results import add_result_option, run_recorded
from ps_train.launch.ports import free_port

IMPLS = ("torch", "rpc_core")
WORLD_SIZE = 2

# name, label, unit, better, target ratio (rpc_core/torch) or None,
# full (warmup, iters, reps), quick (warmup, iters, reps)
WORKLOADS = [
    ("sync_noop", "rpc_sync no-op", "us/call", "lower", 0.2, (300, 500, 9), (50, 200, 3)),
    ("sync_add", "rpc_sync torch.add 10x10", "us/call", "lower", None, (200, 500, 9), (50, 200, 3)),
    ("async_noop", "rpc_async no-op, 5000 in flight", "calls/s", "higher", 5.0, (2, 5000, 7), (1, 5000, 2)),
    ("echo_1KB", "echo round trip 1 KB", "GB/s", "higher", None, (100, 300, 7), (20, 100, 3)),
    ("echo_1MB", "echo round trip 1 MB", "GB/s", "higher", None, (20, 60, 7), (5, 20, 3)),
    ("echo_16MB", "echo round trip 16 MB", "GB/s", "higher", 2.0, (10, 10, 9), (2, 4, 3)),
    ("echo_64MB", "echo round trip 64 MB", "GB/s", "higher", 2.0, (3, 4, 9), (1, 2, 3)),
    ("remote_to_here", "remote(...).to_here() small tensor", "us/call", "lower", 0.3, (200, 300, 7), (30, 100, 3)),
    ("rref_arg_to_owner", "rpc_sync(owner, f, args=(rref,))", "us/call", "lower", None, (200, 500, 7), (30, 100, 3)),
    ("remote_linear_step", "remote Linear(256) fwd+dist bwd", "ms/step", "lower", 0.25, (20, 100, 7), (5, 30, 3)),
    (
        "grad_to_caller_step",
        "rpc_sync(owner, f, (rref, x)) fwd+bwd, grad to x",
        "ms/step",
        "lower",
        0.5,
        (20, 100, 7),
        (5, 30, 3),
    ),
    ("mlp3_distopt_step", "3-shard MLP + DistributedOptimizer", "ms/step", "lower", None, (10, 40, 7), (3, 15, 3)),
    (
        "mlp3_in_backward_step",
        "3-shard MLP, optimizer in the backward",
        "ms/step",
        "lower",
        None,
        (10, 40, 7),
        (3, 15, 3),
    ),
    ("sync_noop_4x4", "rpc_sync no-op, 4 callers + 4 callees", "us/call", "lower", 1.0, (100, 300, 5), (30, 100, 3)),
]
# Workloads run in their own world (more processes than the two of the others).
SEPARATE = {"sync_noop_4x4"}
NAMES = [w[0] for w in WORKLOADS]


def select(only: str | None) -> list[str]:
    if not only:
        return list(NAMES)
    chosen = set()
    for tok in (t.strip() for t in only.split(",")):
        if not tok:
            continue
        hits = [n for n in NAMES if n == tok or n.startswith(tok)]
        if not hits:
            raise SystemExit(f"unknown workload {tok!r}; choose from: {', '.join(NAMES)}")
        chosen.update(hits)
    return [n for n in NAMES if n in chosen]


def run_impl(impl: str, plan, options_extra: dict, timeout: float, log) -> dict:
    """Run one implementation: the world of 2 for most workloads, then the oversubscribed
    world if ``plan`` has its workload; the results are merged into one run record."""
    main_plan = [p for p in plan if p[0] not in SEPARATE]
    sep_plan = [p for p in plan if p[0] in SEPARATE]
    run = _run_world(impl, main_plan, options_extra, timeout, log) if main_plan else None
    if sep_plan and (run is None or run["status"] != "unavailable"):
        from benchmarks import _oversub

        other = _run_world(impl, sep_plan, options_extra, timeout, log, _oversub.oversub_main, _oversub.WORLD_SIZE)
        if run is None:
            return other
        run["results"].update(other["results"])
        run["errors"].update(other["errors"])
        run["notes"] += other["notes"]
        run["wall_s"] += other["wall_s"] or 0
        if run["status"] == "ok":
            run["status"] = other["status"]
    assert run is not None
    return run


def _run_world(
    impl: str, plan, options_extra: dict, timeout: float, log, target=None, world_size: int = WORLD_SIZE
) -> dict:
    """Run one implementation's world of ``world_size``; never hangs longer than ``timeout``."""
    from benchmarks import _workloads  # the spawned children re-import it by name

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=target or _workloads.worker_main,
            args=(rank, world_size, impl, port, plan, options_extra, q),
            name=f"rpc_bench-{impl}-worker{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    run: dict[str, Any] = {
        "status": "ok",
        "notes": [],
        "results": {},
        "errors": {},
        "init_s": None,
        "shutdown_s": None,
        "wall_s": None,
    }
    t_start = time.monotonic()
    deadline = t_start + timeout
    for p in procs:
        p.start()

    def handle(msg):
        kind = msg[0]
        if kind == "unavailable":
            run["status"] = "unavailable"
            run["notes"].append(f"{impl} not available: {msg[1]}")
        elif kind == "ready":
            run["init_s"] = msg[1]
            log(f"  [{impl}] init_rpc took {msg[1]:.2f} s")
        elif kind == "result":
            _, name, value, samples, cpu = msg
            slot = run["results"].get(name)
            if slot is not None:  # several callers measure the same workload: pool them
                slot["samples"] = slot["samples"] + samples
                slot["value"] = statistics.median(slot["samples"])
            else:
                run["results"][name] = {"value": value, "samples": samples, "cpu": cpu}
            cpu_txt = f" (CPU/call caller {cpu[0] * 1e6:.1f} us, callee {cpu[1] * 1e6:.1f} us)" if cpu else ""
            log(f"  [{impl}] {name}: {fmt(value)}{cpu_txt}")
        elif kind == "error":
            _, name, what, text = msg
            run["errors"][name] = what
            run.setdefault("error_text", {})[name] = text
            first = text.strip().splitlines()[0] if text.strip() else what
            run["notes"].append(f"{impl} {name}: {first}")
            log(f"  [{impl}] {name}: {what}: {text}")
        elif kind == "shutdown":
            run["shutdown_s"] = msg[1]
        elif kind == "fatal":
            run["status"] = "crashed"
            last = msg[2].strip().splitlines()[-1]
            run["notes"].append(f"{impl} worker{msg[1]} failed: {last}")
            log(f"  [{impl}] worker{msg[1]} failed:\n{msg[2]}")

    died_at = None
    timed_out = False
    while True:
        try:
            handle(q.get(timeout=0.2))
            continue
        except queue_mod.Empty:
            pass
        alive = [p for p in procs if p.is_alive()]
        if not alive:
            break
        now = time.monotonic()
        if now > deadline:
            timed_out = True
            break
        # A worker died abnormally: its peer may be stuck waiting on it; give it a moment.
        if died_at is None and any(p.exitcode not in (None, 0) for p in procs):
            died_at = now
        if died_at is not None and now - died_at > 10:
            run["notes"].append(f"{impl}: a worker died; killed the remaining worker")
            break
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    # Drain what arrived right before the processes ended.
    while True:
        try:
            handle(q.get(timeout=0.5))
        except Exception:  # noqa: BLE001 - Empty, or a message cut by a kill
            break
    run["wall_s"] = time.monotonic() - t_start
    if timed_out:
        run["status"] = "timeout"
        done = set(run["results"]) | set(run["errors"])
        pending = [name for name, _ in plan if name not in done]
        stage = (
            "init_rpc"
            if run["init_s"] is None and run["status"] == "ok"
            else f"workload {pending[0]}"
            if pending
            else "shutdown"
        )
        run["notes"].append(f"{impl}: hard timeout after {timeout:.0f} s (during {stage}); workers killed")
    else:
        for rank, p in enumerate(procs):
            if p.exitcode not in (0, None):
                if run["status"] == "ok":
                    run["status"] = "crashed"
                run["notes"].append(f"{impl} worker{rank} exited with code {p.exitcode}")
    q.close()
    return run


def merge_rounds(rounds: list[dict]) -> dict:
    """Pool the repetitions of several rounds of one implementation (median over all)."""
    if len(rounds) == 1:
        return rounds[0]
    order = ("crashed", "timeout", "unavailable")
    statuses = [r["status"] for r in rounds]
    merged = {
        "status": next((s for s in order if s in statuses), "ok"),
        "notes": [f"round {i + 1}: {n}" for i, r in enumerate(rounds) for n in r["notes"]],
        "results": {},
        "errors": {},
        "init_s": statistics.median([r["init_s"] for r in rounds if r["init_s"] is not None] or [None]),
        "shutdown_s": max((r["shutdown_s"] for r in rounds if r["shutdown_s"] is not None), default=None),
        "wall_s": sum(r["wall_s"] or 0 for r in rounds),
        "rounds": rounds,
    }
    for r in rounds:
        for name, what in r["errors"].items():
            merged["errors"].setdefault(name, what)
        for name, res in r["results"].items():
            slot = merged["results"].setdefault(name, {"samples": [], "per_round": []})
            slot["samples"].extend(res["samples"])
            slot["per_round"].append(res["value"])
            if res.get("cpu"):
                slot.setdefault("cpus", []).append(res["cpu"])
    for slot in merged["results"].values():
        slot["value"] = statistics.median(slot["samples"])
        cpus = slot.pop("cpus", None)
        slot["cpu"] = (statistics.median(c[0] for c in cpus), statistics.median(c[1] for c in cpus)) if cpus else None
    return merged


def cell(run: dict | None, name: str) -> str:
    if run is None:
        return "not run"
    if name in run["results"]:
        return fmt(run["results"][name]["value"])
    if run["status"] == "unavailable":
        return "not available"
    if name in run["errors"]:
        return run["errors"][name]
    return {"timeout": "timeout", "crashed": "crashed"}.get(run["status"], "-")


def build_rows(selected, runs, floor=None):
    rows = []
    for name, label, unit, better, target, _full, _quick in WORKLOADS:
        if name not in selected:
            continue
        t = runs.get("torch", {}) or {}
        c = runs.get("rpc_core", {}) or {}
        tv = t.get("results", {}).get(name, {}).get("value")
        cv = c.get("results", {}).get(name, {}).get("value")
        ratio = cv / tv if (tv and cv is not None) else None
        met = None
        if ratio is not None and target is not None:
            met = ratio <= target if better == "lower" else ratio >= target
        rows.append(
            {
                "name": name,
                "workload": label,
                "unit": unit,
                "better": better,
                "torch": tv,
                "rpc_core": cv,
                "ratio": ratio,
                "target": target,
                "target_met": met,
                "torch_cell": cell(runs.get("torch"), name),
                "rpc_core_cell": cell(runs.get("rpc_core"), name),
                "floor_x": floor_multiple(unit, cv, floor),
            }
        )
    return rows


def floor_multiple(unit: str, value: float | None, floor: dict | None) -> float | None:
    """An rpc_core figure as a multiple of the machine's floor: a time per call as a multiple
    of the blocking Unix socket round trip (a rate as the time per call it implies), a
    bandwidth as a fraction of memcpy's. None where no floor applies (training steps)."""
    if value is None or not floor:
        return None
    rt = floor["unix_blocking"]["value"]
    if unit == "us/call":
        return value / rt
    if unit == "calls/s":
        return 1e6 / value / rt
    if unit == "GB/s":
        return value / floor["memcpy"]["value"]
    return None


def _table(head: list[str], body: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(str(x[i])) for x in [head] + body) for i in range(len(head))]

    def line(cols):
        return (
            "| "
            + " | ".join(
                str(c).rjust(w) if i in right else str(c).ljust(w)
                for i, (c, w) in enumerate(zip(cols, widths, strict=True))
            )
            + " |"
        )

    out = [
        line(head),
        "|" + "|".join(("-" * (w + 1) + ":") if i in right else "-" * (w + 2) for i, w in enumerate(widths)) + "|",
    ]
    return out + [line(b) for b in body]


def render_floor(floor: dict, machine: dict) -> str:
    from benchmarks import _floor

    out = [_floor.describe_machine(machine), ""]
    out += _table(["floor", "unit", "value"], [[f["label"], f["unit"], fmt(f["value"])] for f in floor.values()], {2})
    return "\n".join(out)


def render_cpu(rows, runs) -> str:
    """CPU time per call (or step) on each side, from time.process_time in both processes."""
    body = []
    for r in rows:
        cells = []
        for impl in IMPLS:
            cpu = ((runs.get(impl) or {}).get("results", {}).get(r["name"]) or {}).get("cpu")
            scale, unit = (1e3, "ms") if r["unit"] == "ms/step" else (1e6, "us")
            cells += [f"{fmt(cpu[0] * scale)} {unit}", f"{fmt(cpu[1] * scale)} {unit}"] if cpu else ["-", "-"]
        if any(c != "-" for c in cells):
            body.append([r["workload"]] + cells)
    if not body:
        return ""
    head = ["CPU per call/step", "torch caller", "torch callee", "rpc_core caller", "rpc_core callee"]
    return "\n".join(
        _table(head, body, {1, 2, 3, 4})
        + ["process CPU time (all threads) of each side over the timed calls, divided by the calls."]
    )


def render(rows, runs, rounds=1, floor=None) -> str:
    head = ["workload", "unit", "torch", "rpc_core", "ratio", "better", "target", "rpc_core x floor"]
    body = []
    for r in rows:
        if r["target"] is None:
            tgt = ""
        else:
            tgt = ("<=" if r["better"] == "lower" else ">=") + f"{r['target']:g}x"
            if r["target_met"] is not None:
                tgt += " met" if r["target_met"] else " MISSED"
        body.append(
            [
                r["workload"],
                r["unit"],
                r["torch_cell"],
                r["rpc_core_cell"],
                f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-",
                r["better"],
                tgt,
                f"{fmt(r['floor_x'])}x" if r.get("floor_x") is not None else "-",
            ]
        )
    out = _table(head, body, {2, 3, 4, 7})
    out.append("")
    out.append(
        "ratio = rpc_core / torch; 'better' is the direction of improvement. "
        "echo GB/s = 2 x payload bytes / round trip (GB = 1e9 B). Median of repetitions"
        + (f", pooled over {rounds} rounds." if rounds > 1 else ".")
    )
    if floor:
        out.append(
            "x floor: time per call / blocking Unix socket round trip (calls/s: the time per call "
            "it implies); GB/s: fraction of memcpy's bandwidth."
        )
    for impl in IMPLS:
        run = runs.get(impl)
        if not run:
            continue
        extra = []
        if run.get("init_s") is not None:
            extra.append(f"init_rpc {run['init_s']:.2f} s")
        if run.get("shutdown_s") is not None:
            extra.append(f"shutdown {run['shutdown_s']:.2f} s")
        if run.get("wall_s") is not None:
            extra.append(f"wall {run['wall_s']:.1f} s")
        out.append(f"{impl}: {run['status']}" + (f" ({', '.join(extra)})" if extra else ""))
        for n in run["notes"]:
            out.append(f"  note: {n}")
    return "\n".join(out)


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
