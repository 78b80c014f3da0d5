"""TorchRec's DLRM-DCNv2 (``torchrec.models.dlrm.DLRM_DCN``) as the oracle of
``model.interaction=dcn``'s forward, at a small shape: the same weights (copied from
ps_train's seeded model into TorchRec's), the same ``KeyedJaggedTensor`` batch (multi-hot,
empty bags, duplicate ids, keys in another order than the tables), the same logits -- from
ps_train's single-process ``DLRM`` and from its server path (the trainer's plan, two servers'
``TableShards``, ``combine``, the interaction and the servers' dense stages).

Without torchrec (CI) every test here is skipped, saying so.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from ps_train.workloads.ctr.cross_network import CrossLayer, CrossSpec, LowRankCrossNet
from ps_train.workloads.ctr.data.jagged import to_bags
from ps_train.workloads.ctr.model import DLRM, dense_stages, interaction
from ps_train.workloads.ctr.tables.plan import BagPlanner, combine
from ps_train.workloads.ctr.tables.rows import FusedLayout
from ps_train.workloads.ctr.tables.shards import TableShards

torchrec = pytest.importorskip(
    "torchrec", reason="torchrec is not installed (the optional `torchrec` extra: README, 'Optional: TorchRec')"
)
from torchrec.models.dlrm import DLRM_DCN  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

SIZES = (50, 9, 400)
NAMES = ("user", "ad", "page")
MAX_BAG = (3, 2, 12)  # ids per bag: 0 up to this
NUM_DENSE, DIM, BOTTOM, TOP, SEED, SERVERS, BATCH = 5, 8, (16,), (12, 6), 3, 2, 16
CROSS = CrossSpec(layers=3, rank=4)


def _kjt(seed: int) -> KeyedJaggedTensor:
    """Multi-hot bags (empty ones too), keyed in another order than the tables."""
    g = torch.Generator().manual_seed(seed)
    order = (2, 0, 1)
    values, lengths = [], []
    for t in order:
        n = torch.randint(0, MAX_BAG[t] + 1, (BATCH,), generator=g)
        lengths.append(n)
        values.append(torch.randint(0, SIZES[t], (int(n.sum()),), generator=g))
    return KeyedJaggedTensor(keys=[NAMES[t] for t in order], values=torch.cat(values), lengths=torch.cat(lengths))


def _torchrec_copy(ours: DLRM) -> Any:
    """TorchRec's DLRM_DCN holding ``ours``' weights."""
    configs = [
        EmbeddingBagConfig(name=f"t{t}", embedding_dim=DIM, num_embeddings=n, feature_names=[NAMES[t]])
        for t, n in enumerate(SIZES)
    ]
    model = DLRM_DCN(
        embedding_bag_collection=EmbeddingBagCollection(tables=configs),
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[*BOTTOM, DIM],
        over_arch_layer_sizes=[*TOP, 1],
        dcn_num_layers=CROSS.layers,
        dcn_low_rank_dim=CROSS.rank,
    )
    cross, head = ours.top[0], ours.top[1]
    assert isinstance(cross, LowRankCrossNet)
    crossnet = model.inter_arch.crossnet
    pairs: list[tuple[Any, Any]] = [
        *zip(model.dense_arch.parameters(), ours.bottom.parameters(), strict=True),
        *zip(model.over_arch.parameters(), head.parameters(), strict=True),
    ]
    for layer, w, v, b in zip(cross.layers, crossnet.W_kernels, crossnet.V_kernels, crossnet.bias, strict=True):
        assert isinstance(layer, CrossLayer)
        pairs += [(w, layer.u), (v, layer.v), (b, layer.bias)]  # TorchRec's W is our U [N, r]
    pairs += [
        (model.sparse_arch.embedding_bag_collection.embedding_bags[f"t{t}"].weight, table.weight)
        for t, table in enumerate(ours.tables)
    ]
    with torch.no_grad():
        for theirs, mine in pairs:
            assert theirs.shape == mine.shape
            theirs.copy_(mine)
    return model


def _server_path(batch: Any, dense: Tensor) -> Tensor:
    """Logits [B] as a trainer computes them, without RPC: two servers' shards of the rows,
    the plan and ``combine``, the interaction, and the dense stages the servers build."""
    layout = FusedLayout("mod", SIZES, SERVERS)
    shards = [TableShards(SIZES, DIM, "mod", s, SERVERS, SEED) for s in range(SERVERS)]
    plan = BagPlanner(layout, DIM, ["sum"] * len(SIZES)).plan(to_bags(batch, NAMES))
    emb = combine(plan, [shard.lookup(*plan.requests[s]) for s, shard in enumerate(shards)])  # [B, T, d]
    bottom, top = dense_stages(NUM_DENSE, len(SIZES), DIM, BOTTOM, TOP, SEED, CROSS)
    return top(interaction(CROSS)(bottom(dense), emb)).squeeze(1)


def test_dcn_forward_equals_torchrecs_dlrm_dcn() -> None:
    ours = DLRM(NUM_DENSE, SIZES, DIM, BOTTOM, TOP, SEED, feature_names=NAMES, cross=CROSS)
    # Not the all-zero start: random biases, so the cross layers' b matters too.
    with torch.no_grad():
        for p in ours.top[0].parameters():
            if p.dim() == 1:
                p.normal_()
    theirs = _torchrec_copy(ours)
    for seed in range(3):
        batch = _kjt(seed)
        dense = torch.randn(BATCH, NUM_DENSE, generator=torch.Generator().manual_seed(100 + seed))
        want = theirs(dense_features=dense, sparse_features=batch).squeeze(1)  # [B]
        with torch.no_grad():
            torch.testing.assert_close(ours(dense, batch), want, atol=1e-5, rtol=1e-5)
    # The server path with the seeded (zero-bias) cross layers, against a TorchRec copy of them.
    fresh = DLRM(NUM_DENSE, SIZES, DIM, BOTTOM, TOP, SEED, feature_names=NAMES, cross=CROSS)
    oracle = _torchrec_copy(fresh)
    batch = _kjt(7)
    dense = torch.randn(BATCH, NUM_DENSE, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = oracle(dense_features=dense, sparse_features=batch).squeeze(1)
        torch.testing.assert_close(_server_path(batch, dense), want, atol=1e-5, rtol=1e-5)
