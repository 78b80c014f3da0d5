"""Row-sharded tables: ownership, seeded block initialisation, and the trainer's lookup
(deduplicate, split by server, reassemble) against one ``nn.EmbeddingBag(sparse=True)``."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from ps_train.ctr.model import DLRM, interact
from ps_train.ctr.rows import INIT_BLOCK, RowSharding, assemble, init_rows, plan_lookup


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
    sh = RowSharding("mod", 10, 2)
    plan = plan_lookup(torch.tensor([3, 4, 3, 9, 4, 3]), sh)
    assert plan.num_unique == 3
    assert [loc.tolist() for loc in plan.local] == [[2], [1, 4]]  # 4 on server 0; 3 and 9 on server 1


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
    shardings = [RowSharding(kind, n, servers) for n in sizes]
    shards: list[list[torch.Tensor]] = [
        [init_rows(1, t, n, dim, sh.global_ids(s)).requires_grad_() for s in range(servers)]
        for t, (n, sh) in enumerate(zip(sizes, shardings, strict=True))]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD([p for table in shards for p in table] + list(bottom.parameters()) + list(top.parameters()),
                          lr=0.5)
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
        embs = []
        for t, sh in enumerate(shardings):
            plan = plan_lookup(ids[:, t], sh)
            rows = [F.embedding(plan.local[s], shards[t][s], sparse=True) for s in range(servers)]  # "server" side
            embs.append(assemble(plan, rows))
        logits = top(interact(bottom(dense), torch.stack(embs, dim=1))).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        loss.backward()
        assert loss.item() == ref_loss.item()
        for t, sh in enumerate(shardings):
            for s in range(servers):
                grad = shards[t][s].grad
                ref_grad = ref_bags[t].weight.grad
                assert ref_grad is not None
                want = ref_grad.coalesce().to_dense()[sh.global_ids(s)]
                if grad is None:  # the batch used none of this shard's rows
                    assert not want.any()
                    continue
                assert grad.layout == torch.sparse_coo
                torch.testing.assert_close(grad.coalesce().to_dense(), want, rtol=0, atol=1e-7)
        ref_opt.step()
        opt.step()
    for t, sh in enumerate(shardings):
        for s in range(servers):
            torch.testing.assert_close(shards[t][s].detach(), ref_bags[t].weight.detach()[sh.global_ids(s)],
                                       rtol=0, atol=1e-7)


def test_a_servers_table_shards_hold_its_rows_and_train_only_the_touched_ones() -> None:
    from ps_train.ctr.shards import TableShards

    sizes, dim = [INIT_BLOCK + 3, 10], 2
    parts = [TableShards(sizes, dim, "range", s, 2, seed=5) for s in range(2)]
    for t, n in enumerate(sizes):
        whole = torch.cat([p.weights[t].detach() for p in parts])
        assert torch.equal(whole, init_rows(5, t, n, dim, torch.arange(n)))
    assert sum(p.nbytes() for p in parts) == sum(sizes) * dim * 4
    before = parts[1].weights[0].detach().clone()
    opt = torch.optim.SparseAdam(list(parts[1].parameters()), lr=0.1)
    rows = parts[1].lookup([torch.tensor([0, 2, 0]), torch.tensor([1])])
    (rows[0].sum() + rows[1].sum()).backward()
    assert parts[1].weights[0].grad.layout == torch.sparse_coo
    opt.step()
    moved = (parts[1].weights[0].detach() != before).any(dim=1)
    assert torch.nonzero(moved).flatten().tolist() == [0, 2]  # lazy: untouched rows keep their values
    with pytest.raises(IndexError, match="outside this server's"):
        parts[1].lookup([torch.tensor([10**6]), torch.tensor([0])])
    with pytest.raises(ValueError, match="names 1 tables"):
        parts[1].lookup([torch.tensor([0])])


@pytest.mark.parametrize("kind", ["range", "mod"])
def test_servers_build_the_same_tables_for_any_number_of_servers(kind: str) -> None:
    from ps_train.ctr.shards import TableShards

    sizes, dim = [2 * INIT_BLOCK + 7, 5], 3
    one = TableShards(sizes, dim, kind, 0, 1, seed=9)
    for servers in (2, 3):
        parts = [TableShards(sizes, dim, kind, s, servers, seed=9) for s in range(servers)]
        for t, n in enumerate(sizes):
            rebuilt = torch.empty(n, dim)
            for s, part in enumerate(parts):
                rebuilt[RowSharding(kind, n, servers).global_ids(s)] = part.weights[t].detach()
            assert torch.equal(rebuilt, one.weights[t].detach()), f"{servers} servers, table {t}"
