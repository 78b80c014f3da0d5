"""Training and evaluation batches of a CTR split (``CtrDataset``).

A split is a ``CtrSplit`` in memory or a memory-mapped prepared folder. Same
contract as ``ps_train.data.BatchIterator`` (both are ``ps_train.data.PartitionCursor``s):
trainer ``rank`` of ``world`` reads a disjoint slice of a per-epoch seeded permutation, so
the trainers together cover the split once per epoch; a resumed iterator continues with
exactly the next batch.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor

from ps_train.partition import PartitionCursor, partition, steps_per_epoch
from ps_train.workloads.ctr.data.bags import Bags
from ps_train.workloads.ctr.data.split import CtrDataset

__all__ = ["CtrBatch", "CtrBatchIterator", "iter_ctr_eval_batches"]

CtrBatch = tuple[Tensor, Tensor | Bags, Tensor]
"""``(dense float32 [B, num_dense], ids, labels float32 [B])``; ``ids``: int64 [B, num_tables]
(one-hot data) or ``Bags`` (multi-hot: a bag of ids per table, ``ps_train.workloads.ctr.data.bags``)."""


class CtrBatchIterator(PartitionCursor, Iterator[CtrBatch]):
    """Endless ``CtrBatch``es of trainer ``rank``'s partition, epoch after epoch
    (``ps_train.data.PartitionCursor``). A saved position is also only valid for the same
    batch size and data: the same offset in another would silently skip or repeat samples."""

    valid_for = ("rank", "world", "seed", "batch_size", "n_items")
    resume_hint = "resume with the same seed, number of trainers, batch size and data"

    def __init__(self, split: CtrDataset, rank: int, world: int, batch_size: int, seed: int) -> None:
        self.split, self.rank, self.world, self.seed = split, rank, world, seed
        self.batch_size = batch_size
        self.n_items = len(split)
        self.steps_per_epoch = steps_per_epoch(self.n_items, world, batch_size) if batch_size >= 1 else 0
        partition(self.n_items, rank, world, seed, 0)  # validates rank/world before the batch check
        if batch_size < 1 or self.steps_per_epoch == 0:
            raise ValueError(
                f"batch_size={batch_size}: each of the {world} trainers gets {self.n_items // world} of "
                f"{self.n_items} training samples, not a full batch; lower the batch size or the number "
                "of trainers, or use more data"
            )
        self.rewind()

    def __next__(self) -> CtrBatch:
        return self.split[self.next_indices()]


def iter_ctr_eval_batches(split: CtrDataset, batch_size: int) -> Iterator[CtrBatch]:
    """All samples in order as ``CtrBatch``es (views; the last may be short): for evaluation."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    for start in range(0, len(split), batch_size):
        yield split[start : start + batch_size]
