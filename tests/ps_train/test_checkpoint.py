import json
import os
import random

import numpy as np
import pytest
import torch

from ps_train.checkpoint.files import (
    MANIFEST_NAME,
    CheckpointError,
    Manifest,
    begin_checkpoint,
    capture_rng_state,
    checkpoint_dir,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_shard_state,
    prune_checkpoints,
    read_manifest,
    resolve_resume,
    restore_rng_state,
    save_checkpoint,
    save_shard_state,
    write_manifest,
)
from ps_train.config import MLPConfig, SyntheticConfig
from ps_train.files import atomic_write_bytes
from ps_train.workloads.vision.data import BatchIterator, load_data
from ps_train.workloads.vision.models import build_model_shards


def _state(value: float):
    return {"model": {"w": torch.full((3,), value)}, "updates": int(value)}


def test_save_and_load_round_trip(tmp_path):
    rng = capture_rng_state()
    ckpt = save_checkpoint(
        tmp_path,
        7,
        {"shard0": _state(1.0), "shard1": _state(2.0)},
        trainer_positions={"trainer0": {"epoch": 1, "offset": 64}},
        rng_states={"trainer0": rng},
        extra={"mode": "sync"},
    )
    assert ckpt == checkpoint_dir(tmp_path, 7) == tmp_path / "checkpoints" / "step_000000007"
    assert sorted(p.name for p in ckpt.iterdir()) == [MANIFEST_NAME, "shard0.pt", "shard1.pt"]
    assert latest_checkpoint(tmp_path) == ckpt
    manifest, shards = load_checkpoint(ckpt)
    assert manifest.step == 7 and [s.file for s in manifest.shards] == ["shard0.pt", "shard1.pt"]
    assert manifest.trainer_positions == {"trainer0": {"epoch": 1, "offset": 64}}
    assert manifest.rng_states["trainer0"] == rng and manifest.extra == {"mode": "sync"}
    assert torch.equal(shards["shard1"]["model"]["w"], torch.full((3,), 2.0)) and shards["shard1"]["updates"] == 2
    assert load_shard_state(ckpt, manifest.shards[0])["updates"] == 1  # what one server loads
    json.loads((ckpt / MANIFEST_NAME).read_text())  # plain JSON, readable by anyone


def test_latest_skips_half_written_checkpoints(tmp_path):
    save_checkpoint(tmp_path, 10, {"shard0": _state(1.0)})
    # A crash after the shards but before the manifest: step 20 must not be picked up.
    partial = begin_checkpoint(tmp_path, 20)
    save_shard_state(partial, "shard0", _state(2.0))
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 10)
    # A manifest whose shard file was truncated afterwards: not complete either.
    save_checkpoint(tmp_path, 30, {"shard0": _state(3.0)})
    shard = checkpoint_dir(tmp_path, 30) / "shard0.pt"
    shard.write_bytes(shard.read_bytes()[:20])
    assert not is_complete(checkpoint_dir(tmp_path, 30))
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 10)
    assert list_checkpoints(tmp_path) == [checkpoint_dir(tmp_path, 10)]
    # Steps sort numerically, not as text.
    save_checkpoint(tmp_path, 100, {"shard0": _state(4.0)})
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 100)


def test_corrupt_shard_fails_the_hash_check(tmp_path):
    ckpt = save_checkpoint(tmp_path, 1, {"shard0": _state(1.0)})
    shard = ckpt / "shard0.pt"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # same size, different bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"shard0.pt does not match the manifest.s checksum"):
        load_checkpoint(ckpt)


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    atomic_write_bytes(path, b"old")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(path, b"new contents")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]  # temp file cleaned up


def test_distributed_protocol_and_stale_manifest(tmp_path):
    ckpt = begin_checkpoint(tmp_path, 5)
    entries = [save_shard_state(ckpt, f"shard{i}", _state(float(i))) for i in range(2)]  # on each server
    with pytest.raises(CheckpointError, match="shard9.pt was not saved"):
        write_manifest(ckpt, Manifest(step=5, shards=entries + [entries[0].__class__("shard9", "shard9.pt", 1, "x")]))
    write_manifest(ckpt, Manifest(step=5, shards=entries))
    assert is_complete(ckpt)
    # Saving step 5 again: begin_checkpoint withdraws the old manifest before shards change.
    begin_checkpoint(tmp_path, 5)
    assert not is_complete(ckpt) and latest_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointError, match="no manifest.json"):
        read_manifest(ckpt)
    with pytest.raises(ValueError, match="must match"):
        save_shard_state(ckpt, "../evil", {})


def test_prune_keeps_newest_complete_and_in_progress(tmp_path):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, {"shard0": _state(float(step))})
    begin_checkpoint(tmp_path, 0)  # stale leftover, older than the newest complete
    begin_checkpoint(tmp_path, 9)  # a save in progress
    removed = prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["step_000000000", "step_000000001", "step_000000002"]
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == ["step_000000003", "step_000000004", "step_000000009"]
    assert prune_checkpoints(tmp_path, keep=0) == []


def test_resolve_resume(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve_resume(tmp_path)
    with pytest.raises(CheckpointError, match="no such directory"):
        resolve_resume(tmp_path / "missing")
    ckpt = save_checkpoint(tmp_path, 3, {"shard0": _state(1.0)})
    assert resolve_resume(tmp_path) == ckpt == resolve_resume(ckpt)


def test_rng_state_round_trip_is_json_safe():
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    state = json.loads(json.dumps(capture_rng_state()))
    first = (torch.rand(3), random.random(), np.random.rand())
    restore_rng_state(state)
    second = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(first[0], second[0]) and first[1:] == second[1:]


def _train(shards, opt, it, steps):
    losses = []
    for _ in range(steps):
        x, y = next(it)
        h = x
        for s in shards:
            h = s.module(h)
        loss = torch.nn.functional.cross_entropy(h, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_resume_from_checkpoint_equals_uninterrupted_training(tmp_path):
    # Oracle for resume: train 8 steps straight vs. 4 steps, checkpoint (shard + optimizer
    # state, data position, RNG for dropout), rebuild everything fresh, load, 4 more steps.
    train, _ = load_data(SyntheticConfig(shape=[16], num_classes=4, train_size=96, test_size=8))
    cfg = MLPConfig(hidden_sizes=[12, 8], dropout=0.3)

    def fresh():
        shards = build_model_shards(cfg, (16,), 4, num_servers=2, strategy="balanced", seed=0)
        params = [p for s in shards for p in s.module.parameters()]
        return shards, torch.optim.Adam(params, lr=0.01), BatchIterator(train, 0, 2, batch_size=8, seed=5)

    torch.manual_seed(42)
    shards, opt, it = fresh()
    straight = _train(shards, opt, it, 8)
    final = [p.detach().clone() for s in shards for p in s.module.parameters()]

    torch.manual_seed(42)
    shards, opt, it = fresh()
    first = _train(shards, opt, it, 4)
    save_checkpoint(
        tmp_path,
        4,
        {s.name: {"model": s.module.state_dict()} for s in shards} | {"optimizer": {"state": opt.state_dict()}},
        trainer_positions={"trainer0": it.state_dict()},
        rng_states={"trainer0": capture_rng_state()},
    )
    torch.manual_seed(999)  # whatever happens in between must not matter

    shards, opt, it = fresh()
    manifest, states = load_checkpoint(resolve_resume(tmp_path))
    for s in shards:
        s.module.load_state_dict(states[s.name]["model"])
    opt.load_state_dict(states["optimizer"]["state"])
    it.load_state_dict(manifest.trainer_positions["trainer0"])
    restore_rng_state(manifest.rng_states["trainer0"])
    resumed = first + _train(shards, opt, it, 4)
    assert resumed == straight  # bit for bit
    trained = [p for s in shards for p in s.module.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(final, trained, strict=True))
