"""Building blocks that more than one workload's stages use."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["mlp"]


def mlp(sizes: Sequence[int], last_relu: bool) -> nn.Sequential:
    """Linear layers ``sizes[0] -> sizes[1] -> ...`` with ReLU between them (and after the
    last one if ``last_relu``)."""
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(n_in, n_out))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)
