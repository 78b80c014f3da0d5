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

import torch
from torch import Tensor

__all__ = ["stochastic_round", "HalfRows", "TABLE_DTYPES"]

TABLE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def stochastic_round(x: Tensor, dtype: torch.dtype, generator: torch.Generator) -> Tensor:
    """``x`` (float32) in ``dtype``, each value rounded up or down at random with the
    probabilities that make the result's mean ``x``."""
    near = x.to(dtype)  # round to nearest
    gap = x - near.float()  # [...]: how far the nearest value is off, and in which direction
    toward = torch.where(gap > 0, torch.inf, -torch.inf).to(dtype)
    other = torch.nextafter(near, toward)  # the neighbour on x's other side
    step = other.float() - near.float()  # same sign as gap (or gap == 0)
    p = torch.where(gap == 0, torch.zeros_like(gap), gap / step)  # in [0, 1/2]
    u = torch.rand(x.shape, generator=generator)
    return torch.where(u < p, other, near)


class HalfRows:
    """Rows of ``values`` ([rows, dim] in a half dtype) as a rows optimizer's target:
    ``index_select`` gives float32 rows, ``index_add_`` adds in float32 and stores the sum
    stochastically rounded (``index`` holds each row once, as a coalesced gradient's rows)."""

    def __init__(self, values: Tensor, generator: torch.Generator) -> None:
        self.values, self.generator = values, generator

    def index_select(self, dim: int, index: Tensor) -> Tensor:
        return self.values.index_select(dim, index).float()

    def index_add_(self, dim: int, index: Tensor, source: Tensor, *, alpha: float = 1) -> Tensor:
        rows = self.values.index_select(dim, index).float().add_(source, alpha=alpha)
        self.values.index_copy_(dim, index, stochastic_round(rows, self.values.dtype, self.generator))
        return self.values
