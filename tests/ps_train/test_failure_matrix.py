"""Failures at awkward moments of a sync run with ``cluster.max_restarts``: each restarted run
ends exactly like the uninterrupted one (``sync_baseline``), and trains every sample of an
epoch once.

The run is ``_app.BASELINE``: 2 servers, 2 trainers, 8 steps, a checkpoint every 4 steps.
"""

import pytest

from ps_train.config import DigitsConfig
from ps_train.faults import FAULT_ENV
from ps_train.launch.restarts import RESTARTS_FILE
from ps_train.partition import partition, steps_per_epoch
from ps_train.sample_log import SAMPLE_LOG_ENV, read_sample_log
from tests.ps_train._app import (
    BASELINE,
    BASELINE_STEPS,
    assert_same_weights,
    final_weights,
    read_json,
    run_app,
    scalars,
)

CHECKPOINT = "step_000000004"


def restarted_run(tmp_path, monkeypatch, fault, *extra, restarts=1):
    """Run the baseline with ``fault`` and up to ``restarts`` restarts; (run dir, metrics)."""
    run_dir = tmp_path / "run"
    monkeypatch.setenv(FAULT_ENV, fault)
    metrics = run_app(run_dir, *BASELINE, f"cluster.max_restarts={restarts}", *extra, timeout=150)
    return run_dir, metrics


def assert_ends_like_the_baseline(run_dir, metrics, sync_baseline, resumed_from):
    """Each attempt resumed after a step of ``resumed_from``; the last ran the baseline's
    remaining steps with its losses and ended with its weights; TensorBoard shows each step once."""
    base_dir, base = sync_baseline
    assert [r["from_step"] for r in metrics["restarts"]] == resumed_from
    assert read_json(run_dir / RESTARTS_FILE) == metrics["restarts"]
    assert metrics["steps"] == BASELINE_STEPS
    for trainer, losses in base["losses"].items():
        assert metrics["losses"][trainer] == losses[resumed_from[-1] :]
        curve = scalars(run_dir / "tb" / trainer)["train/loss"]  # every attempt's event file
        assert [step for step, _ in curve] == list(range(1, BASELINE_STEPS + 1))
        assert [value for _, value in curve] == pytest.approx(losses, rel=1e-6)
    assert_same_weights(final_weights(run_dir), final_weights(base_dir), exact=True)


@pytest.mark.timeout(180)
def test_a_trainer_dead_after_ps0_applied_its_step_and_before_ps1_got_it_leaves_no_server_ahead(
    tmp_path, monkeypatch, sync_baseline
):
    # trainer1's step-5 update reaches ps0, which applies the step-5 round (trainer0's is in
    # too), then trainer1 dies: ps0 is a step ahead of ps1 until the run stops. No checkpoint
    # is written in between (trainer0 waits for ps1's round first), and the restart puts both
    # servers back at the step-4 checkpoint. The fault sits in the separate update call, so
    # this run sends one (with the update in the backward the same state arises when a trainer
    # dies between its gradient calls to ps1 and ps0).
    run_dir, metrics = restarted_run(tmp_path, monkeypatch, "trainer1@5:partial#0", "cluster.update_in_backward=false")
    log = (run_dir / "logs" / "trainer1.log").read_text()
    assert "the step-5 update went to ps0 only, which applied it (version 5)" in log
    [restart] = metrics["restarts"]
    assert (restart["role"], restart["reason"]) == ("trainer1", "killed by signal SIGKILL")
    assert restart["checkpoint"] == str(run_dir / "checkpoints" / CHECKPOINT)
    assert_ends_like_the_baseline(run_dir, metrics, sync_baseline, [4])


def expected_ids(trainer: int, step: int) -> list[int]:
    """The training-split indices trainer ``trainer`` trains on at ``step`` (1-based) in the
    baseline: its share of the step's epoch permutation, batch by batch."""
    n, T, B = DigitsConfig().train_samples(), 2, 32
    spe = steps_per_epoch(n, T, B)
    epoch, k = divmod(step - 1, spe)
    return partition(n, trainer, T, 0, epoch)[k * B : (k + 1) * B].tolist()


@pytest.mark.timeout(180)
def test_a_restarted_sync_run_trains_every_sample_of_an_epoch_exactly_once(tmp_path, monkeypatch, sync_baseline):
    monkeypatch.setenv(SAMPLE_LOG_ENV, "1")
    run_dir, metrics = restarted_run(tmp_path, monkeypatch, "trainer1@6#0")  # steps 5 and 6 are lost
    assert_ends_like_the_baseline(run_dir, metrics, sync_baseline, [4])
    resumed = metrics["restarts"][0]["from_step"]
    trained = []
    for k in range(2):
        lines = read_sample_log(run_dir, f"trainer{k}")
        ran = {(line["attempt"], line["step"]) for line in lines}
        assert {(0, 5), (0, 6), (1, 5), (1, 6)} <= ran  # the work redone
        # What the final weights hold: attempt 0 up to its checkpoint, then attempt 1.
        kept = [line for line in lines if line["attempt"] == 1 or line["step"] <= resumed]
        assert [line["step"] for line in kept] == list(range(1, BASELINE_STEPS + 1))
        for line in kept:
            assert line["epoch"] == 0 and line["ids"] == expected_ids(k, line["step"])
        trained += [i for line in kept for i in line["ids"]]
    assert len(trained) == len(set(trained)) == 2 * 32 * BASELINE_STEPS  # none twice, none lost


@pytest.mark.timeout(180)
def test_trainer0_dead_while_writing_a_checkpoint_leaves_it_incomplete_and_resumes_from_the_one_before(
    tmp_path, monkeypatch, sync_baseline
):
    # The step-8 checkpoint: the servers wrote their files, the manifest is missing.
    run_dir, metrics = restarted_run(tmp_path, monkeypatch, "trainer0@8:checkpoint#0")
    assert "killing trainer0" in (run_dir / "logs" / "trainer0.log").read_text()
    [restart] = metrics["restarts"]
    assert (restart["role"], restart["checkpoint"]) == ("trainer0", str(run_dir / "checkpoints" / CHECKPOINT))
    assert_ends_like_the_baseline(run_dir, metrics, sync_baseline, [4])


@pytest.mark.timeout(180)
def test_trainer0_dead_during_an_evaluation_resumes_from_the_checkpoint_before(tmp_path, monkeypatch, sync_baseline):
    # 360 test samples in batches of 100: killed after the first batch of the step-6 evaluation.
    run_dir, metrics = restarted_run(
        tmp_path, monkeypatch, "trainer0@6:eval#0", "train.eval_every=3", "train.eval_batch_size=100"
    )
    assert "killing trainer0 (pid" in (run_dir / "logs" / "trainer0.log").read_text()
    assert metrics["restarts"][0]["role"] == "trainer0"
    assert_ends_like_the_baseline(run_dir, metrics, sync_baseline, [4])
    tb = scalars(run_dir / "tb" / "trainer0")
    assert [step for step, _ in tb["test/accuracy"]] == [3, 6, BASELINE_STEPS]  # each evaluation once


@pytest.mark.timeout(180)
def test_two_trainers_dead_at_once_are_one_restart(tmp_path, monkeypatch, sync_baseline):
    run_dir, metrics = restarted_run(tmp_path, monkeypatch, "trainer0@5#0,trainer1@5#0")
    [restart] = metrics["restarts"]
    assert restart["role"] in ("trainer0", "trainer1") and restart["reason"] == "killed by signal SIGKILL"
    assert_ends_like_the_baseline(run_dir, metrics, sync_baseline, [4])


@pytest.mark.timeout(240)
def test_the_same_trainer_dead_twice_is_restarted_twice(tmp_path, monkeypatch, sync_baseline):
    # Killed after step 5, then, resumed from step 4, after step 7 of the second attempt.
    run_dir, metrics = restarted_run(tmp_path, monkeypatch, "trainer1@5#0,trainer1@7#1", restarts=2)
    assert [r["role"] for r in metrics["restarts"]] == ["trainer1", "trainer1"]
    assert_ends_like_the_baseline(run_dir, metrics, sync_baseline, [4, 4])
    assert scalars(run_dir / "tb" / "trainer0")["train/restarts"] == [(0, 0.0), (4, 1.0), (4, 2.0)]


@pytest.mark.timeout(240)
def test_a_server_dead_while_the_run_recovers_from_a_trainer_failure_is_one_more_restart(
    tmp_path, monkeypatch, sync_baseline
):
    # trainer1 dies after step 5; in the restarted attempt ps1 loads the step-4 checkpoint,
    # meets the others, which are starting from it, and dies before it applies any update.
    run_dir, metrics = restarted_run(tmp_path, monkeypatch, "trainer1@5#0,ps1@4:restore#1", restarts=2)
    assert [(r["role"], r["reason"]) for r in metrics["restarts"]] == [
        ("trainer1", "killed by signal SIGKILL"),
        ("ps1", "killed by signal SIGKILL"),
    ]
    assert "killing ps1 (pid" in (run_dir / "logs" / "ps1.log").read_text()
    # The recovery that failed left nothing behind: the third attempt resumes from the same
    # checkpoint and ends as the uninterrupted run.
    assert_ends_like_the_baseline(run_dir, metrics, sync_baseline, [4, 4])
