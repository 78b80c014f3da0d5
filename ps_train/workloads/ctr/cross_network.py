"""DCN-v2's cross network with low-rank layers (Wang et al., 2021), DLRM's other interaction.

The input is every feature vector side by side, ``x0 = [x, e_1, ..., e_T]`` flattened to
``[B, N]`` with ``N = (T + 1) d``. Each layer ``l`` crosses the current vector with ``x0``::

    x_{l+1} = x0 * (U_l (V_l x_l) + b_l) + x_l        V_l [r, N], U_l [N, r], b_l [N]

(``*`` elementwise). A full-rank layer would hold an ``N x N`` matrix; the rank-``r`` product
``U_l V_l`` holds ``2 N r`` values, which is what makes the layer affordable at MLPerf
DLRM-DCNv2's width (``N = 27 x 128 = 3456``, ``r = 512``). The output keeps the input's
width, and the top MLP reads it. Initialisation as TorchRec's ``LowRankCrossNet``: U and V
Xavier-normal, ``b`` zero; the draws come from torch's global RNG, so the caller's seed fixes
them (``ps_train.workloads.ctr.model.dense_stages`` builds it seeded, on the server that
hosts the top stage).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["CrossSpec", "CrossLayer", "LowRankCrossNet"]


@dataclass(frozen=True)
class CrossSpec:
    """The cross network's shape: ``layers`` cross layers of rank ``rank``
    (``model.dcn_layers``, ``model.dcn_rank``)."""

    layers: int
    rank: int

    def __post_init__(self) -> None:
        if self.layers < 1:
            raise ValueError(f"model.dcn_layers: {self.layers} must be >= 1 (cross layers of model.interaction=dcn)")
        if self.rank < 1:
            raise ValueError(f"model.dcn_rank: {self.rank} must be >= 1 (the rank of each cross layer's U V)")


class CrossLayer(nn.Module):
    """One low-rank cross layer of width ``width``: ``x0 * (U (V x) + b) + x``."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.v = nn.Parameter(nn.init.xavier_normal_(torch.empty(rank, width)))  # [r, N]: N -> r
        self.u = nn.Parameter(nn.init.xavier_normal_(torch.empty(width, rank)))  # [N, r]: r -> N
        self.bias = nn.Parameter(torch.zeros(width))  # [N]

    def forward(self, x0: Tensor, x: Tensor) -> Tensor:
        """x0, x [B, N] -> [B, N]."""
        return x0 * F.linear(F.linear(x, self.v), self.u, self.bias) + x


class LowRankCrossNet(nn.Module):
    """``spec.layers`` cross layers over inputs ``[B, width]``; the output is ``[B, width]``."""

    def __init__(self, width: int, spec: CrossSpec) -> None:
        super().__init__()
        if width < 1:
            raise ValueError(f"cross network width {width}: must be >= 1")
        self.width = width
        self.layers = nn.ModuleList(CrossLayer(width, spec.rank) for _ in range(spec.layers))

    def forward(self, x0: Tensor) -> Tensor:
        x = x0
        for layer in self.layers:
            x = layer(x0, x)
        return x
