"""The cost of ``cluster.serializer=safe`` against ``pickle`` on e2e_bench's MLP 1+1.

    python -m benchmarks.serializer_bench            # 3 alternating rounds, e2e_bench --quick's steps
    python -m benchmarks.serializer_bench --rounds 5 --steps 2000

Runs ``e2e_bench``'s ps_train job (MLP 1+1, synthetic data, sync mode, batch 32) with each
serializer in alternating order (so slow drift in machine load favours neither), with the
update as its own call and riding on the backward (ps_train's default in sync mode), and
prints the median samples/s of each with safe / pickle and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

from benchmarks._e2e_runs import STEPS, run_ps_train

SERIALIZERS = ("pickle", "safe")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=STEPS["quick"]["mlp"])
    ap.add_argument("--timeout", type=float, default=180.0)
    args = ap.parse_args()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    load_start = os.getloadavg()
    run_root = tempfile.mkdtemp(prefix="serializer_bench_")
    got: dict[tuple[bool, str], list[float]] = {}
    for rnd in range(args.rounds):
        jobs = [(bw, s) for bw in (True, False) for s in SERIALIZERS]
        if rnd % 2:
            jobs.reverse()
        for in_backward, serializer in jobs:
            res = run_ps_train(
                "mlp", 1, 1, "rpc_core", args.steps, run_root, args.timeout, log,
                update_in_backward=in_backward, serializer=serializer,
            )  # fmt: skip
            if res["status"] != "ok":
                raise SystemExit(f"serializer={serializer} update_in_backward={in_backward} failed: {res['error']}")
            got.setdefault((in_backward, serializer), []).append(res["samples_per_s"])
            rate = res["samples_per_s"]
            log(f"[round {rnd + 1}] update_in_backward={in_backward} {serializer}: {rate:,.0f} samples/s")
    load_end = os.getloadavg()
    shutil.rmtree(run_root, ignore_errors=True)
    print(f"MLP 1+1, sync, {args.steps} steps, median of {args.rounds} alternating rounds (samples/s)")
    print("| update | pickle | safe | safe / pickle |")
    print("|---|--:|--:|--:|")
    for in_backward in (True, False):
        p = statistics.median(got[(in_backward, "pickle")])
        s = statistics.median(got[(in_backward, "safe")])
        label = "in the backward (default)" if in_backward else "its own call"
        print(f"| {label} | {p:,.0f} | {s:,.0f} | {s / p:.3f} |")
    print(f"load average (1 min) {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end; {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
