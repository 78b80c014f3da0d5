"""rpc_bench's tables: each workload's median per implementation, the ratio and target, the
figure as a multiple of the machine's floor, and each side's CPU per call."""

from __future__ import annotations

from benchmarks._format import fmt
from benchmarks._rpc_runs import IMPLS, WORKLOADS


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
