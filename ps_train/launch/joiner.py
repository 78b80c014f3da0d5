"""A trainer that joins a running elastic job (``python -m ps_train join=<run dir>``), kept in it.

The join command is its trainer's own small launcher: it runs the trainer in a child process
(forked from it) and watches it, so that a joiner
fails and recovers as a launched trainer does:

- **killed** (a signal: SIGKILL, the OOM killer): replaced at once by a new process with the
  same name and rank, which continues after its predecessor's last step that ps0 applied
  (``ps_train.elastic.trainer.ElasticRole``), as the local launcher replaces a launched one;
- **the job restarted** (a server died; ``cluster.max_restarts``): the job's launcher rewrites
  ``elastic.json`` for its next attempt. The trainer, which lost the old attempt's servers,
  exits with their error, and a new one joins the new attempt, as any joiner does (the first
  free name; it trains from the next epoch that begins);
- **the job is over** (``elastic.json`` removed): the command ends, exit 0 once its trainer
  finished;
- **its trainer failed on its own** (an error that blames no other role, and the job goes on):
  the command fails with that error (``RoleFailed``), as a launched trainer's error stops its
  run. A frozen trainer is not the command's to find: ps0's heartbeats remove it from the job.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from ps_train.config import from_dictconfig
from ps_train.elastic.files import read_job_file
from ps_train.faults import ATTEMPT_ENV, REPLACED_ENV
from ps_train.launch.failures import RoleError, RoleFailed, role_name
from ps_train.launch.local import BLAME_GRACE
from ps_train.launch.rank import run_rank
from ps_train.launch.role_processes import exit_with_parent, report_error

__all__ = ["keep_joined", "JOB_POLL"]

log = logging.getLogger("ps_train")

_PR_SET_PDEATHSIG = 1  # prctl(2)
JOB_POLL = 0.2  # s between looks at elastic.json while the job's launcher restarts it
RESTART_GRACE = 60.0  # s beyond cluster.role_timeout a job may take to start its next attempt
# s to wait for a next attempt after an error that names no other role: most likely the
# trainer's own, but the job may be restarting too (its launcher stops the old roles first)
OWN_ERROR_GRACE = 20.0


class _Joined(NamedTuple):
    rank: int  # the rank the trainer took in the job's group


class _Outcome(NamedTuple):
    exitcode: int
    rank: int | None  # where it joined (None: it died before)
    error: RoleError | None


def _killed_with_parent() -> None:
    """Linux: the kernel SIGKILLs this process when the join command dies, even if it is
    stopped (a frozen trainer runs no thread that could notice); elsewhere a no-op."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    except (OSError, AttributeError):
        pass


def _child(
    job: dict[str, Any], rank: int, next_free: bool, run_dir: str, env: dict[str, str], cwd: str, out: Connection
) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    _killed_with_parent()
    exit_with_parent()
    cfg_dict = job["config"]
    name = [role_name(rank, cfg_dict["cluster"]["num_servers"])]

    def joined(r: int) -> None:
        name[0] = role_name(r, cfg_dict["cluster"]["num_servers"])
        out.send(_Joined(r))

    try:
        cfg = from_dictconfig(cfg_dict)
        run_rank(
            cfg,
            rank,
            job["master_addr"],
            int(job["master_port"]),
            job["secret"],
            run_dir,
            attempt=int(job.get("attempt", 0)),
            joiner=next_free,
            joined=joined,
        )
    except BaseException as e:  # noqa: BLE001 - any failure is reported, then it exits 1
        report_error(name[0], run_dir, cfg_dict["logging"]["level"], e, out)
        os._exit(1)
    logging.shutdown()
    os._exit(0)


def _run_trainer(job: dict[str, Any], rank: int | None, job_dir: str) -> _Outcome:
    """Run one trainer process in ``job``'s current attempt until it exits: a new joiner
    (``rank`` None) or the replacement of the one that held ``rank``."""
    cluster = job["config"]["cluster"]
    first = cluster["num_servers"] + cluster["num_trainers"] if rank is None else rank
    env = dict(os.environ, **{ATTEMPT_ENV: str(int(job.get("attempt", 0)))})
    if rank is not None:
        env[REPLACED_ENV] = "1"
    # Forked from this process, which has imported torch and ps_train already: a replacement
    # or a rejoin starts in a fraction of a second (this process runs no threads to fork).
    ctx = mp.get_context("fork")
    got, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_child, args=(job, first, rank is None, job_dir, env, os.getcwd(), send), name="joiner", daemon=False
    )
    proc.start()
    send.close()  # the child holds its own end: EOF once it exits
    joined, error = None, None
    while True:
        try:
            msg = got.recv()
        except EOFError:
            break
        if isinstance(msg, _Joined):
            joined = msg.rank
            log.info("%s joined the job (attempt %d)", role_name(joined, cluster["num_servers"]), job.get("attempt", 0))
        elif isinstance(msg, RoleError):
            error = msg
    proc.join()
    got.close()
    return _Outcome(proc.exitcode if proc.exitcode is not None else 1, joined, error)


def _job_now(job_dir: str) -> dict[str, Any] | None:
    try:
        return read_job_file(job_dir)
    except (FileNotFoundError, ValueError):  # ended, or being replaced this instant (read again)
        return None if not os.path.exists(os.path.join(job_dir, "elastic.json")) else {}


def _next_attempt(job_dir: str, attempt: int, patience: float) -> dict[str, Any] | None:
    """The job file once it names an attempt after ``attempt``; None if the job ended; the
    current attempt's if neither happened within ``patience`` seconds."""
    deadline = time.monotonic() + patience
    while True:
        job = _job_now(job_dir)
        if job is None or int(job.get("attempt", -1)) > attempt:
            return job
        if time.monotonic() >= deadline:
            return job or {}
        time.sleep(JOB_POLL)  # polling a file the job's launcher rewrites; nothing to wait on


def keep_joined(job_dir: str) -> None:
    """``join=<run dir>``: keep one trainer in the running elastic job there until it is over."""
    job = read_job_file(job_dir)
    S, T = job["config"]["cluster"]["num_servers"], job["config"]["cluster"]["num_trainers"]
    role_timeout = float(job["config"]["cluster"].get("role_timeout") or 0)
    rank: int | None = None  # the rank to take again (a replacement), None: the first free one
    replacements = 0
    log.info("joining the elastic job in %s at %s:%d", job_dir, job["master_addr"], job["master_port"])
    while True:
        attempt = int(job.get("attempt", 0))
        out = _run_trainer(job, rank, job_dir)
        name = role_name(out.rank if out.rank is not None else rank if rank is not None else S + T, S)
        if out.exitcode == 0:
            log.info("%s finished: the job is over", name)
            return
        if out.exitcode < 0:  # killed: replace it, unless the job moved on meanwhile
            now = _next_attempt(job_dir, attempt, 0.0)
            if now is None:
                log.warning("%s was killed and the job is over: nothing to replace", name)
                return
            if int(now.get("attempt", attempt)) == attempt:
                replacements += 1
                rank = out.rank
                log.warning(
                    "replacement %d: %s was killed (signal %d); starting a new %s that continues its partition "
                    "after its last step the servers applied",
                    replacements,
                    name,
                    -out.exitcode,
                    name if rank is not None else "joiner",
                )
                continue
            job, rank = now, None
            log.warning("%s was killed; the job restarted (attempt %d): joining it again", name, now["attempt"])
            continue
        # An error: the job's failure (a server it lost), or its own.
        blames_other = out.error is not None and out.error.peer is not None
        patience = role_timeout + BLAME_GRACE + RESTART_GRACE if blames_other else OWN_ERROR_GRACE
        now = _next_attempt(job_dir, attempt, patience)
        what = out.error.error if out.error is not None else f"exit code {out.exitcode}"
        if now and int(now.get("attempt", attempt)) > attempt:
            log.warning(
                "%s lost the job (%s); the job restarted (attempt %d): joining it again", name, what, now["attempt"]
            )
            job, rank = now, None
            continue
        ended = "; the job ended" if now is None else ""
        raise RoleFailed(
            f"{name} (joined the job in {job_dir}; log: {job_dir}/logs/{name}.log) failed: {what}{ended}",
            role=name,
            reason=what,
        )
