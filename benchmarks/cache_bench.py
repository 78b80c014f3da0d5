"""The trainers' hot-row cache: rows and bytes pulled per step, and test AUC, with and without.

Usage (from the repo root)::

    python -m benchmarks.cache_bench                        # Zipf 1.05 and 1.3, cache off / on
    python -m benchmarks.cache_bench --zipf 1.05 --cache 1000:4 1000:8 --json out.json

Each run is ``python -m ps_train model=dlrm data=synthetic_ctr`` (8 tables of 1,000 rows,
batch 256) with 2 servers and ``--trainers`` trainers in ``--mode`` (async by default: the
mode the cache is meant for), one pass over ``--samples`` samples, no periodic evaluation.
``--cache ROWS:STALENESS`` sets ``model.cache_rows`` and ``model.cache_staleness``; every
skew also runs without a cache. Figures from ``metrics.json``: ``rows_pulled_per_step``
(vectors the servers sent per trainer step) and their bytes (rows x d x 4 B), the bytes the
servers sent per trainer step (``server_bytes_per_step``, summed over servers: besides the
rows, the bottom MLP's output and the gradient of the top MLP's input, which the cache does not
change, and the RPC framing), ``cache_hits_per_step``, ``test_auc`` and the 1-minute load
average before and after the run. Printed as a Markdown table.
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


def one_run(zipf: float, cache: str | None, args: argparse.Namespace, run_dir: str) -> dict[str, Any]:
    steps = int(0.9 * args.samples / (args.trainers * 256))
    extra = []
    if cache is not None:
        rows, staleness = cache.split(":")
        extra = [f"model.cache_rows={rows}", f"model.cache_staleness={staleness}"]
    overrides = [
        f"data.num_samples={args.samples}",
        f"data.zipf_alpha={zipf}",
        f"model.embedding_dim={args.dim}",
        f"cluster.num_trainers={args.trainers}",
        "cluster.num_servers=2",
        f"train.steps={steps}",
        f"mode={args.mode}",
        *extra,
    ]
    job = run_dlrm_job(run_dir, overrides, args.timeout)
    row: dict[str, Any] = {"zipf": zipf, "cache": cache or "off", "dim": args.dim}
    m = job.metrics
    if m is None:
        return {**row, "status": "error", "stderr": job.stderr[-2000:]}
    sent = sum(v["sent"] for v in m["server_bytes_per_step"].values())
    return {
        **row,
        "status": "ok",
        "rows_pulled_per_step": m["rows_pulled_per_step"],
        # The rows' values that came back (float32 [rows, d]), without the request and framing.
        "row_bytes_pulled_per_step": m["rows_pulled_per_step"] * args.dim * 4,
        "server_bytes_sent_per_step": sent,
        "cache_hits_per_step": m["cache_hits_per_step"],
        "test_auc": m["test_auc"],
        "samples_per_s": m["samples_per_s"],
        "load1_before": job.load1_before,
        "load1_after": job.load1_after,
    }


def table(results: list[dict[str, Any]]) -> str:
    """The runs as a Markdown table; "vs off": the row bytes pulled over those of the run
    without a cache on the same skew."""
    lines = [
        "| zipf | cache rows:staleness | rows pulled/step | row bytes pulled/step | vs off | "
        "server bytes sent/step | hits/step | test AUC | load1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['zipf']} | {r['cache']} | error | | | | | | |")
            continue
        off = next(x for x in results if x["zipf"] == r["zipf"] and x["cache"] == "off" and x["status"] == "ok")
        ratio = r["rows_pulled_per_step"] / off["rows_pulled_per_step"]
        lines.append(
            f"| {r['zipf']} | {r['cache']} | {r['rows_pulled_per_step']:,.0f} | "
            f"{r['rows_pulled_per_step'] * 4 * r.get('dim', 16):,.0f} | {ratio:.2f} | "
            f"{r['server_bytes_sent_per_step']:,.0f} | {r['cache_hits_per_step']:,.0f} | "
            f"{r['test_auc']:.4f} | {r['load1_before']:.1f}/{r['load1_after']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--zipf", nargs="+", type=float, default=[1.05, 1.3])
    p.add_argument("--cache", nargs="+", default=["1000:8"], help="ROWS:STALENESS, each a run per skew")
    p.add_argument("--mode", default="async")
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--dim", type=int, default=16, help="model.embedding_dim")
    p.add_argument("--samples", type=int, default=200_000)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default=None)
    add_result_option(p, "cache_bench")
    args = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="cache_bench_") as root:
        for zipf in args.zipf:
            for cache in [None, *args.cache]:
                res = one_run(zipf, cache, args, os.path.join(root, f"{zipf}_{cache or 'off'}".replace(":", "_")))
                print(json.dumps(res), file=sys.stderr, flush=True)
                results.append(res)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": results}, f, indent=1)
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(run_recorded("cache_bench", main))
