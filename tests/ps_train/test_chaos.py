"""The chaos benchmark's kill loop (``ps_train/chaos.py``), bounded: a sync job whose servers
and trainers are SIGKILLed three times at random moments (``cluster.max_restarts``)
ends with the weights of the same job uninterrupted, bit for bit: those of plain torch in one
process (``_oracle``; an uninterrupted sync job has them, tests/ps_train/test_reproducibility.py)."""

from __future__ import annotations

import pytest

from ps_train.chaos import Killer, checkpoint_problems, job_config, run_with_killer
from tests.ps_train._app import assert_same_weights, final_weights, make_cfg
from tests.ps_train._oracle import single_process_run

STEPS = 400


@pytest.mark.timeout(300)
def test_a_sync_job_killed_at_random_three_times_ends_as_the_uninterrupted_one(tmp_path):
    config = [*job_config("sync", "mlp", trainers=2, max_restarts=3), f"train.steps={STEPS}", "checkpoint.every=50"]
    # Gaps of at most 3 s: the job (several seconds an attempt) is hit by 2 or 3 of the kills.
    killer = {"servers": 2, "trainers": 2, "mtbf": 2.0, "seed": 3, "server_share": 0.5, "max_failures": 3}
    chaos, kills = run_with_killer(tmp_path / "chaos", config, 170, {**killer, "max_gap": 3.0})
    assert chaos.returncode == 0, chaos.tail
    assert len(kills) >= 2, kills
    restarts = chaos.metrics["restarts"]
    assert 1 <= len(restarts) <= len(kills)  # two kills in one attempt are one restart
    assert {r["role"] for r in restarts} <= {k.role for k in kills}
    problems, _ = checkpoint_problems(tmp_path / "chaos", STEPS)
    assert problems == []
    _, uninterrupted = single_process_run(make_cfg(*config), STEPS)
    assert_same_weights(final_weights(tmp_path / "chaos"), uninterrupted, exact=True)  # nothing lost, nothing twice


def test_the_killer_draws_its_gaps_and_victims_from_its_seed(tmp_path):
    running = {"ps0": 1, "ps1": 2, "trainer0": 3, "trainer1": 4, "trainer2": 5}
    a, b = (Killer(tmp_path, servers=2, trainers=3, mtbf=10.0, seed=7) for _ in range(2))
    draws = [[(k._gap(), k._victim(running)) for _ in range(50)] for k in (a, b)]
    assert draws[0] == draws[1]
    gaps = [g for g, _ in draws[0]]
    assert 5.0 < sum(gaps) / len(gaps) < 20.0  # exponential with mean 10 s
    assert {v for _, v in draws[0]} == set(running)
    capped = Killer(tmp_path, servers=2, trainers=1, mtbf=10.0, seed=7, max_gap=1.0)
    assert max(capped._gap() for _ in range(50)) <= 1.0
    # Only what runs is drawn: the servers alone while the trainers start; nothing, nobody.
    assert {capped._victim({"ps0": 1, "ps1": 2}) for _ in range(20)} == {"ps0", "ps1"}
    assert capped._victim({}) is None
