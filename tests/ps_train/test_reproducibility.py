"""Sync mode is exact: it equals single-process torch (averaging, or summing, the trainers'
gradients; on rpc_core the update rides on the backward by default, also checked on
test_update_in_backward.py's longer run), repeats bit for bit, survives a resume, and gives
the same numbers on torch.distributed.rpc (backend=torch)."""

import contextlib
import subprocess
import sys

import pytest
import torch

from tests.ps_train._app import (
    BASELINE,
    BASELINE_STEPS,
    assert_same_weights,
    checkpoint_weights,
    final_weights,
    make_cfg,
    read_json,
    run_app,
)
from tests.ps_train._oracle import single_process_run


@pytest.mark.timeout(120)
def test_sync_mode_equals_single_process_torch_bit_for_bit(sync_baseline):
    run_dir, metrics = sync_baseline
    losses, weights = single_process_run(make_cfg(*BASELINE), BASELINE_STEPS)
    assert metrics["losses"] == losses  # per trainer, per step, exactly
    assert_same_weights(final_weights(run_dir), weights, exact=True)


@pytest.mark.timeout(120)
def test_sync_mode_averages_like_one_process_on_the_union_of_the_trainers_batches(sync_baseline):
    # The meaning of mode.aggregate=mean: each step is one step on the trainers' batches
    # together. Float sums in another order: within 1e-6, not bit for bit.
    run_dir, metrics = sync_baseline
    losses, weights = single_process_run(make_cfg(*BASELINE), BASELINE_STEPS, union_batch=True)
    for trainer, values in losses.items():
        assert metrics["losses"][trainer] == pytest.approx(values, rel=0, abs=1e-6)
    mine = final_weights(run_dir)
    assert mine.keys() == weights.keys()
    for k in weights:
        torch.testing.assert_close(mine[k], weights[k], rtol=0, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def assert_run_equals_single_process(run_dir, cfg):
    """Run ``cfg``; its per-step losses and final weights are single-process torch's, bit for
    bit. Returns the run's metrics."""
    metrics = run_app(run_dir, *cfg)
    losses, weights = single_process_run(make_cfg(*cfg), BASELINE_STEPS)
    assert metrics["losses"] == losses
    assert_same_weights(final_weights(run_dir), weights, exact=True)
    return metrics


@pytest.mark.timeout(120)
def test_sync_mode_sum_equals_single_process_torch_summing_gradients_bit_for_bit(tmp_path):
    # mode.aggregate=sum: the rate grows with the trainers (twice the default's steps here).
    cfg = (*BASELINE, "mode.aggregate=sum")
    metrics = assert_run_equals_single_process(tmp_path / "sum", cfg)
    mean_losses, _ = single_process_run(make_cfg(*BASELINE), BASELINE_STEPS)
    assert metrics["losses"]["trainer0"][1:] != mean_losses["trainer0"][1:]  # a different computation


@pytest.mark.timeout(120)
def test_resume_from_run_dir_continues_exactly_like_an_uninterrupted_run(tmp_path):
    cfg = (
        "mode=sync",
        "model=mlp",
        "model.dropout=0.3",
        "optim.momentum=0.9",
        "checkpoint.every=2",
        "checkpoint.keep=0",
    )
    whole = run_app(tmp_path / "whole", *cfg, "train.steps=6")
    first = run_app(tmp_path / "first", *cfg, "train.steps=4")
    # Two sync runs give identical losses and weights. Dropout makes the point: its masks are
    # seeded per (seed, shard, trainer, step), not by which trainer's request a server
    # happened to serve first.
    assert len(first["losses"]["trainer0"]) == len(first["losses"]["trainer1"]) == 4
    for trainer in ("trainer0", "trainer1"):
        assert first["losses"][trainer] == whole["losses"][trainer][:4]
    whole_at_4 = checkpoint_weights(tmp_path / "whole" / "checkpoints" / "step_000000004")
    assert_same_weights(final_weights(tmp_path / "first"), whole_at_4, exact=True)
    # The first run's latest checkpoint is its final one, after step 4 (with momentum buffers).
    second = run_app(tmp_path / "second", *cfg, "train.steps=6", f"resume={tmp_path / 'first'}")
    assert second["steps"] == 6
    for trainer in ("trainer0", "trainer1"):
        assert second["losses"][trainer] == whole["losses"][trainer][4:]
    assert_same_weights(final_weights(tmp_path / "second"), final_weights(tmp_path / "whole"), exact=True)
    manifest = read_json(sorted((tmp_path / "second" / "checkpoints").iterdir())[-1] / "manifest.json")
    assert manifest["step"] == 6


@pytest.mark.timeout(120)
def test_resume_with_another_model_fails_before_starting_and_names_the_field(tmp_path, sync_baseline):
    from ps_train.config import ConfigError

    run_dir, _ = sync_baseline
    with pytest.raises(ConfigError, match=r"model: the checkpoint has .*hidden_sizes"):
        run_app(tmp_path / "r", *BASELINE, "model.hidden_sizes=[32,16]", f"resume={run_dir}")
    assert not (tmp_path / "r" / "logs").exists()  # no role was started


@pytest.mark.timeout(120)
def test_torch_backend_sync_run_equals_rpc_core_run(tmp_path, sync_baseline):
    run_dir, metrics = sync_baseline
    torch_metrics = run_app(tmp_path / "torch", *BASELINE, "backend=torch")
    assert torch_metrics["backend"] == "torch"
    assert torch_metrics["losses"] == metrics["losses"]
    assert_same_weights(final_weights(tmp_path / "torch"), final_weights(run_dir), exact=True)
    assert read_json(tmp_path / "torch" / "metrics.json")["test_accuracy"] == metrics["test_accuracy"]


@pytest.mark.timeout(300)
def test_sync_mode_with_eight_trainers_stays_exact_run_after_run(tmp_path):
    # Many trainers on two servers, each pipelining its steps (the next forward leaves
    # before the update is answered, carrying the release of the step's context), on more
    # processes than cores: a release that overtook its update failed runs now and then.
    # The longer, repeated version is benchmarks/stress_sync.py.
    steps = 100
    cfg = (
        "mode=sync",
        "model=mlp",
        "data=digits",
        "cluster.num_servers=2",
        "cluster.num_trainers=8",
        f"train.steps={steps}",
        f"checkpoint.every={steps}",
        "checkpoint.keep=0",
        f"train.log_every={steps}",
    )  # a log line settles the step: none before the end
    losses, weights = single_process_run(make_cfg(*cfg), steps)
    for run in ("a", "b"):
        with cpu_hogs(2):  # a busy machine: threads start late, and requests overtake each other
            metrics = run_app(tmp_path / run, *cfg, timeout=120)
        assert metrics["losses"] == losses, f"run {run}"
        assert_same_weights(final_weights(tmp_path / run), weights, exact=True)


@contextlib.contextmanager
def cpu_hogs(n):
    """``n`` processes that spin on a core each until the block ends (bounded by a timeout
    of their own, should the test process die)."""
    hogs = [
        subprocess.Popen(
            [sys.executable, "-c", "import time\nend = time.monotonic() + 300\nwhile time.monotonic() < end: pass"]
        )
        for _ in range(n)
    ]
    try:
        yield
    finally:
        for h in hogs:
            h.kill()
            h.wait()
