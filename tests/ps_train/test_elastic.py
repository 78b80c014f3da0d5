"""cluster.elastic=true (async/ssp): a dead trainer is replaced and continues its partition
while the others train on; a trainer started with ``join=<run dir>`` enters the running job
(here in ssp, and frozen once in; in async, killed and replaced: test_elastic_failures.py);
``train/num_trainers`` (ps0's TensorBoard folder) shows the membership over time."""

import os
import subprocess
import sys

import pytest
import torch

from ps_train.config import ConfigError
from ps_train.elastic.files import REPLACEMENTS_FILE
from ps_train.elastic.membership import Assignment, Membership
from ps_train.elastic.trainer import ElasticBatches
from ps_train.faults import FAULT_ENV
from ps_train.launch.restarts import RESTARTS_FILE
from ps_train.metrics import NullWriter
from tests.ps_train._app import BASELINE, cli, make_cfg, read_json, run_app, scalars

STEPS, KILL_AT, BATCH = 16, 6, 32
HEARTBEAT = 3.0  # s: RPC_CORE_HEARTBEAT_TIMEOUT of the frozen-joiner job (30 s by default)
ELASTIC = (
    "mode=async",
    "cluster.elastic=true",
    f"train.steps={STEPS}",
    f"train.batch_size={BATCH}",
    "checkpoint.every=0",
)


def curve(run_dir):
    return [value for _, value in scalars(run_dir / "tb" / "ps0")["train/num_trainers"]]


# A job a second interpreter joins: its launched trainers wait at step 1 until the joiner
# (trainer2) waits for an epoch, so the first to begin (digits with 2 trainers: epoch 0 is 22
# steps) takes it, and trainer0 waits at its last step until ps0 applied the joiner's first
# ``n`` updates (ps_train.faults). The job lasts as long as the test needs, no longer.
JOIN_STEPS = 40


def joiner_holds(n):
    return (
        "trainer0@1:hold_waiting=trainer2,trainer1@1:hold_waiting=trainer2,"
        f"trainer0@{JOIN_STEPS}:hold_steps=trainer2*{n}"
    )


def start_job(tmp_path, run_dir, env, *overrides):
    """A local elastic job of ``JOIN_STEPS`` steps, returned once trainer0 printed its first
    progress line (after its first step: the job trains when the joiner comes), with the
    lines it printed so far."""
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ps_train",
            "cluster.elastic=true",
            f"train.steps={JOIN_STEPS}",
            "train.eval_every=0",
            "train.log_every=1",
            "checkpoint.every=0",
            f"hydra.run.dir={run_dir}",
            *overrides,
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = []
    for line in job.stdout:  # blocks until the job prints; ends if it exits
        seen.append(line)
        if line.startswith("[trainer0] step "):
            break
    if not (run_dir / "elastic.json").is_file():
        job.kill()
        job.wait()
        raise AssertionError("the job did not start as an elastic job:\n" + "".join(seen))
    return job, seen


def assert_every_step_trained_once(metrics, trainers):
    """Each trainer's steps 0..STEPS-1 reached every server once: STEPS updates per trainer
    per server (a replacement continues after its predecessor's last applied step, so none
    is repeated or skipped), i.e. each trainer's whole partition share was trained."""
    for server, counts in metrics["updates_by_trainer"].items():
        assert counts == {t: STEPS for t in trainers}, server
    assert metrics["samples_by_trainer"] == {t: STEPS * BATCH for t in trainers}
    assert metrics["samples"] == len(trainers) * STEPS * BATCH


@pytest.mark.timeout(180)
def test_a_killed_trainer_is_replaced_and_its_partition_trained_while_the_run_goes_on(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv(FAULT_ENV, f"trainer1@{KILL_AT}")
    metrics = run_app(run_dir, *ELASTIC, timeout=150)  # returns: the run finished (exit 0 on the CLI)
    assert metrics["restarts"] == []  # no restart of the run: only trainer1 was started again
    assert metrics["replacements"] == [{"role": "trainer1", "reason": "killed by signal SIGKILL", "attempt": 0}]
    assert read_json(run_dir / REPLACEMENTS_FILE) == metrics["replacements"]
    assert_every_step_trained_once(metrics, ["trainer0", "trainer1"])
    # The replacement ran the steps after the killed one's last: its own losses are those.
    assert len(metrics["losses"]["trainer1"]) == STEPS - KILL_AT
    assert len(metrics["losses"]["trainer0"]) == STEPS
    events = [(e["trainer"], e["event"], e["num_trainers"]) for e in metrics["membership"]]
    assert events[:4] == [
        ("trainer0", "joined", 1),
        ("trainer1", "joined", 2),
        ("trainer1", "left", 1),
        ("trainer1", "joined", 2),
    ] or events[:4] == [
        ("trainer1", "joined", 1),
        ("trainer0", "joined", 2),
        ("trainer1", "left", 1),
        ("trainer1", "joined", 2),
    ]
    assert curve(run_dir)[:4] == [1.0, 2.0, 1.0, 2.0]  # the dip while trainer1 was away
    assert metrics["test_accuracy"] > 0.5
    assert not (run_dir / "elastic.json").exists()  # the job is over: nobody can join it


@pytest.mark.timeout(180)
def test_in_ssp_the_others_do_not_wait_for_a_dead_trainer(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv(FAULT_ENV, f"trainer1@{KILL_AT}")
    # staleness 0: trainer0 may not start a step before trainer1 finished the one before,
    # unless the servers dropped trainer1 from the clock when it died.
    metrics = run_app(run_dir, *ELASTIC, "mode=ssp", "mode.staleness=0", timeout=150)
    assert [r["role"] for r in metrics["replacements"]] == ["trainer1"]
    assert_every_step_trained_once(metrics, ["trainer0", "trainer1"])
    left = next(e for e in metrics["membership"] if e["event"] == "left")
    back = next(e for e in metrics["membership"] if e["event"] == "joined" and e["time_s"] > left["time_s"])
    # The servers dropped trainer1 from the clock when it left (membership, then the job
    # finished at staleness 0 with every step trained once). How many of trainer0's updates
    # land before the replacement is back depends on how fast the launcher forks it: none,
    # with the fork server on a quiet machine.
    assert back["num_trainers"] == 2 and left["num_trainers"] == 1
    assert back["server_updates"] >= left["server_updates"]


@pytest.mark.timeout(300)
def test_in_ssp_a_joiner_that_freezes_is_removed_by_heartbeats_and_the_job_finishes(tmp_path):
    run_dir = tmp_path / "job"
    # staleness 0: every trainer waits for the slowest, so a frozen joiner still counted would
    # hold the job forever; no launcher watches a joiner: ps0's heartbeats must find it.
    env = dict(os.environ, RPC_CORE_HEARTBEAT_TIMEOUT=str(HEARTBEAT), **{FAULT_ENV: joiner_holds(2)})
    job, seen = start_job(tmp_path, run_dir, env, "mode=ssp", "mode.staleness=0")
    joiner = None
    try:
        joiner = subprocess.Popen(
            [sys.executable, "-m", "ps_train", f"join={run_dir}"],
            cwd=tmp_path,
            env=dict(env, **{FAULT_ENV: "trainer2@+2:freeze"}),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        out, _ = job.communicate(timeout=240)
        assert joiner.poll() is None, "the joiner was to stay frozen, not exit"
    finally:
        for p in (job, joiner):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert job.returncode == 0, "".join(seen) + out
    metrics = read_json(run_dir / "metrics.json")
    joiner_events = [e for e in metrics["membership"] if e["trainer"] == "trainer2"]
    assert [e["event"] for e in joiner_events] == ["joined", "left"], metrics["membership"]
    assert joiner_events[0]["num_trainers"] == 3
    assert joiner_events[0]["server_updates"] > 0  # the job was training when it came
    assert 3.0 in curve(run_dir)
    for server, counts in metrics["updates_by_trainer"].items():
        assert counts["trainer0"] == counts["trainer1"] == JOIN_STEPS, server
        assert counts["trainer2"] >= 1, server  # it trained before it froze: its gradients reached every server
    assert (run_dir / "logs" / "trainer2.log").is_file()
    ps0_log = (run_dir / "logs" / "ps0.log").read_text()
    assert "'trainer2' (rank 4) left the group without shutting down" in ps0_log
    assert f"heartbeat_timeout {HEARTBEAT:g} s" in ps0_log or "did not answer a heartbeat" in ps0_log


@pytest.mark.timeout(180)
def test_sync_mode_restarts_the_run_when_a_trainer_dies(tmp_path, monkeypatch):
    # A sync round needs every trainer's gradient: without the dead trainer no round can
    # complete, so sync runs use cluster.max_restarts (and refuse cluster.elastic).
    run_dir = tmp_path / "run"
    monkeypatch.setenv(FAULT_ENV, "trainer1@5#0")
    metrics = run_app(run_dir, *BASELINE, "cluster.max_restarts=1", timeout=150)
    assert [(r["role"], r["from_step"]) for r in metrics["restarts"]] == [("trainer1", 4)]
    assert read_json(run_dir / RESTARTS_FILE) == metrics["restarts"]
    assert "replacements" not in metrics


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["cluster.elastic=true"],
            r"cluster.elastic=true needs mode=async or mode=ssp \(got mode=sync\): every sync "
            r"round waits for every trainer's gradient",
        ),
        (["cluster.elastic=true", "mode=async", "backend=torch"], "cluster.elastic=true needs backend=rpc_core"),
        (["cluster.elastic=true", "mode=ssp", "cluster=env"], "cluster.elastic=true needs cluster.launcher=local"),
        (["join=/nonexistent"], r"join: '/nonexistent' is not the run folder of a running cluster.elastic=true job"),
    ],
)
def test_elastic_settings_are_checked_before_anything_starts(overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_cfg(*overrides)


def test_a_finished_job_cannot_be_joined(tmp_path):
    res = cli(f"join={tmp_path}", cwd=tmp_path)
    assert res.returncode == 2
    assert "is not the run folder of a running cluster.elastic=true job (it has no elastic.json)" in res.stderr


# -- ps0's bookkeeping, in one process --------------------------------------------------------------
class _Info:
    def __init__(self, name, rank):
        self.name, self.id = name, rank


def test_epochs_take_the_launched_trainers_and_the_joiners_present_when_they_begin():
    m = Membership(launched=2, num_servers=1, writer=NullWriter(), version=lambda: 0)
    for name, rank in (("trainer0", 1), ("trainer1", 2)):
        m.changed(_Info(name, rank), True)
    assert m.assignment(0, 0).wait() == Assignment(0, 0, 2)
    m.changed(_Info("trainer1", 2), False)  # dead: its replacement will take its slot
    assert m.assignment(1, 0).wait() == Assignment(0, 1, 2)
    m.changed(_Info("trainer2", 3), True)  # a joiner waits for the next epoch
    waiting = m.assignment(2, -1)
    assert not waiting.done()
    assert m.assignment(0, 1).wait() == Assignment(1, 0, 3)  # trainer0 begins epoch 1: all three
    assert waiting.wait() == Assignment(1, 2, 3)
    assert m.counted() == {0, 2}  # trainer1 is away
    # The job is over once the launched trainers finished; a joiner still waiting is told so.
    late = m.assignment(2, -1)
    reports = m.final_reports()
    m.finish(0, {"trainer": "trainer0"})
    m.finish(1, {"trainer": "trainer1"})
    assert late.wait() is None
    assert not reports.done()  # trainer2 is in the group and has not reported
    m.changed(_Info("trainer2", 3), False)
    assert sorted(reports.wait()) == [0, 1]


def test_elastic_batches_move_to_the_partition_of_each_epoch_and_say_where_they_are():
    from ps_train.workloads.vision.data import BatchIterator, TensorSplit

    data = TensorSplit(torch.arange(40.0).view(40, 1), torch.zeros(40, dtype=torch.int64), 1)
    plan = {1: Assignment(1, 0, 4)}
    batches = ElasticBatches(
        lambda slot, world: BatchIterator(data, slot, world, 5, seed=0), plan.get, Assignment(0, 1, 2), offset=10
    )
    x, _ = next(batches)  # the rest of epoch 0's slot 1 of 2: samples 10..19 of that partition
    assert batches.position() == {"epoch": 0, "slot": 1, "world": 2, "offset": 15}
    next(batches)
    x, _ = next(batches)  # epoch 1: slot 0 of 4
    assert batches.position() == {"epoch": 1, "slot": 0, "world": 4, "offset": 5}
    from ps_train.partition import partition

    assert x.view(-1).long().tolist() == partition(40, 0, 4, 0, 1)[:5].tolist()
    next(batches)
    assert next(batches) is None  # no epoch 2: the job is over
