"""Multi-hot bags for the synthetic CTR data (``data.bag_sizes``, ``data.bag_size_dist``,
``data.id_weights``), as MLPerf DLRM-v2's multi-hot Criteo: each table's bag holds a fixed
number of ids, or a number drawn uniformly from ``1 .. bag_sizes[t]``, each id drawn from
the table's power law like a one-hot id, optionally with a weight in (0, 1].

The first id of every bag is the one-hot data's id (drawn from the same stream), so turning
bags on only adds ids; the rest come from a stream of their own. The hidden model sees a
bag through the weighted mean of its ids' effects (``NumpyBags.pool``), so a bag's signal
does not grow with its length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ps_train.config import BAG_SIZE_DISTS
from ps_train.workloads.ctr.data.bags import BagColumns

__all__ = ["BagShape", "NumpyBags", "draw_bags", "concat_columns"]


@dataclass(frozen=True)
class BagShape:
    """How many ids each table's bags hold: ``sizes[t]`` exactly (``fixed``) or uniformly
    ``1 .. sizes[t]`` (``uniform``); ``weighted``: a weight per id."""

    sizes: tuple[int, ...]
    dist: str = "fixed"
    weighted: bool = False

    def __post_init__(self) -> None:
        if any(s < 1 for s in self.sizes):
            raise ValueError(f"bag sizes {list(self.sizes)}: every table's bags need at least 1 id")
        if self.dist not in BAG_SIZE_DISTS:
            raise ValueError(f"bag size distribution {self.dist!r}: choose one of {list(BAG_SIZE_DISTS)}")

    @staticmethod
    def of(sizes: Sequence[int], num_tables: int, dist: str = "fixed", weighted: bool = False) -> BagShape:
        """``sizes``: [] (one id per table), one size for every table, or one per table."""
        if len(sizes) not in (0, 1, num_tables):
            raise ValueError(
                f"bag sizes {list(sizes)}: give none (one-hot), one for every table, or one per table ({num_tables})"
            )
        full = [1] * num_tables if not sizes else [int(sizes[0])] * num_tables if len(sizes) == 1 else list(sizes)
        return BagShape(tuple(full), dist, weighted)

    @property
    def multi_hot(self) -> bool:
        """Whether any bag can hold more than one id, or ids carry weights."""
        return self.weighted or any(s > 1 for s in self.sizes)


@dataclass
class NumpyBags:
    """``n`` samples' bags, per table: ``ids[t]`` int64 [n, L_t] (valid: the first
    ``lengths[t]`` of each row), ``lengths[t]`` int64 [n], ``weights[t]`` float32 [n, L_t]."""

    ids: list[np.ndarray]
    lengths: list[np.ndarray]
    weights: list[np.ndarray] | None

    def _valid(self, t: int) -> np.ndarray:
        return np.arange(self.ids[t].shape[1]) < self.lengths[t][:, None]  # [n, L_t]

    def pool(self, t: int, per_id: np.ndarray) -> np.ndarray:
        """The weighted mean over each bag of table ``t`` of ``per_id`` ([n, L_t] or
        [n, L_t, K], float64): [n] or [n, K]."""
        w = self._valid(t).astype(np.float64)
        if self.weights is not None:
            w = w * self.weights[t]
        if per_id.ndim == 3:
            return (per_id * w[:, :, None]).sum(axis=1) / w.sum(axis=1)[:, None]
        return (per_id * w).sum(axis=1) / w.sum(axis=1)

    def take(self, m: int) -> NumpyBags:
        """The first ``m`` samples."""
        return NumpyBags(
            [a[:m] for a in self.ids],
            [a[:m] for a in self.lengths],
            [a[:m] for a in self.weights] if self.weights is not None else None,
        )

    def to_columns(self) -> BagColumns:
        """Sample-major ``BagColumns`` (int32 ids). Each table's ids are scattered to their
        places one table at a time, so the work arrays are one table's ``[n, L_t]``, never
        ``[n, T, max L]`` (MLPerf's shape: 214 ids a sample, but 26 x 100 slots)."""
        n, T = len(self.lengths[0]), len(self.ids)
        lengths = np.stack(self.lengths, axis=1).reshape(-1)  # [n * T], sample-major
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.empty(int(offsets[-1]), dtype=np.int32)
        weights = np.empty(int(offsets[-1]), dtype=np.float32) if self.weights is not None else None
        for t, a in enumerate(self.ids):
            valid = self._valid(t)  # [n, L_t]
            places = offsets[np.arange(n) * T + t][:, None] + np.arange(a.shape[1])  # [n, L_t]
            values[places[valid]] = a[valid]
            if weights is not None and self.weights is not None:
                weights[places[valid]] = self.weights[t][valid]
        w = torch.from_numpy(weights) if weights is not None else None
        return BagColumns(torch.from_numpy(values), torch.from_numpy(offsets), w, T)

    @staticmethod
    def from_columns(cols: BagColumns) -> NumpyBags:
        """The bags of ``cols``, per table (for the hidden model's probabilities of a split)."""
        n, T = len(cols), cols.num_tables
        offsets = cols.offsets.numpy()
        values = cols.values.numpy().astype(np.int64)
        weights = cols.weights.numpy() if cols.weights is not None else None
        ids, lengths, ws = [], [], []
        for t in range(T):
            starts = offsets[np.arange(n) * T + t]
            lens = offsets[np.arange(n) * T + t + 1] - starts
            width = max(int(lens.max()) if n else 1, 1)
            pos = np.minimum(starts[:, None] + np.arange(width), max(len(values) - 1, 0))
            valid = np.arange(width) < lens[:, None]
            ids.append(np.where(valid, values[pos], 0) if len(values) else np.zeros((n, width), np.int64))
            lengths.append(lens)
            if weights is not None:
                ws.append(np.where(valid, weights[pos], 0).astype(np.float32))
        return NumpyBags(ids, lengths, ws if weights is not None else None)


def draw_bags(
    first: np.ndarray, shape: BagShape, rng: np.random.Generator, draw_ids: Callable[[int, np.ndarray], np.ndarray]
) -> NumpyBags:
    """Bags for ``n`` samples whose first ids are ``first`` (int64 [n, T]); the rest from
    ``rng``: ``draw_ids(t, u)`` maps uniforms ``u`` to table ``t``'s ids (its power law)."""
    n, T = first.shape
    ids, lengths, weights = [], [], []
    for t in range(T):
        size = shape.sizes[t]
        if shape.dist == "fixed" or size == 1:
            lens = np.full(n, size, dtype=np.int64)
        else:
            lens = np.minimum(1 + np.floor(rng.random(n) * size).astype(np.int64), size)
        a = np.empty((n, size), dtype=np.int64)
        a[:, 0] = first[:, t]
        if size > 1:
            a[:, 1:] = draw_ids(t, rng.random((n, size - 1)))
        ids.append(a)
        lengths.append(lens)
        if shape.weighted:
            weights.append((1.0 - rng.random((n, size))).astype(np.float32))  # (0, 1]
    return NumpyBags(ids, lengths, weights if shape.weighted else None)


def concat_columns(parts: list[BagColumns], num_tables: int) -> BagColumns:
    """The samples of ``parts`` one after another, as one ``BagColumns``."""
    lengths = torch.cat([p.offsets[1:] - p.offsets[:-1] for p in parts])
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    weights = [p.weights for p in parts if p.weights is not None]
    return BagColumns(
        torch.cat([p.values for p in parts]), offsets, torch.cat(weights) if weights else None, num_tables
    )
