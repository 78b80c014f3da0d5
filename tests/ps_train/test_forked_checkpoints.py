"""Checkpoints written by a forked child (``ps_train.checkpoint.forked_writer``) around the
page cache (``ps_train.checkpoint.direct_io``), checked by XXH3-128 (``checksums``): the file
holds the rows of the fork's moment however much the server trains meanwhile; a corrupt
rows or state file is refused naming it; manifests written with SHA-256 still load and are
still verified; a checkpoint due while the previous one is written waits, the steps do not."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
import xxhash

from ps_train.checkpoint.checksums import file_matches
from ps_train.checkpoint.direct_io import write_file_direct
from ps_train.checkpoint.files import (
    MANIFEST_NAME,
    CheckpointError,
    Manifest,
    begin_checkpoint,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
    save_shard_state,
    write_manifest,
)
from ps_train.checkpoint.forked_writer import ForkedWrite, FrozenRows, WriteReport, fork_rows_writer
from ps_train.checkpoint.protocol import Action, CheckpointSchedule, load_resume_state
from ps_train.checkpoint.rows_file import load_rows
from ps_train.config import CtrDataConfig, DLRMConfig
from ps_train.launch.rank import table_settings
from ps_train.workloads.ctr.tables.fused_storage import FusedStorage
from ps_train.workloads.ctr.tables.service import TableServer
from tests.ps_train._app import make_cfg

SIZES = [70_000, 9_000, 300]  # 79,300 rows on one server: two chunks of the forked writer


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
    """The in-RAM storage these tables use (no budget, no lazy rows)."""
    assert isinstance(ts.storage, FusedStorage)
    return ts.storage


def _steps(ts: TableServer, g: torch.Generator, n: int) -> None:
    """``n`` updates of 200 rows anywhere in the storage each."""
    rows_total = _fused(ts).shards.weight.shape[0]
    for _ in range(n):
        rows = torch.randint(0, rows_total, (200,), generator=g)
        grad = torch.sparse_coo_tensor(
            rows.unsqueeze(0), torch.randn(200, 4, generator=g), (rows_total, 4), check_invariants=True
        )
        ts.step({_fused(ts).shards.weight: grad})


def _columns(ts: TableServer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _fused(ts).columns().items()}


def _fork_write(ts: TableServer, name: str, base: str | None, path: Path) -> tuple[ForkedWrite, FrozenRows]:
    frozen: list[FrozenRows] = []

    def fork(rows: FrozenRows) -> ForkedWrite:
        frozen.append(rows)
        return fork_rows_writer(rows, path, path.name)

    return ts.freeze_rows(name, base, fork), frozen[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optim", ["adagrad", "rowwise_adagrad"])
def test_a_forked_writer_holds_the_rows_of_the_fork_while_the_server_trains(tmp_path: Path, optim: str) -> None:
    ts, g = _server(optim), torch.Generator().manual_seed(0)
    _steps(ts, g, 5)
    at_full = _columns(ts)
    child, frozen = _fork_write(ts, "step_000000005", None, tmp_path / "full.rows")
    assert frozen.wanted is None and frozen.row_count == sum(SIZES)
    _steps(ts, g, 50)  # the server trains on while the child writes
    report = child.wait()
    ts.end_snapshot(written=True)
    assert not torch.equal(_fused(ts).shards.weight.detach(), at_full["weight"])  # training went on
    restored = load_rows([tmp_path / "full.rows"])
    assert restored.keys() == at_full.keys()
    for k in at_full:
        assert torch.equal(restored[k], at_full[k]), k
    assert isinstance(report, WriteReport) and report.file.bytes == (tmp_path / "full.rows").stat().st_size
    assert report.file.checksum.startswith("xxh3_128:") and file_matches(tmp_path / "full.rows", report.file.checksum)

    # Differential on it: only the rows changed since, and the chain restores this moment.
    _steps(ts, g, 3)
    changed = int(_fused(ts).changed.sum())
    at_diff = _columns(ts)
    child, frozen = _fork_write(ts, "step_000000010", "step_000000005", tmp_path / "diff.rows")
    assert frozen.base == "step_000000005" and frozen.row_count == changed < sum(SIZES) // 5
    _steps(ts, g, 50)
    child.wait()
    ts.end_snapshot(written=True)
    chain = load_rows([tmp_path / "full.rows", tmp_path / "diff.rows"])
    for k in at_diff:
        assert torch.equal(chain[k], at_diff[k]), k


@pytest.mark.timeout(60)
def test_a_failed_forked_write_names_the_file_and_the_next_checkpoint_is_full(tmp_path: Path) -> None:
    ts, g = _server("adagrad"), torch.Generator().manual_seed(1)
    _steps(ts, g, 2)
    missing = tmp_path / "no such folder" / "ps0.rows"
    child, _ = _fork_write(ts, "step_000000002", None, missing)
    with pytest.raises(CheckpointError, match=f"the process writing {missing} failed: FileNotFoundError"):
        child.wait()
    ts.end_snapshot(written=False)
    _steps(ts, g, 1)
    _, frozen = _fork_write(ts, "step_000000003", "step_000000002", tmp_path / "next.rows")
    assert frozen.wanted is None and frozen.base is None  # the changes since step 2 are not known: full


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, (8 << 20) + 17])
def test_a_direct_write_is_the_bytes_and_their_checksum(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    pieces = [memoryview(data)[i : i + 1_000_003] for i in range(0, size, 1_000_003)]
    written, digest, _ = write_file_direct(tmp_path / "f", pieces, xxhash.xxh3_128)
    assert (tmp_path / "f").read_bytes() == data
    assert written == size and digest == xxhash.xxh3_128(data).hexdigest()
    assert os.listdir(tmp_path) == ["f"]  # no temporary file left


@pytest.mark.timeout(60)
def test_a_corrupt_rows_or_state_file_is_refused_naming_it(tmp_path: Path) -> None:
    ts, g = _server("adagrad"), torch.Generator().manual_seed(2)
    _steps(ts, g, 2)
    ckpt = begin_checkpoint(tmp_path, 2)
    child, frozen = _fork_write(ts, ckpt.name, None, ckpt / "ps0.rows")
    state = save_shard_state(ckpt, "ps0", {"tables": frozen.state})
    rows = child.wait().file
    ts.end_snapshot(written=True)
    write_manifest(ckpt, Manifest(step=2, shards=[state], row_files=[rows]))
    assert load_resume_state(str(ckpt), "ps0")["step"] == 2
    for name, match in (
        ("ps0.rows", f"{ckpt / 'ps0.rows'} does not match its manifest's checksum \\(xxh3_128"),
        ("ps0.pt", f"checkpoint {ckpt}: ps0.pt does not match the manifest's checksum \\(xxh3_128"),
    ):
        path = ckpt / name
        kept = path.read_bytes()
        flipped = bytearray(kept)
        flipped[len(kept) // 2] ^= 0x01  # one bit, mid-file: same size
        path.write_bytes(bytes(flipped))
        with pytest.raises(CheckpointError, match=match):
            load_resume_state(str(ckpt), "ps0")
        path.write_bytes(kept)


def _as_format_2(ckpt: Path) -> None:
    """Rewrite ``ckpt``'s manifest as a ps_train of format 2 wrote it: a SHA-256 per file."""
    raw = json.loads((ckpt / MANIFEST_NAME).read_text())
    raw["format_version"] = 2
    for entry in raw["shards"] + raw["row_files"]:
        del entry["checksum"]
        entry["sha256"] = hashlib.sha256((ckpt / entry["file"]).read_bytes()).hexdigest()
    (ckpt / MANIFEST_NAME).write_text(json.dumps(raw))


def test_a_checkpoint_with_sha256_in_its_manifest_still_loads_and_is_verified(tmp_path: Path) -> None:
    ckpt = save_checkpoint(tmp_path, 3, {"shard0": {"w": torch.arange(6.0)}})
    _as_format_2(ckpt)
    manifest, shards = load_checkpoint(ckpt)
    assert manifest.format_version == 2 and manifest.shards[0].checksum.startswith("sha256:")
    assert torch.equal(shards["shard0"]["w"], torch.arange(6.0))
    data = bytearray((ckpt / "shard0.pt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (ckpt / "shard0.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"shard0.pt does not match the manifest's checksum \(sha256"):
        load_checkpoint(ckpt)
    assert read_manifest(ckpt).shards[0].checksum.startswith("sha256:")


def test_a_checkpoint_due_while_the_previous_is_written_is_deferred_not_waited_for() -> None:
    s = CheckpointSchedule(every=2, final=False)
    busy = {2: False, 3: False, 4: True, 5: True, 6: False, 7: True, 8: True, 9: False}
    actions = {step: s.after(step, last=False, busy=b) for step, b in busy.items()}
    assert [step for step, a in actions.items() if a is Action.SAVE] == [2, 6, 9]  # 4: taken at 6; 8: after 9
    assert s.after(10, last=True, busy=True) is Action.SAVE_AND_WAIT  # the last one waits
    assert CheckpointSchedule(every=3, final=False).after(10, last=True, busy=True) is Action.WAIT
    assert CheckpointSchedule(every=3, final=True).after(10, last=True, busy=False) is Action.SAVE_AND_WAIT
    waits = CheckpointSchedule(every=2, final=False, wait_when_busy=True)
    assert waits.after(4, last=False, busy=True) is Action.SAVE  # Checkpointer.save waits for the previous
