"""Row-sharded tables: ownership, seeded block initialisation, each server's fused storage,
and the trainer's one-hot lookup (deduplicate, split by server, reassemble) against one
``nn.EmbeddingBag(sparse=True)``. Multi-hot bags: ``test_fused_tables.py``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from ps_train.workloads.ctr.data.bags import Bags
from ps_train.workloads.ctr.model import DLRM, interact
from ps_train.workloads.ctr.tables.plan import BagPlanner, combine
from ps_train.workloads.ctr.tables.rows import INIT_BLOCK, FusedLayout, RowSharding, init_rows
from ps_train.workloads.ctr.tables.shards import TableShards


@pytest.mark.parametrize("kind", ["range", "mod"])
@pytest.mark.parametrize("servers", [1, 2, 3, 4])
@pytest.mark.parametrize("rows", [1, 7, 100])
def test_every_row_has_exactly_one_owner_and_local_index(kind: str, servers: int, rows: int) -> None:
    sh = RowSharding(kind, rows, servers)
    ids = torch.arange(rows)
    owner, local = sh.owner(ids), sh.local(ids)
    assert owner.min() >= 0 and owner.max() < servers
    assert sum(sh.rows_of(s) for s in range(servers)) == rows
    for s in range(servers):
        mine = ids[owner == s]
        assert len(mine) == sh.rows_of(s)
        assert torch.equal(local[owner == s], torch.arange(sh.rows_of(s)))  # dense local rows
        assert torch.equal(sh.global_ids(s), mine)


def test_mod_sharding_spreads_consecutive_hot_ids_over_all_servers() -> None:
    sh = RowSharding("mod", 1000, 4)
    assert sh.owner(torch.arange(8)).tolist() == [0, 1, 2, 3, 0, 1, 2, 3]


def test_bad_sharding_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"range.*mod"):
        RowSharding("hash", 10, 2)


@pytest.mark.parametrize("kind", ["range", "mod"])
def test_the_same_seed_gives_the_same_table_for_any_number_of_servers(kind: str) -> None:
    rows, dim = 2 * INIT_BLOCK + 5, 2  # three init blocks, the last one short
    whole = init_rows(7, 3, rows, dim, torch.arange(rows))
    assert whole.abs().max() <= (1.0 / rows) ** 0.5
    for servers in (2, 3):
        sh = RowSharding(kind, rows, servers)
        rebuilt = torch.empty(rows, dim)
        for s in range(servers):
            rebuilt[sh.global_ids(s)] = init_rows(7, 3, rows, dim, sh.global_ids(s))
        assert torch.equal(rebuilt, whole)
    assert not torch.equal(init_rows(8, 3, rows, dim, torch.arange(10)), whole[:10])  # seed matters
    assert not torch.equal(init_rows(7, 4, rows, dim, torch.arange(10)), whole[:10])  # so does the table


def test_a_lookup_asks_each_server_only_for_its_distinct_rows() -> None:
    # Two tables of 10 and 6 rows, mod 2: server 0's storage holds table 0's rows 0, 2, .., 8
    # (storage rows 0..4), then table 1's 0, 2, 4 (storage rows 5..7).
    planner = BagPlanner(FusedLayout("mod", (10, 6), 2), dim=4, pooling=["sum", "sum"])
    ids = torch.tensor([[3, 5], [4, 5], [3, 0], [9, 1], [4, 0], [3, 5]])  # [B=6, T=2]
    plan = planner.plan(Bags.one_hot(ids))
    # server 0: id 4 (table 0) -> storage row 2, id 0 (table 1) -> 5; server 1: ids 3 and 9 of
    # table 0 -> rows 1 and 4, ids 1 and 5 of table 1 -> 5 + 0 and 5 + 2. Each row once, no pooling.
    assert [r.rows.tolist() for r in plan.requests] == [[2, 5], [1, 4, 5, 7]]
    assert all(len(r.offsets) == 0 and r.weights is None for r in plan.requests)
    assert plan.answers == [2, 4]


@pytest.mark.parametrize("kind", ["range", "mod"])
def test_sharded_lookups_train_like_one_embedding_bag(kind: str) -> None:
    # The trainer's side of a distributed step, with the servers' shards as local tensors:
    # losses, sparse gradients and SGD steps equal the single-process DLRM's. Losses are
    # bit-identical; a row used by several samples gets their gradients summed in another
    # order (an indexing backward here, a sparse coalesce there): equal within rounding.
    sizes, dim, servers = [50, 7, 300], 4, 3
    ref = DLRM(5, sizes, dim, [8], [8], seed=1)
    ref_bags = [bag for bag in ref.tables if isinstance(bag, torch.nn.EmbeddingBag)]
    assert len(ref_bags) == len(sizes)
    bottom, top = copy.deepcopy(ref.bottom), copy.deepcopy(ref.top)
    layout = FusedLayout(kind, tuple(sizes), servers)
    shardings = layout.shardings()
    shards = [TableShards(sizes, dim, kind, s, servers, seed=1) for s in range(servers)]
    planner = BagPlanner(layout, dim, ["sum"] * len(sizes))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD([p.weight for p in shards] + list(bottom.parameters()) + list(top.parameters()), lr=0.5)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        dense = torch.randn(16, 5, generator=g)
        ids = torch.stack([torch.randint(0, n, (16,), generator=g) for n in sizes], dim=1)
        ids[:8] = ids[8:]  # repeated ids in the batch
        labels = torch.randint(0, 2, (16,), generator=g).float()

        ref_opt.zero_grad(set_to_none=True)
        ref_loss = F.binary_cross_entropy_with_logits(ref(dense, ids), labels)
        ref_loss.backward()

        opt.zero_grad(set_to_none=True)
        plan = planner.plan(Bags.one_hot(ids))
        answers = [shards[s].lookup(*plan.requests[s]) for s in range(servers)]  # the "servers"
        logits = top(interact(bottom(dense), combine(plan, answers))).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        loss.backward()
        assert loss.item() == ref_loss.item()
        for s in range(servers):
            grad = shards[s].weight.grad
            assert grad is not None and grad.layout == torch.sparse_coo
            got = grad.to_dense()
            for t, sh in enumerate(shardings):
                ref_grad = ref_bags[t].weight.grad
                assert ref_grad is not None
                want = ref_grad.coalesce().to_dense()[sh.global_ids(s)]
                lo, hi = shards[s].row_offsets[t], shards[s].row_offsets[t + 1]
                torch.testing.assert_close(got[lo:hi], want, rtol=0, atol=1e-7)
        ref_opt.step()
        opt.step()
    for t, sh in enumerate(shardings):
        for s in range(servers):
            torch.testing.assert_close(
                shards[s].table(t), ref_bags[t].weight.detach()[sh.global_ids(s)], rtol=0, atol=1e-7
            )


def test_a_servers_table_shards_hold_its_rows_and_train_only_the_touched_ones() -> None:
    sizes, dim = [INIT_BLOCK + 3, 10], 2
    parts = [TableShards(sizes, dim, "range", s, 2, seed=5) for s in range(2)]
    for t, n in enumerate(sizes):
        whole = torch.cat([p.table(t) for p in parts])
        assert torch.equal(whole, init_rows(5, t, n, dim, torch.arange(n)))
    assert sum(p.nbytes() for p in parts) == sum(sizes) * dim * 4
    assert parts[1].row_offsets == [0, INIT_BLOCK // 2 + 1, INIT_BLOCK // 2 + 1 + 5]  # one storage, table after table
    before = parts[1].weight.detach().clone()
    opt = torch.optim.SparseAdam(list(parts[1].parameters()), lr=0.1)
    # Rows 0 and 2 of table 0, row 1 of table 1 (storage row 32770), as three single rows.
    second = parts[1].row_offsets[1] + 1
    out = parts[1].lookup(torch.tensor([0, 2, second]), torch.zeros(0, dtype=torch.int64), None)
    assert torch.equal(out, parts[1].weight.detach()[[0, 2, second]])
    out.sum().backward()
    grad = parts[1].weight.grad
    assert grad is not None and grad.layout == torch.sparse_coo
    assert grad.coalesce().indices()[0].tolist() == [0, 2, second]
    opt.step()
    moved = (parts[1].weight.detach() != before).any(dim=1)
    assert torch.nonzero(moved).flatten().tolist() == [0, 2, second]  # lazy: untouched rows keep their values
    with pytest.raises(IndexError, match="outside this server's"):
        parts[1].lookup(torch.tensor([10**6]), torch.zeros(0, dtype=torch.int64), None)
    with pytest.raises(ValueError, match="nondecreasing"):
        parts[1].lookup(torch.tensor([0, 1]), torch.tensor([1, 0]), None)


@pytest.mark.parametrize("kind", ["range", "mod"])
def test_servers_build_the_same_tables_for_any_number_of_servers(kind: str) -> None:
    sizes, dim = [2 * INIT_BLOCK + 7, 5], 3
    one = TableShards(sizes, dim, kind, 0, 1, seed=9)
    for servers in (2, 3):
        parts = [TableShards(sizes, dim, kind, s, servers, seed=9) for s in range(servers)]
        for t, n in enumerate(sizes):
            rebuilt = torch.empty(n, dim)
            for s, part in enumerate(parts):
                rebuilt[RowSharding(kind, n, servers).global_ids(s)] = part.table(t)
            assert torch.equal(rebuilt, one.table(t)), f"{servers} servers, table {t}"
