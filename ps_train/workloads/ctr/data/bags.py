"""Multi-hot categorical features: a bag of ids per table and sample, as jagged tensors.

A CTR sample has, for each table, a bag of ids (one for Criteo's single-valued fields, up to
a hundred for MLPerf DLRM-v2's multi-hot ones), optionally with a weight per id; the model
pools each bag into one vector (``sum`` or ``mean``, as ``nn.EmbeddingBag``).

- ``Bags``: one batch, every table's bags in one jagged pair, table-major (the layout of
  ``F.embedding_bag`` over all tables at once, and of TorchRec's ``KeyedJaggedTensor``);
- ``BagColumns``: a whole split's bags, sample-major, from which ``Bags`` of any samples
  are gathered without a loop over tables.

A one-hot batch is an ``ids [B, T]`` tensor; ``as_bags`` turns it into ``Bags``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Bags", "BagColumns", "as_bags", "jagged_positions"]


def jagged_positions(starts: Tensor, lengths: Tensor) -> Tensor:
    """The positions ``starts[i] + 0 .. lengths[i] - 1`` of every run, concatenated (int64
    [lengths.sum()]): the gather index of a jagged selection, with no Python loop."""
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    ends = torch.cumsum(lengths, 0)
    # Each position's run start, minus where that run begins in the output, plus its rank.
    shift = torch.repeat_interleave(starts - (ends - lengths), lengths)
    return shift + torch.arange(total, dtype=torch.int64)


@dataclass(frozen=True, eq=False)  # == on tensors is elementwise, not a bool
class Bags:
    """A batch's bags of every table, table-major.

    - ``values``: int64 [N], each id in ``[0, rows_t)`` of its table;
    - ``offsets``: int64 [T * B + 1]; bag ``(t, b)`` (table t, sample b) holds
      ``values[offsets[t * B + b] : offsets[t * B + b + 1]]``; ``offsets[0] == 0``,
      ``offsets[-1] == N``;
    - ``weights``: float32 [N] (one per id, as ``per_sample_weights``) or None.
    """

    values: Tensor
    offsets: Tensor
    weights: Tensor | None
    num_tables: int

    def __post_init__(self) -> None:
        if self.values.dtype != torch.int64 or self.values.dim() != 1:
            raise ValueError(f"Bags.values: need int64 [N], got {self.values.dtype} {tuple(self.values.shape)}")
        if self.offsets.dtype != torch.int64 or self.offsets.dim() != 1 or self.num_tables < 1:
            raise ValueError(
                f"Bags.offsets: need int64 [T * B + 1] with T >= 1, got {self.offsets.dtype} "
                f"{tuple(self.offsets.shape)}, T={self.num_tables}"
            )
        if (len(self.offsets) - 1) % self.num_tables:
            raise ValueError(f"Bags.offsets: {len(self.offsets) - 1} bags do not split into {self.num_tables} tables")
        if int(self.offsets[0]) != 0 or int(self.offsets[-1]) != len(self.values):
            raise ValueError(
                f"Bags.offsets: must run from 0 to len(values)={len(self.values)}, got "
                f"{int(self.offsets[0])}..{int(self.offsets[-1])}"
            )
        w = self.weights
        if w is not None and (w.dtype != torch.float32 or w.shape != self.values.shape):
            raise ValueError(f"Bags.weights: need float32 [{len(self.values)}], got {w.dtype} {tuple(w.shape)}")

    @staticmethod
    def one_hot(ids: Tensor) -> Bags:
        """One id per table and sample: ``ids`` int64 [B, T]."""
        if ids.dim() != 2:
            raise ValueError(f"one-hot ids must be [B, num_tables], got {tuple(ids.shape)}")
        B, T = ids.shape
        return Bags(ids.t().reshape(-1), torch.arange(B * T + 1, dtype=torch.int64), None, T)

    @property
    def batch_size(self) -> int:
        return (len(self.offsets) - 1) // self.num_tables

    def lengths(self) -> Tensor:
        """Ids per bag, int64 [T * B] (table-major)."""
        return self.offsets[1:] - self.offsets[:-1]

    def table(self, t: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """Table ``t``'s ``(input [n], offsets [B], per_sample_weights [n] | None)`` for
        ``nn.EmbeddingBag``: what the single-process model pools, table by table."""
        B = self.batch_size
        lo, hi = int(self.offsets[t * B]), int(self.offsets[(t + 1) * B])
        w = self.weights[lo:hi] if self.weights is not None else None
        return self.values[lo:hi], self.offsets[t * B : (t + 1) * B] - lo, w


def as_bags(ids: Tensor | Bags) -> Bags:
    """``ids`` as ``Bags``: one-hot ``[B, T]`` ids are bags of one."""
    return ids if isinstance(ids, Bags) else Bags.one_hot(ids)


@dataclass(frozen=True, eq=False)
class BagColumns:
    """A split's bags, sample-major: bag ``(i, t)`` (sample i, table t) holds
    ``values[offsets[i * T + t] : offsets[i * T + t + 1]]``.

    - ``values``: int32 or int64 [M] (int32 halves the memory; every table has < 2**31 rows);
    - ``offsets``: int64 [N * T + 1];
    - ``weights``: float32 [M] or None.
    """

    values: Tensor
    offsets: Tensor
    weights: Tensor | None
    num_tables: int

    def __post_init__(self) -> None:
        if self.values.dtype not in (torch.int32, torch.int64) or self.values.dim() != 1:
            raise ValueError(
                f"BagColumns.values: need int32/int64 [M], got {self.values.dtype} {tuple(self.values.shape)}"
            )
        if self.offsets.dtype != torch.int64 or (len(self.offsets) - 1) % max(self.num_tables, 1):
            raise ValueError(
                f"BagColumns.offsets: need int64 [N * {self.num_tables} + 1], got {self.offsets.dtype} "
                f"{tuple(self.offsets.shape)}"
            )
        if self.weights is not None and self.weights.shape != self.values.shape:
            raise ValueError(f"BagColumns.weights: need [{len(self.values)}], got {tuple(self.weights.shape)}")

    def __len__(self) -> int:
        return (len(self.offsets) - 1) // self.num_tables

    def _select(self, index: slice | Tensor) -> tuple[Tensor, Tensor]:
        """Sample indices int64 [B] of ``index``, and their bags' numbers in table-major order [T * B]."""
        samples = torch.arange(len(self))[index] if isinstance(index, slice) else index.to(torch.int64)
        T = self.num_tables
        bags = (samples.unsqueeze(0) * T + torch.arange(T).unsqueeze(1)).reshape(-1)  # [T, B] -> [T * B]
        return samples, bags

    def batch(self, index: slice | Tensor) -> Bags:
        """The ``Bags`` of samples ``index`` (a slice or int64 [B]), table-major."""
        _, bags = self._select(index)
        starts = self.offsets[bags]
        lengths = self.offsets[bags + 1] - starts
        where = jagged_positions(starts, lengths)
        offsets = torch.zeros(len(bags) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        w = self.weights[where] if self.weights is not None else None
        return Bags(self.values[where].to(torch.int64), offsets, w, self.num_tables)

    def subset(self, index: slice | Tensor) -> BagColumns:
        """The bags of samples ``index``, sample-major (a new split's)."""
        samples, _ = self._select(index)
        T = self.num_tables
        bags = (samples.unsqueeze(1) * T + torch.arange(T).unsqueeze(0)).reshape(-1)  # [B, T] -> [B * T]
        starts = self.offsets[bags]
        lengths = self.offsets[bags + 1] - starts
        where = jagged_positions(starts, lengths)
        offsets = torch.zeros(len(bags) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        w = self.weights[where] if self.weights is not None else None
        return BagColumns(self.values[where], offsets, w, T)

    def max_per_table(self) -> Tensor:
        """Each table's largest id, int64 [T] (-1 for a table with no ids)."""
        T = self.num_tables
        lengths = self.offsets[1:] - self.offsets[:-1]  # [N * T]
        table = torch.arange(len(lengths)) % T
        per_value = torch.repeat_interleave(table, lengths)
        out = torch.full((T,), -1, dtype=torch.int64)
        return out.scatter_reduce(0, per_value, self.values.to(torch.int64), reduce="amax")

    def nbytes(self) -> int:
        ts = [self.values, self.offsets] + ([self.weights] if self.weights is not None else [])
        return sum(t.element_size() * t.nelement() for t in ts)
