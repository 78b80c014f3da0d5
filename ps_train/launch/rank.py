"""One process of a run: its role (a parameter server or a trainer), from start to shutdown.

``run_rank`` is what every process runs: forked by the local launcher
(``ps_train.launch.local``), or started by torchrun or SLURM with ``cluster.launcher=env``
(``ps_train.app``). It builds the role -- a server with the model's parts (its embedding
tables, ``ps_train.workloads.ctr.tables.service``), or the model's trainer (``ps_train.workloads.ctr.trainer``) --
joins the group, runs it, and shuts down.

It is one of the few places that hold the run's whole config (``ps_train.config.Config``):
what it starts takes the groups it reads, or a record of them built here
(``server_settings``, ``table_settings``, the trainers' ``TrainerSplit``); only the trainer,
whose workload's subclass may read any group, takes the whole config.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ps_train import backend, rpc_allowlist
from ps_train.config import Config, DLRMConfig, config_to_dict
from ps_train.elastic.membership import keep_membership, serve_elastic
from ps_train.elastic.trainer import join_group, wait_for_servers
from ps_train.faults import die, fault_at
from ps_train.launch.failures import role_name
from ps_train.metrics import MetricsWriter, make_writer, mark_attempt
from ps_train.observe import phases
from ps_train.observe.console import ConsoleHandler
from ps_train.observe.dashboard import swept_values, write_dashboard
from ps_train.observe.server_metrics import ServerMetrics, rpc_byte_counts
from ps_train.observe.traces import ProfileWindow, write_served
from ps_train.partition import TrainerSplit
from ps_train.workload import workload_for
from rpc_core import tune_malloc
from rpc_core.errors import RendezvousError
from rpc_core.memory import MMAP_THRESHOLD, TRIM_THRESHOLD, Thresholds

__all__ = ["run_rank", "setup_role_logging", "server_settings", "table_settings"]

if TYPE_CHECKING:  # imported where used: the launcher imports this module, the fork server the roles
    from ps_train.roles.server import ServerSettings
    from ps_train.table_service import TableSettings

log = logging.getLogger("ps_train")


def setup_role_logging(run_dir: str, name: str, level: str) -> None:
    """This process logs to ``<run_dir>/logs/<name>.log``; records marked for the console
    (``ps_train.observe.console.CONSOLE``) also go to stderr, one line each."""
    logs = Path(run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(logs / f"{name}.log")
    handler.setFormatter(logging.Formatter(f"%(asctime)s [{name}] %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler, ConsoleHandler(name)]
    root.setLevel(level)


def server_settings(cfg: Config) -> ServerSettings:
    """What a parameter server of the run ``cfg`` reads of it."""
    from ps_train.roles.server import ServerSettings

    return ServerSettings(
        model=cfg.model,
        data=cfg.data,
        cluster=cfg.cluster,
        mode=cfg.mode,
        optim=cfg.optim,
        checkpoint_writer=cfg.checkpoint.writer,
        backend=cfg.backend,
        seed=cfg.seed,
    )


def table_settings(cfg: Config) -> TableSettings:
    """What a server's embedding tables (a workload's ``table_service``) read of the run ``cfg``
    besides its model and data."""
    from ps_train.table_service import TableSettings

    return TableSettings(
        optim=cfg.optim,
        num_servers=cfg.cluster.num_servers,
        num_trainers=cfg.cluster.num_trainers,
        batch_size=cfg.train.batch_size,
        seed=cfg.seed,
    )


# A table server under a RAM budget (model.table_memory_budget) makes and frees tensors of
# tens of MB each step (a DLRM-DCNv2 server's rows, their gradients and the update's float32
# copies: ~40 MB each) and should stay near its budget. From 1 MiB up they get mappings of
# their own, handed back when freed: under rpc_core's default 32 MiB threshold they came out
# of heaps whose free gaps stayed resident (0.6-0.8 GB per server at preset=dlrmv2). Its steps
# take seconds, so the page faults of fresh mappings cost little (docs/ctr.md, Sizing).
BUDGETED_SERVER_MALLOC = Thresholds(mmap_threshold=1 << 20, trim_threshold=32 << 20)


def malloc_thresholds(cfg: Config, rank: int) -> Thresholds:
    """The malloc thresholds of role ``rank`` (``rpc_core.tune_malloc``): lower ones for a
    server holding tables under a RAM budget, rpc_core's own for every other role."""
    budgeted = isinstance(cfg.model, DLRMConfig) and cfg.model.table_memory_budget is not None
    if rank < cfg.cluster.num_servers and budgeted:
        return BUDGETED_SERVER_MALLOC
    return Thresholds(MMAP_THRESHOLD, TRIM_THRESHOLD)


def run_rank(
    cfg: Config,
    rank: int,
    master_addr: str,
    master_port: int,
    secret: str | None,
    run_dir: str,
    resume: str | None = None,
    init_method: str | None = None,
    attempt: int = 0,
    joiner: bool = False,
    joined: Callable[[int], None] | None = None,
) -> dict[str, Any] | None:
    """Run one role until the whole job is done; returns the metrics on trainer0.

    ``resume``: a complete checkpoint dir (see ``checkpoint.files.resolve_resume``) to start from.
    ``init_method``: where the ranks meet, if not ``tcp://master_addr:master_port``.
    ``attempt``: how many times the run was restarted before this start (TensorBoard shows it).
    ``joiner``: a trainer joining a running elastic job (``join=``): it takes the first free
    trainer rank from ``rank`` on. ``joined(rank)``: called once this trainer is in an elastic
    job's group with every server, with the rank it took (a joiner's launcher replaces it at
    that rank).
    """
    S, T = cfg.cluster.num_servers, cfg.cluster.num_trainers
    name = role_name(rank, S)
    torch.set_num_threads(1)  # many small processes on few cores: intra-op threads only fight
    # rpc_core owns the malloc policy (rpc_core.memory; RPC_CORE_MALLOC_TUNE=0 or the user's
    # own MALLOC_*/GLIBC_TUNABLES settings turn it off). init_rpc applies it on rpc_core, but
    # torch's init_rpc does not: calling it here gives both backends the same allocator, and
    # before the server builds its model rather than after.
    malloc_tuned = tune_malloc(*malloc_thresholds(cfg, rank))
    setup_role_logging(run_dir, name, cfg.logging.level)
    log.info(
        "malloc thresholds: %s",
        "fixed by rpc_core.memory"
        if malloc_tuned
        else "glibc's defaults or the environment's (RPC_CORE_MALLOC_TUNE=0, MALLOC_*, GLIBC_TUNABLES, or not glibc)",
    )
    backend.select(cfg.backend)
    rpc = backend.rpc()
    from ps_train.checkpoint.protocol import load_resume_state, load_server_state
    from ps_train.roles import server as server_mod

    workload = workload_for(cfg.model)  # the model's: ps_train.workload

    resume_state = load_resume_state(resume, server=name if rank < S else None) if resume else None
    sampler: ServerMetrics | None = None
    if rank < S:
        # Before init_rpc: trainers may ask for it at once. The model's tables, if any, are its own part.
        tables = workload.table_service(cfg.model, cfg.data, table_settings(cfg), rank, run_dir)
        ps = server_mod.create(server_settings(cfg), rank, tables)
        if resume_state is not None:
            load_server_state(ps, resume_state)
        # One TensorBoard writer per folder: TensorBoard reads a folder's event files one after
        # the other, so a second writer's session mark would drop the first one's later points.
        keeps_membership = rank == 0 and cfg.cluster.elastic
        sampled = cfg.logging.server_every > 0
        writer = make_writer(
            cfg.logging.tensorboard and (sampled or keeps_membership), f"{run_dir}/tb/{name}", f".{name}"
        )
        if keeps_membership:
            keep_membership(ps, cfg.cluster, run_dir, resume_state, writer)  # ps_train.elastic.membership
        # Before init_rpc: trainers may send updates as soon as it returns, and every one counts.
        sampler = _server_metrics(cfg, ps, writer) if sampled and cfg.logging.tensorboard else None
    init_method = init_method or f"tcp://{master_addr}:{master_port}"
    if cfg.cluster.serializer == "safe":
        rpc_allowlist.register(cfg.model)  # before init_rpc: the first calls may come at once
    opts = backend.make_options(
        init_method,
        cfg.cluster.rpc_timeout,
        cfg.cluster.num_worker_threads,
        secret,
        cfg.cluster.init_timeout,
        cfg.cluster.serializer,
    )
    log.info(
        "starting %s (rank %d of %d, pid %d) on the %s backend, rendezvous at %s%s",
        name,
        rank,
        S + T,
        os.getpid(),
        cfg.backend,
        init_method,
        f", resuming from {resume} (step {resume_state['step']})" if resume_state else "",
    )
    if cfg.cluster.elastic:  # a dynamic group: trainers can leave and join (ps_train.elastic.trainer)
        rank = join_group(lambda r: role_name(r, S), rank, opts, cfg.cluster.init_timeout, next_free=joiner)
        if joiner:
            name = role_name(rank, S)
            setup_role_logging(run_dir, name, cfg.logging.level)
            log.info("joined the running job as %s (rank %d)", name, rank)
    else:
        try:
            phases.mark("rendezvous")
            rpc.init_rpc(name, rank=rank, world_size=S + T, rpc_backend_options=opts)
        except RendezvousError as e:
            if not e.missing_ranks:
                raise
            # rpc_core knows ranks; the user knows roles: name them as every other failure does.
            roles = ", ".join(role_name(r, S) for r in e.missing_ranks)
            raise RendezvousError(f"{e} [missing: {roles}]", missing_ranks=e.missing_ranks) from e
        backend.restore_rpc_timeout(cfg.cluster.rpc_timeout)
        phases.mark("joined")
        log.info("%s joined the job: all %d ranks are up", name, S + T)  # benchmarks/scale_bench.py reads it
    if rank < S and resume_state is not None and fault_at(name, resume_state["step"], "restore"):
        die(name, resume_state["step"])  # a test fault: in the middle of a restart's recovery
    result = None
    try:
        if rank >= S:
            start, data_state = 0, None
            if resume_state is not None:  # async/ssp: each trainer after its own last step the checkpoint holds
                data_state = resume_state["trainer_positions"].get(name)
                start = data_state["step"] if data_state is not None else resume_state["step"]
            if cfg.cluster.elastic:
                wait_for_servers(S, cfg.cluster.init_timeout)
                if joined is not None:
                    joined(rank)
            t = workload.trainer()(cfg, rank - S, run_dir, start_step=start, data_state=data_state)
            mark_attempt(t.writer, t.step, attempt if t.index == 0 else None)  # see ps_train.launch.restarts
            if t.index == 0:
                write_dashboard(cfg.logging.tensorboard, swept_values(config_to_dict(cfg)), run_dir)  # once per run
            result = t.run(on_step=_step_hooks(cfg, run_dir, rank))
        elif cfg.cluster.elastic:
            serve_elastic(ps)  # ps_train.elastic.membership
    except BaseException:
        _abandon(rpc)
        raise
    # A server serves the trainers inside shutdown's wait for every worker: its time until
    # the group is down counts as training (ps_train.observe.phases).
    phases.mark("shutdown" if rank >= S else "serving")
    rpc.shutdown()
    phases.mark("shut_down" if rank >= S else "served")
    if sampler is not None:
        sampler.close()
    if rank < S and cfg.profile.enabled:
        write_served(run_dir, name, rank, S + T)  # what it ran for the trainers' profiled steps
    if rank < S and ps.membership is not None:
        ps.membership.close()  # after shutdown: ps0 records every trainer's leave first
    log.info("%s finished", name)
    return result


def _server_metrics(cfg: Config, server: Any, writer: MetricsWriter) -> ServerMetrics:
    """The timer that samples this server's counters into ``writer`` (``tb/<name>/``), started."""
    sampler = ServerMetrics(
        server,
        writer,
        cfg.logging.server_every,
        staleness=server.stale_updates,
        byte_counts=rpc_byte_counts if backend.name() == "rpc_core" else None,
    )
    sampler.start()
    return sampler


def _step_hooks(cfg: Config, run_dir: str, rank: int) -> Any:
    """What runs after each trainer step: the checkpoint protocol and, with
    ``profile.enabled``, the profiled window (``ps_train.observe.traces``)."""
    from ps_train.checkpoint.protocol import checkpoint_hook

    split = TrainerSplit(cfg.cluster.num_trainers, cfg.train.batch_size, cfg.seed)
    saves = checkpoint_hook(cfg.checkpoint, split, config_to_dict(cfg))

    def checkpoint(trainer: Any, step: int) -> None:
        last = step == trainer.steps  # the final checkpoint: a phase of its own (ps_train.observe.phases)
        if last:
            phases.mark("checkpoint_start")
        saves(trainer, step)
        if last:
            phases.mark("checkpoint_end")

    if not cfg.profile.enabled:
        return checkpoint
    rpc = backend.rpc()
    world = cfg.cluster.num_servers + cfg.cluster.num_trainers
    window = ProfileWindow(
        run_dir,
        rank,
        world,
        cfg.profile.warmup,
        cfg.profile.steps,
        lambda worker, fn, args: rpc.rpc_sync(worker, fn, args=args),
    )

    def hooks(trainer: Any, step: int) -> None:
        window(trainer, step)  # first: a checkpoint is not part of the profiled steps
        checkpoint(trainer, step)

    return hooks


def _abandon(rpc: Any) -> None:
    """Shut down a failed role without waiting for its peers: a graceful shutdown would wait
    for every peer (forever, for a frozen one) and its error would hide the role's own."""
    try:
        rpc.shutdown(graceful=False)
    except Exception:  # the role's own error is what matters; it is being raised
        log.exception("shutting down after the failure failed too")
