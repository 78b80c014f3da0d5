"""What the servers' TensorBoard metrics cost (ps_train.observe.server_metrics).

    python -m benchmarks.server_metrics_bench            # per-update and per-sample cost
    python -m benchmarks.server_metrics_bench --e2e 3    # also the default experiment's samples/s,
                                                         # with and without, 3 alternating runs each

A server pays the counters on every update (``UpdateCounters``) and one ``sample()`` every
``logging.server_every`` seconds; the end-to-end runs compare ``logging.server_every=1`` (the
default) with ``0`` (no sampler; the counters remain, they are part of the update).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._results import add_result_option, run_recorded
from ps_train.metrics import TensorBoardWriter
from ps_train.observe.server_metrics import ByteCounts, ServerMetrics, UpdateCounters


class _Server:
    def __init__(self) -> None:
        self.version = 0
        self.counters = UpdateCounters()

    def table_counts(self) -> dict[str, int]:
        return {"rows_read": self.version * 100, "rows_updated": self.version * 50, "rows_live": 1000}


def per_update_us(n: int = 200_000) -> float:
    c = UpdateCounters()
    t0 = time.perf_counter()
    for i in range(n):
        c.contributed()
        c.applied(0.001)
        c.stale(i & 3)
    return (time.perf_counter() - t0) / n * 1e6


def per_sample_ms(n: int = 300) -> float:
    server = _Server()
    with tempfile.TemporaryDirectory() as d, TensorBoardWriter(d) as w:
        sampler = ServerMetrics(server, w, 1.0, staleness=True, byte_counts=lambda: ByteCounts(0, 0))
        times = []
        for _ in range(n):
            for i in range(50):  # 50 updates per interval
                server.counters.contributed()
                server.counters.applied(0.001)
                server.counters.stale(i & 3)
                server.version += 1
            t0 = time.perf_counter()
            sampler.sample()
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def e2e(rounds: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"1.0": [], "0": []}
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    with tempfile.TemporaryDirectory() as d:
        for i in range(rounds):
            for every in out:
                run_dir = f"hydra.run.dir={d}/{every}-{i}"
                cmd = [sys.executable, "-m", "ps_train", f"logging.server_every={every}", run_dir]
                p = subprocess.run(
                    cmd,
                    capture_output=True,
                    text=True,
                    env=env,
                )
                m = re.search(r"done: .* ([\d,]+) samples/s", p.stdout)
                print(f"  server_every={every} run {i}: {m.group(1) if m else 'failed'} samples/s", flush=True)
                if m:
                    out[every].append(float(m.group(1).replace(",", "")))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--e2e", type=int, default=0, help="alternating runs of the default experiment per setting")
    add_result_option(ap, "server_metrics_bench")
    args = ap.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    print(f"counters per update: {per_update_us():.2f} us")
    print(f"one sample (14 scalars + a histogram): {per_sample_ms():.3f} ms")
    if args.e2e:
        res = e2e(args.e2e)
        for every, rates in res.items():
            if rates:
                print(f"server_every={every}: median {statistics.median(rates):,.0f} samples/s over {rates}")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    sys.exit(run_recorded("server_metrics_bench", main))
