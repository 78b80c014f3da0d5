"""KeyedJagged batches (TorchRec's KeyedJaggedTensor fields) for model=dlrm.

Oracles: the same batch as ``Bags`` (itself checked against ``nn.EmbeddingBag`` in
test_dlrm.py) and, when torchrec is installed, TorchRec's own ``EmbeddingBagCollection``.
"""

from __future__ import annotations

import pytest
import torch

from ps_train.config import ConfigError
from ps_train.workloads.ctr.data.bags import Bags
from ps_train.workloads.ctr.data.jagged import KeyedJagged, is_keyed_jagged, keyed_jagged, to_bags
from ps_train.workloads.ctr.model import DLRM
from ps_train.workloads.ctr.tables.plan import BagPlanner
from ps_train.workloads.ctr.tables.rows import FusedLayout
from tests.ps_train._app import make_cfg

SIZES = (30, 7, 200)
NAMES = ["user", "ad", "page"]


def _bags(seed: int = 0, batch: int = 6, weighted: bool = True) -> Bags:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(SIZES) * batch,), generator=g)  # empty bags too
    table = torch.arange(len(SIZES)).repeat_interleave(batch).repeat_interleave(lengths)
    sizes = torch.tensor(SIZES)[table]
    values = (torch.rand(len(table), generator=g) * sizes).long()
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    weights = torch.rand(len(values), generator=g) if weighted else None
    return Bags(values, offsets, weights, len(SIZES))


def _model() -> DLRM:
    return DLRM(4, SIZES, 3, [5], [5], seed=1, feature_names=NAMES)


def test_keys_in_any_order_give_the_bags_of_the_tables() -> None:
    bags = _bags()
    kjt = KeyedJagged.from_bags(bags, NAMES)
    same = kjt.to_bags(NAMES)
    assert torch.equal(same.values, bags.values) and torch.equal(same.offsets, bags.offsets)
    # The same features with their keys in another order (each key's block moved as a whole).
    order = [2, 0, 1]
    B, off = bags.batch_size, bags.offsets
    blocks = [(int(off[t * B]), int(off[(t + 1) * B])) for t in order]
    assert bags.weights is not None
    shuffled = KeyedJagged(
        tuple(NAMES[t] for t in order),
        torch.cat([bags.values[lo:hi] for lo, hi in blocks]),
        torch.cat([bags.lengths()[t * B : (t + 1) * B] for t in order]),
        torch.cat([bags.weights[lo:hi] for lo, hi in blocks]),
    )
    back = shuffled.to_bags(NAMES)
    assert torch.equal(back.values, bags.values) and torch.equal(back.offsets, bags.offsets)
    assert back.weights is not None and torch.equal(back.weights, bags.weights)
    from_offsets = KeyedJagged.from_offsets(NAMES, bags.values, bags.offsets, bags.weights)
    assert torch.equal(from_offsets.lengths, bags.lengths())


def test_dlrm_takes_keyed_jagged_batches_as_its_bags() -> None:
    model = _model()
    bags = _bags(weighted=True)
    dense = torch.randn(bags.batch_size, 4)
    want = model(dense, bags)
    got = model(dense, KeyedJagged.from_bags(bags, NAMES))
    assert torch.equal(got, want)
    # The distributed trainer plans the same requests from either form.
    planner = BagPlanner(FusedLayout("mod", SIZES, 2), 3, ["sum"] * 3)
    a, b = planner.plan(bags), planner.plan(to_bags(KeyedJagged.from_bags(bags, NAMES), NAMES))
    for ra, rb in zip(a.requests, b.requests, strict=True):
        assert torch.equal(ra.rows, rb.rows) and torch.equal(ra.offsets, rb.offsets)


def test_bad_keyed_jagged_batches_say_what_is_wrong() -> None:
    bags = _bags()
    with pytest.raises(ValueError, match=r"missing \['page'\], not a table's \['pages'\]"):
        KeyedJagged.from_bags(bags, ["user", "ad", "pages"]).to_bags(NAMES)
    with pytest.raises(ValueError, match=r"lengths add up to"):
        KeyedJagged(("a",), torch.arange(3), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"distinct feature names"):
        KeyedJagged(("a", "a"), torch.arange(2), torch.tensor([1, 1]))
    with pytest.raises(TypeError, match=r"need a KeyedJagged or torchrec's KeyedJaggedTensor, got dict"):
        keyed_jagged({})
    assert not is_keyed_jagged(bags)
    with pytest.raises(ConfigError, match=r"model.feature_names: \['a'\] must name each of the 8 tables' feature"):
        make_cfg("model=dlrm", "data=synthetic_ctr", "model.feature_names=[a]")


def test_torchrec_keyed_jagged_tensors_match_its_embedding_bag_collection() -> None:
    torchrec = pytest.importorskip(
        "torchrec", reason="torchrec is not installed (optional extra: README, 'Optional: TorchRec')"
    )
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    model = _model()
    bags = _bags()
    ours = KeyedJagged.from_bags(bags, NAMES)
    kjt = torchrec.KeyedJaggedTensor(keys=NAMES, values=bags.values, lengths=bags.lengths(), weights=bags.weights)
    assert is_keyed_jagged(kjt)
    theirs = keyed_jagged(kjt)
    assert theirs.keys == ours.keys and torch.equal(theirs.values, ours.values)
    configs = [
        EmbeddingBagConfig(
            name=f"t{t}", embedding_dim=3, num_embeddings=n, feature_names=[NAMES[t]], pooling=PoolingType.SUM
        )
        for t, n in enumerate(SIZES)
    ]
    ebc = torchrec.EmbeddingBagCollection(tables=configs, is_weighted=True, device=torch.device("cpu"))
    with torch.no_grad():
        for t, w in enumerate(model.table_weights()):
            ebc.embedding_bags[f"t{t}"].weight.copy_(w)
    pooled = ebc(kjt).to_dict()
    bags_again = to_bags(kjt, NAMES)
    for t, bag in enumerate(model.tables):
        torch.testing.assert_close(bag(*bags_again.table(t)), pooled[NAMES[t]], rtol=0, atol=1e-6)
