"""``CtrSplit``: one split of a click-through-rate dataset held in memory, and the time split.

A sample is ``num_dense`` float features, one categorical id per table (single-hot, as in
Criteo: each of its 26 categorical fields holds one value) or a bag of them (multi-hot,
``ps_train.workloads.ctr.data.bags``), and a 0/1 click label.

Memory: ``ids`` are int64 so they index ``nn.Embedding``/``EmbeddingBag`` tables of any size
without a cast: 8 bytes x ``num_tables`` per sample, e.g. 1M samples x 26 tables = 208 MB,
plus 4 x ``num_dense`` bytes of dense features (52 MB for 13) and 4 MB of labels. That is
fine for the synthetic default and for test-size Criteo files; a full Criteo day (~190M
lines) would need ~40 GB: it is prepared once into memory-mapped arrays instead
(``ps_train.workloads.ctr.data.mapped.MappedCtrSplit``, another ``CtrDataset``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from ps_train.workloads.ctr.data.bags import BagColumns, Bags

__all__ = ["CtrDataset", "CtrSplit", "time_split", "held_out_count"]


class CtrDataset(Protocol):
    """What training and evaluation read from a split: its size, tables and batches.
    ``CtrSplit`` holds one in memory; ``ps_train.workloads.ctr.data.mapped.MappedCtrSplit`` maps a prepared
    folder."""

    @property
    def table_sizes(self) -> list[int]: ...

    @property
    def num_dense(self) -> int: ...

    def __len__(self) -> int: ...

    def __getitem__(self, index: slice | Tensor) -> tuple[Tensor, Tensor | Bags, Tensor]:
        """``(dense float32 [B, num_dense], ids, labels float32 [B])``; ``ids``: int64
        [B, num_tables] (one-hot) or ``Bags`` (multi-hot)."""
        ...


@dataclass(frozen=True, eq=False)  # == on tensors is elementwise, not a bool
class CtrSplit:
    """One split (train or test) of a CTR dataset.

    - ``dense``: float32 ``[N, num_dense]`` (``num_dense`` may be 0);
    - ``ids``: int64 ``[N, num_tables]``, column ``t`` in ``[0, table_sizes[t])``;
    - ``labels``: float32 ``[N]`` in {0, 1} (float so it feeds ``BCEWithLogitsLoss`` as is);
    - ``table_sizes``: rows per table, ``len(table_sizes) == num_tables``;
    - ``bags``: multi-hot data: every sample's bag of ids per table (``ids`` then holds each
      bag's first id); None for one-hot data.

    Construction checks dtypes, shapes and that every id lies inside its table, so a model's
    embedding lookup can never go out of range on data that got this far.
    """

    dense: Tensor
    ids: Tensor
    labels: Tensor
    table_sizes: list[int]
    bags: BagColumns | None = None

    def __post_init__(self) -> None:
        n = self.labels.shape[0] if self.labels.dim() == 1 else -1
        if self.labels.dim() != 1 or self.labels.dtype != torch.float32:
            raise ValueError(f"CtrSplit.labels: need float32 [N], got {self.labels.dtype} {tuple(self.labels.shape)}")
        if self.dense.dim() != 2 or self.dense.dtype != torch.float32 or self.dense.shape[0] != n:
            raise ValueError(
                f"CtrSplit.dense: need float32 [N={n}, num_dense], got {self.dense.dtype} {tuple(self.dense.shape)}"
            )
        if self.ids.dim() != 2 or self.ids.dtype != torch.int64 or self.ids.shape[0] != n:
            raise ValueError(
                f"CtrSplit.ids: need int64 [N={n}, num_tables], got {self.ids.dtype} {tuple(self.ids.shape)}"
            )
        if self.ids.shape[1] != len(self.table_sizes):
            raise ValueError(
                f"CtrSplit: ids have {self.ids.shape[1]} columns but there are {len(self.table_sizes)} table sizes"
            )
        if any(int(s) < 1 for s in self.table_sizes):
            raise ValueError(f"CtrSplit.table_sizes: every table needs at least one row, got {self.table_sizes}")
        object.__setattr__(self, "table_sizes", [int(s) for s in self.table_sizes])
        if n > 0 and self.ids.shape[1] > 0:
            lo, hi = self.ids.min(dim=0).values, self.ids.max(dim=0).values
            bad = ((lo < 0) | (hi >= torch.tensor(self.table_sizes))).nonzero().flatten().tolist()
            if bad:
                t = bad[0]
                raise ValueError(
                    f"CtrSplit.ids: table {t} has ids in [{int(lo[t])}, {int(hi[t])}] outside "
                    f"[0, {self.table_sizes[t]})"
                )
        if self.bags is not None:
            self._check_bags(self.bags, n)
        if n > 0 and not bool(((self.labels == 0) | (self.labels == 1)).all()):
            raise ValueError("CtrSplit.labels: every label must be 0 or 1")

    def _check_bags(self, bags: BagColumns, n: int) -> None:
        if len(bags) != n or bags.num_tables != len(self.table_sizes):
            raise ValueError(
                f"CtrSplit.bags: {len(bags)} samples x {bags.num_tables} tables, expected {n} x {len(self.table_sizes)}"
            )
        if len(bags.values) and int(bags.values.min()) < 0:
            raise ValueError("CtrSplit.bags: negative ids")
        top = bags.max_per_table()
        bad = (top >= torch.tensor(self.table_sizes)).nonzero().flatten().tolist()
        if bad:
            raise ValueError(
                f"CtrSplit.bags: table {bad[0]} has id {int(top[bad[0]])} outside [0, {self.table_sizes[bad[0]]})"
            )

    def __len__(self) -> int:
        return self.labels.shape[0]

    @property
    def num_dense(self) -> int:
        return self.dense.shape[1]

    @property
    def num_tables(self) -> int:
        return self.ids.shape[1]

    def positive_rate(self) -> float:
        """Fraction of label-1 samples (NaN for an empty split)."""
        return float(self.labels.mean()) if len(self) else float("nan")

    def nbytes(self) -> int:
        """Bytes held by the three tensors."""
        bags = self.bags.nbytes() if self.bags is not None else 0
        return bags + sum(t.element_size() * t.nelement() for t in (self.dense, self.ids, self.labels))

    def __getitem__(self, index: int | slice | Tensor) -> tuple[Tensor, Tensor | Bags, Tensor]:
        """``(dense [B, num_dense], ids [B, num_tables] or Bags, labels [B])`` for a slice or
        index tensor (no batch dim for an int; multi-hot data: ``Bags`` of that one sample)."""
        if self.bags is None:
            return self.dense[index], self.ids[index], self.labels[index]
        where = slice(index, index + 1) if isinstance(index, int) else index
        return self.dense[index], self.bags.batch(where), self.labels[index]

    def subset(self, index: slice | Tensor) -> CtrSplit:
        """A new split of the selected samples (views for a slice, copies for an index tensor)."""
        bags = self.bags.subset(index) if self.bags is not None else None
        return CtrSplit(self.dense[index], self.ids[index], self.labels[index], list(self.table_sizes), bags)


def time_split(split: CtrSplit, test_fraction: float) -> tuple[CtrSplit, CtrSplit]:
    """``(train, test)`` with the LAST ``round(N * test_fraction)`` samples as test.

    For data in time order (Criteo's day files, and the lines inside them) this evaluates on
    the future, as a deployed CTR model would be; a random split would leak tomorrow's ids
    and click rates into training and overstate AUC.
    """
    n = len(split)
    n_test = held_out_count(n, test_fraction)
    return split.subset(slice(0, n - n_test)), split.subset(slice(n - n_test, n))


def held_out_count(n: int, test_fraction: float) -> int:
    """How many of ``n`` samples ``time_split`` makes the test split: ``round(n * test_fraction)``,
    neither 0 nor ``n``."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction}: must be strictly between 0 and 1")
    n_test = int(round(n * test_fraction))
    if n_test == 0 or n_test == n:
        raise ValueError(
            f"test_fraction={test_fraction} of {n} samples leaves an empty "
            f"{'test' if n_test == 0 else 'train'} split; use more data or another fraction"
        )
    return n_test
