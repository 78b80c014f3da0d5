"""Restarting a failed run from its latest checkpoint (``cluster.max_restarts``).

Local launcher (``run_local``, around the attempts of ``ps_train.launch.local.launch_local``
that the caller hands it, bound to the run's config): when a role dies or stops sending
heartbeats, the launcher stops the other roles (``ps_train.launch.local``); then, at most
``cluster.max_restarts`` times, this module starts the whole run again in the same run
folder from the latest complete checkpoint there (or, if the run wrote none yet, from where
it started: the original ``resume=`` or step 0). Each restart is logged (console and run log) and recorded as
``{"role", "reason", "from_step", "checkpoint"}`` in ``<run_dir>/restarts.json`` as it
happens and in ``metrics.json``'s ``restarts`` list at the end; trainer0 plots
``train/restarts`` in TensorBoard. Sync runs are bit-reproducible across a resume, so a
restarted sync run ends with the losses and weights of an uninterrupted one.

``cluster=env`` (torchrun, SLURM): no ps_train launcher watches the ranks. A failed rank
exits non-zero, and torchrun's ``--max-restarts`` starts the whole worker group again with
``TORCHELASTIC_RESTART_COUNT`` raised by one; ``start_checkpoint`` then makes every rank of
the new attempt resume from the run folder's latest complete checkpoint, as ``resume=auto``
does on purpose (e.g. for a requeued SLURM job). A failed rank exits with one line naming
the role that failed (``rank_failed``) and notes it in ``logs/failures.jsonl``, from which
trainer0 of the next attempt records the restart (``record_env_restart``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Protocol

from ps_train.checkpoint.files import latest_checkpoint, read_manifest
from ps_train.config import RESUME_AUTO, ClusterConfig
from ps_train.elastic.files import read_replacements, remove_job_file
from ps_train.files import atomic_write_text
from ps_train.launch.failures import RoleFailed
from ps_train.metrics import write_metrics_json
from ps_train.observe.console import CONSOLE
from rpc_core.errors import failed_worker

__all__ = [
    "Restart",
    "LaunchAttempt",
    "RESTARTS_FILE",
    "FAILURES_FILE",
    "run_local",
    "start_checkpoint",
    "read_restarts",
    "restart_count",
    "rank_failed",
    "record_env_restart",
]

log = logging.getLogger("ps_train")

RESTARTS_FILE = "restarts.json"
FAILURES_FILE = "logs/failures.jsonl"  # cluster=env: one line per rank that failed, per attempt


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


class LaunchAttempt(Protocol):
    """One attempt of a run with the local launcher (``launch_local`` with the run's config):
    trainer0's metrics, or ``RoleFailed``."""

    def __call__(self, run_dir: str, resume: str | None, *, timeout: float | None, attempt: int) -> dict[str, Any]: ...


def run_local(
    cluster: ClusterConfig, launch: LaunchAttempt, run_dir: str, resume: str | None, timeout: float | None = None
) -> dict[str, Any]:
    """Run ``launch`` (the run's ``cluster`` group: ``max_restarts``, ``elastic``), restarting
    after a failure up to ``cluster.max_restarts`` times; returns trainer0's metrics with the
    ``restarts`` list (also in metrics.json).

    ``timeout`` bounds all attempts together; running out of time is not restarted.
    """
    try:
        return _run_local(cluster, launch, run_dir, resume, timeout)
    finally:
        if cluster.elastic:  # the job is over: nobody can join it (kept between attempts)
            remove_job_file(run_dir)


def _run_local(
    cluster: ClusterConfig, launch: LaunchAttempt, run_dir: str, resume: str | None, timeout: float | None
) -> dict[str, Any]:
    deadline = None if timeout is None else time.monotonic() + timeout
    restarts: list[Restart] = []
    while True:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            metrics = launch(run_dir, resume, timeout=remaining, attempt=len(restarts))
            break
        except RoleFailed as failure:
            if failure.role is None or len(restarts) >= cluster.max_restarts:
                if restarts:
                    raise RoleFailed(
                        f"{failure} (after {len(restarts)} restart(s), the most cluster.max_restarts="
                        f"{cluster.max_restarts} allows)",
                        role=failure.role,
                        reason=failure.reason,
                        checkpoint=failure.checkpoint,
                    ) from failure
                raise
            resume = start_checkpoint(resume, run_dir, restarted=True)
            restart = Restart(failure.role, failure.reason, _step_of(resume), resume)
            restarts.append(restart)
            _record(run_dir, restarts)
            where = f"its checkpoint after step {restart.from_step} ({resume})" if resume else "step 0 (no checkpoint)"
            log.warning(
                "restart %d of %d: %s failed (%s); stopped the other roles; restarting the run from %s",
                len(restarts),
                cluster.max_restarts,
                restart.role,
                restart.reason,
                where,
                extra=CONSOLE,
            )
    metrics["restarts"] = [dataclasses.asdict(r) for r in restarts]
    if cluster.elastic:  # trainers replaced without a restart (ps_train.elastic.files)
        metrics["replacements"] = read_replacements(run_dir)
    write_metrics_json(Path(run_dir) / "metrics.json", metrics)  # trainer0 wrote it without the restarts
    return metrics


def _record(run_dir: str, restarts: list[Restart] | list[dict[str, Any]]) -> None:
    rows = [dataclasses.asdict(r) if isinstance(r, Restart) else r for r in restarts]
    atomic_write_text(Path(run_dir) / RESTARTS_FILE, json.dumps(rows, indent=2) + "\n")


def rank_failed(rank: int, name: str, run_dir: str, attempt: int, error: BaseException) -> RoleFailed:
    """``cluster=env``: the one-line error a failed rank exits with. It names the failed
    role -- the peer an RPC error names (a dead or silent server), else this rank -- and
    the checkpoint a restarted job resumes from; the line is also noted in
    ``logs/failures.jsonl`` for the next attempt's restart record."""
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    reason = f"{type(error).__name__}: {first}" if first else type(error).__name__
    peer = failed_worker(error)  # rpc_core's errors name the worker they are about
    role = peer if peer is not None and peer != name else name
    path = Path(run_dir) / FAILURES_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:  # one short write in append mode: lines of several ranks do not mix
        f.write(json.dumps({"attempt": attempt, "role": role, "seen_by": name, "reason": reason}) + "\n")
    last = latest_checkpoint(run_dir)
    hint = (
        f"the latest complete checkpoint is {last}; a restarted job (torchrun --max-restarts) or "
        f"resume={run_dir} continues from it"
        if last
        else "no checkpoint was written yet"
    )
    seen = f"seen by {name} (rank {rank})" if role != name else f"rank {rank}"
    return RoleFailed(
        f"{role} failed ({seen}): {reason}; {hint}", role=role, reason=reason, checkpoint=str(last) if last else None
    )


def record_env_restart(run_dir: str, attempt: int, checkpoint: str | None) -> dict[str, Any]:
    """``cluster=env``, trainer0 of attempt ``attempt`` > 0: add this restart to
    ``restarts.json`` (who failed in the attempt before, from ``logs/failures.jsonl``)."""
    rows = read_restarts(run_dir)
    failures = []
    path = Path(run_dir) / FAILURES_FILE
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut short by a killed rank
            if row.get("attempt") == attempt - 1:
                failures.append(row)
    if failures:
        # A rank that noted a failure was alive to note it, so it is not the cause: take the
        # first note naming a role that noted nothing (killed, frozen), else the first note.
        reporters = {row["seen_by"] for row in failures}
        first = next((row for row in failures if row["role"] not in reporters), failures[0])
        role, reason = first["role"], f"{first['reason']} (seen by {first['seen_by']})"
    else:
        role, reason = "unknown", "torchrun restarted the job; no rank noted a failure (see torchrun's output)"
    restart = dataclasses.asdict(Restart(role, reason, _step_of(checkpoint), checkpoint))
    if len(rows) < attempt:  # once per attempt
        rows.append(restart)
        _record(run_dir, rows)
    log.warning(
        "restart %d (by torchrun): %s failed (%s); resuming from %s",
        attempt,
        role,
        reason,
        f"its checkpoint after step {restart['from_step']} ({checkpoint})" if checkpoint else "step 0",
        extra=CONSOLE,
    )
    return restart
