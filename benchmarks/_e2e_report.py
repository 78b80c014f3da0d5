"""e2e_bench's comparison table: the median over rounds of each cell, the ratios, the
targets met or missed, the requests per step and the loss check, as printed."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks._e2e_runs import BACKENDS, BATCH_SIZE, CLUSTERS, IMPLS, LABELS, TARGETS
from benchmarks._format import fmt


def merge(results: list[dict]) -> dict:
    """Median samples/s over the rounds that succeeded; errors are kept for the notes."""
    ok = [r["samples_per_s"] for r in results if r["status"] == "ok" and r["samples_per_s"]]
    return {
        "samples_per_s": statistics.median(ok) if ok else None,
        "per_round": [r["samples_per_s"] for r in results],
        "errors": [(i + 1, r["error"]) for i, r in enumerate(results) if r["status"] != "ok"],
    }


def requests_per_step(results: list[dict]) -> float | None:
    """The most requests a server served per trainer step, over the runs that succeeded."""
    got = [max(r["requests_per_step"]) for r in results if r["status"] == "ok" and r.get("requests_per_step")]
    return max(got) if got else None


def loss_check(single: list[dict], core: list[dict]) -> float | None:
    """Largest |loss difference| between a 1+1 ps_train run and the single-process run."""
    ref = next((r["losses"] for r in single if r["status"] == "ok" and r.get("losses")), None)
    if ref is None:
        return None
    diffs = [
        max(abs(a - b) for a, b in zip(ref, r["losses"], strict=True))
        for r in core
        if r["status"] == "ok" and r.get("losses") and len(r["losses"]) == len(ref)
    ]
    return max(diffs) if diffs else None


def build_rows(models, raw) -> list[dict]:
    rows = []
    for model in models:
        single = merge(raw[(model, "single")])
        for servers, trainers in CLUSTERS:
            merged = {"single": single} | {v: merge(raw[(model, servers, trainers, v)]) for v in BACKENDS}
            row: dict[str, Any] = {
                "model": model,
                "servers": servers,
                "trainers": trainers,
                "config": f"{model} {servers}+{trainers}",
                "per_round": {k: m["per_round"] for k, m in merged.items()},
                "errors": {k: m["errors"] for k, m in merged.items()},
                "requests_per_step": {
                    v: requests_per_step(raw[(model, servers, trainers, v)]) for v in BACKENDS if v != "torch"
                },
            }
            row |= {k: m["samples_per_s"] for k, m in merged.items()}
            s, t = row["single"], row["torch"]
            for v in ("rpc_core", "rpc_core_bw"):
                c = row[v]
                row[f"{v}/torch"] = c / t if c and t else None
                row[f"{v}/single"] = c / s if c and s else None
            if (servers, trainers) == (1, 1):
                row["max_loss_diff_vs_single"] = {
                    b: loss_check(raw[(model, "single")], raw[(model, 1, 1, b)]) for b in BACKENDS
                }
            rows.append(row)
    return rows


def evaluate_targets(rows) -> list[dict]:
    out = []
    by_key = {(r["model"], r["servers"], r["trainers"]): r for r in rows}
    for model, servers, trainers, over, threshold, strict, label in TARGETS:
        row = by_key.get((model, servers, trainers))
        if row is None:
            continue
        for variant in ("rpc_core", "rpc_core_bw"):
            ratio = variant + over
            v = row[ratio]
            met = None if v is None else (v > threshold if strict else v >= threshold)
            out.append(
                {"target": f"{label} ({LABELS[variant]})", "ratio": ratio, "threshold": threshold}
                | {"strict": strict, "value": v, "met": met}
            )
    return out


def render(rows, targets, info) -> str:
    head = [
        "config",
        "single-process",
        "ps_train torch",
        "ps_train rpc_core",
        "rpc_core, in backward",
        "rpc_core/torch",
        "in backward/torch",
        "rpc_core/single",
        "in backward/single",
    ]
    body = []
    for r in rows:

        def cell(impl, r=r):
            if r[impl] is not None:
                return fmt(r[impl]) + (" *" if impl == "single" and r["servers"] > 1 else "")
            return "error" if r["errors"][impl] else "-"

        body.append(
            [
                f"{r['config']} ({r['servers']} server{'s' * (r['servers'] > 1)}, "
                f"{r['trainers']} trainer{'s' * (r['trainers'] > 1)})",
                cell("single"),
                cell("torch"),
                cell("rpc_core"),
                cell("rpc_core_bw"),
            ]
            + [
                f"{r[k]:.2f}x" if r[k] is not None else "-"
                for k in ("rpc_core/torch", "rpc_core_bw/torch", "rpc_core/single", "rpc_core_bw/single")
            ]
        )
    widths = [max(len(str(x[i])) for x in [head] + body) for i in range(len(head))]

    def line(cols):
        return (
            "| "
            + " | ".join(
                str(c).ljust(w) if i == 0 else str(c).rjust(w)
                for i, (c, w) in enumerate(zip(cols, widths, strict=True))
            )
            + " |"
        )

    out = [
        line(head),
        "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|",
    ]
    out += [line(b) for b in body]
    out.append("")
    steps = ", ".join(f"{m} {n}" for m, n in info["steps"].items())
    out.append(
        f"samples/s (higher is better), batch {BATCH_SIZE} per trainer, steps per trainer: "
        f"{steps}; mode=sync; rpc_core: the update as its own call (cluster.update_in_backward=false) "
        "and riding on the backward (true, sync's default); "
        + (f"median of {info['rounds']} rounds." if info["rounds"] > 1 else "1 round.")
    )
    out.append(
        "ps_train: metrics.json samples_per_s = samples of all trainers / longest trainer "
        "training-loop wall time (process startup, init_rpc, final eval, shutdown excluded)."
    )
    out.append(
        f"single-process: plain torch loop in one process, {info['single_threads']} "
        "intra-op thread(s), same model init, data order, SGD and batch size; it has no "
        "servers/trainers,"
    )
    out.append(
        "  so * marks the same single-process figure repeated in the 2+2 row "
        "(rpc_core/single there = 2 trainers' total vs one process)."
    )
    for v in ("rpc_core", "rpc_core_bw"):
        counted = [f"{r['config']} {r['requests_per_step'][v]:.2f}" for r in rows if r["requests_per_step"][v]]
        if counted:
            out.append(f"requests per trainer step and server (the busiest server), {LABELS[v]}: " + ", ".join(counted))
    for r in rows:
        d = r.get("max_loss_diff_vs_single")
        if d:
            parts = [f"{b} {d[b]:.2g}" if d[b] is not None else f"{b} -" for b in BACKENDS]
            out.append(f"loss check {r['model']} 1+1 vs single-process, max |per-step loss diff|: " + ", ".join(parts))
    if info["rounds"] > 1:
        out.append("per round (spread of the noise), /torch and /single, update call | in backward:")
        for r in rows:
            pr = r["per_round"]

            def ratios(num, den):
                # one value per round in each
                return ", ".join(f"{a / b:.2f}" if a and b else "-" for a, b in zip(num, den, strict=True))

            out.append(
                f"  {r['config']}: "
                + " | ".join(ratios(pr[v], pr[d]) for d in ("torch", "single") for v in ("rpc_core", "rpc_core_bw"))
            )
    la = info.get("loadavg")
    if la:
        out.append(
            f"machine: {info['cpus']} CPUs, load average {la[0]} at start, {la[1]} at end "
            "(shared cores: compare ratios within one run)."
        )
    if targets:
        out.append("")
        out.append("targets, ps_train on rpc_core:")
        w = max(len(t["target"]) for t in targets)
        for t in targets:
            v = f"{t['value']:.2f}x" if t["value"] is not None else "-"
            verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
            out.append(f"  {t['target'].ljust(w)}  {t['ratio']} = {v:>7}  {verdict}")
    errors = [(r["config"], impl, rnd, err) for r in rows for impl in IMPLS for rnd, err in r["errors"][impl]]
    seen = set()
    if errors:
        out.append("")
        out.append("errors:")
        for config, impl, rnd, err in errors:
            model = config.split()[0]
            where = f"{model} single-process" if impl == "single" else f"{config} ps_train {LABELS[impl]}"
            key = (where, rnd)
            if key in seen:
                continue
            seen.add(key)
            rtag = f" (round {rnd})" if info["rounds"] > 1 else ""
            out.append(f"  {where}{rtag}: {err}")
    return "\n".join(out)
