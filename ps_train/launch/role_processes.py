"""Role processes of a local run: what each is started with, and how it is started.

``RoleProcesses`` forks them from a ``ForkServer`` (``ps_train.launch.fork_server``) that
has imported what they need (``preload_modules``); where there is no ``os.fork`` it spawns
them. Each runs ``_child``: it takes the launch's environment and working directory, runs
``ps_train.launch.rank.run_rank``, sends trainer0's metrics or its error to the launcher
(``report_error``), writes its phase marks (``ps_train.observe.phases``) and exits without
the interpreter's teardown.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

from ps_train.config import Config, DataConfig, ModelConfig, OptimConfig, from_dictconfig
from ps_train.launch.failures import RoleError, role_name
from ps_train.launch.fork_server import ForkServer
from ps_train.launch.heartbeat import start_heartbeat
from ps_train.launch.rank import run_rank, setup_role_logging
from ps_train.observe import phases
from ps_train.roles.server_optimizer import imports_dynamo
from ps_train.stage_sharding import shard_layout
from ps_train.workload import import_plugins, registered_workloads, workload_for

__all__ = [
    "RoleLaunch",
    "RoleProcesses",
    "RoleStart",
    "exit_with_parent",
    "preload_modules",
    "prepare_roles",
    "report_error",
    "workload_modules",
]

# What the fork server imports once (the launcher has the rest), so forked roles import nothing heavy.
_PRELOAD = [
    "ps_train.launch.local",
    "ps_train.launch.rank",
    "ps_train.roles.server",
    "ps_train.roles.trainer",
    "ps_train.checkpoint.protocol",
    "ps_train.metrics",
    "rpc_core",
    "rpc_core.autograd",
    "torch.utils.tensorboard",
    "numpy.random",  # numpy imports it lazily, in each trainer's partition: 0.1 CPU-s each
]


def exit_with_parent() -> None:
    """A role must not outlive its launcher (e.g. killed by a test timeout)."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-launcher", daemon=True).start()


@dataclass(frozen=True)
class RoleLaunch:
    """What every role of one launch gets (a forked role finds it in its copy of the launcher)."""

    cfg_dict: dict[str, Any]
    port: int
    secret: str
    run_dir: str
    results: Connection  # trainer0's metrics, to the launcher
    errors: Connection  # RoleErrors, to the launcher
    env: dict[str, str]  # the launcher's environment as of the launch
    cwd: str
    heartbeats: Any  # the HeartbeatBoard's shared counters
    beat_every: float
    attempt: int
    workloads: list[str]
    # The Config of cfg_dict once ``config()`` built it in this process (the fork server does,
    # before forking: 20 ms of CPU per role otherwise, OmegaConf's merge onto the schemas).
    _config: list[Config] = field(default_factory=list, init=False, repr=False, compare=False)

    def config(self) -> Config:
        """The run's ``Config``, built from ``cfg_dict`` once per process (and its forks)."""
        if not self._config:
            self._config.append(from_dictconfig(self.cfg_dict))
        return self._config[0]


@dataclass(frozen=True)
class RoleStart:
    """One role to start: its rank, the checkpoint it resumes from and its environment."""

    rank: int
    resume: str | None
    env: dict[str, str] | None  # None: the launch's


def _child(launch: RoleLaunch, start: RoleStart) -> None:
    phases.mark("started")
    rank, run_dir, cfg_dict = start.rank, launch.run_dir, launch.cfg_dict
    name = role_name(rank, cfg_dict["cluster"]["num_servers"])
    start_heartbeat(launch.heartbeats, rank, launch.beat_every)  # first: the launcher counts silence from its start
    try:
        # A spawned role (no fork server) starts with its own: take this launch's environment.
        os.environ.clear()
        os.environ.update(start.env if start.env is not None else launch.env)
        os.chdir(launch.cwd)
        exit_with_parent()
        import_plugins(launch.workloads)  # already imported when forked from the fork server
        cfg = launch.config()
        out = run_rank(
            cfg,
            rank,
            cfg.cluster.master_addr,
            launch.port,
            launch.secret,
            run_dir,
            start.resume,
            attempt=launch.attempt,
        )
        if out is not None:
            launch.results.send(out)  # returns once it is all in the pipe (the launcher reads as it comes)
    except BaseException as e:  # noqa: BLE001 - any failure of a role is reported, then it exits 1
        report_error(name, run_dir, cfg_dict["logging"]["level"], e, launch.errors)
        os._exit(1)
    phases.mark("exiting")
    phases.write_marks(run_dir, name)
    # Done: skip the interpreter teardown (torch's takes seconds on a busy machine, and
    # rpc threads have nothing left to do).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _prepare(launch: RoleLaunch, prepare: Callable[[], None] | None) -> None:
    """In the fork server, before it forks a role: what every role would otherwise compute
    for itself. A failure here is left to the roles: each then computes it and reports its
    own error, naming itself, as it would without a fork server."""
    try:
        cfg = launch.config()
        if prepare is not None:
            prepare()
        # Every trainer needs the shard layout, and computing it builds the model (tens of ms
        # of CPU per trainer, 64 of them at once): here, once.
        shard_layout(cfg.model, cfg.data, cfg.cluster, cfg.seed)
    except Exception:  # noqa: BLE001, S110 - see the docstring: the roles report it
        pass


def report_error(name: str, run_dir: str, level: str, error: BaseException, errors: Connection) -> None:
    """A failed role's traceback goes to its log, and only there; the launcher gets one
    ``RoleError`` and tells the user, once for the whole run (``failures.failure_report``)."""
    if not logging.getLogger().handlers:  # it failed before run_rank set up its log
        setup_role_logging(run_dir, name, level)
    logging.getLogger("ps_train").error("%s failed:\n%s", name, traceback.format_exc())
    try:
        # Sent before the process exits: the launcher finds it in the pipe once it sees the exit.
        errors.send(RoleError.of(name, error))
    except OSError:  # the launcher is gone: nobody to tell
        pass
    logging.shutdown()


def workload_modules() -> list[str]:
    """The registered workloads' modules (``ps_train.workload``): a role imports them to find
    its workload registered (a forked one has them already)."""
    return [w.module for w in registered_workloads() if w.module]


def preload_modules(model: ModelConfig, data: DataConfig, optim: OptimConfig) -> list[str]:
    """What the fork server imports for the roles of a run of ``model`` on ``data`` with
    ``optim``: what every role uses and the launcher has not imported (``_PRELOAD``), and
    what the run's workload asks for."""
    w = workload_for(model)
    # A torch.optim optimizer imports torch._dynamo (~1.5 s of CPU): once here, not per server.
    dynamo = ["torch._dynamo"] if imports_dynamo(optim) else []
    return [*_PRELOAD, *dynamo, *w.preload, *w.preload_for(data)]


def prepare_roles(model: ModelConfig, data: DataConfig) -> Callable[[], None]:
    """What the fork server runs once before forking the roles of a run of ``model`` on
    ``data``: the workload's ``prepare`` (e.g. the synthetic data set every trainer would
    draw for itself)."""
    return partial(workload_for(model).prepare, data)


def os_threads() -> int:
    """Threads of this process, native ones included (a library's C++ thread pool is no
    Python thread but holds locks a fork copies all the same)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # no /proc: what Python knows of
        return threading.active_count()


class RoleProcesses:
    """Starts role processes: forked from a ``ForkServer`` where there is ``os.fork`` and the
    launcher is single-threaded (as ``python -m ps_train`` is when it launches); else from
    ``multiprocessing``'s forkserver, a fresh interpreter that imports ``preload`` once (a
    launcher embedded in a threaded program: a fork of it could copy a lock some thread
    holds, and a role would wait on it forever); else spawned (each imports what it needs)."""

    def __init__(self, launch: RoleLaunch, preload: list[str], prepare: Callable[[], None] | None = None) -> None:
        """``prepare``: run by the fork server before it forks a role (not for spawned roles,
        which each do that work themselves)."""
        self.launch = launch
        threads = os_threads()
        forkable = hasattr(os, "fork") and threads == 1
        if hasattr(os, "fork") and not forkable:
            # Said, because it costs start-up time and is easy to cause by accident (a BLAS
            # pool started at import: python -m ps_train sets OPENBLAS_NUM_THREADS=1 for that).
            logging.getLogger("ps_train").info(
                "the launcher runs %d threads: roles start from multiprocessing's forkserver, "
                "not forked from a preloaded copy of it",
                threads,
            )
        self.server = (
            ForkServer(preload, partial(_child, launch), partial(_prepare, launch, prepare)) if forkable else None
        )
        if not forkable and "forkserver" in mp.get_all_start_methods():
            self.spawn: Any = mp.get_context("forkserver")
            self.spawn.set_forkserver_preload(preload)
        else:
            self.spawn = mp.get_context("spawn")

    def start(self, starts: list[tuple[RoleStart, str]]) -> list[Any]:
        """A process for each ``(start, role name)``, in order."""
        if self.server is not None:
            return self.server.start_all(starts)
        procs = []
        for start, name in starts:
            p = self.spawn.Process(target=_child, args=(self.launch, start), name=name, daemon=False)
            p.start()
            procs.append(p)
        return procs

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
