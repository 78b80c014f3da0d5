"""``run(cfg, run_dir)``: train one experiment; what ``python -m ps_train`` calls after Hydra.

Tests call it directly with a ``Config``; nothing here knows about Hydra.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

from ps_train.checkpoint.files import CheckpointError
from ps_train.config import Config, ConfigError, config_to_dict
from ps_train.files import atomic_write_text
from ps_train.launch.environment import EnvRank, env_rank
from ps_train.launch.failures import role_name
from ps_train.launch.local import launch_local
from ps_train.launch.prechecks import check_data
from ps_train.launch.rank import run_rank
from ps_train.launch.restarts import (
    rank_failed,
    read_restarts,
    record_env_restart,
    restart_count,
    run_local,
    start_checkpoint,
)
from ps_train.metrics import write_metrics_json
from ps_train.workload import DatasetNotFoundError, import_plugins
from ps_train.workloads import BUILTIN

# The built-in workloads, and any named in PS_TRAIN_PLUGINS, register themselves (ps_train.workload)
# before a config is composed or a role is started.
import_plugins(BUILTIN)
import_plugins()

log = logging.getLogger("ps_train")


def run(
    cfg: Config, run_dir: str, overrides: list[str] | None = None, timeout: float | None = None
) -> dict[str, Any] | None:
    """Train ``cfg``; outputs go to ``run_dir``. Returns the final metrics (on the process
    that has them: always with the local launcher, trainer0's rank with ``launcher=env``; None
    for a trainer that joined a running job with ``join=``).

    ``timeout`` (seconds, local launcher only): stop the run and raise ``RoleFailed`` if it
    has not finished by then (restarts included, see ``ps_train.launch.restarts``).
    """
    if cfg.join is not None:
        join_job(cfg.join)
        return None
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    attempt = restart_count() if cfg.cluster.launcher == "env" else 0
    resume = start_checkpoint(cfg.resume, run_dir, restarted=attempt > 0)
    if resume:
        from ps_train.checkpoint.protocol import check_resumable

        state = check_resumable(config_to_dict(cfg), resume)  # fails here, before any process starts
        resume = state["checkpoint"]
        (log.warning if attempt else log.info)(
            "resuming from %s (step %d)%s",
            resume,
            state["step"],
            f"; torchrun restarted the job {attempt} time(s)" if attempt else "",
        )
    if cfg.cluster.launcher == "local":
        # The data, before any role starts (DataCheckError).
        check_data(cfg.model, cfg.data, cfg.cluster.num_trainers, cfg.train.batch_size)
        write_provenance(run_dir, cfg, overrides or [])
        return run_local(cfg.cluster, partial(launch_local, cfg), run_dir, resume, timeout=timeout)
    place = env_rank(cfg.cluster, os.environ)
    rank, world = place.rank, place.world_size
    expected = cfg.cluster.num_servers + cfg.cluster.num_trainers
    if world != expected:
        raise ConfigError(
            f"the launcher started {world} processes but cluster.num_servers + cluster.num_trainers "
            f"= {expected}; start exactly {expected} (e.g. torchrun --nproc-per-node ...)"
        )
    if cfg.backend == "rpc_core" and not os.environ.get("RPC_CORE_AUTH_SECRET"):
        raise ConfigError(
            "cluster.launcher=env: set RPC_CORE_AUTH_SECRET to the same secret on every rank (e.g. "
            "export RPC_CORE_AUTH_SECRET=$(python -c 'import secrets; print(secrets.token_hex(16))') "
            "once, then start the ranks); only processes that know it can join the job"
        )
    if rank == 0:
        write_provenance(run_dir, cfg, overrides or [])
    log.info(
        "rank %d of %d (%s; local rank %s, node %s), rank 0 at %s:%d",
        rank,
        world,
        place.launcher,
        place.local_rank,
        place.node_rank,
        place.master_addr,
        place.master_port,
    )
    init_method = env_init_method(cfg, place)
    # The secret comes from RPC_CORE_AUTH_SECRET (the same on every rank); rpc_core reads it.
    if attempt and rank == cfg.cluster.num_servers:  # trainer0 records torchrun's restart
        record_env_restart(run_dir, attempt, resume)
    try:
        metrics = run_rank(
            cfg,
            rank,
            place.master_addr,
            place.master_port,
            None,
            run_dir,
            resume,
            init_method=init_method,
            attempt=attempt,
        )
    except (ConfigError, CheckpointError, DatasetNotFoundError):
        raise
    except Exception as e:
        # No launcher watches this rank: exit now, non-zero, with one line naming the failed
        # role (the traceback goes to this role's log), so torchrun or SLURM can restart the job.
        log.exception("this rank failed")
        raise rank_failed(rank, role_name(rank, cfg.cluster.num_servers), run_dir, attempt, e) from e
    if metrics is not None:
        metrics["restarts"] = read_restarts(run_dir)
        write_metrics_json(Path(run_dir) / "metrics.json", metrics)  # trainer0 wrote it without them
    return metrics


def join_job(job_dir: str) -> None:
    """``join=<run dir>``: run one more trainer for the running elastic job there, with the
    job's own config, until the job is over (its logs and TensorBoard events go to that run
    folder, under the name it gets: the first free ``trainer<k>``). A killed trainer is
    replaced, and after a restart of the job a new one joins it (``ps_train.launch.joiner``)."""
    from ps_train.launch.joiner import keep_joined

    keep_joined(job_dir)


def env_init_method(cfg: Config, place: EnvRank) -> str:
    """Where the ranks of a ``launcher=env`` job meet.

    Plainly (two terminals, srun): ``tcp://MASTER_ADDR:MASTER_PORT``, rank 0 listens there.
    Under torchrun, torchrun's own store already listens on MASTER_PORT: the torch backend
    joins it (``env://``); for rpc_core, rank 0 picks a free port next to it and hands it
    to the other ranks through torchrun's store.
    """
    addr, port, rank = place.master_addr, place.master_port, place.rank
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return f"tcp://{addr}:{port}"
    if cfg.backend == "torch":
        return "env://"
    from datetime import timedelta

    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # torch re-exports it implicitly

    from ps_train.launch.ports import free_port

    timeout = timedelta(seconds=cfg.cluster.init_timeout)
    store = TCPStore(addr, port, is_master=False, timeout=timeout)
    key = (
        f"ps_train/rpc_core_port/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
        f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    )
    if rank == 0:
        chosen = free_port(addr)
        store.set(key, str(chosen))
    else:
        chosen = int(store.get(key))  # waits until rank 0 set it
    log.info("torchrun's store holds %s:%d; rpc_core meets at port %d", addr, port, chosen)
    return f"tcp://{addr}:{chosen}"


def write_provenance(run_dir: str, cfg: Config, overrides: list[str]) -> None:
    """What it takes to reproduce the run: the resolved config, the command-line overrides,
    package versions and the git revision, in ``<run_dir>/provenance.json``."""
    import torch

    info: dict[str, Any] = {
        "argv": sys.argv,
        "overrides": overrides,
        "config": config_to_dict(cfg),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {},
    }
    for name in ("torch", "torchvision", "hydra-core", "omegaconf", "tensorboard", "numpy", "scikit-learn"):
        try:
            from importlib.metadata import PackageNotFoundError, version

            info["packages"][name] = version(name)
        except PackageNotFoundError:
            info["packages"][name] = None
    repo = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True, timeout=5)
        info["git_revision"] = rev.stdout.strip() or None
        info["git_dirty"] = bool(dirty.stdout.strip()) if rev.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        info["git_revision"] = None
    info["torch_threads"] = torch.get_num_threads()
    atomic_write_text(Path(run_dir) / "provenance.json", json.dumps(info, indent=2))
