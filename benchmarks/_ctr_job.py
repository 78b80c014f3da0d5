"""One ``python -m ps_train model=dlrm data=synthetic_ctr`` job, as the CTR benchmarks run it
(cache_bench, mode_bench, dynamic_tables_bench): in a child process from the repo root, no
evaluation before the end, no checkpoints, no progress lines; its ``metrics.json`` and the
machine's load around it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What every CTR benchmark job sets; each adds its own overrides after these.
DLRM_JOB = ("model=dlrm", "data=synthetic_ctr", "train.eval_every=0", "checkpoint.every=0", "logging.progress=false")


def load1() -> float:
    """The machine's 1-minute load average."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


class JobResult(NamedTuple):
    metrics: dict[str, Any] | None  # trainer0's metrics.json; None: the job failed
    stderr: str  # the job's standard error (why it failed)
    load1_before: float
    load1_after: float
    seconds: float  # wall time of the whole child process


def run_dlrm_job(run_dir: str, overrides: list[str], timeout: float) -> JobResult:
    """Run the job with ``overrides`` (after ``DLRM_JOB``) in ``run_dir``."""
    cmd = [sys.executable, "-m", "ps_train", *DLRM_JOB, *overrides, f"hydra.run.dir={run_dir}"]
    before, t0 = load1(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    seconds, after = time.perf_counter() - t0, load1()
    metrics = None
    if proc.returncode == 0:
        with open(os.path.join(run_dir, "metrics.json")) as f:
            metrics = json.load(f)
    return JobResult(metrics, proc.stderr, before, after, seconds)
