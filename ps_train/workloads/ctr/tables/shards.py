"""A server's shards of the embedding tables, fused: built in seeded blocks, one storage for
all of them, pooled in one gather.

Server ``s`` of ``S`` holds, for every table ``t``, the rows ``RowSharding(kind, rows_t, S)``
gives it, one table after another in one float32 parameter ``[sum_t rows_of(s), dim]``
(``FusedLayout.row_offsets``: where each table starts). ``lookup`` answers a trainer's
``ServerRequest`` (``ps_train.workloads.ctr.tables.plan``) for every table at once with one
``F.embedding_bag``; its backward turns the gradients of the answer's vectors into one
sparse gradient of the storage with every touched row once (``rows_gradient``), so the
update is one optimizer step over those rows, whatever the number of tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ps_train.workloads.ctr.tables.rows import INIT_BLOCK, FusedLayout, init_rows

__all__ = ["TableShards", "rows_gradient", "bag_offsets"]


def bag_offsets(rows: Tensor, offsets: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """A ``ServerRequest``'s bags as ``F.embedding_bag`` takes them: offsets int64 [P] of
    every bag (each single row its own), and per-row weights [N] (1 for the single rows) or
    None."""
    n = len(rows)
    singles = int(offsets[0]) if len(offsets) else n
    full = torch.cat([torch.arange(singles, dtype=torch.int64), offsets]) if len(offsets) else torch.arange(n)
    if weights is None:
        return full, None
    return full, torch.cat([torch.ones(singles, dtype=weights.dtype), weights])


def rows_gradient(rows: Tensor, offsets: Tensor, weights: Tensor | None, grad: Tensor, num_rows: int) -> Tensor:
    """The gradient of a storage of ``num_rows`` rows from the gradient ``grad`` [P, d] of
    ``embedding_bag(rows, storage, offsets, per_sample_weights=weights)``: a coalesced sparse
    COO tensor whose indices are the distinct ``rows`` (sorted) and whose values [U, d] sum
    each row's weighted bag gradients. Computed as one more ``embedding_bag``, over the bags'
    gradients grouped by row, so nothing of size [N, d] is made."""
    n, P = len(rows), len(offsets)
    lengths = torch.diff(offsets, append=torch.tensor([n]))
    bag_of = torch.repeat_interleave(torch.arange(P), lengths)  # [N]
    # Rows all distinct (single rows, as a dynamic table's slots come, in no order): one
    # sort gives the distinct rows and the order grouping them (``argsort(inverse)`` is
    # the sort's permutation then), where ``unique`` and a stable ``argsort`` take two.
    # NumPy's sort of int64 is ~4x torch's; without ties any sort gives the same order.
    order = torch.from_numpy(np.argsort(rows.contiguous().numpy()))
    ranked = rows[order]
    if n < 2 or bool((ranked[1:] != ranked[:-1]).all()):
        unique, starts = ranked, torch.arange(n)
    else:
        unique, inverse = torch.unique(rows, return_inverse=True)  # [U], [N]
        order = torch.argsort(inverse, stable=True)  # rows grouped, each group in request order
        counts = torch.bincount(inverse, minlength=len(unique))
        starts = torch.zeros_like(counts)
        if len(counts) > 1:
            torch.cumsum(counts[:-1], 0, out=starts[1:])
    w = weights[order] if weights is not None else None
    values = F.embedding_bag(bag_of[order], grad, starts, mode="sum", per_sample_weights=w)  # [U, d]
    return torch.sparse_coo_tensor(
        unique.unsqueeze(0), values, (num_rows, grad.shape[1]), is_coalesced=True, check_invariants=False
    )


class _PooledLookup(torch.autograd.Function):
    """``embedding_bag`` over the storage whose backward is ``rows_gradient``."""

    @staticmethod
    def forward(ctx: Any, storage: Tensor, rows: Tensor, offsets: Tensor, weights: Tensor | None) -> Tensor:
        ctx.save_for_backward(rows, offsets, weights)
        ctx.num_rows = storage.shape[0]
        return F.embedding_bag(rows, storage, offsets, mode="sum", per_sample_weights=weights)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        rows, offsets, weights = ctx.saved_tensors
        return rows_gradient(rows, offsets, weights, grad.contiguous(), ctx.num_rows), None, None, None


class TableShards(nn.Module):
    """Server ``server``'s rows of every table, in one parameter ``weight`` [rows, dim]."""

    def __init__(
        self,
        table_sizes: Sequence[int],
        dim: int,
        kind: str,
        server: int,
        num_servers: int,
        seed: int,
        dynamic_rows: Sequence[int] = (),
    ) -> None:
        super().__init__()
        self.dim = dim
        self.server = server
        self.layout = FusedLayout(kind, tuple(int(n) for n in table_sizes), num_servers, tuple(dynamic_rows))
        self.row_offsets = self.layout.row_offsets(server)  # [T + 1]
        weight = torch.empty(self.layout.storage_rows(server), dim)
        weight[self.row_offsets[-1] :] = 0  # the default row of ids without one (dynamic tables)
        # Table by table, block by block: the storage is the only large allocation.
        for t, (n, sh) in enumerate(zip(table_sizes, self.layout.shardings(), strict=True)):
            first = self.row_offsets[t]
            if self.layout.is_dynamic(
                t
            ):  # slots get their rows when ids arrive (ps_train.workloads.ctr.tables.dynamic)
                weight[first : self.row_offsets[t + 1]] = 0
                continue
            for start in range(0, sh.rows_of(server), INIT_BLOCK):
                stop = min(sh.rows_of(server), start + INIT_BLOCK)
                weight[first + start : first + stop] = init_rows(seed, t, n, dim, sh.global_ids(server, start, stop))
        self.weight = nn.Parameter(weight)

    @property
    def num_tables(self) -> int:
        return len(self.row_offsets) - 1

    def table(self, t: int) -> Tensor:
        """Table ``t``'s rows here, [rows_of(server), dim]: a view of the storage."""
        return self.weight.detach()[self.row_offsets[t] : self.row_offsets[t + 1]]

    def _checked(self, rows: Tensor, offsets: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor | None]:
        n = len(rows)
        if rows.dtype != torch.int64 or rows.dim() != 1 or offsets.dtype != torch.int64 or offsets.dim() != 1:
            raise ValueError(
                f"a lookup needs int64 rows [N] and offsets [P], got {rows.dtype} "
                f"{tuple(rows.shape)} and {offsets.dtype} {tuple(offsets.shape)}"
            )
        if n and (int(rows.min()) < 0 or int(rows.max()) >= self.weight.shape[0]):
            raise IndexError(
                f"ps{self.server}: rows outside this server's {self.weight.shape[0]} rows of "
                f"{self.num_tables} tables (range {int(rows.min())}..{int(rows.max())})"
            )
        if len(offsets) and (int(offsets[0]) < 0 or int(offsets[-1]) > n or bool((offsets[1:] < offsets[:-1]).any())):
            raise ValueError(f"ps{self.server}: pooled bag offsets must be nondecreasing within 0..{n}")
        singles = int(offsets[0]) if len(offsets) else n
        if weights is not None and (weights.dim() != 1 or len(weights) != n - singles):
            raise ValueError(f"ps{self.server}: {tuple(weights.shape)} weights for {n - singles} pooled rows")
        return bag_offsets(rows, offsets, weights)

    def lookup(self, rows: Tensor, offsets: Tensor, weights: Tensor | None) -> Tensor:
        """One vector per single row and per pooled bag of a ``ServerRequest``: [P, dim].
        Its backward leaves one coalesced sparse gradient of ``weight`` (the touched rows)."""
        full, w = self._checked(rows, offsets, weights)
        return _PooledLookup.apply(self.weight, rows, full, w)

    def read(self, rows: Tensor, offsets: Tensor, weights: Tensor | None) -> Tensor:
        """``lookup`` without autograd, for evaluation."""
        full, w = self._checked(rows, offsets, weights)
        with torch.no_grad():
            return F.embedding_bag(rows, self.weight, full, mode="sum", per_sample_weights=w)

    def nbytes(self) -> int:
        """Bytes of the table values held here (not counting optimizer state)."""
        return self.weight.numel() * self.weight.element_size()
