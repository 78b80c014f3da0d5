"""Chaos for a ``python -m ps_train`` job, as ``benchmarks/chaos_bench.py`` and the tests run it:
a job run with a hard time limit, a kill loop with a mean time between failures, and what a
run that survived it lost.

``Killer`` SIGKILLs a random role of a running ``python -m ps_train`` job, servers and
trainers, at random moments: the gaps between kills are drawn from an exponential
distribution with mean ``mtbf`` seconds (a Poisson process of failures, seeded, as
torchft's punisher does), so a kill lands at a random point of a step, of a checkpoint
write, of an evaluation or of a restart's start-up. Roles are found by the pid each logs
when it starts (``logs/<role>.log``): after a restart or a replacement the new process is the
one killed next.
"""

from __future__ import annotations

import dataclasses
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

__all__ = [
    "SERVERS",
    "job_config",
    "JobRun",
    "Kill",
    "Killer",
    "run_job",
    "current_pid",
    "checkpoint_problems",
    "lost_updates",
    "metric",
]

_PID = re.compile(r"starting (\S+) \(rank \d+ of \d+, pid (\d+)\)")
_ROOT = Path(__file__).resolve().parent.parent


SERVERS = 2  # the chaos job's servers: a kill of one leaves the other's shards to check


def job_config(mode: str, model: str, trainers: int, max_restarts: int) -> list[str]:
    """The chaos job's overrides: ``model`` ``mlp`` (digits) or ``dlrm`` (synthetic CTR) in
    ``mode`` with ``trainers`` trainers, elastic unless sync, ``max_restarts`` run restarts."""
    data = ["model=dlrm", "data=synthetic_ctr"] if model == "dlrm" else ["model=mlp", "data=digits"]
    return [
        f"mode={mode}",
        *data,
        f"cluster.num_servers={SERVERS}",
        f"cluster.num_trainers={trainers}",
        f"cluster.elastic={'false' if mode == 'sync' else 'true'}",
        f"cluster.max_restarts={max_restarts}",
        "train.eval_every=0",
        "logging.progress=false",
        "logging.tensorboard=false",
        # Every checkpoint stays: the last attempt's trainer positions are read from the one it
        # resumed from (lost_updates), which a later save would otherwise prune.
        "checkpoint.keep=0",
    ]


@dataclasses.dataclass
class JobRun:
    returncode: int  # -1: timed out (killed by the benchmark)
    wall_s: float
    tail: str  # the end of its console output
    metrics: dict[str, Any]  # metrics.json ({} if the job wrote none)


def run_job(run_dir: Path, overrides: list[str], timeout: float, env: dict[str, str] | None = None) -> JobRun:
    """``python -m ps_train <overrides> hydra.run.dir=<run_dir>``, killed after ``timeout`` s."""
    cmd = [sys.executable, "-m", "ps_train", *overrides, f"hydra.run.dir={run_dir}"]
    full_env = dict(os.environ, **(env or {}))
    full_env.pop("PS_TRAIN_FAULT", None)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=_ROOT)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        rc, tail = -1, f"timed out after {timeout:g} s"
    wall = time.perf_counter() - t0
    path = run_dir / "metrics.json"
    metrics = json.loads(path.read_text()) if path.is_file() else {}
    return JobRun(rc, wall, tail, metrics)


def _alive(pid: int) -> bool:
    """Running, not a zombie its launcher has yet to reap (killing that would kill nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def current_pid(run_dir: Path, role: str) -> int | None:
    """The pid of the process that holds ``role`` now (the last start its log names), if alive."""
    log = run_dir / "logs" / f"{role}.log"
    try:
        text = log.read_text()
    except OSError:
        return None
    pids = [int(m.group(2)) for m in _PID.finditer(text) if m.group(1) == role]
    return pids[-1] if pids and _alive(pids[-1]) else None


@dataclasses.dataclass
class Kill:
    time_s: float  # since the killer started
    role: str
    pid: int


class Killer(threading.Thread):
    """Kills a random role of the job in ``run_dir`` every Exp(``mtbf``) seconds.

    ``servers`` / ``trainers``: how many of each the job has; a failure hits a server with
    probability ``server_share``, else a trainer, each uniformly among all of the job's roles,
    running or not. A victim that is not running when its failure is due (the run restarts, or
    it is being replaced) is killed as soon as it runs again: its node failed while it started.
    Drawing only among the roles already up would put the failures that fall due during a
    restart on the first role to come back (ps0), restart after restart. Stops after
    ``max_failures`` kills, or when ``stop`` is set. ``max_gap``: gaps longer than this many
    seconds are cut to it (a bounded test needs its kills inside a short job).
    """

    TICK = 0.1  # s: the killer's clock; a kill lands within this of its time

    def __init__(
        self,
        run_dir: Path,
        servers: int,
        trainers: int,
        mtbf: float,
        seed: int,
        server_share: float = 0.3,
        max_failures: int | None = None,
        max_gap: float | None = None,
    ) -> None:
        super().__init__(daemon=True, name="chaos-killer")
        self.run_dir, self.servers, self.trainers = run_dir, servers, trainers
        self.mtbf, self.server_share, self.max_failures, self.max_gap = mtbf, server_share, max_failures, max_gap
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.kills: list[Kill] = []

    def _gap(self) -> float:
        gap = self.rng.expovariate(1.0 / self.mtbf)
        return gap if self.max_gap is None else min(gap, self.max_gap)

    def _victim(self) -> str:
        """The role the next failure hits: a server with probability ``server_share``, else a
        trainer, each uniformly (the job's roles, whether they run at this moment or not)."""
        pick_server = self.servers > 0 and (self.trainers == 0 or self.rng.random() < self.server_share)
        if pick_server:
            return f"ps{self.rng.randrange(self.servers)}"
        return f"trainer{self.rng.randrange(self.trainers)}"

    def run(self) -> None:
        t0 = time.monotonic()
        due = self._gap()
        victim: str | None = None  # drawn when its failure falls due; killed once it runs
        while self.max_failures is None or len(self.kills) < self.max_failures:
            if self.stop.wait(max(0.0, min(self.TICK, due - (time.monotonic() - t0)))):
                return  # the job ended
            if time.monotonic() - t0 < due:
                continue
            if victim is None:
                victim = self._victim()
            pid = current_pid(self.run_dir, victim)
            if pid is None:
                continue  # not running now (a restart, a replacement): at the next tick that finds it
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            now = time.monotonic() - t0
            late = f", {now - due:.1f} s after its failure fell due" if now - due > 2 * self.TICK else ""
            self.kills.append(Kill(round(now, 2), victim, pid))
            print(f"  [{now:7.1f} s] killed {victim} (pid {pid}{late})", flush=True)
            victim = None
            due = now + self._gap()


def run_with_killer(
    run_dir: Path, overrides: list[str], timeout: float, killer_args: dict[str, Any]
) -> tuple[JobRun, list[Kill]]:
    """Run the job while a ``Killer(run_dir, **killer_args)`` kills its roles."""
    killer = Killer(run_dir, **killer_args)
    killer.start()
    try:
        job = run_job(run_dir, overrides, timeout)
    finally:
        killer.stop.set()
        killer.join()
    return job, killer.kills


def checkpoint_problems(run_dir: Path, steps: int) -> tuple[list[str], list[str]]:
    """Problems with the complete checkpoints left in ``run_dir`` (none: all load with
    matching hashes, the last at step ``steps``), and the saves that never completed (trainer0
    killed while writing one: without a manifest nothing ever resumes from it)."""
    from ps_train.checkpoint.files import is_complete, latest_checkpoint, load_checkpoint

    problems, interrupted = [], []
    root = run_dir / "checkpoints"
    for d in sorted(root.iterdir()) if root.is_dir() else []:
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


def lost_updates(metrics: dict[str, Any], trainers: int, steps: int) -> dict[str, tuple[int, int]]:
    """Elastic async/ssp: per server, the launched trainers' updates (missing, applied twice)
    in the job's last attempt, against ``steps`` minus the steps each had in the checkpoint the
    attempt resumed from (its own, from the manifest; the servers count from there).
    ``(0, 0)`` everywhere: nothing lost."""
    restarts = metrics.get("restarts", [])
    resumed = {f"trainer{t}": 0 for t in range(trainers)}
    if restarts and restarts[-1].get("checkpoint"):  # None: it started over from step 0
        path = Path(restarts[-1]["checkpoint"]) / "manifest.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: the checkpoint the job's last attempt resumed from is gone, so its trainers' "
                "positions are unknown; run the chaos job with checkpoint.keep=0 (job_config does)"
            )
        manifest = json.loads(path.read_text())
        for name in resumed:
            resumed[name] = manifest["trainer_positions"].get(name, {}).get("step", restarts[-1]["from_step"])
    out = {}
    for server, counts in metrics.get("updates_by_trainer", {}).items():
        diffs = [counts.get(name, 0) - (steps - done) for name, done in resumed.items()]
        out[server] = (sum(-d for d in diffs if d < 0), sum(d for d in diffs if d > 0))
    return out


def metric(metrics: dict[str, Any], name: str) -> float:
    value = metrics.get(name)
    return float("nan") if value is None else float(value)
