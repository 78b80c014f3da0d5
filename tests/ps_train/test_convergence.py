"""Many trainers still converge: the default experiment with 8 async trainers, whose updates
are several updates stale, reaches the accuracy of the 2-trainer default."""

import pytest

from tests.ps_train._app import run_app


@pytest.mark.timeout(240)
def test_default_experiment_with_eight_async_trainers_reaches_90_percent(tmp_path):
    # The default experiment (MLP on digits, SGD lr 0.05 with momentum 0.9, 2 servers) with 8
    # async trainers. Without the staleness rule it ends at chance (0.10): mean staleness ~5
    # times a momentum of 0.9 diverges (ps_train.modes.aggregation). With lr / staleness it reached
    # 0.94-0.97 after 100 steps per trainer, but once 0.897 in a suite run beside other tests
    # (and 0.90 beside 4 CPU hogs): the order of async updates follows the scheduler. 150
    # steps (~30 passes over each trainer's partition) gave 0.96-0.97 beside 4 hogs, which
    # keeps the 0.90 target with a margin.
    metrics = run_app(
        tmp_path, "mode=async", "cluster.num_trainers=8", "train.steps=150", "logging.tensorboard=false", timeout=150
    )
    assert metrics["mode"] == "async" and metrics["num_trainers"] == 8
    assert metrics["max_staleness"] >= 2  # the updates were stale: the rule had work to do
    assert metrics["test_accuracy"] >= 0.90, metrics["test_accuracy"]
