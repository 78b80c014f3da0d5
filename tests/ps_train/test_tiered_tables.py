"""Lazy and tiered tables in real runs (``ps_train.workloads.ctr.tables.tiered_storage``):
a sync run with lazy rows, or with a RAM budget that sends most rows to disk and back,
trains exactly as the eager in-RAM run does (the same initial rows, the same sums, the
same updates); ``metrics.json`` reports the tier's counts; and a tiered run killed and
resumed from its checkpoint ends like the uninterrupted one."""

from __future__ import annotations

from pathlib import Path

import pytest

from ps_train.config import ConfigError
from tests.ps_train._app import make_cfg, run_app, scalars
from tests.ps_train.test_dlrm import SMALL

# 7,007 rows: ~3,500 per server; a step touches at most 2 trainers x 32 samples x 3 tables.
TIERED = (
    *(o for o in SMALL if not o.startswith(("data.table_sizes", "data.table_rows"))),
    "data.table_sizes=[4000,7,3000]",
    "data.table_rows=4000",
    "mode=sync",
    "cluster.num_servers=2",
    "cluster.num_trainers=2",
    "train.steps=16",
)
BUDGET = "model.table_memory_budget=26000"  # ~200 rows of 4 floats + Adagrad's 4 in RAM: most go to disk


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_lazy_and_tiered_runs_train_exactly_as_the_eager_run(tmp_path: Path) -> None:
    eager = run_app(tmp_path / "eager", *TIERED, timeout=120)
    lazy = run_app(tmp_path / "lazy", *TIERED, "model.lazy_rows=true", timeout=120)
    tiered = run_app(tmp_path / "tiered", *TIERED, BUDGET, timeout=120)
    for trainer in ("trainer0", "trainer1"):
        assert lazy["losses"][trainer] == eager["losses"][trainer]
        assert tiered["losses"][trainer] == eager["losses"][trainer]
    assert "tier" not in eager and lazy["tier"]["ps0"]["rows_created"] > 0
    for tier in tiered["tier"].values():
        assert tier["rows_evicted"] > 0 and tier["bytes_written"] > 0 and tier["rows_read_back"] > 0
        assert 0 < tier["hit_rate"] < 1 and tier["ram_bytes"] <= 26000
    assert (tmp_path / "tiered" / "tables" / "ps0" / "rocksdb").is_dir()
    for s in ("ps0", "ps1"):  # the servers' TensorBoard folders
        tags = scalars(tmp_path / "tiered" / "tb" / s)
        assert "server/tier_rows_in_ram" in tags and "server/tier_rows_evicted_per_s" in tags


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_a_resumed_tiered_run_ends_like_the_uninterrupted_one(tmp_path: Path) -> None:
    cfg = (*TIERED, BUDGET, "checkpoint.every=4", "checkpoint.keep=0")
    whole = run_app(tmp_path / "whole", *cfg, timeout=120)
    run_app(tmp_path / "first", *(*cfg, "train.steps=8"), timeout=120)
    second = run_app(tmp_path / "second", *cfg, f"resume={tmp_path / 'first'}", timeout=120)
    for trainer in ("trainer0", "trainer1"):
        assert second["losses"][trainer] == whole["losses"][trainer][8:]


def test_bad_table_storage_settings_name_the_setting() -> None:
    with pytest.raises(ConfigError, match="model.table_memory_budget: 'lots'"):
        make_cfg(*TIERED, "model.table_memory_budget=lots")
    with pytest.raises(ConfigError, match="model.table_dtype: unknown 'float8'"):
        make_cfg(*TIERED, "model.table_dtype=float8")
    with pytest.raises(ConfigError, match="model.table_optim=sparse_adam: lazy, tiered"):
        make_cfg(*TIERED, BUDGET, "model.table_optim=sparse_adam")


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_rows_travel_in_half_and_train_as_float32_does(tmp_path: Path, dtype: str) -> None:
    """The answers and their gradients cross the wire in the rows' dtype: a server's bytes per
    step fall by about 2 bytes per value each way, and the losses stay near float32's."""
    cfg = (*TIERED, "model.lazy_rows=true")
    full = run_app(tmp_path / "float32", *cfg, timeout=120)
    half = run_app(tmp_path / dtype, *cfg, f"model.table_dtype={dtype}", timeout=120)
    for server, full_bytes in full["server_bytes_per_step"].items():
        half_bytes = half["server_bytes_per_step"][server]
        # 2 bytes saved per value of every answer out and of its gradient in: the same saving
        # both ways (at this tiny width, framing and ids are most of the bytes)
        saved_out = full_bytes["sent"] - half_bytes["sent"]
        saved_in = full_bytes["received"] - half_bytes["received"]
        assert saved_out > 0.05 * full_bytes["sent"], (server, half_bytes, full_bytes)
        assert abs(saved_in - saved_out) < 0.1 * saved_out, (server, half_bytes, full_bytes)
    for trainer in ("trainer0", "trainer1"):
        for a, b in zip(half["losses"][trainer], full["losses"][trainer], strict=True):
            assert abs(a - b) < 0.02 * abs(b), (trainer, a, b)
