"""The local launcher: every process of a run, started and watched on this machine.

Ranks 0..S-1 are the parameter servers ``ps0..``, ranks S..S+T-1 the trainers
``trainer0..``. ``launch_local`` starts all of them on this machine with a fresh auth
secret and a free port, watches them, and stops the run as soon as one fails -- exits, or
stops sending heartbeats for ``cluster.role_timeout`` seconds (``ps_train.launch.heartbeat``) --
naming it (and the latest complete checkpoint to resume from; ``RoleFailed``,
``ps_train.launch.failures``). A role that fails with an error writes the traceback to its own
log and sends the launcher one ``RoleError`` (its error, and the role the error blames), so
the run ends with its first cause, once, and what the other roles did because of it, not with
every role's traceback. Restarting the run is the caller's choice
(``ps_train.launch.restarts``). Each process runs ``ps_train.launch.rank.run_rank`` (which,
with ``cluster.launcher=env``, a torchrun/SLURM-started process runs directly).

Local roles are forked from a fork server that is itself a fork of the launcher
(``ps_train.launch.fork_server``, ``ps_train.launch.role_processes``): torch and ps_train are
imported once, by the launcher, and what only roles need (``preload_modules``) once more by
the fork server, so a role starts in a fraction of a second. Each role gets the launcher's
environment and working directory as of the launch, exits as soon as it is done (no slow
interpreter teardown), and exits by itself if the launcher dies. Each process marks where
its time went (``ps_train.observe.phases``): ``metrics.json``'s ``phases``.

Roles inherit the launcher's environment, so a test can set ``PS_TRAIN_FAULT`` here to
make one of them die at a chosen step (see ``ps_train.faults``).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import secrets
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from ps_train.config import Config, config_to_dict
from ps_train.elastic.files import record_replacement, write_job_file
from ps_train.faults import ATTEMPT_ENV, REPLACED_ENV
from ps_train.launch.failures import FailedRole, RoleError, RoleFailed, failure_report, first_cause, role_name
from ps_train.launch.heartbeat import HeartbeatBoard, process_state
from ps_train.launch.ports import free_port
from ps_train.launch.role_processes import (
    RoleLaunch,
    RoleProcesses,
    RoleStart,
    preload_modules,
    prepare_roles,
    workload_modules,
)
from ps_train.observe import phases
from ps_train.observe.console import CONSOLE

log = logging.getLogger("ps_train")

BLAME_GRACE = 5.0  # seconds a failed run waits for the role the first failures blame to fail too


def launch_local(
    cfg: Config, run_dir: str, resume: str | None = None, timeout: float | None = None, attempt: int = 0
) -> dict[str, Any]:
    """Start every role as a process on this machine; return trainer0's metrics.

    Raises ``RoleFailed`` naming the first role that failed or went silent for
    ``cluster.role_timeout`` seconds (or, with ``timeout`` seconds, the roles still running
    when time ran out), after stopping all the others. ``attempt``: how many times the run
    was restarted before this launch.
    """
    S, T = cfg.cluster.num_servers, cfg.cluster.num_trainers
    # master_port=0: a free port for this run, so concurrent runs and -m sweep jobs never clash.
    port = cfg.cluster.master_port or free_port(cfg.cluster.master_addr)
    secret = secrets.token_hex(16)  # per run: only this run's processes can talk to each other
    cfg_dict = config_to_dict(cfg)
    if cfg.cluster.elastic:  # before the line below: whoever reads that line can join
        write_job_file(run_dir, cfg.cluster.master_addr, port, secret, cfg_dict, attempt)
    log.info(
        "starting %d servers + %d trainers on %s:%d; logs in %s/logs", S, T, cfg.cluster.master_addr, port, run_dir
    )
    launched_at, launched_cpu = time.time(), time.process_time()
    ctx = mp.get_context("fork" if hasattr(os, "fork") else "spawn")
    # Pipes, not queues: a queue's semaphores outlive a launcher that leaves with os._exit
    # (python -m ps_train after a failure), and the resource tracker warns about them.
    results_in, results_out = ctx.Pipe(duplex=False)  # trainer0's metrics
    env, cwd = dict(os.environ, **{ATTEMPT_ENV: str(attempt)}), os.getcwd()
    board = HeartbeatBoard(ctx, S + T, cfg.cluster.role_timeout)
    errors_in, errors_out = ctx.Pipe(duplex=False)  # RoleErrors from the roles that fail (see _report)
    procs: dict[int, Any] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    workloads = workload_modules()
    launch = RoleLaunch(
        cfg_dict,
        port,
        secret,
        run_dir,
        results_out,
        errors_out,
        env,
        cwd,
        board.counters,
        board.interval,
        attempt,
        workloads,
    )
    # Before any thread of this launch: the fork server is a copy of this process.
    roles = RoleProcesses(launch, preload_modules(cfg.model, cfg.data, cfg.optim), prepare_roles(cfg.model, cfg.data))

    def start(ranks: list[int], resume: str | None = resume, env: dict[str, str] | None = None) -> list[Any]:
        started = roles.start([(RoleStart(rank, resume, env), role_name(rank, S)) for rank in ranks])
        for rank in ranks:
            board.started(rank)  # its startup allowance counts from here, not from the fork server's start
        return started

    def replace(rank: int, reason: str) -> Any:
        """Elastic: start a trainer in place of a dead one (it continues where ps0 says)."""
        rows = record_replacement(run_dir, role_name(rank, S), reason, attempt)
        log.warning(  # on the console with any logging level (ps_train.observe.console)
            "replacement %d: %s failed (%s); the other roles go on; starting a new %s that continues "
            "its partition after its last step the servers applied",
            len(rows),
            role_name(rank, S),
            reason,
            role_name(rank, S),
            extra=CONSOLE,
        )
        board.restart(rank)
        # ps0 says where it starts (the attempt's checkpoint may be pruned by now).
        return start([rank], resume=None, env=dict(env, **{REPLACED_ENV: "1"}))[0]

    # Read trainer0's metrics as they come: a long run's (per-step losses) fill the pipe, and
    # trainer0 cannot exit before they are read.
    got: list[dict[str, Any]] = []

    def collect() -> None:
        try:
            got.append(results_in.recv())
        except EOFError:  # every role exited, none sent metrics
            pass

    collector = threading.Thread(target=collect, name="metrics-collector", daemon=True)
    collector.start()
    try:
        procs.update(enumerate(start(list(range(S + T)))))
        _Watch(procs, S, run_dir, deadline, board, errors_in, replace if cfg.cluster.elastic else None).run()
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()  # a role of a failed run holds nothing worth a graceful stop
        for p in procs.values():
            p.join(5)
        exited_at = time.time()
        roles.close()  # it holds copies of the pipes too
        results_out.close()  # the roles' copies are closed: the collector reads what is left, then EOF
        errors_in.close()
        errors_out.close()
        collector.join(10)
        results_in.close()
    if not got:
        raise RoleFailed(f"all roles exited cleanly but trainer0 reported no metrics; see {run_dir}/logs")
    launcher = {
        "start": phases.process_start_time(),
        "launch": launched_at,
        "exited": exited_at,
        "finished": time.time(),
    }
    cpu = {"launcher start-up": launched_cpu, "collect": time.process_time() - launched_cpu}
    if roles.server is not None and roles.server.preloaded_at is not None:
        launcher["preloaded"] = roles.server.preloaded_at
        cpu["preload"] = roles.server.preload_cpu_s or 0.0
    got[0]["phases"] = phases.run_phases(run_dir, launcher, cpu, role_name(S, S))
    return got[0]


def _how(exitcode: int) -> str:
    return f"killed by signal {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exit code {exitcode}"


def _checkpoint_hint(run_dir: str) -> tuple[str, str | None]:
    """The sentence naming the checkpoint to resume from, and that checkpoint."""
    from ps_train.checkpoint.files import latest_checkpoint

    last = latest_checkpoint(run_dir)
    return (
        (f"the latest complete checkpoint is {last}; continue with resume={run_dir}", str(last))
        if last
        else ("no checkpoint was written yet; the run has to start over", None)
    )


def _unresponsive(procs: dict[int, Any], silent: list[tuple[int, float]], S: int, run_dir: str) -> RoleFailed:
    """The error for roles whose heartbeats stopped (the longest silent first)."""
    silent = sorted(silent, key=lambda rs: (-rs[1], rs[0]))
    parts = []
    for rank, quiet in silent:
        state = process_state(procs[rank].pid)
        parts.append(
            (
                role_name(rank, S),
                f"unresponsive: no heartbeat for {quiet:.1f} s" + (f", the process is {state}" if state else ""),
            )
        )
    hint, last = _checkpoint_hint(run_dir)
    (first, reason), others = parts[0], parts[1:]
    also = f"; also unresponsive: {', '.join(name for name, _ in others)}" if others else ""
    rank = silent[0][0]
    return RoleFailed(
        f"{first} (rank {rank}, {reason}; log: {run_dir}/logs/{first}.log) failed; stopped the run{also}; {hint}",
        role=first,
        reason=reason,
        checkpoint=last,
    )


class _Watch:
    """Waits for all roles; on the first failure (exit or silence) stops the run with one
    ``RoleFailed`` naming its first cause (``failures.failure_report``).

    ``replace(rank, reason) -> process`` (elastic runs): a trainer killed by a signal or gone
    silent is killed and replaced instead, while every server runs. A trainer that exits with
    an error (its own, or a server's it saw) still stops the run.
    """

    def __init__(
        self,
        procs: dict[int, Any],
        S: int,
        run_dir: str,
        deadline: float | None,
        board: HeartbeatBoard,
        errors: Connection,
        replace: Any = None,
    ) -> None:
        self.procs, self.S, self.run_dir, self.deadline, self.board = procs, S, run_dir, deadline, board
        self.errors, self.replace = errors, replace
        self.alive = dict(procs)
        self.said: dict[str, RoleError] = {}  # what each failed role sent before it exited

    def _wait(self, timeout: float | None) -> list[int]:
        """Wait for exits (or records) up to ``timeout`` seconds; the ranks that exited, reaped."""
        ready = multiprocessing.connection.wait(
            [p.sentinel for p in self.alive.values()] + [self.errors], timeout=timeout
        )
        while self.errors.poll(0):  # a role's record is in the pipe before its exit can be seen
            record = self.errors.recv()
            self.said[record.role] = record
        exited = [rank for rank, p in self.alive.items() if p.sentinel in ready]
        for rank in exited:
            self.procs[rank].join()
            del self.alive[rank]
        return exited

    def run(self) -> None:
        while self.alive:
            remaining = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
            wait = self.board.check_every()
            if remaining is not None:
                wait = remaining if wait is None else min(wait, remaining)
            exited = self._wait(wait)
            if not exited:
                self._check_time_and_heartbeats()
                continue
            failed = [r for r in exited if self.procs[r].exitcode != 0]
            servers_fine = all(self.procs[r].exitcode is None for r in range(self.S))
            if self.replace is not None and servers_fine:
                for rank in [r for r in failed if r >= self.S and self.procs[r].exitcode < 0]:  # killed, not an error
                    failed.remove(rank)
                    self.procs[rank] = self.alive[rank] = self.replace(rank, _how(self.procs[rank].exitcode))
            if failed:
                raise self._stop(failed)

    def _check_time_and_heartbeats(self) -> None:
        procs, S = self.procs, self.S
        if self.deadline is not None and time.monotonic() >= self.deadline:
            hint, last = _checkpoint_hint(self.run_dir)
            raise RoleFailed(
                f"the run did not finish within its time limit; roles still running: "
                f"{[role_name(r, S) for r in self.alive]}; {hint}",
                checkpoint=last,
            )
        silent = self.board.silent(self.alive)
        if silent and self.replace is not None and all(rank >= S for rank, _ in silent):
            for rank, quiet in silent:
                state = process_state(procs[rank].pid)
                procs[rank].kill()  # frozen: it must not come back and train a partition twice
                procs[rank].join()
                reason = f"unresponsive: no heartbeat for {quiet:.1f} s" + (
                    f", the process was {state}" if state else ""
                )
                procs[rank] = self.alive[rank] = self.replace(rank, reason)
            return
        if silent:
            raise _unresponsive(procs, silent, S, self.run_dir)

    def _stop(self, failed: list[int]) -> RoleFailed:
        """The error for a run whose roles ``failed`` just exited non-zero. A dead role makes its
        peers fail too, soon after, and their errors name it: if each failed role so far blames
        another that still runs, wait up to ``BLAME_GRACE`` seconds for that one to fail too."""
        order = sorted(failed, key=lambda r: (self.procs[r].exitcode >= 0, r))  # killed ones first: no record
        until = time.monotonic() + BLAME_GRACE
        if self.deadline is not None:
            until = min(until, self.deadline)
        while True:
            report = [self._failed_role(r) for r in order]
            cause = first_cause(report)
            remaining = until - time.monotonic()
            if cause.blames() is None or remaining <= 0 or not self.alive:
                break
            order += sorted(
                (r for r in self._wait(remaining) if self.procs[r].exitcode != 0),
                key=lambda r: (self.procs[r].exitcode >= 0, r),
            )
        # Roles that failed at about the same time (their records are in already) are reported
        # as failed, not as stopped by the launcher.
        self._wait(0)
        order += [
            r
            for r, p in self.procs.items()
            if r not in order and (p.exitcode not in (None, 0) or role_name(r, self.S) in self.said)
        ]
        report = [self._failed_role(r) for r in order]
        hint, last = _checkpoint_hint(self.run_dir)
        everyone = [role_name(r, self.S) for r, p in self.procs.items() if p.exitcode != 0]  # not finished
        return failure_report(report, everyone, self.run_dir, hint, last)

    def _failed_role(self, rank: int) -> FailedRole:
        name = role_name(rank, self.S)
        code = self.procs[rank].exitcode
        return FailedRole(name, rank, "failing" if code is None else _how(code), self.said.get(name))
