"""The checkpoint protocol between roles: saving a running job, and resuming from it.

``ps_train.checkpoint.files`` defines what a checkpoint is on disk; this module decides who
writes which part, and when. trainer0 coordinates: after step k (every
``checkpoint.every`` steps, and at the end) it asks each server, through the server's RRef,
to write its shards' weights and optimizer state (``ParameterServer.save_state``), then
writes the manifest tying the files to step k, every trainer's data position and the RNG
states. In sync mode the servers cannot move while trainer0 is busy checkpointing (step
k+1 needs trainer0's gradients), so the checkpoint is exactly the state after step k. In
async/ssp modes each shard is saved as it is at that moment and every trainer resumes from
trainer0's step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence, Sized
from pathlib import Path
from typing import Any, Protocol

from ps_train.checkpoint.files import (
    CheckpointError,
    Manifest,
    begin_checkpoint,
    capture_rng_state,
    load_shard_state,
    prune_checkpoints,
    read_manifest,
    resolve_resume,
    write_manifest,
)
from ps_train.config import Config, ConfigError, config_to_dict
from ps_train.data import steps_per_epoch

log = logging.getLogger("ps_train.checkpoint")


class RestoredServer(Protocol):
    """What resuming uses of a server (``ps_train.roles.server.ParameterServer``)."""

    @property
    def rank(self) -> int: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class CheckpointingTrainer(Protocol):
    """What the coordinator uses of trainer0 (``ps_train.roles.trainer.Trainer``)."""

    @property
    def cfg(self) -> Config: ...

    @property
    def index(self) -> int: ...

    @property
    def steps(self) -> int:
        """The step it trains to."""

    @property
    def run_dir(self) -> str: ...

    @property
    def servers(self) -> Sequence[Any]:
        """RRefs to the ParameterServers: ``servers[r]`` is ps<r>'s."""

    @property
    def train_set(self) -> Sized:
        """Its training split (its length places every trainer's data after a step)."""

    def settle(self) -> dict[str, float]:
        """Wait until the servers applied its last step's update."""


def load_server_state(ps: RestoredServer, resume_state: dict[str, Any]) -> None:
    """Before the job starts: give server ``ps`` its saved state."""
    ps.load_state_dict(resume_state["servers"][f"ps{ps.rank}"])


def data_position(cfg: Config, n_items: int, step: int) -> dict[str, int]:
    """Where every trainer's batch iterator stands after ``step`` steps (the same for all)."""
    spe = steps_per_epoch(n_items, cfg.cluster.num_trainers, cfg.train.batch_size)
    return {"epoch": step // spe, "offset": (step % spe) * cfg.train.batch_size}


def save(trainer: CheckpointingTrainer, step: int) -> Path:
    """trainer0: write a complete checkpoint of the job after ``step``."""
    cfg = trainer.cfg
    trainer.settle()  # the servers have applied step ``step``'s update
    ckpt = begin_checkpoint(trainer.run_dir, step)
    # Every server writes its own file at once; trainer.servers[r] is ps<r>'s RRef.
    futs = [server.rpc_async().save_state(str(ckpt)) for server in trainer.servers]
    shards = [f.wait() for f in futs]
    pos = data_position(cfg, len(trainer.train_set), step)
    positions = {}
    for k in range(cfg.cluster.num_trainers):
        positions[f"trainer{k}"] = dict(pos, rank=k, world=cfg.cluster.num_trainers, seed=cfg.seed)
    write_manifest(
        ckpt,
        Manifest(
            step=step,
            shards=shards,
            trainer_positions=positions,
            rng_states={"trainer0": capture_rng_state()},
            extra={"mode": cfg.mode.name, "backend": cfg.backend, "config": config_to_dict(cfg)},
        ),
    )
    prune_checkpoints(trainer.run_dir, cfg.checkpoint.keep)
    log.info("checkpoint after step %d: %s", step, ckpt)
    return ckpt


def checkpoint_hook(cfg: Config, run_dir: str) -> Callable[[CheckpointingTrainer, int], None]:
    """The per-step callback trainer0 runs: checkpoint every ``checkpoint.every`` steps and
    after the last step (unless ``checkpoint.final`` is false)."""

    def hook(trainer: CheckpointingTrainer, step: int) -> None:
        if trainer.index != 0:
            return
        every = cfg.checkpoint.every
        if (every and step % every == 0) or (step == trainer.steps and cfg.checkpoint.final):
            save(trainer, step)

    return hook


def load_resume_state(path: str, server: str | None = None) -> dict[str, Any]:
    """Read the latest complete checkpoint under ``path`` (a run dir or checkpoint dir).

    ``server``: also load that server's state file (``ps0``, ...), hash-verified; trainers
    need only the manifest.
    """
    ckpt = resolve_resume(path)
    manifest = read_manifest(ckpt)
    servers = {}
    if server is not None:
        entry = {s.name: s for s in manifest.shards}.get(server)
        if entry is None:
            raise CheckpointError(
                f"resume={path}: checkpoint {ckpt} has no state for {server} (it has "
                f"{sorted(s.name for s in manifest.shards)}); resume with the same "
                "cluster.num_servers"
            )
        servers[server] = load_shard_state(ckpt, entry)
    return {
        "checkpoint": str(ckpt),
        "step": manifest.step,
        "servers": servers,
        "trainer_positions": manifest.trainer_positions,
        "extra": manifest.extra,
    }


def check_resumable(cfg: Config, path: str) -> dict[str, Any]:
    """In the launcher, before any role starts: the checkpoint to resume from exists and was
    written by a run this config can continue (same model, cluster shape, seed and data)."""
    state = load_resume_state(path)
    saved = state["extra"].get("config")
    if saved:
        now = config_to_dict(cfg)
        problems = [
            f"{key}: the checkpoint has {saved.get(key)!r}, this run {now.get(key)!r}"
            for key in _RESUME_MUST_MATCH
            if key in saved and saved.get(key) != now.get(key)
        ]
        for group, key in (
            ("cluster", "num_servers"),
            ("cluster", "num_trainers"),
            ("cluster", "placement"),
            ("optim", "name"),
            ("data", "name"),
        ):
            old, new = saved.get(group, {}).get(key), now[group][key]
            if old is not None and old != new:
                problems.append(f"{group}.{key}: the checkpoint has {old!r}, this run {new!r}")
        for key in _TABLE_KEYS:  # model=dlrm: the servers' saved table shards have these shapes
            old, new = saved.get("data", {}).get(key), now["data"].get(key)
            if old is not None and new is not None and old != new:
                problems.append(f"data.{key}: the checkpoint has {old!r}, this run {new!r}")
        if problems:
            raise ConfigError(
                f"resume={path}: {state['checkpoint']} was written by a different setup; pass the "
                "original run's overrides again:\n  - " + "\n  - ".join(problems)
            )
    return state


# Config sections a resumed run must share with the checkpoint's run (optim.lr etc. may change).
_RESUME_MUST_MATCH = ("model", "seed")
_TABLE_KEYS = ("num_tables", "table_rows", "table_sizes")
