"""The update rides on the trainer's distributed backward (``cluster.update_in_backward=true``
on rpc_core): a trainer step costs each server one forward and one gradient call,
in every mode (ssp's clock answers with ps0's part of the backward), counted by rpc_core
(``connection_stats().requests_received``, metrics.json ``server_requests``); in sync mode
the run still equals single-process torch bit for bit."""

import pytest

from tests.ps_train._app import assert_same_weights, final_weights, make_cfg, run_app, scalars
from tests.ps_train._oracle import single_process_run

STEPS, TRAINERS = 30, 2
# Calls of a run besides its steps: each trainer fetches every server's RRef, trainer0 asks
# every server for its stats at the last step and at the end, saves the final checkpoint.
ONE_OFF = 16


def job(mode: str, in_backward: bool) -> tuple[str, ...]:
    return (
        f"mode={mode}",
        "model=mlp",
        "data=digits",
        "cluster.num_servers=2",
        f"cluster.num_trainers={TRAINERS}",
        f"cluster.update_in_backward={str(in_backward).lower()}",
        f"train.steps={STEPS}",
        f"train.log_every={STEPS}",
        "checkpoint.every=0",
    )


def requests_per_server(tmp_path, mode: str, in_backward: bool) -> list[int]:
    return run_app(tmp_path / "run", *job(mode, in_backward), timeout=150)["server_requests"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_a_step_sends_each_server_two_requests(tmp_path, mode):
    metrics = run_app(tmp_path / "run", *job(mode, True), timeout=150)
    for server, n in enumerate(metrics["server_requests"]):
        assert 2 * STEPS * TRAINERS <= n <= 2 * STEPS * TRAINERS + ONE_OFF, f"ps{server}: {n} requests"
    if mode == "sync":
        # And sync mode stays exact: rpc_core's backward hooks apply the update as each
        # server's part of the backward ends, with the same gradients, summed in the same
        # order, stepped by the same optimizer: single-process torch's losses and weights.
        losses, weights = single_process_run(make_cfg(*job(mode, True)), STEPS)
        assert metrics["losses"] == losses  # per trainer, per step, exactly
        assert_same_weights(final_weights(tmp_path / "run"), weights, exact=True)
    if mode == "ssp":
        # ps0's answer in the backward carries the clock's too; its staleness is still counted.
        for server in ("ps0", "ps1"):
            assert scalars(tmp_path / "run" / "tb" / server).get("server/staleness_mean"), server


@pytest.mark.timeout(180)
def test_with_the_update_call_an_ssp_step_sends_ps0_four(tmp_path):
    # forward, gradient call, update call, clock: what the update in the backward saves.
    ps0, ps1 = requests_per_server(tmp_path, "ssp", False)
    assert 4 * STEPS * TRAINERS <= ps0 <= 4 * STEPS * TRAINERS + ONE_OFF
    assert 3 * STEPS * TRAINERS <= ps1 <= 3 * STEPS * TRAINERS + ONE_OFF


@pytest.mark.timeout(180)
def test_with_the_update_call_a_sync_step_sends_three_and_stays_exact(tmp_path):
    # Sync's default rides on the backward; the update call (the path backend=torch and the
    # hot-row cache take, pipelined on rpc_core) must stay exact as well.
    metrics = run_app(tmp_path / "run", *job("sync", False), timeout=150)
    for server, n in enumerate(metrics["server_requests"]):
        assert 3 * STEPS * TRAINERS <= n <= 3 * STEPS * TRAINERS + ONE_OFF, f"ps{server}: {n} requests"
    losses, weights = single_process_run(make_cfg(*job("sync", False)), STEPS)
    assert metrics["losses"] == losses
    assert_same_weights(final_weights(tmp_path / "run"), weights, exact=True)
