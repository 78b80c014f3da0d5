"""The trainers' hot-row cache (``model.cache_rows``, ``model.cache_staleness``).

In one process against the tables themselves (``TableShards``): the cache answers as the
server would, and the gradients it pushes plus those of the pulled rows are the gradient
without a cache. Then whole runs: with rows that cannot move, a cached run equals an
uncached one step for step; every pushed gradient reaches the optimizer; fewer bytes are
pulled; an async run with the cache learns as well as without.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ps_train.config import ConfigError
from ps_train.workloads.ctr.data.bags import as_bags
from ps_train.workloads.ctr.tables.cache import RowCache
from ps_train.workloads.ctr.tables.plan import BagPlanner
from ps_train.workloads.ctr.tables.rows import FusedLayout
from ps_train.workloads.ctr.tables.shards import TableShards
from tests.ps_train._app import make_cfg, run_app
from tests.ps_train.test_dlrm import SMALL

SIZES = (50, 9, 400)
DIM = 4


def _setup() -> tuple[BagPlanner, TableShards, RowCache]:
    layout = FusedLayout("range", SIZES, 1)
    shards = TableShards(SIZES, DIM, "range", 0, 1, seed=3)
    cache = RowCache(capacity=30, staleness=3, server_rows=[layout.row_offsets(0)[-1]], dim=DIM)
    return BagPlanner(layout, DIM, ["sum"] * 3), shards, cache


def _zipf_ids(g: torch.Generator, batch: int = 16) -> torch.Tensor:
    # Skewed: low ids far more often, so a few rows are hot.
    u = torch.rand(batch, len(SIZES), generator=g)
    return torch.stack([(u[:, t] ** 3 * n).long() for t, n in enumerate(SIZES)], dim=1)  # [B, T]


def test_the_cache_answers_as_the_server_and_its_pushes_complete_the_gradient() -> None:
    planner, shards, cache = _setup()
    g = torch.Generator().manual_seed(0)
    total_hits = 0
    for step in range(9):
        plan = planner.plan(as_bags(_zipf_ids(g)))
        [req] = plan.requests
        want = shards.lookup(*req)  # [U + P, d], what the server answers without a cache
        w_grad = torch.randn(want.shape, generator=g)
        (expected,) = torch.autograd.grad(want, shards.weight, w_grad)

        cache.begin_step(step)
        sp = cache.split(0, req)
        pushed: list[torch.Tensor] = []
        got = cache.assemble(0, sp, shards.lookup(*sp.request), pushed.append)
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # rows never change here
        shards.weight.grad = None
        got.backward(w_grad)  # the whole graph, as the distributed backward runs it
        assert shards.weight.grad is not None
        total = shards.weight.grad.to_dense()
        if len(sp.hit_rows):
            [push] = pushed
            total = total.index_add(0, sp.hit_rows, push)
        torch.testing.assert_close(total, expected.to_dense(), rtol=0, atol=1e-6)
        total_hits += len(sp.hit_rows)
        # The request shrank by exactly the rows served here.
        assert len(sp.request.rows) == len(req.rows) - len(sp.hit_rows)
    assert total_hits > 0 and cache.hits == total_hits


def test_cached_values_are_refreshed_every_staleness_steps() -> None:
    planner, shards, cache = _setup()
    ids = torch.zeros(4, 3, dtype=torch.int64)  # the same rows every step: hot at once
    seen_hits = []
    for step in range(7):
        cache.begin_step(step)
        sp = cache.split(0, planner.plan(as_bags(ids)).requests[0])
        cache.assemble(0, sp, shards.lookup(*sp.request), lambda g: None)
        seen_hits.append(len(sp.hit_rows))
    # Step 0: nothing is hot yet. Refresh at 3 and 6: pulled once, then served until the next.
    assert seen_hits == [0, 0, 0, 0, 3, 3, 0]


def test_cache_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"model.cache_staleness: 0 must be >= 1"):
        make_cfg("model=dlrm", "data=synthetic_ctr", "model.cache_rows=10", "model.cache_staleness=0")
    with pytest.raises(ConfigError, match=r"model.cache_rows: .*cluster.update_in_backward=true"):
        make_cfg("model=dlrm", "data=synthetic_ctr", "model.cache_rows=10", "cluster.update_in_backward=true")


CACHED = ("model.cache_rows=200", "model.cache_staleness=4")


@pytest.mark.timeout(240)
def test_with_frozen_rows_a_cached_sync_run_equals_an_uncached_one(tmp_path: Path) -> None:
    # A table rate of 1e-30 moves no float32 row, so a cached value is the server's: the
    # answers put together from cache and server must give the same losses, bit for bit;
    # every row a step used is updated (its gradient pushed) either way.
    run = (*SMALL, "mode=sync", "train.steps=10", "optim=sgd", "model.table_optim=sgd", "model.table_lr=1e-30")
    plain = run_app(tmp_path / "plain", *run, timeout=120)
    cached = run_app(tmp_path / "cached", *run, *CACHED, timeout=120)
    assert cached["losses"] == plain["losses"]
    assert cached["cache_hits_per_step"] > 0 and plain["cache_hits_per_step"] == 0
    assert cached["table_rows_updated"] == plain["table_rows_updated"]
    assert cached["rows_pushed_per_step"] == plain["rows_pushed_per_step"]
    assert cached["rows_pulled_per_step"] == plain["rows_pulled_per_step"] - cached["cache_hits_per_step"]


@pytest.mark.timeout(240)
def test_an_async_run_with_the_cache_pulls_fewer_rows_and_learns(tmp_path: Path) -> None:
    run = (*SMALL, "mode=async", "train.steps=40", "train.batch_size=64", "model.table_lr=0.2")
    m = run_app(tmp_path, *run, *CACHED, timeout=150)
    assert m["cache_hits_per_step"] > 0.3 * m["rows_pushed_per_step"]
    assert 0.5 < m["test_auc"] <= 1.0 and m["test_best_auc"] > m["test_auc"] - 0.05
    assert m["test_log_loss"] < m["test_base_log_loss"] + 0.05
