"""rpc_bench's workloads and how it runs them: the table of workloads (name, label, unit,
direction, target, iteration counts), one implementation's world of spawned workers with a
hard timeout (``run_impl``), and the rounds pooled (``merge_rounds``)."""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import statistics
import time
from typing import Any

from benchmarks._format import fmt
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
