"""Restarting a failed run from its latest checkpoint (``cluster.max_restarts``).

Local launcher (``run_local``): when a role dies or stops sending heartbeats, the launcher
stops the other roles (``ps_train.launch``); then, at most ``cluster.max_restarts`` times,
this module starts the whole run again in the same run folder from the latest complete
checkpoint there (or, if the run wrote none yet, from where it started: the original
``resume=`` or step 0). Each restart is logged (console and run log) and recorded as
``{"role", "reason", "from_step", "checkpoint"}`` in ``<run_dir>/restarts.json`` as it
happens and in ``metrics.json``'s ``restarts`` list at the end; trainer0 plots
``train/restarts`` in TensorBoard. Sync runs are bit-reproducible across a resume, so a
restarted sync run ends with the losses and weights of an uninterrupted one.

``cluster=env`` (torchrun, SLURM): no ps_train launcher watches the ranks. A failed rank
exits non-zero, and torchrun's ``--max-restarts`` starts the whole worker group again with
``TORCHELASTIC_RESTART_COUNT`` raised by one; ``start_checkpoint`` then makes every rank of
the new attempt resume from the run folder's latest complete checkpoint, as ``resume=auto``
does on purpose (e.g. for a requeued SLURM job).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from ps_train.checkpoint_files import atomic_write_text, latest_checkpoint, read_manifest
from ps_train.config import RESUME_AUTO, Config
from ps_train.launch import RoleFailed, launch_local
from ps_train.metrics import write_metrics_json

__all__ = ["Restart", "RESTARTS_FILE", "run_local", "start_checkpoint", "read_restarts", "restart_count"]

log = logging.getLogger("ps_train")

RESTARTS_FILE = "restarts.json"


@dataclasses.dataclass
class Restart:
    role: str  # the role that failed, e.g. "ps1"
    reason: str  # how: "killed by signal SIGKILL", "unresponsive: no heartbeat for 30.2 s, ..."
    from_step: int  # the step the restarted attempt resumed after (0: from scratch)
    checkpoint: str | None  # the checkpoint it resumed from (None: from scratch)


def restart_count() -> int:
    """How many times torchrun restarted this job's processes (0 without torchrun)."""
    raw = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(raw) if raw.isdigit() else 0


def start_checkpoint(resume: str | None, run_dir: str, restarted: bool) -> str | None:
    """What a (re)started attempt resumes from: the run folder's latest complete checkpoint
    when restarted or ``resume=auto``, else the ``resume=`` the user gave (None: step 0).

    A restarted attempt whose run folder has no checkpoint yet starts where the first did.
    """
    if restarted or resume == RESUME_AUTO:
        last = latest_checkpoint(run_dir)
        if last is not None:
            return str(last)
    return None if resume == RESUME_AUTO else resume


def _step_of(checkpoint: str | None) -> int:
    return read_manifest(checkpoint).step if checkpoint else 0


def read_restarts(run_dir: str) -> list[dict[str, Any]]:
    """The restarts recorded in ``run_dir`` so far (oldest first)."""
    path = Path(run_dir) / RESTARTS_FILE
    return list(json.loads(path.read_text())) if path.is_file() else []


def run_local(cfg: Config, run_dir: str, resume: str | None, timeout: float | None = None) -> dict[str, Any]:
    """Run with the local launcher, restarting after a failure up to ``cluster.max_restarts``
    times; returns trainer0's metrics with the ``restarts`` list (also in metrics.json).

    ``timeout`` bounds all attempts together; running out of time is not restarted.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    restarts: list[Restart] = []
    while True:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            metrics = launch_local(cfg, run_dir, resume, timeout=remaining, attempt=len(restarts))
            break
        except RoleFailed as failure:
            if failure.role is None or len(restarts) >= cfg.cluster.max_restarts:
                if restarts:
                    raise RoleFailed(f"{failure} (after {len(restarts)} restart(s), the most cluster.max_restarts="
                                     f"{cfg.cluster.max_restarts} allows)", role=failure.role,
                                     reason=failure.reason, checkpoint=failure.checkpoint) from failure
                raise
            resume = start_checkpoint(resume, run_dir, restarted=True)
            restart = Restart(failure.role, failure.reason, _step_of(resume), resume)
            restarts.append(restart)
            _record(run_dir, restarts)
            where = f"its checkpoint after step {restart.from_step} ({resume})" if resume else "step 0 (no checkpoint)"
            log.warning("restart %d of %d: %s failed (%s); stopped the other roles; restarting the run from %s",
                        len(restarts), cfg.cluster.max_restarts, restart.role, restart.reason, where)
    metrics["restarts"] = [dataclasses.asdict(r) for r in restarts]
    write_metrics_json(Path(run_dir) / "metrics.json", metrics)  # trainer0 wrote it without the restarts
    return metrics


def _record(run_dir: str, restarts: list[Restart]) -> None:
    atomic_write_text(Path(run_dir) / RESTARTS_FILE,
                      json.dumps([dataclasses.asdict(r) for r in restarts], indent=2) + "\n")
