"""``ps_train.observe.phases``: the roles' marks make consecutive phases along the run's
critical path, each ending when the last process that had to get there did."""

from __future__ import annotations

import json

import pytest

from ps_train.observe.phases import PHASES, run_phases


def _write(run_dir, role: str, wall: dict[str, float], cpu: dict[str, float]) -> None:
    folder = run_dir / "phases"
    folder.mkdir(exist_ok=True)
    (folder / f"{role}.json").write_text(json.dumps({"wall": wall, "cpu": cpu}))


def test_phases_follow_the_latest_role_and_add_up_to_the_wall_time(tmp_path):
    launcher = {"start": 100.0, "launch": 102.0, "preloaded": 103.0, "exited": 120.0, "finished": 120.5}
    # ps0 is the last to start and to join; trainer0 (rank 1 of 1 server + 1 trainer) leads the rest.
    _write(
        tmp_path,
        "ps0",
        {"started": 104.0, "rendezvous": 105.0, "joined": 106.0, "serving": 106.5, "served": 119.0},
        {"started": 0.0, "rendezvous": 0.5, "joined": 0.6, "serving": 0.7, "served": 3.8},
    )
    _write(
        tmp_path,
        "trainer0",
        {
            "started": 103.5,
            "rendezvous": 104.0,
            "joined": 105.5,
            "loop_start": 107.0,
            "first_step": 108.0,
            "checkpoint_start": 112.0,
            "checkpoint_end": 113.0,
            "eval_start": 115.0,
            "eval_end": 116.0,
            "shutdown": 116.0,
            "shut_down": 117.0,
        },
        {
            "started": 0.0,
            "rendezvous": 0.1,
            "joined": 0.2,
            "loop_start": 0.7,
            "first_step": 0.9,
            "checkpoint_start": 1.9,
            "checkpoint_end": 2.0,
            "eval_start": 2.5,
            "eval_end": 2.8,
            "shutdown": 2.8,
            "shut_down": 3.0,
        },
    )
    cpu = {"launcher start-up": 1.5, "preload": 0.4, "collect": 0.1}
    out = run_phases(str(tmp_path), launcher, cpu, "trainer0")
    wall = {p["name"]: p["wall_s"] for p in out["phases"]}
    assert list(wall) == [
        "launcher start-up",
        "preload",
        "role start",
        "set-up",
        "rendezvous",
        "trainer set-up",
        "first step",
        "training loop",
        "checkpoint",
        "final evaluation",
        "shutdown",
        "collect",
    ]
    assert wall == {
        "launcher start-up": 2.0,
        "preload": 1.0,
        "role start": 1.0,  # to ps0's start
        "set-up": 1.0,  # to ps0's rendezvous
        "rendezvous": 1.0,  # to ps0's join, after trainer0's
        "trainer set-up": 1.0,
        "first step": 1.0,
        "training loop": 6.0,  # 108 -> 115 less the checkpoint
        "checkpoint": 1.0,
        "final evaluation": 1.0,
        "shutdown": 4.0,
        "collect": 0.5,
    }
    assert out["wall_s"] == 20.5 == sum(wall.values())
    used = {p["name"]: p["cpu_s"] for p in out["phases"]}
    assert used["set-up"] == 0.6  # ps0 0.5 + trainer0 0.1
    # ps0 serving, in and out of its shutdown's wait; trainer0 to its checkpoint and after it
    assert used["training loop"] == pytest.approx(3.2 + 1.0 + 0.5)
    assert used["shutdown"] == pytest.approx(0.2)  # trainer0's: a server's is in its serving
    assert used["launcher start-up"] == 1.5
    assert len(PHASES) + 1 == len(out["phases"])


def test_a_role_without_marks_leaves_its_phases_empty(tmp_path):
    launcher = {"start": 0.0, "launch": 1.0, "exited": 5.0, "finished": 5.0}
    out = run_phases(str(tmp_path), launcher, {}, "trainer0")
    wall = {p["name"]: p["wall_s"] for p in out["phases"]}
    assert wall["launcher start-up"] == 1.0 and wall["preload"] == 0.0 and wall["shutdown"] == 4.0
    assert out["roles"] == 0
