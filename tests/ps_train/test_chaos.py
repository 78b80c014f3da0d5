"""The chaos benchmark's kill loop (``ps_train/chaos.py``), bounded: a sync job whose servers
and trainers are SIGKILLed three times at random moments (``cluster.max_restarts``)
ends with the weights of the same job uninterrupted, bit for bit: those of plain torch in one
process (``_oracle``; an uninterrupted sync job has them, tests/ps_train/test_reproducibility.py)."""

from __future__ import annotations

import collections
import json
import subprocess
import time
from pathlib import Path

import pytest

from ps_train.chaos import Killer, checkpoint_problems, job_config, lost_updates, run_with_killer
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
    roles = {"ps0", "ps1", "trainer0", "trainer1", "trainer2"}
    a, b = (Killer(tmp_path, servers=2, trainers=3, mtbf=10.0, seed=7) for _ in range(2))
    draws = [[(k._gap(), k._victim()) for _ in range(400)] for k in (a, b)]
    assert draws[0] == draws[1]
    gaps = [g for g, _ in draws[0]]
    assert 8.0 < sum(gaps) / len(gaps) < 12.5  # exponential with mean 10 s
    victims = collections.Counter(v for _, v in draws[0])
    assert set(victims) == roles
    assert 0.2 < (victims["ps0"] + victims["ps1"]) / 400 < 0.4  # server_share 0.3
    capped = Killer(tmp_path, servers=2, trainers=1, mtbf=10.0, seed=7, max_gap=1.0)
    assert max(capped._gap() for _ in range(50)) <= 1.0


def _start(run_dir: Path, role: str) -> subprocess.Popen:
    proc = subprocess.Popen(["sleep", "60"])
    with open(run_dir / "logs" / f"{role}.log", "a") as log:  # the line every role logs first
        log.write(f"ps_train: starting {role} (rank 0 of 3, pid {proc.pid}) on the rpc_core backend\n")
    return proc


@pytest.mark.timeout(60)
def test_a_victim_not_running_when_its_failure_falls_due_is_killed_once_it_runs(tmp_path):
    # Only ps0 runs at first (a restart brings the roles back one by one): the failures that
    # fall due meanwhile must not all land on ps0; the trainer's waits until it runs.
    (tmp_path / "logs").mkdir()
    procs = {"ps0": _start(tmp_path, "ps0")}
    killer = Killer(tmp_path, servers=1, trainers=2, mtbf=0.05, seed=1, server_share=0.0, max_failures=2)
    killer.start()
    try:
        deadline = time.monotonic() + 30
        while killer.is_alive() and time.monotonic() < deadline:
            if time.monotonic() > deadline - 29 and "trainer0" not in procs:  # after ~1 s
                procs["trainer0"] = _start(tmp_path, "trainer0")
                procs["trainer1"] = _start(tmp_path, "trainer1")
            killer.join(0.05)
        ps0_alive = procs["ps0"].poll() is None
    finally:
        killer.stop.set()
        killer.join()
        for p in procs.values():
            p.kill()
            p.wait()
    assert ps0_alive and len(killer.kills) == 2, killer.kills  # ps0, the only one up at first, was spared
    assert {k.role for k in killer.kills} <= {"trainer0", "trainer1"}
    assert all(k.time_s >= 0.9 for k in killer.kills), killer.kills  # none before the trainers ran


def test_lost_updates_counts_from_the_checkpoint_the_last_attempt_resumed_from(tmp_path: Path) -> None:
    ckpt = tmp_path / "step_000000040"
    ckpt.mkdir()
    positions = {"trainer0": {"step": 40}, "trainer1": {"step": 38}}
    (ckpt / "manifest.json").write_text(json.dumps({"trainer_positions": positions}))
    metrics = {
        "restarts": [{"checkpoint": str(ckpt), "from_step": 40}],
        # After the resume trainer0 ran its 60 remaining steps, trainer1 one fewer than its 62
        # and ps1 got one of trainer0's twice.
        "updates_by_trainer": {"ps0": {"trainer0": 60, "trainer1": 61}, "ps1": {"trainer0": 61, "trainer1": 62}},
    }
    assert lost_updates(metrics, trainers=2, steps=100) == {"ps0": (1, 0), "ps1": (0, 1)}


def test_lost_updates_says_so_when_the_resumed_checkpoint_was_pruned(tmp_path: Path) -> None:
    metrics = {"restarts": [{"checkpoint": str(tmp_path / "step_000000040"), "from_step": 40}]}
    with pytest.raises(FileNotFoundError, match="checkpoint.keep=0"):
        lost_updates(metrics, trainers=2, steps=100)
