"""The local launcher: every process of a run, started and watched on this machine.

Ranks 0..S-1 are the parameter servers ``ps0..``, ranks S..S+T-1 the trainers
``trainer0..``. ``launch_local`` starts all of them on this machine with a fresh auth
secret and a free port, watches them, and stops the run as soon as one fails -- exits, or
stops sending heartbeats for ``cluster.role_timeout`` seconds (``ps_train.launch.heartbeat``) --
naming it (and the latest complete checkpoint to resume from; ``RoleFailed``,
``ps_train.launch.failures``). Restarting the run is the caller's choice
(``ps_train.launch.restarts``). Each process runs ``ps_train.launch.rank.run_rank`` (which,
with ``cluster.launcher=env``, a torchrun/SLURM-started process runs directly).

Local roles are forked from a ``forkserver`` that has imported torch and ps_train once, so
a role starts in well under a second instead of re-importing torch (seconds per process on
a busy machine). Each role gets the launcher's environment and working directory as of the
launch (not the forkserver's), exits as soon as it is done (no slow interpreter teardown),
and exits by itself if the launcher dies.

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
import sys
import threading
import time
import traceback
from typing import Any

from ps_train.config import Config, config_to_dict, from_dictconfig
from ps_train.elastic.files import record_replacement, remove_job_file, write_job_file
from ps_train.faults import ATTEMPT_ENV
from ps_train.launch.failures import RoleFailed, role_name
from ps_train.launch.heartbeat import HeartbeatBoard, process_state, start_heartbeat
from ps_train.launch.ports import free_port
from ps_train.launch.rank import run_rank

log = logging.getLogger("ps_train")

# What the forkserver imports once, so forked roles start without importing anything heavy.
_PRELOAD = [
    "ps_train.launch.local",
    "ps_train.launch.rank",
    "ps_train.roles.server",
    "ps_train.roles.trainer",
    "ps_train.checkpoint.protocol",
    "ps_train.data",
    "ps_train.metrics",
    "rpc_core",
    "rpc_core.autograd",
    "sklearn.datasets",
    "ps_train.ctr.trainer",
    "ps_train.ctr.table_server",
    "sklearn.model_selection",
    "torch.utils.tensorboard",
    "torch._dynamo",
]  # the first torch.optim optimizer imports it: ~2.5 s of CPU per server


def _exit_with_parent() -> None:
    """A role must not outlive its launcher (e.g. killed by a test timeout)."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-launcher", daemon=True).start()


def _child(
    cfg_dict: dict[str, Any],
    rank: int,
    port: int,
    secret: str,
    run_dir: str,
    resume: str | None,
    results: Any,
    env: dict[str, str],
    cwd: str,
    heartbeats: Any,
    beat_every: float,
    attempt: int,
) -> None:
    name = role_name(rank, cfg_dict["cluster"]["num_servers"])
    start_heartbeat(heartbeats, rank, beat_every)  # first: the launcher counts silence from its start
    try:
        # The forkserver was started by an earlier launch: take this launch's environment.
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        _exit_with_parent()
        cfg = from_dictconfig(cfg_dict)
        out = run_rank(cfg, rank, cfg.cluster.master_addr, port, secret, run_dir, resume, attempt=attempt)
        if out is not None:
            results.put(out)
            results.close()
            results.join_thread()  # the result is in the pipe before we exit
    except BaseException:  # noqa: BLE001 - any failure of a role is reported, then it exits 1
        msg = traceback.format_exc()
        logging.getLogger("ps_train").error("%s failed:\n%s", name, msg)
        sys.stderr.write(f"[{name}] failed:\n{msg}")
        sys.stderr.flush()
        logging.shutdown()
        os._exit(1)
    # Done: skip the interpreter teardown (torch's takes seconds on a busy machine, and
    # rpc threads have nothing left to do).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _context() -> Any:
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        return ctx
    return mp.get_context("spawn")


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
    log.info(
        "starting %d servers + %d trainers on %s:%d; logs in %s/logs", S, T, cfg.cluster.master_addr, port, run_dir
    )
    ctx = _context()
    results = ctx.Queue()
    cfg_dict = config_to_dict(cfg)
    env, cwd = dict(os.environ, **{ATTEMPT_ENV: str(attempt)}), os.getcwd()
    board = HeartbeatBoard(ctx, S + T, cfg.cluster.role_timeout)
    procs = {}
    deadline = None if timeout is None else time.monotonic() + timeout

    def start(rank: int, resume: str | None = resume) -> Any:
        p = ctx.Process(
            target=_child,
            args=(
                cfg_dict,
                rank,
                port,
                secret,
                run_dir,
                resume,
                results,
                env,
                cwd,
                board.counters,
                board.interval,
                attempt,
            ),
            name=role_name(rank, S),
            daemon=False,
        )
        p.start()
        return p

    def replace(rank: int, reason: str) -> Any:
        """Elastic: start a trainer in place of a dead one (it continues where ps0 says)."""
        rows = record_replacement(run_dir, role_name(rank, S), reason, attempt)
        log.warning(
            "replacement %d: %s failed (%s); the other roles go on; starting a new %s that continues "
            "its partition after its last step the servers applied",
            len(rows),
            role_name(rank, S),
            reason,
            role_name(rank, S),
        )
        board.restart(rank)
        return start(rank, resume=None)  # ps0 says where it starts; the attempt's checkpoint may be pruned by now

    # Read trainer0's metrics as they come: a long run's (per-step losses) fill the pipe, and
    # trainer0 cannot exit before they are read.
    got: list[dict[str, Any]] = []
    collector = threading.Thread(target=lambda: got.append(results.get()), name="metrics-collector", daemon=True)
    collector.start()
    try:
        if cfg.cluster.elastic:
            write_job_file(run_dir, cfg.cluster.master_addr, port, secret, cfg_dict)
        for rank in range(S + T):
            procs[rank] = start(rank)
        _watch(procs, S, run_dir, deadline, board, replace if cfg.cluster.elastic else None)
    finally:
        if cfg.cluster.elastic:
            remove_job_file(run_dir)
        for p in procs.values():
            if p.is_alive():
                p.kill()  # a role of a failed run holds nothing worth a graceful stop
        for p in procs.values():
            p.join(5)
    collector.join(10)
    if not got:
        raise RoleFailed(f"all roles exited cleanly but trainer0 reported no metrics; see {run_dir}/logs")
    return got[0]


def _how(exitcode: int) -> str:
    return f"killed by signal {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exit code {exitcode}"


def _describe(rank: int, exitcode: int, S: int, run_dir: str) -> str:
    name = role_name(rank, S)
    return f"{name} (rank {rank}, {_how(exitcode)}; log: {run_dir}/logs/{name}.log)"


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


def _watch(
    procs: dict[int, Any], S: int, run_dir: str, deadline: float | None, board: HeartbeatBoard, replace: Any = None
) -> None:
    """Wait for all roles; on the first failure (exit or silence) stop and name the role.

    ``replace(rank, reason) -> process`` (elastic runs): a trainer killed by a signal or gone
    silent is killed and replaced instead, while every server runs. A trainer that exits with
    an error (its own, or a server's it saw) still stops the run.
    """
    alive = dict(procs)
    while alive:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        wait = board.check_every()
        if remaining is not None:
            wait = remaining if wait is None else min(wait, remaining)
        ready = multiprocessing.connection.wait([p.sentinel for p in alive.values()], timeout=wait)
        if not ready:
            if deadline is not None and time.monotonic() >= deadline:
                hint, last = _checkpoint_hint(run_dir)
                raise RoleFailed(
                    f"the run did not finish within its time limit; roles still running: "
                    f"{[role_name(r, S) for r in alive]}; {hint}",
                    checkpoint=last,
                )
            silent = board.silent(alive)
            if silent and replace is not None and all(rank >= S for rank, _ in silent):
                for rank, quiet in silent:
                    state = process_state(procs[rank].pid)
                    procs[rank].kill()  # frozen: it must not come back and train a partition twice
                    procs[rank].join()
                    reason = f"unresponsive: no heartbeat for {quiet:.1f} s" + (
                        f", the process was {state}" if state else ""
                    )
                    procs[rank] = alive[rank] = replace(rank, reason)
                continue
            if silent:
                raise _unresponsive(procs, silent, S, run_dir)
            continue
        failed: list[int] = []
        for rank, p in list(alive.items()):
            if p.sentinel in ready:
                p.join()
                del alive[rank]
                if p.exitcode != 0:
                    failed.append(rank)
        servers_fine = all(procs[r].exitcode is None for r in range(S))
        if replace is not None and servers_fine:
            for rank in [r for r in failed if r >= S and procs[r].exitcode < 0]:  # killed, not an error
                failed.remove(rank)
                procs[rank] = alive[rank] = replace(rank, _how(procs[rank].exitcode))
        if failed:
            # A dead role makes its peers fail too, soon after. Name the cause first: a role
            # killed by a signal, else the first in rank order; list the others as well.
            for rank, p in alive.items():
                if p.exitcode is not None and p.exitcode != 0:
                    failed.append(rank)
            failed.sort(key=lambda r: (procs[r].exitcode >= 0, r))
            first, *others = failed
            also = (
                f"; also failed: {', '.join(_describe(r, procs[r].exitcode, S, run_dir) for r in others)}"
                if others
                else ""
            )
            hint, last = _checkpoint_hint(run_dir)
            raise RoleFailed(
                f"{_describe(first, procs[first].exitcode, S, run_dir)} failed; stopped the run{also}; {hint}",
                role=role_name(first, S),
                reason=_how(procs[first].exitcode),
                checkpoint=last,
            )
