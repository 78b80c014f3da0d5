"""End to end through ``ps_train.app.run``: the run folder, TensorBoard events, every mode
with 2 trainers, every model, the digits and synthetic data loaders."""

import math
import re

import pytest
import torch
from tensorboard.plugins.hparams import plugin_data_pb2

from tests.ps_train._app import final_weights, hparams_plugin, read_json, run_app, scalars

ROLES = ("ps0", "ps1", "trainer0", "trainer1")


def check_metrics(metrics, steps, trainers=2, batch=32):
    assert metrics["steps"] == steps
    assert metrics["samples"] == steps * trainers * batch
    assert 0.0 <= metrics["test_accuracy"] <= 1.0
    assert math.isfinite(metrics["test_loss"]) and metrics["test_loss"] > 0
    assert metrics["samples_per_s"] > 0 and metrics["wall_time_s"] > 0
    assert sorted(metrics["losses"]) == [f"trainer{k}" for k in range(trainers)]
    for losses in metrics["losses"].values():
        assert len(losses) == steps and all(math.isfinite(v) for v in losses)


@pytest.mark.timeout(90)
def test_smoke_run_folder_has_metrics_logs_tensorboard_and_provenance(tmp_path):
    run_dir = tmp_path / "run"
    metrics = run_app(run_dir, "train.steps=4", "train.eval_every=2")
    check_metrics(metrics, steps=4)
    assert metrics == read_json(run_dir / "metrics.json")
    assert metrics["mode"] == "sync" and metrics["backend"] == "rpc_core"
    assert metrics["server_updates"] == [4, 4]  # one aggregated update per step on each server
    # Each server's bytes per trainer step (rpc_core's counters): at least the activation that
    # enters its shard, x [32, 64] on ps0 and the first hidden layer's [32, 128] on ps1, float32.
    per = metrics["server_bytes_per_step"]
    assert per["ps0"]["received"] >= 32 * 64 * 4 and per["ps1"]["received"] >= 32 * 128 * 4

    for role in ROLES:  # every role logged where it joined and that it finished
        log = (run_dir / "logs" / f"{role}.log").read_text()
        assert "rendezvous at tcp://127.0.0.1:" in log and f"{role} finished" in log

    t0 = scalars(run_dir / "tb" / "trainer0")
    for tag in (
        "train/loss",
        "train/accuracy",
        "train/lr",
        "train/samples_per_s",
        "test/accuracy",
        "test/loss",
        "rpc/forward_latency_ms/ps0",
        "rpc/forward_latency_ms/ps1",
        "rpc/bytes_sent/ps0",
        "rpc/bytes_sent/ps1",
        "rpc/bytes_received/ps0",
        "rpc/bytes_received/ps1",
        "server/updates/shard0",
        "server/updates/shard1",
    ):
        assert tag in t0, f"trainer0 events lack {tag}; have {sorted(t0)}"
    assert [s for s, _ in t0["train/loss"]] == [1, 2, 3, 4]
    assert [v for _, v in t0["train/loss"]] == pytest.approx(metrics["losses"]["trainer0"], rel=1e-6)
    assert [s for s, _ in t0["test/accuracy"]] == [2, 4]  # every train.eval_every steps and at the end
    assert t0["test/accuracy"][-1][1] == pytest.approx(metrics["test_accuracy"])
    assert t0["train/lr"][-1][1] == pytest.approx(0.05)
    assert t0["server/updates/shard0"][-1] == (4, 4.0)
    assert all(v > 0 for _, v in t0["rpc/bytes_sent/ps0"])
    assert "train/staleness" not in t0  # sync mode has none

    t1 = scalars(run_dir / "tb" / "trainer1")  # loss and accuracy per trainer
    assert [v for _, v in t1["train/loss"]] == pytest.approx(metrics["losses"]["trainer1"], rel=1e-6)
    assert "train/accuracy" in t1

    hp = hparams_plugin(run_dir / "tb")  # the run's HParams session, at tb/ (ps_train.observe.dashboard)
    start = plugin_data_pb2.HParamsPluginData.FromString(hp["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["optim.lr"].number_value == pytest.approx(0.05)
    assert start.hparams["mode.name"].string_value == "sync"
    for r in (0, 1):  # the servers' own runs
        ps = scalars(run_dir / "tb" / f"ps{r}")
        assert ps["server/updates_per_s"][-1][0] == 4  # the last sample is at the server's final version
        # Both trainers' gradients in every round: over the samples, gradients = 2 x updates.
        versions = [0] + [v for v, _ in ps["server/updates_per_s"]]
        updates = {b: b - a for a, b in zip(versions, versions[1:], strict=False) if b > a}  # a sample's own updates
        per_round = ps["server/contributions_per_round"]
        assert sum(c * updates[v] for v, c in per_round) == pytest.approx(2 * 4), (per_round, versions)

    prov = read_json(run_dir / "provenance.json")
    assert prov["overrides"] == ["train.steps=4", "train.eval_every=2"]
    assert prov["config"]["train"]["steps"] == 4
    assert prov["packages"]["torch"] and prov["packages"]["hydra-core"]
    assert re.fullmatch(r"[0-9a-f]{40}", prov["git_revision"])
    assert (run_dir / "checkpoints" / "step_000000004" / "manifest.json").is_file()


@pytest.mark.timeout(90)
def test_async_mode_two_trainers_cnn_applies_every_gradient_without_inplace_errors(tmp_path):
    run_dir = tmp_path / "run"
    metrics = run_app(run_dir, "mode=async", "model=cnn", "train.steps=5")
    check_metrics(metrics, steps=5)
    assert metrics["mode"] == "async"
    # Each trainer's gradients are applied on their own: 2 trainers x 5 steps on every server.
    assert metrics["server_updates"] == [10, 10]
    for trainer in ("trainer0", "trainer1"):
        tags = scalars(run_dir / "tb" / trainer)
        assert len(tags["train/staleness"]) == 5
        assert all(0 <= v <= metrics["max_staleness"] for _, v in tags["train/staleness"])
    assert metrics["max_staleness"] <= 10


@pytest.mark.timeout(90)
def test_ssp_mode_keeps_trainers_within_the_staleness_bound_on_synthetic_data(tmp_path):
    run_dir = tmp_path / "run"
    metrics = run_app(
        run_dir,
        "mode=ssp",
        "mode.staleness=1",
        "model=mlp",
        "data=synthetic",
        "data.shape=[1,12,12]",
        "data.train_size=512",
        "data.test_size=64",
        "train.steps=6",
    )
    check_metrics(metrics, steps=6)
    assert metrics["mode"] == "ssp"
    assert metrics["max_steps_ahead"] <= 1
    assert metrics["server_updates"] == [12, 12]
    tags = scalars(run_dir / "tb" / "trainer0")
    assert "train/staleness" in tags
    assert [s for s, _ in tags["train/steps_ahead"]] == list(range(1, 7))
    assert all(v <= 1 for _, v in tags["train/steps_ahead"])


@pytest.mark.timeout(90)
def test_resnet18_trains_on_tiny_synthetic_cifar_sized_images(tmp_path):
    metrics = run_app(
        tmp_path / "run",
        "model=resnet18",
        "data=synthetic",
        "data.shape=[3,32,32]",
        "data.train_size=32",
        "data.test_size=8",
        "train.batch_size=4",
        "train.steps=2",
        "checkpoint.keep=1",
    )
    check_metrics(metrics, steps=2, batch=4)
    assert metrics["server_updates"] == [2, 2]
    weights = final_weights(tmp_path / "run")  # 6 stages in 2 shards, BatchNorm statistics included
    assert {(server, shard) for server, shard, _ in weights} == {("ps0", 0), ("ps1", 1)}
    assert any(key.endswith("running_mean") for _, _, key in weights)


@pytest.mark.timeout(90)
def test_checkpoint_final_false_skips_only_the_checkpoint_after_the_last_step(tmp_path):
    from ps_train.checkpoint.files import list_checkpoints

    metrics = run_app(tmp_path, "train.steps=5", "checkpoint.every=2", "checkpoint.keep=0", "checkpoint.final=false")
    check_metrics(metrics, steps=5)
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step_000000002", "step_000000004"]


@pytest.mark.timeout(180)
def test_the_safe_serializer_trains_exactly_what_pickle_trains(tmp_path):
    # Sync mode is bit-reproducible: the serializer must change nothing but the bytes on the wire.
    pickled = run_app(tmp_path / "pickle", "train.steps=6", "checkpoint.every=3")
    safe = run_app(tmp_path / "safe", "train.steps=6", "checkpoint.every=3", "cluster.serializer=safe")
    check_metrics(safe, steps=6)
    assert safe["losses"] == pickled["losses"] and safe["test_accuracy"] == pickled["test_accuracy"]
    a, b = final_weights(tmp_path / "pickle"), final_weights(tmp_path / "safe")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
