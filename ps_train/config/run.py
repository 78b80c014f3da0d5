"""The groups that shape a run rather than the model: consistency ``mode``, ``train`` length
and batches, ``checkpoint`` cadence and ``logging``."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

from ps_train.config.base import Problems
from ps_train.modes import AGGREGATES, MODE_NAMES, STALENESS_RULES, option_problems

__all__ = [
    "ModeConfig",
    "TrainConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "ProfileConfig",
    "MODE_NAMES",
    "AGGREGATES",
    "STALENESS_RULES",
    "CHECKPOINT_WRITERS",
    "CHECKPOINT_WHEN_BUSY",
]

CHECKPOINT_WRITERS = ("fork", "thread")
CHECKPOINT_WHEN_BUSY = ("defer", "wait")


@dataclass
class ModeConfig:
    name: str = "sync"  # sync | async | ssp | hybrid (ps_train.modes)
    # ssp: max steps a trainer may run ahead of the slowest; hybrid: how many steps of the
    # other trainers' table updates a lookup may miss
    staleness: int = 0
    aggregate: str = "mean"  # sync/hybrid only: mean (as DDP) or sum of the trainers' (dense) gradients
    staleness_rule: str = "scale"  # async/ssp/hybrid only: scale (lr / staleness) or none

    def problems(self) -> Problems:
        # Each mode checks the options it reads; one it does not read must keep its default
        # (set with another mode it would silently do nothing): ps_train.modes.
        p = Problems()
        p += option_problems(self, {f.name: f.default for f in dataclasses.fields(self) if f.name != "name"})
        return p


@dataclass
class TrainConfig:
    # Exactly one of steps / epochs; both count per trainer (an epoch = one pass over the
    # trainer's own partition).
    steps: int | None = 300
    epochs: int | None = None  # passes over each trainer's partition (with steps=null)
    batch_size: int = 32  # per trainer
    eval_every: int = 100  # steps; 0 = evaluate only at the end
    eval_batch_size: int = 512  # samples per forward when evaluating
    log_every: int = 20  # steps between progress lines and TensorBoard training scalars

    def problems(self) -> Problems:
        p = Problems()
        p.need(
            (self.steps is None) != (self.epochs is None),
            f"train.steps/train.epochs: set exactly one (got steps={self.steps}, epochs={self.epochs}); "
            "e.g. train.steps=null train.epochs=3",
        )
        p.need(self.steps is None or self.steps > 0, f"train.steps: {self.steps} must be > 0")
        p.need(self.epochs is None or self.epochs > 0, f"train.epochs: {self.epochs} must be > 0")
        p.need(self.batch_size > 0, f"train.batch_size: {self.batch_size} must be > 0")
        p.need(self.eval_batch_size > 0, f"train.eval_batch_size: {self.eval_batch_size} must be > 0")
        p.need(self.eval_every >= 0, f"train.eval_every: {self.eval_every} must be >= 0 (0 = only at the end)")
        p.need(self.log_every >= 1, f"train.log_every: {self.log_every} must be >= 1")
        return p


@dataclass
class CheckpointConfig:
    every: int = 100  # steps; 0 = only at the end
    keep: int = 2  # newest complete checkpoints to keep; 0 = keep all
    final: bool = True  # also after the last step; false: none there (benchmarks, runs never resumed)
    # Embedding tables (model=dlrm): write only the rows changed since the previous checkpoint,
    # and every full_every-th checkpoint all of them (docs/ctr.md#checkpoints-that-do-not-stop-training).
    differential: bool = False
    full_every: int = 4  # every n-th checkpoint writes every row (with differential=true)
    # Embedding tables: how a server writes its rows while training goes on. fork: a forked
    # child writes the copy-on-write image of the rows, around the page cache (O_DIRECT where
    # the filesystem takes it), POSIX only; thread: a thread of the server copies each block
    # of rows before an update changes it, and writes them around the page cache too.
    writer: str = "fork"
    # A checkpoint due while the previous one is still being written: defer (taken after the
    # first step that finds the previous one complete; steps never wait) or wait (the step
    # waits for the previous one: checkpoints exactly every `every` steps).
    when_busy: str = "defer"

    def problems(self) -> Problems:
        p = Problems()
        p.need(
            self.writer in CHECKPOINT_WRITERS,
            f"checkpoint.writer: unknown writer {self.writer!r}; use one of {list(CHECKPOINT_WRITERS)}",
        )
        p.need(
            self.when_busy in CHECKPOINT_WHEN_BUSY,
            f"checkpoint.when_busy: {self.when_busy!r} is not one of {list(CHECKPOINT_WHEN_BUSY)}",
        )
        p.need(
            self.writer != "fork" or hasattr(os, "fork"),
            "checkpoint.writer=fork needs os.fork, which this platform lacks; use checkpoint.writer=thread",
        )
        p.need(self.every >= 0, f"checkpoint.every: {self.every} must be >= 0 (0 = only at the end)")
        p.need(self.keep >= 0, f"checkpoint.keep: {self.keep} must be >= 0 (0 = keep all)")
        p.need(
            self.full_every >= 1,
            f"checkpoint.full_every: {self.full_every} must be >= 1 (1 = every checkpoint full)",
        )
        return p


@dataclass
class LoggingConfig:
    tensorboard: bool = True  # write TensorBoard events under the run folder's tb/
    progress: bool = True  # periodic one-line status (step, loss, samples/s)
    level: str = "INFO"  # the console's log level: DEBUG, INFO, WARNING or ERROR
    # Seconds between a server's TensorBoard samples (tb/ps<r>/: updates/s, staleness, bytes, ...); 0 = none.
    server_every: float = 1.0

    def problems(self) -> Problems:
        p = Problems()
        p.need(
            isinstance(logging.getLevelName(self.level.upper()), int),
            f"logging.level: unknown level {self.level!r}; use DEBUG, INFO, WARNING or ERROR",
        )
        p.need(
            self.server_every >= 0, f"logging.server_every: {self.server_every} must be >= 0 (0 = no server metrics)"
        )
        return p


@dataclass
class ProfileConfig:
    """``profile.enabled=true``: each trainer records ``steps`` steps after ``warmup`` with
    rpc_core.profiler; every role writes traces/<role>.json (ps_train.observe.traces)."""

    enabled: bool = False  # record a trace of a window of steps (backend=rpc_core; docs/observing.md#traces)
    warmup: int = 5  # steps each trainer runs before the recorded ones
    steps: int = 5  # steps recorded

    def problems(self) -> Problems:
        p = Problems()
        p.need(self.warmup >= 1, f"profile.warmup: {self.warmup} must be >= 1 (steps before the recorded ones)")
        p.need(self.steps >= 1, f"profile.steps: {self.steps} must be >= 1")
        return p
