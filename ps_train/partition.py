"""Per-trainer partitions of a training set, shared by every workload.

A trainer sees a disjoint slice of a per-epoch seeded permutation (``partition``), so all
trainers together cover the training set once per epoch; ``PartitionCursor`` records a
trainer's position as ``(epoch, offset)`` so a resumed run continues with exactly the next
batch. A workload's batch iterator (the vision ``BatchIterator``, CTR's ``CtrBatchIterator``)
is a ``PartitionCursor`` that turns the next indices into a batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["partition", "steps_per_epoch", "total_steps", "PartitionCursor", "TrainerSplit"]

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class TrainerSplit:
    """How a run deals its training set out to the trainers it launched: ``world`` trainers
    (``cluster.num_trainers``), ``batch_size`` samples a step, the partitions seeded by ``seed``.
    What places a trainer's data after a step (a checkpoint's positions, an elastic trainer's
    batches) needs these and nothing else of the config."""

    world: int
    batch_size: int
    seed: int

    def position(self, n_items: int, step: int) -> dict[str, int]:
        """Where every trainer's batch iterator stands after ``step`` steps of the same length
        (sync mode: the same for all)."""
        spe = steps_per_epoch(n_items, self.world, self.batch_size)
        return {"epoch": step // spe, "offset": (step % spe) * self.batch_size}


def partition(n_items: int, rank: int, world: int, seed: int, epoch: int) -> Tensor:
    """Indices (int64) of trainer ``rank``'s share of ``n_items`` for ``epoch``.

    A seeded permutation per (seed, epoch), dealt out by stride: the ``world`` partitions are
    disjoint, cover all items, differ in size by at most one, and depend on nothing else.
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"partition: rank {rank} must be in [0, world={world}) and world >= 1")
    if n_items < 0 or epoch < 0:
        raise ValueError(f"partition: n_items ({n_items}) and epoch ({epoch}) must be >= 0")
    # NumPy's SeedSequence hashes (seed, epoch) in full; torch's CPU generator would keep
    # only 32 bits of a combined seed, making different (seed, epoch) pairs collide.
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed & _MASK64, epoch])))
    return torch.from_numpy(rng.permutation(n_items).astype(np.int64))[rank::world]


def steps_per_epoch(n_items: int, world: int, batch_size: int) -> int:
    """Full batches per epoch, the same for every trainer (the smallest partition decides),
    so in sync mode all trainers take the same number of steps."""
    return (n_items // world) // batch_size


def total_steps(steps: int | None, epochs: int | None, n_items: int, world: int, batch_size: int) -> int:
    """Steps each trainer runs for ``train.steps`` or ``train.epochs``."""
    if steps is not None:
        return steps
    if epochs is None:
        raise ValueError("train.steps/train.epochs: set one of them")
    return epochs * steps_per_epoch(n_items, world, batch_size)


class PartitionCursor:
    """Trainer ``rank``'s position in the per-epoch seeded partitions of ``n_items`` samples
    (``partition``): ``(epoch, offset)``, ``offset`` = samples of this epoch's partition
    already consumed. Only the first ``n_items // world`` samples of each partition are used,
    in full batches, so every rank takes the same number of steps per epoch
    (``steps_per_epoch``), as sync mode needs. ``state_dict`` / ``load_state_dict`` save and
    restore the position exactly; a saved position is only valid for the same ``valid_for``
    settings."""

    rank: int
    world: int
    seed: int
    batch_size: int
    n_items: int
    valid_for: tuple[str, ...] = ("rank", "world", "seed")
    resume_hint = "resume with the same seed and cluster.num_trainers"

    def rewind(self) -> None:
        """Go to the first batch of epoch 0 (a workload's iterator calls it once it is set up)."""
        self.epoch, self.offset = 0, 0
        self.last_batch: tuple[int, Tensor] | None = None  # (epoch, indices [batch_size]) of the last batch
        self._perm: Tensor | None = None
        self._perm_epoch = -1

    def _indices(self) -> Tensor:
        if self._perm is None or self._perm_epoch != self.epoch:
            self._perm = partition(self.n_items, self.rank, self.world, self.seed, self.epoch)
            self._perm_epoch = self.epoch
        return self._perm

    def next_indices(self) -> Tensor:
        """The next batch's sample indices [batch_size] (a new epoch once this one's are used)."""
        if self.offset + self.batch_size > self.n_items // self.world:
            self.epoch, self.offset = self.epoch + 1, 0
        idx = self._indices()[self.offset : self.offset + self.batch_size]
        self.offset += self.batch_size
        self.last_batch = (self.epoch, idx)  # for the debug record of trained samples (ps_train.sample_log)
        return idx

    def state_dict(self) -> dict[str, int]:
        """JSON-safe position, plus the settings it is only valid for."""
        return {"epoch": self.epoch, "offset": self.offset, **{k: getattr(self, k) for k in self.valid_for}}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in self.valid_for:
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot restore a data position saved with {key}={state[key]} into a trainer with "
                    f"{key}={getattr(self, key)}; {self.resume_hint}"
                )
        if state["epoch"] < 0 or not 0 <= state["offset"] <= self.n_items // self.world:
            raise ValueError(f"invalid data position {state}")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
