"""The table-storage contract (``ps_train.workloads.ctr.tables.storage.TableStorage``), checked on every
storage: lookups equal a plain ``F.embedding_bag`` over a dense copy of the rows, updates
equal the optimizer applied to that dense copy, a snapshot restored into a new storage
reads and trains on bit-identically, and the changed rows it reports are exactly the rows
updated. Then what only the tiered storage has: rows evicted to disk and read back
bit-identical, its counters, and its errors (budget too small, a foreign store, a full disk)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ps_train.config import OptimConfig
from ps_train.workloads.ctr.tables import row_pool
from ps_train.workloads.ctr.tables.dynamic import DynamicSpec, DynamicTable
from ps_train.workloads.ctr.tables.dynamic_storage import DynamicStorage
from ps_train.workloads.ctr.tables.fused_storage import FusedStorage
from ps_train.workloads.ctr.tables.half_rows import HalfRows, chunk_rows, stochastic_round
from ps_train.workloads.ctr.tables.optimizers import RowWiseAdagrad, make_table_optimizer
from ps_train.workloads.ctr.tables.row_pool import BudgetError
from ps_train.workloads.ctr.tables.row_store import STORE_RAM_BYTES, RowStore, StoreError
from ps_train.workloads.ctr.tables.rows import FusedLayout
from ps_train.workloads.ctr.tables.shards import TableShards
from ps_train.workloads.ctr.tables.storage import TableRequest, TableStorage
from ps_train.workloads.ctr.tables.tiered_storage import TieredStorage, TierSettings

SIZES = (300, 500, 70)
DIM, SERVER, SERVERS, SEED, LR = 4, 1, 2, 11, 0.1
LAYOUT = FusedLayout("range", SIZES, SERVERS)
NUM_ROWS = LAYOUT.storage_rows(SERVER)  # 150 + 250 + 35
STEP_ROWS = 40  # the most distinct rows one request here names


def _fused(optim: str, tmp: Path) -> TableStorage:
    shards = TableShards(SIZES, DIM, "range", SERVER, SERVERS, SEED)
    return FusedStorage(shards, make_table_optimizer(optim, [shards.weight], OptimConfig(lr=LR)), "ps1")


def _tiered(optim: str, tmp: Path, dtype: str = "float32", budget_rows: int | None = None) -> TableStorage:
    budget = None
    if budget_rows is not None:
        state = {"sgd": 0, "adagrad": 4 * DIM, "rowwise_adagrad": 4}[optim]
        row = DIM * (2 if dtype != "float32" else 4) + state + 26  # + the slot's bookkeeping
        budget = 4 * NUM_ROWS + budget_rows * row
    settings = TierSettings(DIM, dtype, optim, OptimConfig(lr=LR), None, SEED, budget, str(budget), tmp, STEP_ROWS)
    return TieredStorage(LAYOUT, SERVER, settings, "ps1", start_rows=8)  # the pool grows as rows come


def _dynamic(optim: str, tmp: Path, tiered: bool = False) -> TableStorage:
    """A dynamic table appended to the fixed ones, wrapping a fused storage (or a tiered one
    with a small budget): fixed rows pass through."""
    layout = FusedLayout("range", (*SIZES, 1000), SERVERS, (0, 0, 0, 20))
    inner: TableStorage
    if tiered:
        settings = TierSettings(DIM, "float32", optim, OptimConfig(lr=LR), None, SEED, 20_000, "20000", tmp, STEP_ROWS)
        inner = TieredStorage(layout, SERVER, settings, "ps1", start_rows=8)
    else:
        shards = TableShards((*SIZES, 1000), DIM, "range", SERVER, SERVERS, SEED, (0, 0, 0, 20))
        inner = FusedStorage(shards, make_table_optimizer(optim, [shards.weight], OptimConfig(lr=LR)), "ps1")
    default = layout.default_row(SERVER)
    assert default is not None
    table = DynamicTable(DynamicSpec(20))
    return DynamicStorage(inner, {3: table}, layout.row_offsets(SERVER), default, SEED, (*SIZES, 1000), "ps1")


STORAGES: dict[str, Callable[[str, Path], TableStorage]] = {
    "fused": _fused,
    "lazy": _tiered,
    "tiered": lambda optim, tmp: _tiered(optim, tmp, budget_rows=2 * STEP_ROWS),  # most rows live on disk
    "dynamic": _dynamic,
    "dynamic-tiered": lambda optim, tmp: _dynamic(optim, tmp, tiered=True),
}
OPTIMS = ["sgd", "adagrad", "rowwise_adagrad"]


def _request(g: torch.Generator, step: int | None) -> TableRequest:
    """10 single rows and 6 bags (one empty) of fixed-table rows, with weights."""
    rows = torch.randint(0, NUM_ROWS, (STEP_ROWS,), generator=g)
    offsets = torch.tensor([10, 14, 20, 20, 27, 33], dtype=torch.int64)
    weights = torch.rand(STEP_ROWS - 10, generator=g)
    return TableRequest(rows, offsets, weights, None, step, 0)


def _oracle_lookup(dense: torch.Tensor, req: TableRequest) -> torch.Tensor:
    singles = int(req.offsets[0])
    full = torch.cat([torch.arange(singles), req.offsets])
    assert req.weights is not None
    w = torch.cat([torch.ones(singles), req.weights])
    return F.embedding_bag(req.rows, dense, full, mode="sum", per_sample_weights=w)


def _all_rows(storage: TableStorage) -> torch.Tensor:
    n = LAYOUT.row_offsets(SERVER)[-1]  # the fixed tables' rows
    return storage.read(TableRequest(torch.arange(n), torch.zeros(0, dtype=torch.int64)))


def _train(storage: TableStorage, g: torch.Generator, steps: int, first: int = 1) -> list[torch.Tensor]:
    """``steps`` lookups, backward with random output gradients, updates; the gradients."""
    grads = []
    for step in range(first, first + steps):
        req = _request(g, step)
        out = storage.lookup(req)
        out.backward(torch.randn(out.shape, generator=g))
        grad = storage.handle.grad
        assert grad is not None
        storage.handle.grad = None
        storage.step(grad.coalesce())
        grads.append(grad.coalesce())
    return grads


@pytest.mark.parametrize("optim", OPTIMS)
@pytest.mark.parametrize("kind", list(STORAGES))
@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_lookups_and_updates_equal_the_optimizer_on_a_dense_copy(tmp_path: Path, kind: str, optim: str) -> None:
    storage = STORAGES[kind](optim, tmp_path)
    n = LAYOUT.row_offsets(SERVER)[-1]
    dense = nn.Parameter(LAYOUT.initial_rows(SERVER, SEED, DIM, torch.arange(n)))
    oracle = make_table_optimizer(optim, [dense], OptimConfig(lr=LR))
    assert torch.equal(_all_rows(storage), dense.detach())
    g, g_oracle = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for step in range(1, 9):
        req = _request(g, step)
        out = storage.lookup(req)
        want = _oracle_lookup(dense, _request(g_oracle, step))
        assert torch.equal(out, want)
        upstream = torch.randn(out.shape, generator=g)
        assert torch.equal(upstream, torch.randn(out.shape, generator=g_oracle))
        out.backward(upstream)
        grad = storage.handle.grad
        assert grad is not None and grad.is_sparse
        storage.handle.grad = None
        (want_grad,) = torch.autograd.grad(want, [dense], upstream)
        torch.testing.assert_close(grad.coalesce().to_dense()[:n], want_grad, rtol=0, atol=1e-6)
        assert storage.step(grad.coalesce()) == len(torch.unique(req.rows))
        sparse = torch.sparse_coo_tensor(grad.coalesce().indices(), grad.coalesce().values(), (n, DIM))
        oracle.step([sparse.coalesce()])
        assert torch.equal(_all_rows(storage), dense.detach()), f"step {step}"


@pytest.mark.parametrize("kind", list(STORAGES))
@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_changed_rows_are_exactly_the_rows_updated(tmp_path: Path, kind: str) -> None:
    storage = STORAGES[kind]("adagrad", tmp_path)
    g = torch.Generator().manual_seed(2)
    _train(storage, g, 2)
    storage.take_changed()
    grads = _train(storage, g, 3, first=3)
    want = torch.unique(torch.cat([gr.indices()[0] for gr in grads]))
    assert torch.equal(storage.take_changed(), want)
    assert len(storage.take_changed()) == 0


@pytest.mark.parametrize("optim", OPTIMS)
@pytest.mark.parametrize("kind", list(STORAGES))
@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_a_snapshot_restores_bit_identically_and_trains_on_alike(tmp_path: Path, kind: str, optim: str) -> None:
    storage = STORAGES[kind](optim, tmp_path / "a")
    _train(storage, torch.Generator().manual_seed(3), 6)
    snap = storage.begin_snapshot("step_000000006", None)
    entry = snap.write(str(tmp_path), "ps1")
    storage.end_snapshot(written=True)
    restored = STORAGES[kind](optim, tmp_path / "b")
    restored.load_state({**snap.state, "rows_files": [str(tmp_path / entry.file)]})
    assert torch.equal(_all_rows(restored), _all_rows(storage))
    # The optimizer state came along: the same further steps give the same rows.
    _train(storage, torch.Generator().manual_seed(4), 4, first=7)
    _train(restored, torch.Generator().manual_seed(4), 4, first=7)
    assert torch.equal(_all_rows(restored), _all_rows(storage))


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_dynamic_rows_over_a_tiered_storage_survive_eviction(tmp_path: Path) -> None:
    storage = _dynamic("adagrad", tmp_path, tiered=True)
    assert isinstance(storage, DynamicStorage) and isinstance(storage.inner, TieredStorage)
    marker, none = torch.tensor([-4, -4]), torch.zeros(0, dtype=torch.int64)
    out = storage.lookup(TableRequest(marker, none, None, torch.tensor([77, 78]), 1, 0))
    out.sum().backward()
    grad = storage.handle.grad
    assert grad is not None
    storage.step(grad.coalesce())
    storage.handle.grad = None
    before = storage.read(TableRequest(marker, none, None, torch.tensor([77, 78])))
    pool = storage.inner.pool
    pool.evict(torch.nonzero(pool.slot_row >= 0).squeeze(1))
    assert torch.equal(storage.read(TableRequest(marker, none, None, torch.tensor([77, 78]))), before)
    again = storage.lookup(TableRequest(marker, none, None, torch.tensor([77, 78]), 2, 0))
    assert torch.equal(again.detach(), before)


# -- the tiered storage -----------------------------------------------------------------------------
@pytest.mark.parametrize("optim", OPTIMS)
@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_a_row_evicted_and_read_back_is_bit_identical_with_its_optimizer_state(tmp_path: Path, optim: str) -> None:
    storage = _tiered(optim, tmp_path, budget_rows=2 * STEP_ROWS)
    assert isinstance(storage, TieredStorage)
    _train(storage, torch.Generator().manual_seed(5), 10)
    pool = storage.pool
    slots = torch.nonzero(pool.touched).squeeze(1)
    rows = pool.slot_row[slots]
    before = [c.index_select(0, slots).clone() for c in pool.columns()]
    pool.evict(torch.nonzero(pool.slot_row >= 0).squeeze(1))  # every row leaves RAM
    assert pool.held() == 0
    back = pool.ensure(rows)
    for b, c in zip(before, pool.columns(), strict=True):
        assert torch.equal(c.index_select(0, back), b)
    tier = storage.counters()["tier"]
    assert tier["rows_evicted"] > 0 and tier["rows_read_back"] >= len(rows) and tier["bytes_written"] > 0
    assert 0 < tier["hit_rate"] < 1 and tier["rows_in_ram"] <= 2 * STEP_ROWS
    storage.close()


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_a_checkpoint_flushes_dirty_rows_in_bounded_write_batches_and_restores_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A checkpoint writes every dirty row of the pool to the store first; in one batch that
    # held the whole pool several times over at once. A small batch size stands in for 65,536.
    monkeypatch.setattr(row_pool, "FLUSH_ROWS", 7)
    storage = _tiered("rowwise_adagrad", tmp_path / "a", budget_rows=4 * STEP_ROWS)
    assert isinstance(storage, TieredStorage) and storage.store is not None
    _train(storage, torch.Generator().manual_seed(8), 6)
    dirty = int(storage.pool.dirty.sum())
    assert dirty > 7
    batches: list[int] = []
    put = storage.store.put

    def counted_put(rows: Sequence[int], values: Sequence[bytes]) -> None:
        batches.append(len(rows))
        put(rows, values)

    monkeypatch.setattr(storage.store, "put", counted_put)
    snap = storage.begin_snapshot("step_000000006", None)
    assert sum(batches) == dirty and max(batches) <= 7 and not storage.pool.dirty.any()
    entry = snap.write(str(tmp_path), "ps1")
    storage.end_snapshot(written=True)
    restored = _tiered("rowwise_adagrad", tmp_path / "b", budget_rows=4 * STEP_ROWS)
    restored.load_state({**snap.state, "rows_files": [str(tmp_path / entry.file)]})
    assert torch.equal(_all_rows(restored), _all_rows(storage))
    storage.close()
    restored.close()


def test_a_budget_that_holds_rocksdbs_caches_pays_for_them_a_smaller_one_leaves_them_out(tmp_path: Path) -> None:
    row = DIM * 4 + 4 * DIM + 26  # float32 values, Adagrad's state, the slot's bookkeeping
    index = 4 * NUM_ROWS
    big = TierSettings(
        DIM, "float32", "adagrad", OptimConfig(lr=LR), None, SEED, index + STORE_RAM_BYTES + 10 * STEP_ROWS * row,
        "big", tmp_path / "big", STEP_ROWS,
    )  # fmt: skip
    storage = TieredStorage(LAYOUT, SERVER, big, "ps1", start_rows=8)
    assert storage.pool.capacity == 10 * STEP_ROWS  # RocksDB's 48 MiB came out of the budget
    storage.close()
    small = _tiered("adagrad", tmp_path / "small", budget_rows=2 * STEP_ROWS)
    assert isinstance(small, TieredStorage)
    assert small.pool.capacity == 2 * STEP_ROWS  # too small to pay for them: they stay outside
    small.close()


def test_a_budget_too_small_for_one_step_names_the_setting_and_the_minimum(tmp_path: Path) -> None:
    with pytest.raises(BudgetError, match=r"model.table_memory_budget=.*at least [0-9.]+MB"):
        _tiered("adagrad", tmp_path, budget_rows=STEP_ROWS - 1)


def test_a_store_left_by_another_run_or_format_is_refused(tmp_path: Path) -> None:
    _tiered("adagrad", tmp_path, budget_rows=2 * STEP_ROWS).close()
    with pytest.raises(StoreError, match="left by another run"):
        _tiered("adagrad", tmp_path, budget_rows=2 * STEP_ROWS)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "ps_train_store.json").write_text('{"format": 0}')
    with pytest.raises(StoreError, match="another format"):
        RowStore(tmp_path / "other", {}, "ps1")


def test_the_stores_index_and_filter_blocks_are_held_in_its_block_cache_not_beside_it(tmp_path: Path) -> None:
    store = RowStore(tmp_path / "ps1", {}, "ps1")
    files, per_file = 3, 10_000
    for f in range(files):  # one flushed file each: a file's index and bloom filter are built
        rows = list(range(f * per_file, (f + 1) * per_file))
        store.put(rows, [r.to_bytes(8, "big") * 32 for r in rows])  # 256 bytes a row
        store.db.flush()
    asked = list(range(0, files * per_file, 7))
    assert store.get(asked) == [r.to_bytes(8, "big") * 32 for r in asked]
    mem = store.memory()
    # Outside the cache, RocksDB would keep ~2.6 bytes per row (its whole filters and
    # indexes); inside it, only each open file's reader (~2 KB a file, whatever its rows).
    assert mem["table_readers"] < 0.5 * files * per_file
    assert 0 < mem["block_cache_pinned"] <= mem["block_cache"] <= STORE_RAM_BYTES
    store.close()


# -- half-precision rows ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_rounding_picks_a_neighbour_with_the_mean_of_the_value(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64) * 0.01
    draws = torch.stack([stochastic_round(x, dtype, g) for _ in range(4000)]).float()  # [4000, 64]
    lo = torch.nextafter(x.to(dtype), torch.full((64,), -torch.inf, dtype=dtype)).float()
    hi = torch.nextafter(x.to(dtype), torch.full((64,), torch.inf, dtype=dtype)).float()
    assert bool(((draws >= torch.minimum(lo, x.to(dtype).float())) & (draws <= hi)).all())
    ulp = (hi - lo) / 2
    assert bool(((draws.mean(0) - x).abs() < 0.1 * ulp).all())  # unbiased, within sampling noise


def _reference_round(x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Stochastic rounding written out plainly, a new tensor per operation."""
    near = x.to(dtype)
    gap = x - near.float()
    other = torch.nextafter(near, torch.where(gap > 0, torch.inf, -torch.inf).to(dtype))
    step = other.float() - near.float()
    p = torch.where(gap == 0, torch.zeros_like(gap), gap / step)
    return torch.where(torch.rand(x.shape, generator=generator) < p, other, near)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_rounding_in_place_rounds_as_the_plain_formula_bit_for_bit(dtype: torch.dtype) -> None:
    # Values of every scale, ties, the format's edges (overflow to inf), zeros, infinities, NaN.
    special = [0.0, -0.0, 0.5, 1.0, 1.00048828125, 3e-8, 6e-8, 65504.0, 65520.0, 7e4, -7e4, 1e39]
    special += [float("inf"), -float("inf"), float("nan")]
    x = torch.cat([torch.randn(4096) * 10.0 ** torch.randint(-9, 7, (4096,)), torch.tensor(special)])
    before = x.clone()
    ours = stochastic_round(x, dtype, torch.Generator().manual_seed(3))
    plain = _reference_round(x, dtype, torch.Generator().manual_seed(3))
    assert torch.equal(ours.view(torch.int16), plain.view(torch.int16))
    assert torch.equal(x.view(torch.int32), before.view(torch.int32))  # the input is left as it was


def test_a_large_update_a_slice_of_rows_at_a_time_equals_the_whole_at_once() -> None:
    # More rows than one slice takes (chunk_rows), and a last slice that is not full.
    n, dim, lr, eps = 3 * chunk_rows(torch.empty(0, 128)) + 123, 128, 0.01, 1e-8
    rows = torch.randperm(n + 50, generator=torch.Generator().manual_seed(0))[:n]
    grad = torch.randn(n, dim, generator=torch.Generator().manual_seed(1))
    values = torch.randn(n + 50, dim, generator=torch.Generator().manual_seed(2)).to(torch.float16)
    optimizer = RowWiseAdagrad([nn.Parameter(torch.zeros(n + 50, dim))], lr=lr, eps=eps)
    optimizer.sums[0].uniform_(0, 1, generator=torch.Generator().manual_seed(3))
    sums = optimizer.sums[0].clone()
    # The whole at once, as written in RowWiseAdagrad's docstring.
    total = sums[rows] + grad.pow(2).mean(dim=1)
    want_sums = sums.index_copy(0, rows, total)
    moved = values[rows].float() + grad * (-lr / (total.sqrt() + eps)).unsqueeze(1)
    want = values.index_copy(0, rows, stochastic_round(moved, torch.float16, torch.Generator().manual_seed(4)))
    optimizer.step_rows(HalfRows(values, torch.Generator().manual_seed(4)), rows, grad)
    assert torch.equal(optimizer.sums[0], want_sums)
    assert torch.equal(values.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_half_rows_look_up_as_stored_and_restore_bit_identically(tmp_path: Path, dtype: str) -> None:
    storage = _tiered("rowwise_adagrad", tmp_path / "a", dtype, budget_rows=2 * STEP_ROWS)
    assert isinstance(storage, TieredStorage) and storage.pool.values.dtype == getattr(torch, dtype)
    n = LAYOUT.row_offsets(SERVER)[-1]
    initial = LAYOUT.initial_rows(SERVER, SEED, DIM, torch.arange(n)).to(getattr(torch, dtype)).float()
    assert torch.equal(_all_rows(storage), initial)
    _train(storage, torch.Generator().manual_seed(6), 6)
    assert not torch.equal(_all_rows(storage), initial)
    snap = storage.begin_snapshot("s", None)
    entry = snap.write(str(tmp_path), "ps1")
    restored = _tiered("rowwise_adagrad", tmp_path / "b", dtype, budget_rows=2 * STEP_ROWS)
    restored.load_state({**snap.state, "rows_files": [str(tmp_path / entry.file)]})
    _train(storage, torch.Generator().manual_seed(7), 3, first=7)
    _train(restored, torch.Generator().manual_seed(7), 3, first=7)
    assert torch.equal(_all_rows(restored), _all_rows(storage))


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MB tmpfs (root only: mounting needs it; skipped otherwise)."""
    where = tmp_path / "tiny"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.timeout(60)
def test_a_full_disk_is_a_clear_error_naming_the_budget(full_disk: Path) -> None:
    store = RowStore(full_disk / "ps1", {}, "ps1")
    rows, blob = list(range(1000)), bytes(1000)
    with pytest.raises(StoreError, match=r"could not write 1000 rows .*model.table_memory_budget.*checkpoint"):
        for i in range(100):  # 100 MB into 1 MB
            store.put([r + 1000 * i for r in rows], [blob] * len(rows))
