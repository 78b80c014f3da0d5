"""Half-precision table rows (``model.table_dtype=float16|bfloat16``): stochastic rounding.

Rows are stored in half precision; an update computes in float32 (the optimizer state stays
float32) and rounds the new row back *stochastically*, as FBGEMM's half-precision tables
do: a value between two representable neighbours ``lo < x < hi`` becomes ``hi`` with
probability ``(x - lo) / (hi - lo)``, so the rounding is unbiased (its mean is ``x``) and
small updates, which round-to-nearest would lose below half an ulp, still move the row
on average.

``HalfRows`` is what a rows optimizer updates through (``RowTarget``): float32 copies of
the rows out, rounded rows back. Its random numbers come from a generator the storage seeds
per step, so a run is reproducible and a resumed run draws what the uninterrupted one drew.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["stochastic_round", "chunk_rows", "HalfRows", "TABLE_DTYPES"]

TABLE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def stochastic_round(x: Tensor, dtype: torch.dtype, generator: torch.Generator) -> Tensor:
    """``x`` (float32) in ``dtype``, each value rounded up or down at random with the
    probabilities that make the result's mean ``x``."""
    # In place where it can be: a table server rounds a step's rows at once (~100 K rows of
    # 128 values, 50 MB per float32 temporary), and each temporary counted in its peak RSS.
    near = x.to(dtype)  # round to nearest
    gap = near.float()
    torch.sub(x, gap, out=gap)  # x - near: how far the nearest value is off, and in which direction
    toward = torch.full_like(near, -torch.inf).masked_fill_(gap > 0, torch.inf)
    other = torch.nextafter(near, toward)  # the neighbour on x's other side
    del toward
    step = other.float().sub_(near)  # same sign as gap (or gap == 0)
    # In [0, 1/2]; where gap == 0 it is 0 or NaN (0 / 0), and u < p is false either way.
    p = gap.div_(step)
    del step
    u = torch.rand(x.shape, generator=generator)
    return torch.where(u.lt_(p).bool(), other, near)


def chunk_rows(values: Tensor) -> int:
    """How many rows of ``values`` [rows, ...] an update takes at a time: about 128 K values,
    so a float32 temporary (512 KiB) stays under a table server's mmap threshold (1 MiB,
    ``ps_train.launch.rank``) and the next slice reuses its memory instead of faulting in
    fresh pages."""
    return max(1, (1 << 17) // max(1, math.prod(values.shape[1:])))


class HalfRows:
    """Rows of ``values`` ([rows, dim] in a half dtype) as a rows optimizer's target:
    ``index_select`` gives float32 rows, ``index_add_`` adds in float32 and stores the sum
    stochastically rounded (``index`` holds each row once, as a coalesced gradient's rows)."""

    def __init__(self, values: Tensor, generator: torch.Generator) -> None:
        self.values, self.generator = values, generator

    def index_select(self, dim: int, index: Tensor) -> Tensor:
        return self.values.index_select(dim, index).float()

    def index_add_(self, dim: int, index: Tensor, source: Tensor, *, alpha: float = 1) -> Tensor:
        # A slice of the rows at a time: the float32 copies and the rounding's temporaries of
        # a step's ~100 K rows would be hundreds of MB at once. The random numbers are drawn
        # in the same order as for all rows at once (slices follow each other), so the rows
        # round alike.
        n = chunk_rows(self.values)
        for at in range(0, len(index), n):
            part = index[at : at + n]
            rows = self.values.index_select(dim, part).float()
            rows.add_(source.narrow(dim, at, len(part)), alpha=alpha)
            self.values.index_copy_(dim, part, stochastic_round(rows, self.values.dtype, self.generator))
        return self.values
