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
from pathlib import Path
from typing import Any, Dict, List, Optional

from ps_train.checkpoint import atomic_write_text
from ps_train.config import Config, ConfigError, config_to_dict
from ps_train.launch import launch_local, run_rank

log = logging.getLogger("ps_train")


def run(cfg: Config, run_dir: str, overrides: Optional[List[str]] = None, timeout: Optional[float] = None) -> Optional[Dict[str, Any]]:
    """Train ``cfg``; outputs go to ``run_dir``. Returns the final metrics (on the process
    that has them: always with the local launcher, trainer0's rank with ``launcher=env``).

    ``timeout`` (seconds, local launcher only): stop the run and raise ``RoleFailed`` if it
    has not finished by then.
    """
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    resume = None
    if cfg.resume:
        from ps_train.checkpoint_io import check_resumable

        state = check_resumable(cfg, cfg.resume)  # fails here, before any process starts
        resume = state["checkpoint"]
        log.info("resuming from %s (step %d)", resume, state["step"])
    if cfg.cluster.launcher == "local":
        write_provenance(run_dir, cfg, overrides or [])
        return launch_local(cfg, run_dir, resume, timeout=timeout)
    rank, world = env_rank()
    expected = cfg.cluster.num_servers + cfg.cluster.num_trainers
    if world != expected:
        raise ConfigError(f"the launcher started {world} processes but cluster.num_servers + cluster.num_trainers "
                         f"= {expected}; start exactly {expected} (e.g. torchrun --nproc-per-node ...)")
    if cfg.backend == "rpc_core" and not os.environ.get("RPC_CORE_AUTH_SECRET"):
        raise ConfigError("cluster.launcher=env: set RPC_CORE_AUTH_SECRET to the same secret on every rank (e.g. "
                         "export RPC_CORE_AUTH_SECRET=$(python -c 'import secrets; print(secrets.token_hex(16))') "
                         "once, then start the ranks); only processes that know it can join the job")
    if rank == 0:
        write_provenance(run_dir, cfg, overrides or [])
    # The secret comes from RPC_CORE_AUTH_SECRET (the same on every rank); rpc_core reads it.
    return run_rank(cfg, rank, cfg.cluster.master_addr, cfg.cluster.master_port, None, run_dir, resume)


def env_rank() -> tuple[int, int]:
    """This process's rank and the world size from torchrun's or SLURM's environment."""
    for rank_var, world_var in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank_var in os.environ and world_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[world_var])
    raise ConfigError("cluster.launcher=env needs RANK and WORLD_SIZE (torchrun) or SLURM_PROCID and "
                     "SLURM_NTASKS (srun) in the environment; to run everything here use cluster=local")


def write_provenance(run_dir: str, cfg: Config, overrides: List[str]) -> None:
    """What it takes to reproduce the run: the resolved config, the command-line overrides,
    package versions and the git revision, in ``<run_dir>/provenance.json``."""
    import torch

    info: Dict[str, Any] = {
        "argv": sys.argv,
        "overrides": overrides,
        "config": config_to_dict(cfg),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {},
    }
    for name in ("torch", "torchvision", "hydra-core", "omegaconf", "tensorboard", "numpy", "scikit-learn"):
        try:
            from importlib.metadata import version

            info["packages"][name] = version(name)
        except Exception:
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
