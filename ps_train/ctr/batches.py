"""Training and evaluation batches of a ``CtrSplit``.

Same contract as ``ps_train.data.BatchIterator``: trainer ``rank`` of ``world`` reads a
disjoint slice of a per-epoch seeded permutation (``ps_train.data.partition``), so the
trainers together cover the split once per epoch; the position is ``(epoch, offset)`` and a
resumed iterator continues with exactly the next batch.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor

from ps_train.ctr.split import CtrSplit
from ps_train.data import partition, steps_per_epoch

__all__ = ["CtrBatch", "CtrBatchIterator", "iter_ctr_eval_batches"]

CtrBatch = tuple[Tensor, Tensor, Tensor]
"""``(dense float32 [B, num_dense], ids int64 [B, num_tables], labels float32 [B])``."""


class CtrBatchIterator(Iterator[CtrBatch]):
    """Endless ``CtrBatch``es of trainer ``rank``'s partition, epoch after epoch.

    Every trainer uses only the first ``len(split) // world`` samples of its partition and
    drops the incomplete last batch, so all trainers take the same number of steps per
    epoch (``steps_per_epoch``), as sync mode needs. ``offset`` counts the samples of this
    epoch's partition already consumed.
    """

    def __init__(self, split: CtrSplit, rank: int, world: int, batch_size: int, seed: int) -> None:
        self.split, self.rank, self.world, self.seed = split, rank, world, seed
        self.batch_size = batch_size
        self.n_items = len(split)
        self.steps_per_epoch = steps_per_epoch(self.n_items, world, batch_size) if batch_size >= 1 else 0
        partition(self.n_items, rank, world, seed, 0)  # validates rank/world before the batch check
        if batch_size < 1 or self.steps_per_epoch == 0:
            raise ValueError(
                f"batch_size={batch_size}: each of the {world} trainers gets {self.n_items // world} of "
                f"{self.n_items} training samples, not a full batch; lower the batch size or the number "
                "of trainers, or use more data")
        self.epoch, self.offset = 0, 0
        self._perm: Tensor | None = None
        self._perm_epoch = -1

    def _indices(self) -> Tensor:
        if self._perm is None or self._perm_epoch != self.epoch:
            self._perm = partition(self.n_items, self.rank, self.world, self.seed, self.epoch)
            self._perm_epoch = self.epoch
        return self._perm

    def __next__(self) -> CtrBatch:
        if self.offset + self.batch_size > self.n_items // self.world:
            self.epoch, self.offset = self.epoch + 1, 0
        idx = self._indices()[self.offset:self.offset + self.batch_size]
        self.offset += self.batch_size
        return self.split[idx]

    def state_dict(self) -> dict[str, int]:
        """JSON-safe position, plus the settings it is only valid for."""
        return {"epoch": self.epoch, "offset": self.offset, "rank": self.rank, "world": self.world,
                "seed": self.seed, "batch_size": self.batch_size, "n_items": self.n_items}

    def load_state_dict(self, state: dict[str, int]) -> None:
        # batch_size and n_items matter too: the same offset in another batch size or data
        # set would silently skip or repeat samples.
        for key in ("rank", "world", "seed", "batch_size", "n_items"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot restore a data position saved with {key}={state[key]} into an iterator with "
                    f"{key}={getattr(self, key)}; resume with the same seed, number of trainers, batch "
                    "size and data")
        if state["epoch"] < 0 or not 0 <= state["offset"] <= self.n_items // self.world:
            raise ValueError(f"invalid data position {state}")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])


def iter_ctr_eval_batches(split: CtrSplit, batch_size: int) -> Iterator[CtrBatch]:
    """All samples in order as ``CtrBatch``es (views; the last may be short): for evaluation."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    for start in range(0, len(split), batch_size):
        yield split[start:start + batch_size]
