"""What every stand-in for a parameter server has (``ps_train.modes.base.ModeServer``) when a
test drives a mode directly: its identity, lock and version, no BatchNorm, no elastic
membership, a position record; no forward unless a subclass gives one."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from ps_train.checkpoint.positions import TrainerPositions


@dataclass
class StandInServer:
    rank: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    version: int = 0
    has_running_stats: bool = False
    membership: None = None
    positions: TrainerPositions = field(default_factory=TrainerPositions)
    owns_gradients: bool = False  # gradients() hands out tensors the tests still read

    def run_shard(self, shard: int, x: torch.Tensor, trainer: int, step: int) -> torch.Tensor:
        raise AssertionError("no forward in these tests")

    def shard_copy(self, shard: int) -> dict[str, torch.Tensor]:
        raise AssertionError("no forward in these tests")

    def run_shard_with(self, shard: int, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("no forward in these tests")
