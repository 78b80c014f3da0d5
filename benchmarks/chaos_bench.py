"""Chaos: an elastic async run while trainers are killed at random and a server once.

    python benchmarks/chaos_bench.py [--minutes 3] [--kill-every 20] [--trainers 3] [--seed 0]

1. calibrates: a short fault-free run gives the steps per trainer that take about
   ``--minutes`` on this machine;
2. runs that config fault-free (the reference);
3. runs it again (``cluster.elastic=true``, ``cluster.max_restarts=2``) while a killer
   SIGKILLs a random trainer every ``--kill-every`` s (the launcher replaces it) and ps1 once,
   halfway (the launcher restarts the run from its latest checkpoint);
4. checks: the chaos run exits 0, its final test accuracy is within 1 point of the
   reference's, and every checkpoint left in its folder is complete and loads with
   matching hashes (the final one at the last step); then prints a summary table: kills,
   replacements, restarts, accuracies and the wall-time overhead against the reference.

Every run has a hard time limit (a few times ``--minutes``). Exits 1 if a check fails.
Roles are found by the pid each one logs when it starts (``logs/<role>.log``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

_PID = re.compile(r"starting (\S+) \(rank \d+ of \d+, pid (\d+)\)")
CONFIG = [
    "mode=async",
    "cluster.num_servers=2",
    "train.eval_every=0",
    "logging.progress=false",
    "logging.tensorboard=false",
    "checkpoint.keep=3",
]


def _run(run_dir: Path, overrides: list[str], timeout: float) -> tuple[int, float, str]:
    cmd = [sys.executable, "-m", "ps_train", *CONFIG, *overrides, f"hydra.run.dir={run_dir}"]
    env = dict(os.environ)
    env.pop("PS_TRAIN_FAULT", None)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return -1, time.perf_counter() - t0, f"timed out after {timeout:g} s"
    return proc.returncode, time.perf_counter() - t0, (proc.stdout + proc.stderr)[-2000:]


def current_pid(run_dir: Path, role: str) -> int | None:
    """The pid of the process that holds ``role`` now (the last start its log names), if alive."""
    log = run_dir / "logs" / f"{role}.log"
    if not log.is_file():
        return None
    pids = [int(m.group(2)) for m in _PID.finditer(log.read_text()) if m.group(1) == role]
    if not pids or not Path(f"/proc/{pids[-1]}").exists():
        return None
    return pids[-1]


class Killer(threading.Thread):
    """Kills a random trainer every ``every`` s, and ps1 once at ``server_at`` s."""

    def __init__(self, run_dir: Path, trainers: int, every: float, server_at: float, seed: int) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.trainers, self.every, self.server_at = run_dir, trainers, every, server_at
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.kills: list[tuple[float, str]] = []

    def _kill(self, role: str, t0: float) -> None:
        pid = current_pid(self.run_dir, role)
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.kills.append((time.monotonic() - t0, role))
        print(f"  [{time.monotonic() - t0:6.1f} s] killed {role} (pid {pid})", flush=True)

    def run(self) -> None:
        t0 = time.monotonic()
        server_done = False
        next_trainer = self.every
        while not self.stop.is_set():
            now = time.monotonic() - t0
            if not server_done and now >= self.server_at:
                self._kill("ps1", t0)
                server_done = True
            if now >= next_trainer:
                self._kill(f"trainer{self.rng.randrange(self.trainers)}", t0)
                next_trainer += self.every * self.rng.uniform(0.75, 1.25)
            self.stop.wait(0.5)  # the killer's own clock tick, not a wait for anything


def check_checkpoints(run_dir: Path, steps: int) -> tuple[list[str], list[str]]:
    """Problems with the complete checkpoints left in the run folder (none: all intact, the
    last at the last step), and the saves that never completed (trainer0 killed while
    writing one: without a manifest nothing ever resumes from it)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from ps_train.checkpoint.files import is_complete, latest_checkpoint, load_checkpoint

    problems, interrupted = [], []
    root = run_dir / "checkpoints"
    dirs = sorted(root.iterdir()) if root.is_dir() else []
    for d in dirs:
        if not is_complete(d):
            interrupted.append(d.name)
            continue
        try:
            load_checkpoint(d)  # every shard file, hash-verified
        except Exception as e:  # noqa: BLE001 - any failure to load is the finding
            problems.append(f"{d.name}: does not load: {e}")
    last = latest_checkpoint(run_dir)
    if last is None or not last.name.endswith(f"{steps:09d}"):
        problems.append(f"the latest complete checkpoint is {last}, not the one after the last step {steps}")
    return problems, interrupted


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=3.0, help="about how long each full run trains")
    ap.add_argument("--kill-every", type=float, default=20.0, help="seconds between trainer kills")
    ap.add_argument("--trainers", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="which trainers get killed")
    ap.add_argument("--out", type=Path, default=Path("runs/chaos"), help="run folders go here")
    args = ap.parse_args(argv)
    out = args.out / time.strftime("%Y-%m-%d_%H-%M-%S")
    limit = max(120.0, 4 * 60 * args.minutes)

    cal_steps = 200
    rc, wall, tail = _run(
        out / "calibrate", [f"cluster.num_trainers={args.trainers}", f"train.steps={cal_steps}"], limit
    )
    if rc != 0:
        print(f"calibration run failed ({rc}):\n{tail}")
        return 1
    cal = json.loads((out / "calibrate" / "metrics.json").read_text())
    step_s = cal["wall_time_s"] / cal_steps
    steps = max(100, int(60 * args.minutes / step_s) // 100 * 100)
    common = [f"cluster.num_trainers={args.trainers}", f"train.steps={steps}", f"checkpoint.every={steps // 10}"]
    print(f"{steps} steps per trainer (~{step_s * 1e3:.1f} ms a step) in {out}", flush=True)

    print("fault-free run ...", flush=True)
    rc, ref_wall, tail = _run(out / "reference", common + ["cluster.elastic=true"], limit)
    if rc != 0:
        print(f"the fault-free run failed ({rc}):\n{tail}")
        return 1
    ref = json.loads((out / "reference" / "metrics.json").read_text())

    print("chaos run ...", flush=True)
    chaos_dir = out / "chaos"
    killer = Killer(chaos_dir, args.trainers, args.kill_every, server_at=ref_wall / 2, seed=args.seed)
    killer.start()
    try:
        rc, wall, tail = _run(chaos_dir, common + ["cluster.elastic=true", "cluster.max_restarts=2"], limit)
    finally:
        killer.stop.set()
        killer.join()
    metrics: dict[str, Any] = {}
    if (chaos_dir / "metrics.json").is_file():
        metrics = json.loads((chaos_dir / "metrics.json").read_text())
    problems = [] if rc == 0 else [f"the chaos run exited {rc}: {tail}"]
    acc, ref_acc = metrics.get("test_accuracy", float("nan")), ref["test_accuracy"]
    if not abs(acc - ref_acc) <= 0.01:
        problems.append(f"test accuracy {acc:.4f} is not within 1 point of the fault-free {ref_acc:.4f}")
    bad, interrupted = check_checkpoints(chaos_dir, steps)
    problems += bad

    rows = [
        ("steps per trainer", f"{steps}", ""),
        ("wall time (s)", f"{ref_wall:.1f}", f"{wall:.1f}"),
        ("test accuracy", f"{ref_acc:.4f}", f"{acc:.4f}"),
        (
            "kills (trainers / servers)",
            "0 / 0",
            f"{sum(r != 'ps1' for _, r in killer.kills)} / {sum(r == 'ps1' for _, r in killer.kills)}",
        ),
        ("trainer replacements", "0", f"{len(metrics.get('replacements', []))}"),
        ("run restarts (from checkpoint)", "0", f"{len(metrics.get('restarts', []))}"),
        (
            "complete / interrupted checkpoints",
            "",
            f"{len(list((chaos_dir / 'checkpoints').glob('step_*'))) - len(interrupted)} / {len(interrupted)}",
        ),
        ("wall-time overhead", "", f"{(wall / ref_wall - 1) * 100:+.0f} %"),
    ]
    print(f"\n| {'':34} | {'fault-free':>10} | {'chaos':>10} |\n|{'-' * 36}|{'-' * 12}|{'-' * 12}|")
    for name, a, b in rows:
        print(f"| {name:34} | {a:>10} | {b:>10} |")
    for r in metrics.get("restarts", []):
        print(f"restart: {r['role']} ({r['reason']}), resumed after step {r['from_step']}")
    for r in metrics.get("replacements", []):
        print(f"replacement: {r['role']} ({r['reason']}), attempt {r['attempt']}")
    print(
        "\n"
        + (
            "OK: the run finished, accuracy within 1 point, checkpoints intact"
            if not problems
            else "FAILED:\n  - " + "\n  - ".join(problems)
        )
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
