"""Dynamic tables against hashing: a server's peak RSS under its row cap, and test AUC.

    python -m benchmarks.dynamic_tables_bench                     # the defaults (10-15 min)
    python -m benchmarks.dynamic_tables_bench --samples 2000000 --tables 1

Synthetic CTR data whose ``--tables`` tables draw ids from ``--ids`` (10M) distinct ones with
Zipf skew ``--zipf`` (0.8: one pass meets more ids than the cap holds), 1 server + 1 trainer,
one pass over ``--samples``, row-wise Adagrad. Runs: **dynamic** (``kind: dynamic``,
``max_rows`` = ``--cap`` slots, LRU), **hashed** (fixed tables of ``--cap`` rows, the same ids
folded in: colliding ids share a row), and **baseline** (tables of 2 rows: the server's RSS
without tables). The table gives each run's test AUC (and the data's best), the server's peak
RSS against the bound the cap implies (docs/ctr.md), rows live / created / evicted, samples/s
and the load average before and after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

from benchmarks._ctr_job import run_dlrm_job
from benchmarks._results import add_result_option, run_recorded


def id_map_bytes(cap: int) -> int:
    """What one table's id -> slot map (``IdSlotMap``) holds for ``cap`` slots: its flat tensors."""
    from ps_train.workloads.ctr.tables.id_map import IdSlotMap

    m = IdSlotMap(cap)
    return m.keys.nbytes + m.values.nbytes


def run(kind: str, args: argparse.Namespace, run_dir: str) -> dict[str, Any]:
    dim, cap = args.dim, args.cap
    if kind == "dynamic":
        entry = f"{{num_embeddings: {args.ids}, kind: dynamic, max_rows: {cap}}}"
        data = []
    elif kind == "hashed":
        entry = f"{{num_embeddings: {cap}}}"
        data = [f"data.drawn_ids={args.ids}"]
    else:  # the same run with tables of 2 rows: the server's RSS without the tables
        entry = "{num_embeddings: 2}"
        data = [f"data.drawn_ids={args.ids}"]
    tables = ", ".join(entry.replace("{", f"{{name: t{t}, ", 1) for t in range(args.tables))
    steps = int((1 - 0.1) * args.samples / args.batch)
    overrides = [
        f"data.num_samples={args.samples}",
        f"data.zipf_alpha={args.zipf}",
        *data,
        f"model.tables=[{tables}]",
        f"model.embedding_dim={dim}",
        "model.table_optim=rowwise_adagrad",
        f"model.table_lr={args.lr}",
        "cluster.num_trainers=1",
        "cluster.num_servers=1",
        f"train.batch_size={args.batch}",
        f"train.steps={steps}",
        "mode=sync",
    ]
    job = run_dlrm_job(run_dir, overrides, args.timeout)
    row: dict[str, Any] = {"kind": kind, "load_before": job.load1_before, "load_after": job.load1_after}
    m = job.metrics
    if m is None:
        return {**row, "status": "error", "stderr": job.stderr[-3000:]}
    row.update(
        status="ok",
        test_auc=m.get("test_auc"),
        test_best_auc=m.get("test_best_auc"),
        server_peak_rss=m["peak_rss_bytes"]["ps0"],
        samples_per_s=m["samples_per_s"],
        wall_time_s=m.get("wall_time_s"),
    )
    for key in ("live", "created", "evicted"):
        if f"dynamic_rows_{key}" in m:
            row[f"rows_{key}"] = m[f"dynamic_rows_{key}"]["ps0"]
    return row


def bound(args: argparse.Namespace, map_bytes: int) -> dict[str, float]:
    """What the cap implies per server, in bytes: rows, row-wise Adagrad, bookkeeping, id map."""
    slots = args.tables * args.cap
    return {
        "rows": slots * args.dim * 4,
        "rowwise_adagrad": slots * 4,
        "bookkeeping": slots * 34,  # id, last use, free list (8 B each), two 1-byte marks, use log (8 B)
        "id_map": args.tables * map_bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ids", type=int, default=10_000_000, help="distinct ids per table")
    ap.add_argument("--cap", type=int, default=1_000_000, help="dynamic: slots per server; hashed: rows")
    ap.add_argument("--tables", type=int, default=2)
    ap.add_argument("--samples", type=int, default=3_000_000)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--zipf", type=float, default=0.8)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--only", choices=["dynamic", "hashed", "baseline"], nargs="*")
    ap.add_argument("--json", help="also write the rows here")
    add_result_option(ap, "dynamic_tables_bench")
    args = ap.parse_args()
    map_bytes = id_map_bytes(args.cap)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.only or ("baseline", "dynamic", "hashed"):
            rows.append(run(kind, args, os.path.join(tmp, kind)))
            print(json.dumps(rows[-1]), flush=True)
    b = bound(args, map_bytes)
    base = next((r["server_peak_rss"] for r in rows if r["kind"] == "baseline" and r["status"] == "ok"), None)
    print(f"\n{args.tables} tables x {args.ids:,} ids, Zipf {args.zipf}, cap {args.cap:,} rows per table, d={args.dim}")
    print(
        f"bound from the cap: {', '.join(f'{k} {v / 2**20:.0f} MiB' for k, v in b.items())}"
        f" (id map: {map_bytes / args.cap:.0f} B/slot); total {sum(b.values()) / 2**20:.0f} MiB"
        + (
            f" + server without tables {base / 2**20:.0f} MiB = {(sum(b.values()) + base) / 2**20:.0f} MiB"
            if base
            else ""
        )
    )
    print(
        "\n| run | test AUC (best) | server peak RSS | rows live / created / evicted | samples/s | load before/after |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r["status"] != "ok":
            print(f"| {r['kind']} | error: {r['stderr'][-300:]!r} |")
            continue
        auc = f"{r['test_auc']:.4f} ({r['test_best_auc']:.4f})" if r.get("test_auc") is not None else "-"
        live = f"{r['rows_live']:,} / {r['rows_created']:,} / {r['rows_evicted']:,}" if "rows_live" in r else "-"
        print(
            f"| {r['kind']} | {auc} | {r['server_peak_rss'] / 2**20:.0f} MiB | {live} | "
            f"{r['samples_per_s']:.0f} | {r['load_before']:.1f} / {r['load_after']:.1f} |"
        )
    ok = {r["kind"]: r for r in rows if r["status"] == "ok"}
    if "dynamic" in ok and "hashed" in ok:
        speed = ok["dynamic"]["samples_per_s"] / ok["hashed"]["samples_per_s"]
        print(f"\ndynamic / hashed samples/s: {speed:.2f}x (target >= 0.8x: {'PASS' if speed >= 0.8 else 'FAIL'})")
    if "dynamic" in ok and base:
        over = ok["dynamic"]["server_peak_rss"] - base  # what the dynamic tables cost the server
        limit = sum(b.values()) + 300 * 2**20
        print(
            f"dynamic server RSS over the server without tables: {over / 2**20:.0f} MiB, bound + 300 MiB = "
            f"{limit / 2**20:.0f} MiB ({'PASS' if over <= limit else 'FAIL'})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "bound": b, "id_map_bytes": map_bytes, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(run_recorded("dynamic_tables_bench", main))
