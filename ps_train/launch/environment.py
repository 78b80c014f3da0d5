"""``cluster=env``: which rank this process is, and where rank 0 listens, from its launcher.

A launcher that starts one process per rank tells each its place through environment
variables; these are the ones ps_train reads (docs/deploy.md shows each launcher's job):

- torchrun and Kubeflow's PyTorchJob: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT`` (a PyTorchJob's ``MASTER_ADDR`` is the master pod's service name, set on
  the master pod too). torchrun also says ``TORCHELASTIC_USE_AGENT_STORE=True``: its own
  store listens on ``MASTER_PORT`` (``app.env_init_method`` meets next to it);
- SLURM's srun: ``SLURM_PROCID``, ``SLURM_NTASKS`` and the node list; srun sets no
  ``MASTER_ADDR``, so rank 0's host is the first node of the step's node list
  (``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``), where srun places task 0.

``LOCAL_RANK``/``GROUP_RANK`` (``SLURM_LOCALID``/``SLURM_NODEID``) are only reported: a
rank's role follows from its global rank alone (ranks 0..S-1 are the servers).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ps_train.config import ClusterConfig, ConfigError

__all__ = ["EnvRank", "env_rank", "first_slurm_host"]

# Where two processes of one machine meet when no launcher names rank 0's host.
_LOCAL_HOST = "127.0.0.1"


@dataclass(frozen=True)
class EnvRank:
    """One rank of a ``cluster=env`` job as its launcher described it."""

    rank: int
    world_size: int
    master_addr: str  # rank 0's host: it listens there, every other rank dials it
    master_port: int
    launcher: str  # "torchrun", "srun" or "RANK/WORLD_SIZE" (a PyTorchJob, a shell)
    local_rank: int | None  # the rank among this node's processes, if the launcher says
    node_rank: int | None  # the node's index in the job, if the launcher says


def env_rank(cluster: ClusterConfig, environ: Mapping[str, str]) -> EnvRank:
    """This process's place in the job, from ``environ`` (the launcher's variables) and the
    ``cluster`` group (whose ``master_addr``/``master_port`` default to ``MASTER_ADDR``/
    ``MASTER_PORT``; an empty ``master_addr`` means "ask the launcher")."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        torchrun = "TORCHELASTIC_RUN_ID" in environ or "TORCHELASTIC_USE_AGENT_STORE" in environ
        launcher = "torchrun" if torchrun else "RANK/WORLD_SIZE"
        rank, world = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
        local, node = _opt_int(environ, "LOCAL_RANK"), _opt_int(environ, "GROUP_RANK", "PET_NODE_RANK")
    elif "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        launcher = "srun"
        rank, world = _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_NTASKS")
        local, node = _opt_int(environ, "SLURM_LOCALID"), _opt_int(environ, "SLURM_NODEID")
    else:
        raise ConfigError(
            "cluster.launcher=env needs RANK and WORLD_SIZE (torchrun, a PyTorchJob) or SLURM_PROCID "
            "and SLURM_NTASKS (srun) in the environment; to run everything here use cluster=local"
        )
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(
            f"the launcher gave rank {rank} of a world of {world} ({launcher}); a rank must be in "
            f"0..world_size-1: check how the job starts its processes"
        )
    addr = cluster.master_addr
    if not addr:
        nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        if launcher == "srun" and nodes:
            addr = first_slurm_host(nodes)
        elif launcher == "srun":
            raise ConfigError(
                "cluster.launcher=env under srun: no MASTER_ADDR and no SLURM_JOB_NODELIST to find "
                'rank 0\'s host; export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" '
                "| head -n1) before srun, or pass cluster.master_addr=<rank 0's host>"
            )
        else:
            addr = _LOCAL_HOST
    return EnvRank(rank, world, addr, cluster.master_port, launcher, local, node)


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM host list: ``node[07-09,12],gpu1`` -> ``node07``.

    Each bracket holds comma-separated numbers and ranges; the first host takes the start
    of each bracket's first range, zero padding kept (what ``scontrol show hostnames``
    prints first).
    """
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            end = i
            break
    first = nodelist[:end].strip()
    host = re.sub(r"\[([^\],-]+)[^\]]*\]", lambda m: m.group(1), first)
    if not first or "[" in host or "]" in host:
        raise ConfigError(
            f"cannot read the first host of the SLURM node list {nodelist!r}; export MASTER_ADDR="
            '<rank 0\'s host> (e.g. $(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1))'
        )
    return host


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ConfigError(
            f"the launcher's {name}={environ[name]!r} is not a whole number; "
            "cluster.launcher=env reads it as this process's place in the job"
        ) from None


def _opt_int(environ: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        if name in environ:
            return _int(environ, name)
    return None
