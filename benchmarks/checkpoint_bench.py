"""Checkpoints of embedding tables while training: steps/s during a checkpoint's write, and
the bytes of differential checkpoints against full ones.

    python -m benchmarks.checkpoint_bench                     # preset=dlrm_large, 200 steps
    python -m benchmarks.checkpoint_bench --shape medium      # 26 x 100,000 rows (0.67 GB)

Three sync runs of the same job (2 servers + 2 trainers, Adagrad tables), one after another:
``none`` (no checkpoints), ``full`` (a full checkpoint every ``--every`` steps) and
``differential`` (the first full, then only the rows changed since the previous one). Each
step's end comes from trainer0's TensorBoard events; a checkpoint is being written from
trainer0's request (the manifest's ``created_unix``) until its manifest is in place. The table
gives steps/s overall and of the steps that ended inside those windows, their ratio to the
``none`` run over the same steps (``--warmup`` steps left out), and each checkpoint's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._results import add_result_option, run_recorded

SHAPES = {
    "large": ["preset=dlrm_large"],
    "medium": ["preset=dlrm_large", "data.table_rows=100000"],
}


def run(shape: str, kind: str, steps: int, every: int, run_dir: Path, timeout: float) -> None:
    overrides = [
        *SHAPES[shape],
        "mode=sync",
        f"train.steps={steps}",
        "train.log_every=1",
        "logging.progress=false",
        "cluster.role_timeout=600",  # a shared machine under load starts processes slowly
        "checkpoint.final=false",
        "checkpoint.keep=0",
        f"checkpoint.every={0 if kind == 'none' else every}",
        f"checkpoint.differential={'true' if kind == 'differential' else 'false'}",
        "checkpoint.full_every=1000",
        f"hydra.run.dir={run_dir}",
    ]
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "ps_train", *overrides], check=True, timeout=timeout, stdout=subprocess.DEVNULL
    )
    print(f"  {kind}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)


def step_ends(run_dir: Path) -> list[float]:
    """Wall time at the end of every step of trainer0 (step 1 first)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "tb" / "trainer0"), size_guidance={"scalars": 0})
    ea.Reload()
    events = sorted(ea.Scalars("train/loss"), key=lambda e: e.step)
    return [e.wall_time for e in events]


def checkpoints(run_dir: Path) -> list[dict[str, Any]]:
    out = []
    for ckpt in sorted((run_dir / "checkpoints").glob("step_*")):
        manifest = json.loads((ckpt / "manifest.json").read_text())
        out.append(
            {
                "step": manifest["step"],
                "start": manifest["created_unix"],
                "end": (ckpt / "manifest.json").stat().st_mtime,
                "bytes": sum(f.stat().st_size for f in ckpt.iterdir()),
                "differential": bool(manifest.get("bases")),
            }
        )
    return out


def rate(ends: list[float], first: int, last: int) -> float:
    """Steps per second of steps first..last (1-based, inclusive)."""
    return (last - first + 1) / (ends[last - 1] - ends[first - 2])


def during(ends: list[float], windows: list[dict[str, Any]], warmup: int) -> tuple[int, float, list[int]]:
    """Steps that ended inside a window, their total time, and which they are."""
    steps, total = [], 0.0
    for i in range(warmup, len(ends)):
        if any(w["start"] <= ends[i] <= w["end"] for w in windows):
            steps.append(i + 1)
            total += ends[i] - ends[i - 1]
    return len(steps), total, steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="large")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=1500)
    ap.add_argument("--run-root", default=None)
    ap.add_argument("--json", default=None)
    add_result_option(ap, "checkpoint_bench")
    args = ap.parse_args(argv)
    root = Path(args.run_root or tempfile.mkdtemp(prefix="checkpoint_bench."))
    load = os.getloadavg()
    results: dict[str, Any] = {"shape": args.shape, "steps": args.steps, "every": args.every, "load_before": load}
    for kind in ("none", "full", "differential"):
        run_dir = root / kind
        run(args.shape, kind, args.steps, args.every, run_dir, args.timeout)
        ends = step_ends(run_dir)
        ckpts = checkpoints(run_dir) if kind != "none" else []
        n, busy, steps = during(ends, ckpts, args.warmup)
        results[kind] = {
            "steps_per_s": rate(ends, args.warmup + 1, len(ends)),
            "steps_while_writing": n,
            "steps_per_s_while_writing": n / busy if busy else None,
            "steps_written_during": steps,
            "checkpoints": ckpts,
        }
    results["load_after"] = os.getloadavg()
    base = results["none"]["steps_per_s"]
    print(
        f"shape {args.shape}, {args.steps} steps, checkpoint every {args.every}; load {load[0]:.1f} -> "
        f"{results['load_after'][0]:.1f}"
    )
    print(f"{'run':<14}{'steps/s':>9}{'while writing':>15}{'x none':>8}{'steps in windows':>18}")
    for kind in ("none", "full", "differential"):
        r = results[kind]
        w = r["steps_per_s_while_writing"]
        ratio = f"{w / base:.2f}" if w else "-"
        shown = f"{w:.2f}" if w else "-"
        print(f"{kind:<14}{r['steps_per_s']:>9.2f}{shown:>15}{ratio:>8}{r['steps_while_writing']:>18}")
    full = [c["bytes"] for c in results["full"]["checkpoints"]]
    diff = [c["bytes"] for c in results["differential"]["checkpoints"] if c["differential"]]
    if full and diff:
        results["differential_over_full"] = max(diff) / max(full)
        print(
            f"bytes: full {max(full) / 1e9:.3f} GB, differential {[round(d / 1e9, 3) for d in diff]} GB: "
            f"largest {max(diff) / max(full):.3f} of a full one"
        )
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    if not args.run_root:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_recorded("checkpoint_bench", main))
