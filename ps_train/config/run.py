"""The groups that shape a run rather than the model: consistency ``mode``, ``train`` length
and batches, ``checkpoint`` cadence and ``logging``."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from ps_train.config.base import Problems

__all__ = ["ModeConfig", "TrainConfig", "CheckpointConfig", "LoggingConfig", "MODE_NAMES", "AGGREGATES",
           "STALENESS_RULES"]

MODE_NAMES = ("sync", "async", "ssp")
AGGREGATES = ("mean", "sum")  # sync: how a step's gradients combine (ps_train.modes.aggregation)
STALENESS_RULES = ("scale", "none")  # async/ssp: the learning rate of a stale gradient (ps_train.modes.aggregation)


@dataclass
class ModeConfig:
    name: str = "sync"  # sync | async | ssp
    staleness: int = 0  # ssp only: max steps a trainer may run ahead of the slowest
    aggregate: str = "mean"  # sync only: mean (as DDP) or sum of the trainers' gradients
    staleness_rule: str = "scale"  # async/ssp only: scale (lr / staleness) or none

    def problems(self) -> Problems:
        p = Problems()
        p.need(self.name in MODE_NAMES,
               f"mode.name: unknown mode {self.name!r}; choose one of {list(MODE_NAMES)} (e.g. mode=ssp)")
        if self.name == "ssp":
            p.need(self.staleness >= 0, f"mode.staleness: {self.staleness} must be >= 0 in ssp mode")
        else:
            p.need(self.staleness == 0,
                   f"mode.staleness: only used by mode=ssp (got {self.staleness} with mode={self.name})")
        p.need(self.aggregate in AGGREGATES,
               f"mode.aggregate: unknown rule {self.aggregate!r}; choose one of {list(AGGREGATES)}")
        p.need(self.staleness_rule in STALENESS_RULES,
               f"mode.staleness_rule: unknown rule {self.staleness_rule!r}; choose one of {list(STALENESS_RULES)}")
        # Each option belongs to one kind of mode; set with another it would silently do nothing.
        if self.name != "sync":
            p.need(self.aggregate == "mean",
                   f"mode.aggregate: only used by mode=sync (got {self.aggregate} with mode={self.name}, which "
                   "applies each trainer's gradient on its own; see mode.staleness_rule)")
        else:
            p.need(self.staleness_rule == "scale",
                   f"mode.staleness_rule: only used by mode=async and mode=ssp (got {self.staleness_rule} with "
                   "mode=sync, whose gradients are never stale; see mode.aggregate)")
        return p


@dataclass
class TrainConfig:
    # Exactly one of steps / epochs; both count per trainer (an epoch = one pass over the
    # trainer's own partition).
    steps: int | None = 300
    epochs: int | None = None
    batch_size: int = 32  # per trainer
    eval_every: int = 100  # steps; 0 = evaluate only at the end
    eval_batch_size: int = 512
    log_every: int = 20

    def problems(self) -> Problems:
        p = Problems()
        p.need((self.steps is None) != (self.epochs is None),
               f"train.steps/train.epochs: set exactly one (got steps={self.steps}, epochs={self.epochs}); "
               "e.g. train.steps=null train.epochs=3")
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

    def problems(self) -> Problems:
        p = Problems()
        p.need(self.every >= 0, f"checkpoint.every: {self.every} must be >= 0 (0 = only at the end)")
        p.need(self.keep >= 0, f"checkpoint.keep: {self.keep} must be >= 0 (0 = keep all)")
        return p


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    progress: bool = True  # periodic one-line status (step, loss, samples/s)
    level: str = "INFO"

    def problems(self) -> Problems:
        p = Problems()
        p.need(isinstance(logging.getLevelName(self.level.upper()), int),
               f"logging.level: unknown level {self.level!r}; use DEBUG, INFO, WARNING or ERROR")
        return p
