"""Stress: sync-mode training with many trainers, repeated, on a busy machine.

    python -m benchmarks.stress_sync [--runs 10] [--trainers 8] [--steps 300] [--hogs 2]

Runs ``python -m ps_train mode=sync`` again and again (2 servers, many trainers, steps
pipelined: no log line settles a step before the end) with ``--hogs`` processes spinning
beside it, and checks that every run finishes and that all runs give the same final loss
(sync mode is deterministic). Each run has a hard timeout; the hogs are killed at the end.
Prints one line per run and a summary; exits 1 if any run failed or differed.
The test suite runs a short version of this (tests/ps_train/test_reproducibility.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._results import add_result_option, run_recorded


def _run(run_dir: Path, trainers: int, steps: int, timeout: float) -> tuple:
    cmd = [
        sys.executable,
        "-m",
        "ps_train",
        "mode=sync",
        "cluster.num_servers=2",
        f"cluster.num_trainers={trainers}",
        f"train.steps={steps}",
        f"train.log_every={steps}",
        "train.eval_every=0",
        "logging.progress=false",
        f"hydra.run.dir={run_dir}",
    ]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, time.perf_counter() - t0, f"timed out after {timeout:g} s", None
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "Error" in ln or "error" in ln]
        return False, wall, (lines[-1] if lines else f"exit code {proc.returncode}")[:300], None
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return True, wall, "", metrics["final_train_loss"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--trainers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--hogs", type=int, default=2, help="processes spinning on a core each meanwhile")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    add_result_option(ap, "stress_sync")
    args = ap.parse_args(argv)
    hogs = [
        subprocess.Popen(
            [sys.executable, "-c", "import time\nend = time.monotonic() + 3600\nwhile time.monotonic() < end: pass"]
        )
        for _ in range(args.hogs)
    ]
    failures, losses = 0, set()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.runs):
                ok, wall, why, loss = _run(Path(tmp) / f"run{i}", args.trainers, args.steps, args.timeout)
                failures += not ok
                if ok:
                    losses.add(loss)
                print(
                    f"run {i + 1}/{args.runs}: {'ok' if ok else 'FAILED'} in {wall:.1f} s"
                    + (f" (final loss {loss:.6f})" if ok else f": {why}"),
                    flush=True,
                )
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    same = len(losses) <= 1
    print(
        f"{args.runs - failures} of {args.runs} runs finished ({args.trainers} trainers, 2 servers, "
        f"{args.steps} steps, {args.hogs} hogs); final losses {'identical' if same else 'DIFFER: ' + str(losses)}"
    )
    return 0 if failures == 0 and same else 1


if __name__ == "__main__":
    sys.exit(run_recorded("stress_sync", main))
