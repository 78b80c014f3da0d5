"""Checkpoints of embedding tables that do not stop training (``ps_train.workloads.ctr.tables.snapshot``,
``ps_train.checkpoint.rows_file``): a snapshot written while updates go on holds the rows as
they were when it was taken; differential checkpoints hold only the changed rows and restore,
through their chain, the same tables; a broken chain is refused naming the file; and a sync
run killed and resumed from a differential checkpoint ends like the uninterrupted run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ps_train.checkpoint.files import (
    CheckpointError,
    Manifest,
    ShardFile,
    begin_checkpoint,
    prune_checkpoints,
    read_manifest,
    write_manifest,
)
from ps_train.checkpoint.protocol import load_resume_state
from ps_train.checkpoint.rows_file import RowChunk, RowsFileError, load_rows, write_rows_file
from ps_train.config import ConfigError, CtrDataConfig, DLRMConfig
from ps_train.faults import FAULT_ENV
from ps_train.launch.rank import table_settings
from ps_train.workloads.ctr.tables.fused_storage import FusedStorage
from ps_train.workloads.ctr.tables.service import TableServer
from ps_train.workloads.ctr.tables.snapshot import TableSnapshot
from tests.ps_train._app import make_cfg, run_app, saved_tables

SIZES = [5000, 7000, 300]  # 12,300 rows on one server: 4 blocks of 4,096


def _server(optim: str) -> TableServer:
    cfg = make_cfg(
        "model=dlrm",
        "data=synthetic_ctr",
        "data.num_tables=3",
        f"data.table_sizes=[{','.join(map(str, SIZES))}]",
        "model.embedding_dim=4",
        f"model.table_optim={optim}",
        "cluster.num_servers=1",
    )
    assert isinstance(cfg.model, DLRMConfig) and isinstance(cfg.data, CtrDataConfig)
    return TableServer(cfg.model, cfg.data, table_settings(cfg), rank=0)


def _fused(ts: TableServer) -> FusedStorage:
    assert isinstance(ts.storage, FusedStorage)
    return ts.storage


def _step(ts: TableServer, g: torch.Generator, hot: bool) -> None:
    """One update of ~60 rows: mostly the first rows of the storage (Zipf-like), some anywhere."""
    n = _fused(ts).shards.weight.shape[0]
    anywhere = torch.randint(0, n, (0 if hot else 20,), generator=g)
    rows = torch.cat([torch.randint(0, 50, (40,), generator=g), anywhere])
    values = torch.randn(len(rows), 4, generator=g)
    grad = torch.sparse_coo_tensor(rows.unsqueeze(0), values, (n, 4), check_invariants=True)
    ts.step({_fused(ts).shards.weight: grad})


def _write_while_training(ts: TableServer, snap: TableSnapshot, path: Path, g: torch.Generator, hot: bool) -> None:
    """Write the snapshot's rows file with updates between its blocks (as the server's
    writer thread and its updates interleave; ``hot``: updates of the first rows only), and
    end the snapshot."""

    def interleaved() -> Iterator[RowChunk]:
        for chunk in snap.rows.chunks():
            yield chunk
            for _ in range(3):
                _step(ts, g, hot)

    write_rows_file(path, snap.header, interleaved())
    ts.end_snapshot(written=True)


def _columns(ts: TableServer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _fused(ts).columns().items()}


@pytest.mark.parametrize("optim", ["adagrad", "rowwise_adagrad", "sparse_adam", "sgd"])
def test_a_snapshot_written_while_updates_go_on_holds_the_rows_of_its_moment(tmp_path, optim):
    ts, g = _server(optim), torch.Generator().manual_seed(0)
    for _ in range(5):
        _step(ts, g, hot=False)
    full = ts.begin_snapshot("step_000000005", base=None)
    assert not full.differential and full.rows.rows == _fused(ts).shards.weight.shape[0]
    at_full = _columns(ts)
    _write_while_training(ts, full, tmp_path / "full.rows", g, hot=True)
    assert full.rows.rows_copied_aside == 0  # the hot block was written first, before any update
    assert not torch.equal(_fused(ts).shards.weight.detach(), at_full["weight"])  # training went on
    restored = load_rows([tmp_path / "full.rows"])
    assert restored.keys() == at_full.keys()
    for k in at_full:
        assert torch.equal(restored[k], at_full[k]), k

    for _ in range(4):
        _step(ts, g, hot=False)
    changed = int(_fused(ts).changed.sum())
    diff = ts.begin_snapshot("step_000000010", base="step_000000005")
    assert diff.differential and diff.rows.rows == changed < _fused(ts).shards.weight.shape[0] // 10
    at_diff = _columns(ts)
    _write_while_training(ts, diff, tmp_path / "diff.rows", g, hot=False)
    assert diff.rows.rows_copied_aside > 0  # updates met rows not yet written: copied aside
    chain = load_rows([tmp_path / "full.rows", tmp_path / "diff.rows"])
    for k in at_diff:
        assert torch.equal(chain[k], at_diff[k]), k
    assert (tmp_path / "diff.rows").stat().st_size < (tmp_path / "full.rows").stat().st_size / 10

    # A server that did not count changes from the asked base writes everything.
    assert not ts.begin_snapshot("step_000000020", base="step_000000015").differential


def test_a_chain_must_start_with_a_full_rows_file(tmp_path):
    ts, g = _server("adagrad"), torch.Generator().manual_seed(1)
    _write_while_training(ts, ts.begin_snapshot("step_000000001", None), tmp_path / "full.rows", g, hot=False)
    _step(ts, g, hot=True)
    diff = ts.begin_snapshot("step_000000002", "step_000000001")
    _write_while_training(ts, diff, tmp_path / "diff.rows", g, hot=False)
    with pytest.raises(RowsFileError, match="diff.rows is differential; a chain must start with a full rows file"):
        load_rows([tmp_path / "diff.rows"])
    (tmp_path / "cut.rows").write_bytes((tmp_path / "full.rows").read_bytes()[:-100])
    with pytest.raises(RowsFileError, match="cut.rows: truncated"):
        load_rows([tmp_path / "cut.rows"])


def _fake_checkpoint(run: Path, step: int, base: int | None) -> Path:
    ckpt = begin_checkpoint(run, step)
    (ckpt / "ps0.pt").write_bytes(b"x")
    (ckpt / "ps0.rows").write_bytes(b"y")
    write_manifest(
        ckpt,
        Manifest(
            step=step,
            shards=[ShardFile("ps0", "ps0.pt", 1, "")],
            row_files=[ShardFile("ps0.rows", "ps0.rows", 1, "")],
            bases={} if base is None else {"ps0": f"step_{base:09d}"},
        ),
    )
    return ckpt


def test_pruning_keeps_the_checkpoints_a_kept_one_builds_on(tmp_path):
    for step, base in ((2, None), (4, 2), (6, 4), (8, None), (10, 8)):
        _fake_checkpoint(tmp_path, step, base)
    removed = prune_checkpoints(tmp_path, keep=2)  # keeps 8 and 10 (10 builds on 8)
    assert sorted(p.name for p in removed) == ["step_000000002", "step_000000004", "step_000000006"]
    for step, base in ((12, 10), (14, 12)):
        _fake_checkpoint(tmp_path, step, base)
    assert prune_checkpoints(tmp_path, keep=1) == []  # 14 needs 12, 10 and 8


def test_the_full_every_setting_is_checked():
    with pytest.raises(ConfigError, match=r"checkpoint.full_every: 0 must be >= 1 \(1 = every checkpoint full\)"):
        make_cfg("checkpoint.full_every=0")


# Sync DLRM, 2 servers + 2 trainers, checkpoints after steps 2 (full), 4 (on 2), 6 (on 4), 8 (full).
RUN = (
    "model=dlrm",
    "data=synthetic_ctr",
    "data.num_samples=3000",
    "data.num_tables=3",
    "data.table_sizes=[40,7,300]",
    "data.num_dense=5",
    "model.embedding_dim=4",
    "model.bottom_mlp=[8]",
    "model.top_mlp=[8]",
    "train.batch_size=32",
    "mode=sync",
    "train.steps=8",
    "checkpoint.every=2",
    "checkpoint.keep=0",
    "checkpoint.when_busy=wait",  # a checkpoint after every second step, however fast the steps
)
DIFFERENTIAL = ("checkpoint.differential=true", "checkpoint.full_every=3")


@pytest.mark.timeout(600)  # two small runs and a restart: ~1 min on a quiet machine
def test_a_run_killed_and_resumed_from_a_differential_chain_ends_like_the_uninterrupted_run(tmp_path, monkeypatch):
    whole = run_app(tmp_path / "whole", *RUN, timeout=240)  # full checkpoints only
    # The wait after the last step for the step-8 checkpoint is reported apart from the training's rate.
    assert whole["final_checkpoint_wait_s"] > 0
    assert whole["samples_per_s"] == pytest.approx(whole["samples"] / whole["wall_time_s"])
    # trainer0 dies while the step-8 checkpoint is written (the servers wrote their files, the
    # manifest is missing): the run restarts from step 6, a chain of steps 2 (full), 4 and 6.
    monkeypatch.setenv(FAULT_ENV, "trainer0@8:checkpoint#0")
    run_dir = tmp_path / "killed"
    killed = run_app(run_dir, *RUN, *DIFFERENTIAL, "cluster.max_restarts=1", timeout=300)
    ckpts = run_dir / "checkpoints"
    assert [r["from_step"] for r in killed["restarts"]] == [6]
    bases = {p.name: read_manifest(p).bases for p in sorted(ckpts.iterdir())}
    assert bases == {
        "step_000000002": {},
        "step_000000004": {"ps0": "step_000000002", "ps1": "step_000000002"},
        "step_000000006": {"ps0": "step_000000004", "ps1": "step_000000004"},
        "step_000000008": {},  # written again by the resumed run: the first after a restart is full
    }
    for trainer, losses in whole["losses"].items():
        assert killed["losses"][trainer] == losses[6:]  # the resumed attempt's steps 7 and 8
    a, b = saved_tables(tmp_path / "whole"), saved_tables(run_dir)
    for server in a:
        for column, x in a[server].items():
            assert torch.equal(x, b[server][column]), f"{server} {column}"
    # Step 6 restored through its chain equals the uninterrupted run's full step-6 checkpoint.
    a6, b6 = (
        saved_tables(tmp_path / "whole", ckpts.parent.parent / "whole" / "checkpoints" / "step_000000006"),
        saved_tables(run_dir, ckpts / "step_000000006"),
    )
    for server in a6:
        for column, x in a6[server].items():
            assert torch.equal(x, b6[server][column]), f"{server} {column} at step 6"
    diff_bytes = (ckpts / "step_000000006" / "ps0.rows").stat().st_size
    assert diff_bytes < (ckpts / "step_000000002" / "ps0.rows").stat().st_size

    # A broken link is refused, naming it and where to resume from instead.
    link = ckpts / "step_000000004" / "ps0.rows"
    kept = link.read_bytes()
    link.unlink()
    with pytest.raises(CheckpointError) as e:
        load_resume_state(str(ckpts / "step_000000006"), "ps0")
    assert str(e.value) == (
        f"checkpoint {ckpts / 'step_000000006'} holds only the rows ps0 changed since {ckpts / 'step_000000004'}, "
        f"which is incomplete (its manifest.json or a file it lists); resume from an earlier checkpoint, "
        f"e.g. resume={ckpts / 'step_000000002'} (a full one)"
    )
    link.write_bytes(kept)
    assert load_resume_state(str(ckpts / "step_000000006"), "ps0")["step"] == 6
    rows = ckpts / "step_000000002" / "ps1.rows"
    rows.write_bytes(rows.read_bytes()[:-8] + b"\0" * 8)  # same size, other bytes
    with pytest.raises(CheckpointError, match=f"{rows} does not match its manifest's checksum"):
        load_resume_state(str(ckpts / "step_000000006"), "ps1")
