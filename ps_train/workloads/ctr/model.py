"""A DLRM-style click-through-rate model (Naumov et al., 2019), as plain nn.Modules.

    dense  [B, num_dense] -> bottom MLP -> x [B, d]
    ids    [B, T] or bags  -> one pooled embedding per table -> e [B, T, d]
    z = interact(x, e)     model.interaction=dot: [B, d + (T + 1) T / 2]: x, and the dot
                           product of every pair of the T + 1 vectors (x and the T
                           embeddings), strict lower triangle
    z = concat_features(x, e)   model.interaction=dcn: [B, (T + 1) d], the T + 1 vectors
                           side by side, which the top stage's cross layers take first
                           (``cross_network``)
    logit = top stage(z)   [B]; loss: binary cross-entropy with logits

No RPC here: ``DLRM`` is the single-process model (each table an
``nn.EmbeddingBag(mode=pooling[t], sparse=True)``: one id per bag for one-hot data, as
Criteo's features are single-valued, a bag of ids for multi-hot ``Bags``), which
distributed runs are checked against; the distributed run keeps the
same ``bottom`` and ``top`` modules (``dense_stages``: the servers build them
from the config like any model's stages) and splits each table by rows across servers
(``ps_train.workloads.ctr.tables.rows``), initialised to the same values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ps_train.config import DLRMConfig
from ps_train.layers import mlp
from ps_train.workloads.ctr.cross_network import CrossSpec, LowRankCrossNet
from ps_train.workloads.ctr.data.bags import Bags
from ps_train.workloads.ctr.data.jagged import KeyedJagged, to_bags
from ps_train.workloads.ctr.tables.rows import init_rows

__all__ = [
    "interact",
    "concat_features",
    "interaction",
    "interaction_size",
    "cross_spec",
    "top_stage",
    "dense_stages",
    "DLRM",
]


def interaction_size(num_tables: int, dim: int, cross: CrossSpec | None = None) -> int:
    """Width of DLRM's interaction, what the top stage reads. Dot (``cross`` None,
    ``interact``): the dense vector and one dot product per pair of the T + 1 vectors (it and
    the T embeddings). DCN (``concat_features``): the T + 1 vectors side by side, which the
    cross layers keep at that width."""
    f = num_tables + 1
    if cross is not None:
        return f * dim
    return dim + f * (f - 1) // 2


def cross_spec(cfg: DLRMConfig) -> CrossSpec | None:
    """The cross network ``model.interaction=dcn`` puts in the top stage (None: dot)."""
    return CrossSpec(cfg.dcn_layers, cfg.dcn_rank) if cfg.interaction == "dcn" else None


def top_stage(num_tables: int, dim: int, top: Sequence[int], cross: CrossSpec | None) -> nn.Sequential:
    """DLRM's stage after the interaction: the top MLP ``[B, z] -> [B, 1]``, preceded, for
    DCN, by the cross network ``[B, z] -> [B, z]`` (its parameters are dense, so they live
    and train with the top MLP on its server). Draws from torch's global RNG."""
    width = interaction_size(num_tables, dim, cross)
    head = mlp([width, *top, 1], last_relu=False)
    if cross is None:
        return head
    return nn.Sequential(LowRankCrossNet(width, cross), head)


def dense_stages(
    num_dense: int,
    num_tables: int,
    dim: int,
    bottom: Sequence[int],
    top: Sequence[int],
    seed: int,
    cross: CrossSpec | None = None,
) -> list[nn.Sequential]:
    """``[bottom MLP, top stage]``, initialised exactly as ``DLRM(..., seed, cross=cross)``
    initialises them, without touching the caller's RNG: the dense stages a distributed run
    places on servers."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return [
            mlp([num_dense, *bottom, dim], last_relu=True),  # [B, num_dense] -> [B, dim]
            top_stage(num_tables, dim, top, cross),  # [B, z] -> [B, 1]
        ]


def interact(x: Tensor, emb: Tensor) -> Tensor:
    """DLRM's dot interaction: x [B, d], emb [B, T, d] -> [B, d + (T + 1) T / 2]."""
    feats = torch.cat([x.unsqueeze(1), emb], dim=1)  # [B, T + 1, d]
    dots = torch.bmm(feats, feats.transpose(1, 2))  # [B, T + 1, T + 1]
    f = feats.shape[1]
    rows, cols = torch.tril_indices(f, f, offset=-1)
    return torch.cat([x, dots[:, rows, cols]], dim=1)


def concat_features(x: Tensor, emb: Tensor) -> Tensor:
    """DCN's input: x [B, d], emb [B, T, d] -> [B, (T + 1) d], x first, then table by table
    (TorchRec's ``InteractionDCNArch`` order); the cross layers live in the top stage."""
    return torch.cat([x.unsqueeze(1), emb], dim=1).flatten(1)


def interaction(cross: CrossSpec | None) -> Callable[[Tensor, Tensor], Tensor]:
    """What runs between the bottom MLP and the top stage, on the trainer (no parameters):
    ``interact`` for dot, ``concat_features`` when the top stage starts with cross layers."""
    return interact if cross is None else concat_features


class DLRM(nn.Module):
    """The whole model in one process. ``bottom``/``top`` are built from ``seed`` (torch's
    default initialisation); table ``t`` holds ``init_rows(seed, t, ...)`` and pools its bags
    by ``pooling[t]`` (``sum`` if not given). ``cross``: DCN-v2 cross layers as the
    interaction (``top`` then starts with them), else the dot interaction."""

    def __init__(
        self,
        num_dense: int,
        table_sizes: Sequence[int],
        dim: int,
        bottom: Sequence[int],
        top: Sequence[int],
        seed: int,
        pooling: Sequence[str] | None = None,
        feature_names: Sequence[str] | None = None,
        cross: CrossSpec | None = None,
    ) -> None:
        super().__init__()
        # What each table's feature is called in KeyedJagged batches (ps_train.workloads.ctr.data.jagged).
        self.feature_names = list(feature_names) if feature_names else [f"f{t}" for t in range(len(table_sizes))]
        torch.manual_seed(seed)
        self.bottom = mlp([num_dense, *bottom, dim], last_relu=True)
        self.top = top_stage(len(table_sizes), dim, top, cross)
        self.interact = interaction(cross)
        self.tables = nn.ModuleList()
        modes = list(pooling) if pooling else ["sum"] * len(table_sizes)
        for t, rows in enumerate(table_sizes):
            bag = nn.EmbeddingBag(rows, dim, mode=modes[t], sparse=True)
            with torch.no_grad():
                bag.weight.copy_(init_rows(seed, t, rows, dim, torch.arange(rows)))
            self.tables.append(bag)

    def table_weights(self) -> list[nn.Parameter]:
        """Each table's rows, [rows_t, dim], in table order."""
        return [
            bag.weight
            for bag in self.tables
            if isinstance(bag, nn.EmbeddingBag) and isinstance(bag.weight, nn.Parameter)
        ]

    def forward(self, dense: Tensor, ids: Tensor | Bags | KeyedJagged | Any) -> Tensor:
        """dense [B, num_dense] float, ids [B, T] int64, ``Bags``, or a ``KeyedJagged`` /
        TorchRec ``KeyedJaggedTensor`` keyed by ``feature_names`` -> logits [B]."""
        x = self.bottom(dense)
        bags = to_bags(ids, self.feature_names)
        emb = torch.stack([bag(*bags.table(t)) for t, bag in enumerate(self.tables)], dim=1)  # [B, T, d]
        return self.top(self.interact(x, emb)).squeeze(1)
