"""Async and ssp runs restarted from a checkpoint: every trainer resumes after its own last step
that the checkpoint's servers hold, so each sample of an epoch is trained at least once, and
twice only for a step in flight when the checkpoint was taken.

The run: 2 servers, 3 trainers, 16 steps (an epoch is 14 steps of 32 samples per trainer), a
checkpoint every 8 steps. trainer1 stalls after its step 3 (it lags far behind, alive);
trainer0 checkpoints after its step 8 and is killed after step 9; the run restarts from the
step-8 checkpoint.
"""

import threading

import pytest

from ps_train.checkpoint.files import SaveStarted, read_manifest, save_checkpoint
from ps_train.checkpoint.positions import DataPoint, TrainerPositions, earliest
from ps_train.checkpoint.protocol import load_resume_state, trainer_positions
from ps_train.config import DigitsConfig
from ps_train.faults import FAULT_ENV, parse_faults
from ps_train.modes.asynchronous import AsyncMode
from ps_train.partition import TrainerSplit, partition, steps_per_epoch
from ps_train.sample_log import SAMPLE_LOG_ENV, read_sample_log
from tests.ps_train._app import make_cfg, read_json, run_app

STEPS, TRAINERS, BATCH = 16, 3, 32
RUN = (
    "model=mlp",
    "data=digits",
    "cluster.num_servers=2",
    f"cluster.num_trainers={TRAINERS}",
    f"train.steps={STEPS}",
    "checkpoint.every=8",
    "checkpoint.keep=0",
    "cluster.max_restarts=1",
    "train.eval_every=0",
    "logging.progress=false",
)


def expected_ids(trainer: int, step: int) -> list[int]:
    """The training-split indices ``trainer`` trains on at ``step`` (1-based): its share of
    the step's epoch permutation, batch by batch."""
    n = DigitsConfig().train_samples()
    epoch, k = divmod(step - 1, steps_per_epoch(n, TRAINERS, BATCH))
    return partition(n, trainer, TRAINERS, 0, epoch)[k * BATCH : (k + 1) * BATCH].tolist()


@pytest.mark.timeout(100)
@pytest.mark.parametrize(
    "mode",
    [
        ("mode=async",),
        # trainer0 may run 6 steps ahead of the stalled trainer1: to step 9, its last.
        ("mode=ssp", "mode.staleness=6"),
    ],
    ids=["async", "ssp"],
)
def test_a_restart_resumes_each_trainer_from_its_own_step_and_loses_no_sample(tmp_path, monkeypatch, mode):
    run_dir = tmp_path / "run"
    monkeypatch.setenv(SAMPLE_LOG_ENV, "1")
    monkeypatch.setenv(FAULT_ENV, "trainer1@3:stall#0,trainer0@9#0")
    metrics = run_app(run_dir, *RUN, *mode, timeout=75)

    [restart] = metrics["restarts"]
    assert (restart["role"], restart["from_step"]) == ("trainer0", 8)
    positions = read_manifest(restart["checkpoint"]).trainer_positions
    resumed = {name: p["step"] for name, p in positions.items()}
    # trainer0 checkpoints after its step 8; the stalled trainer1 had 3 steps in: its own,
    # not trainer0's 8 (which would skip its batches 4..8 of the epoch).
    assert (resumed["trainer0"], resumed["trainer1"]) == (8, 3)
    assert 0 <= resumed["trainer2"] <= STEPS
    assert metrics["steps"] == STEPS

    for k in range(TRAINERS):
        name = f"trainer{k}"
        lines = read_sample_log(run_dir, name)
        if k == 1:
            assert max(line["step"] for line in lines if line["attempt"] == 0) == 3  # it stalled
        # What the final weights hold: attempt 0 up to the checkpoint's step of this trainer,
        # then attempt 1, which starts right after it.
        kept = [line for line in lines if line["attempt"] == 1 or line["step"] <= resumed[name]]
        assert [line["step"] for line in kept] == list(range(1, STEPS + 1)), name
        for line in kept:
            assert line["ids"] == expected_ids(k, line["step"]), (name, line["step"])
        # Every sample of epoch 0 (14 batches of this trainer's share) once, 2 batches of epoch 1.
        epoch0 = [i for line in kept if line["epoch"] == 0 for i in line["ids"]]
        n = DigitsConfig().train_samples()
        assert sorted(epoch0) == sorted(partition(n, k, TRAINERS, 0, 0)[: 14 * BATCH].tolist())

    # Every update of the steps above is in the final weights, and at most one more per server
    # (trainer2's step in flight at the checkpoint, held by some servers and trained again):
    # each server's version counts the updates it applied, the checkpoint's and attempt 1's.
    for version in metrics["server_updates"]:
        assert 0 <= version - TRAINERS * STEPS <= 1, metrics["server_updates"]
    assert read_json(run_dir / "restarts.json") == metrics["restarts"]


# -- the pieces, in one process ---------------------------------------------------------------------
def test_the_checkpoint_keeps_each_trainer_at_its_fewest_steps_among_the_servers():
    ps0, ps1 = TrainerPositions(), TrainerPositions()
    ps0.start = ps1.start = {"trainer2": {"epoch": 0, "offset": 64, "step": 2}}  # resumed; no update yet
    ps0.completed(0, 4, {"epoch": 0, "offset": 160})
    ps1.completed(0, 4, {"epoch": 0, "offset": 160})
    ps0.completed(1, 6, {"epoch": 0, "offset": 224})  # step 7 reached ps0 ...
    ps1.completed(1, 5, {"epoch": 0, "offset": 192})  # ... not yet ps1
    ps0.completed(1, 3, {"epoch": 0, "offset": 128})  # a late answer never moves it back
    assert ps0.last(1) == DataPoint(7, {"epoch": 0, "offset": 224})
    assert earliest([ps0.snapshot(), ps1.snapshot()]) == {
        "trainer0": {"epoch": 0, "offset": 160, "step": 5},
        "trainer1": {"epoch": 0, "offset": 192, "step": 6},  # ps1's: step 7 is trained again
        "trainer2": {"epoch": 0, "offset": 64, "step": 2},
    }
    ps0.completed(3, 0, {"epoch": 0, "offset": 32})  # on ps0 only: every server holds none of it
    assert "trainer3" not in earliest([ps0.snapshot(), ps1.snapshot()])


def test_sync_keeps_every_trainer_at_trainer0s_step_and_async_each_at_its_own():
    cfg = make_cfg(*RUN)
    split = TrainerSplit(cfg.cluster.num_trainers, cfg.train.batch_size, cfg.seed)
    n = DigitsConfig().train_samples()  # 14 steps per epoch
    sync = [SaveStarted("ps0", None, False), SaveStarted("ps1", None, False)]
    assert trainer_positions(split, n, 15, sync)["trainer2"] == {
        "epoch": 1,
        "offset": 32,
        "rank": 2,
        "world": 3,
        "seed": 0,
        "step": 15,
    }
    at = {"trainer0": {"epoch": 1, "offset": 32, "step": 15}, "trainer1": {"epoch": 0, "offset": 96, "step": 3}}
    ahead = dict(at, trainer0={"epoch": 1, "offset": 64, "step": 16})
    started = [SaveStarted("ps0", None, False, positions=ahead), SaveStarted("ps1", None, False, positions=at)]
    out = trainer_positions(split, n, 15, started)
    assert (out["trainer0"]["step"], out["trainer1"]["step"]) == (15, 3)
    # trainer2 had no update every server holds: from the beginning.
    assert out["trainer2"] == {"epoch": 0, "offset": 0, "rank": 2, "world": 3, "seed": 0, "step": 0}


def test_a_checkpoint_without_per_trainer_steps_resumes_every_trainer_at_its_step(tmp_path):
    # As written before per-trainer positions: every trainer at the manifest's step.
    positions = {f"trainer{k}": {"epoch": 0, "offset": 96, "rank": k, "world": 3, "seed": 0} for k in range(3)}
    save_checkpoint(tmp_path, 3, {"ps0": {"shards": {}}}, trainer_positions=positions)
    state = load_resume_state(str(tmp_path))
    assert state["step"] == 3
    assert state["trainer_positions"] == {name: dict(p, step=3) for name, p in positions.items()}


class _Server:
    """What AsyncMode uses of a ParameterServer: a version, a lock, and a record."""

    def __init__(self):
        self.lock = threading.Lock()
        self.version = 0
        self.positions = TrainerPositions()
        self.membership = None
        self.grads = {}

    def gradients(self, context_id):
        return self.grads

    def step(self, grads, lr_factor=1.0):
        self.version += 1


class _Run:
    class mode:
        name, staleness, aggregate, staleness_rule = "async", 0, "mean", "none"

    class cluster:
        num_servers, num_trainers, num_worker_threads, placement, elastic = 1, 2, 4, "auto", False


def test_held_updates_wait_for_the_release_and_then_apply_in_arrival_order():
    server, mode = _Server(), AsyncMode(_Run())
    assert mode.update(server, 1, 0, 0, {"epoch": 0, "offset": 32}).wait() == 0
    mode.hold_updates(server)
    first = mode.update(server, 2, 1, 0, {"epoch": 0, "offset": 32})
    second = mode.update(server, 3, 0, 1, {"epoch": 0, "offset": 64})
    assert not first.done() and not second.done()
    assert server.version == 1 and server.positions.last(1) is None  # nothing moved meanwhile
    mode.release_updates(server)
    assert (first.wait(), second.wait(), server.version) == (0, 0, 3)
    assert server.positions.steps() == {0: 2, 1: 1}
    assert mode.update(server, 4, 1, 1, None).wait() == 0  # no position: the record stays
    assert server.positions.steps() == {0: 2, 1: 1}


def test_a_stall_fault_parses():
    assert parse_faults("trainer1@3:stall#0")[0].action == "stall"
    with pytest.raises(ValueError, match="stall"):
        parse_faults("trainer1@3:stalled")
