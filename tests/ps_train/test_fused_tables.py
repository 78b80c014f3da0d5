"""Fused table storage, multi-hot bags pooled on the servers that own their rows, and the
trainer's plan (ps_train.workloads.ctr.data.bags, plan, shards) against single-process ``nn.EmbeddingBag``
tables and against the per-table path (one ``F.embedding`` and one torch optimizer per table)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ps_train.config import ConfigError, DLRMConfig
from ps_train.workloads.ctr.data.bags import BagColumns, Bags
from ps_train.workloads.ctr.data.synthetic import SyntheticCtr, synthetic_ctr
from ps_train.workloads.ctr.data.synthetic_bags import BagShape
from ps_train.workloads.ctr.model import DLRM
from ps_train.workloads.ctr.tables.optimizers import RowsAdagrad
from ps_train.workloads.ctr.tables.plan import BagPlanner, combine
from ps_train.workloads.ctr.tables.rows import FusedLayout
from ps_train.workloads.ctr.tables.shards import TableShards, rows_gradient
from tests.ps_train._app import make_cfg

SIZES = [40, 7, 5000]


def _grad(t: torch.Tensor) -> torch.Tensor:
    assert t.grad is not None
    return t.grad


def _servers(kind: str, S: int, dim: int = 4) -> tuple[list[TableShards], BagPlanner]:
    shards = [TableShards(SIZES, dim, kind, s, S, seed=1) for s in range(S)]
    return shards, BagPlanner(FusedLayout(kind, tuple(SIZES), S), dim, ["sum"] * len(SIZES))


def _batch(shape: BagShape | None, n: int = 64) -> Bags | torch.Tensor:
    train, _, _ = synthetic_ctr(600, 5, SIZES, 1.05, 0, 0.1, bag_shape=shape)
    return train[slice(0, n)][1]


@pytest.mark.parametrize("kind", ["range", "mod"])
@pytest.mark.parametrize("servers", [1, 2, 3])
@pytest.mark.parametrize("case", ["one-hot", "weighted-sum", "mean"])
def test_pooled_lookups_equal_embedding_bags(kind: str, servers: int, case: str) -> None:
    shape = {
        "one-hot": None,
        "weighted-sum": BagShape((3, 1, 20), "uniform", True),
        "mean": BagShape((3, 2, 20), "fixed", False),
    }[case]
    pooling = ["mean", "sum", "mean"] if case == "mean" else ["sum"] * 3
    ids = _batch(shape)
    bags = ids if isinstance(ids, Bags) else Bags.one_hot(ids)
    ref = DLRM(5, SIZES, 4, [8], [8], seed=1, pooling=pooling)
    want = torch.stack([bag(*bags.table(t)) for t, bag in enumerate(ref.tables)], dim=1)  # [B, T, d]
    shards = [TableShards(SIZES, 4, kind, s, servers, seed=1) for s in range(servers)]
    planner = BagPlanner(FusedLayout(kind, tuple(SIZES), servers), 4, pooling)
    plan = planner.plan(bags)
    if case != "one-hot" and servers <= 2:  # table 2's bags of up to 20 ids: fewer bytes pooled on the servers
        assert sum(plan.pooled_rows) > 0
    elif case == "one-hot":
        assert sum(plan.pooled_rows) == 0 and all(len(r.offsets) == 0 for r in plan.requests)
    got = combine(plan, [sh.lookup(*plan.requests[s]) for s, sh in enumerate(shards)])
    # One server: the same sums in the same order, bit for bit; more: partials added up.
    if servers == 1 or case == "one-hot":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    g = torch.randn_like(want)
    (want * g).sum().backward()
    (got * g).sum().backward()
    for t, (weight, sharding) in enumerate(
        zip(ref.table_weights(), FusedLayout(kind, tuple(SIZES), servers).shardings(), strict=True)
    ):
        ref_grad = _grad(weight).coalesce().to_dense()
        for s, sh in enumerate(shards):
            grad = _grad(sh.weight).coalesce().to_dense()[sh.row_offsets[t] : sh.row_offsets[t + 1]]
            torch.testing.assert_close(grad, ref_grad[sharding.global_ids(s)], rtol=0, atol=5e-6)


def test_a_servers_gradient_names_each_touched_row_once() -> None:
    g = torch.Generator().manual_seed(0)
    storage = torch.randn(50, 3)
    rows = torch.tensor([7, 2, 7, 9, 2, 2, 30])  # duplicates within and across bags
    offsets = torch.tensor([0, 2, 2, 5])  # bags [7, 2], [], [7, 9, 2], [2, 30]
    weights = torch.rand(7, generator=g)
    grad_out = torch.randn(4, 3, generator=g)
    sparse = rows_gradient(rows, offsets, weights, grad_out, 50)
    assert sparse.is_coalesced() and sparse.indices()[0].tolist() == [2, 7, 9, 30]
    w = storage.clone().requires_grad_()
    F.embedding_bag(rows, w, offsets, mode="sum", per_sample_weights=weights, sparse=True).backward(grad_out)
    torch.testing.assert_close(sparse.to_dense(), _grad(w).coalesce().to_dense(), rtol=0, atol=1e-6)


def _per_table_step(
    tables: list[torch.nn.Parameter], opt: torch.optim.Optimizer, kind: str, S: int, ids: torch.Tensor, g: torch.Tensor
) -> torch.Tensor:
    """Today's per-table path on one server holding all rows (S = 1) or on every server:
    each table's distinct rows looked up with ``F.embedding(sparse=True)``, reassembled by
    index, one torch optimizer over the per-table parameters. ``tables[s * T + t]``."""
    T = len(SIZES)
    layout = FusedLayout(kind, tuple(SIZES), S)
    embs = []
    for t, sharding in enumerate(layout.shardings()):
        unique, inverse = torch.unique(ids[:, t], return_inverse=True)
        owner, local = sharding.owner(unique), sharding.local(unique)
        rows = torch.zeros(len(unique), tables[0].shape[1])
        for s in range(S):
            where = torch.nonzero(owner == s, as_tuple=True)[0]
            rows = rows.index_put((where,), F.embedding(local[where], tables[s * T + t], sparse=True))
        embs.append(rows[inverse])
    emb = torch.stack(embs, dim=1)
    opt.zero_grad(set_to_none=True)
    (emb * g).sum().backward()
    for p in tables:
        if p.grad is not None:
            p.grad = p.grad.coalesce()
    opt.step()
    return emb.detach()


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # torch's Adagrad on sparse gradients
@pytest.mark.parametrize("kind", ["range", "mod"])
def test_fused_tables_train_like_the_per_table_path(kind: str) -> None:
    # Forward: the same rows, bit for bit. Update: one RowsAdagrad step over the fused storage
    # equals torch's Adagrad table by table, bit for bit, given the same gradient; the
    # gradients themselves sum a row's samples in another order (1e-6).
    S, T, dim = 2, len(SIZES), 4
    shards, planner = _servers(kind, S, dim)
    fused_opt = RowsAdagrad([sh.weight for sh in shards], lr=0.1)
    tables = [torch.nn.Parameter(shards[s].table(t).clone()) for s in range(S) for t in range(T)]
    torch_opt = torch.optim.Adagrad(tables, lr=0.1)
    gen = SyntheticCtr(5, SIZES, 1.05, seed=2)
    _, ids, _, _ = gen.generate(5 * 128)
    for step in range(5):
        batch = torch.from_numpy(ids[step * 128 : (step + 1) * 128])
        g = 0.01 * torch.randn(128, T, dim, generator=torch.Generator().manual_seed(step))  # a mean loss's scale
        want = _per_table_step(tables, torch_opt, kind, S, batch, g)
        plan = planner.plan(Bags.one_hot(batch))
        answers = [sh.lookup(*plan.requests[s]) for s, sh in enumerate(shards)]
        got = combine(plan, answers)
        assert torch.equal(got.detach(), want)
        grads = torch.autograd.grad(got, [sh.weight for sh in shards], g)
        # The per-table path's own gradients, rebuilt into the fused storage: the update alone is bit-equal.
        per_table = [torch.cat([_grad(tables[s * T + t]).to_dense() for t in range(T)]) for s in range(S)]
        torch.testing.assert_close([x.to_dense() for x in grads], per_table, rtol=0, atol=1e-6)
        before = [sh.weight.detach().clone() for sh in shards]
        fused_opt.step([p.to_sparse(sparse_dim=1).coalesce() for p in per_table])
        for s in range(S):
            fused_now = shards[s].weight.detach()
            assert torch.equal(fused_now, torch.cat([tables[s * T + t].detach() for t in range(T)]))
            untouched = ~per_table[s].any(dim=1)
            assert torch.equal(fused_now[untouched], before[s][untouched])  # only touched rows move


def test_bag_columns_gather_any_samples_table_major() -> None:
    # 3 samples x 2 tables, sample-major: bags (0,0)=[1,2] (0,1)=[5] (1,0)=[] (1,1)=[6,7,8] (2,0)=[3] (2,1)=[4]
    cols = BagColumns(
        torch.tensor([1, 2, 5, 6, 7, 8, 3, 4], dtype=torch.int32),
        torch.tensor([0, 2, 3, 3, 6, 7, 8]),
        torch.arange(8, dtype=torch.float32),
        2,
    )
    bags = cols.batch(torch.tensor([2, 0, 1]))
    assert bags.values.tolist() == [3, 1, 2, 4, 5, 6, 7, 8]  # table 0 of samples 2, 0, 1; then table 1
    assert bags.lengths().tolist() == [1, 2, 0, 1, 1, 3]
    assert bags.weights is not None and bags.weights.tolist() == [6, 0, 1, 7, 2, 3, 4, 5]
    sub = cols.subset(slice(1, 3))
    assert len(sub) == 2 and sub.values.tolist() == [6, 7, 8, 3, 4] and sub.offsets.tolist() == [0, 0, 3, 4, 5]
    values, offsets, w = bags.table(1)
    assert values.tolist() == [4, 5, 6, 7, 8] and offsets.tolist() == [0, 1, 2] and w is not None


def test_multi_hot_synthetic_data_keeps_the_one_hot_ids_and_is_reproducible() -> None:
    shape = BagShape((1, 5, 3), "uniform", True)
    one = SyntheticCtr(4, [30, 200, 1000], 1.05, seed=3)
    multi = SyntheticCtr(4, [30, 200, 1000], 1.05, seed=3, bag_shape=shape)
    d1, i1, _, _ = one.generate(70_000)  # spans two generation chunks
    d2, i2, y2, p2, bags = multi.generate_with_bags(70_000)
    assert (d1 == d2).all() and (i1 == i2).all()  # bags add ids after the one-hot ones
    assert bags is not None and len(bags) == 70_000
    lengths = (bags.offsets[1:] - bags.offsets[:-1]).view(-1, 3)
    assert lengths[:, 0].eq(1).all() and lengths[:, 1].min() == 1 and lengths[:, 1].max() == 5
    assert lengths[:, 2].max() == 3
    first = bags.values[bags.offsets[:-1].view(-1, 3)].to(torch.int64)  # each bag's first id
    assert torch.equal(first, torch.from_numpy(i2))
    again = multi.generate_with_bags(70_000)
    assert again[4] is not None and torch.equal(again[4].values, bags.values) and (again[2] == y2).all()
    assert abs(float(y2.mean()) - 0.25) < 0.02  # the click rate holds with bags
    assert abs(p2.mean() - multi.probabilities(d2[:1000], i2[:1000], bags.subset(slice(0, 1000))).mean()) < 0.05


def test_bag_and_pooling_settings_are_checked() -> None:
    base = ("model=dlrm", "data=synthetic_ctr", "data.num_tables=3")
    cfg = make_cfg(*base, "data.bag_sizes=[2,3,4]", "model.pooling=[mean]")
    assert isinstance(cfg.model, DLRMConfig) and cfg.model.pooling_list(3) == ["mean"] * 3
    with pytest.raises(ConfigError, match=r"data.bag_sizes: \[2, 3\] lists 2 sizes for 3 tables"):
        make_cfg(*base, "data.bag_sizes=[2,3]")
    with pytest.raises(ConfigError, match="data.bag_size_dist: unknown 'zipf'"):
        make_cfg(*base, "data.bag_size_dist=zipf")
    with pytest.raises(ConfigError, match="model.pooling: mean pooling takes no per-id weights"):
        make_cfg(*base, "data.id_weights=true", "model.pooling=[sum,mean,sum]")
    with pytest.raises(ConfigError, match=r"model.pooling: \['max'\]: each must be one of"):
        make_cfg(*base, "model.pooling=[max]")
    with pytest.raises(ConfigError, match="model.pooling: .* lists 2 values for 3 tables"):
        make_cfg(*base, "model.pooling=[sum,mean]")
