"""Failures around trainers that joined an elastic job (``join=<run dir>``), and what samples
an elastic async job trains across a replacement.

- a joiner killed is replaced, as a launched trainer is: the new process takes its name and
  continues its partition after its last step the servers applied;
- a server killed restarts the job from its checkpoint (``cluster.max_restarts``), and the
  joiners come back with the restarted job;
- async/ssp data is at-least-once: across a replacement no sample of an epoch is lost, and
  at most the step in flight when the trainer died is trained twice.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections import Counter

import pytest

from ps_train.elastic.membership import Assignment, Membership
from ps_train.faults import FAULT_ENV
from ps_train.metrics import NullWriter
from ps_train.sample_log import SAMPLE_LOG_ENV, read_sample_log
from tests.ps_train._app import read_json

STEPS = 40  # per launched trainer; digits with 2 trainers: 22 steps an epoch
# The launched trainers wait at step 1 until the joiner (trainer2) waits for an epoch, so the
# next one takes it, and trainer0 waits at its last step until ps0 applied ``n`` of the joiner's
# updates (ps_train.faults): the job lasts until the joiner trained, however long it took to come.
JOINER_CAME = "trainer0@1:hold_waiting=trainer2{a},trainer1@1:hold_waiting=trainer2{a}"
JOINER_TRAINED = "trainer0@" + str(STEPS) + ":hold_steps=trainer2*{n}{a}"


def joiner_holds(n, attempt=None):
    a = "" if attempt is None else f"#{attempt}"
    return JOINER_CAME.format(a=a) + "," + JOINER_TRAINED.format(n=n, a=a)


_PID = re.compile(r"starting (\S+) \(rank \d+ of \d+, pid (\d+)\)")


def start(args, env, cwd):
    return subprocess.Popen(
        [sys.executable, "-m", "ps_train", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def read_until(proc, marker, seen):
    """Lines of ``proc`` until one contains ``marker`` (blocks on its output; fails if it ends first)."""
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            return line
    raise AssertionError(f"no {marker!r} in the output:\n" + "".join(seen))


def job_and_joiner(tmp_path, job_env, joiner_env, *overrides):
    """A local elastic async job, and a joiner started as soon as the job can be joined."""
    run_dir = tmp_path / "job"
    job = start(
        [
            "mode=async",
            "cluster.elastic=true",
            f"train.steps={STEPS}",
            "train.eval_every=0",
            "train.log_every=100",
            "logging.progress=false",
            f"hydra.run.dir={run_dir}",
            *overrides,
        ],
        job_env,
        tmp_path,
    )
    seen: list[str] = []
    read_until(job, "starting 2 servers + 2 trainers", seen)  # elastic.json is written before this line
    joiner = start([f"join={run_dir}"], joiner_env, tmp_path)
    return run_dir, job, joiner, seen


def finish(*procs, timeout=240):
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def clean_env(**extra):
    env = dict(os.environ, **extra)
    if FAULT_ENV not in extra:
        env.pop(FAULT_ENV, None)
    return env


def steps_and_ids(run_dir, name):
    lines = read_sample_log(run_dir, name)
    return [line["step"] for line in lines], lines


@pytest.mark.timeout(300)
def test_a_killed_joiner_is_replaced_and_continues_its_partition(tmp_path):
    # The job ends once ps0 applied 4 updates of trainer2: the replacement's first among them.
    job_env = clean_env(**{SAMPLE_LOG_ENV: "1", FAULT_ENV: joiner_holds(4)})
    # The joiner's trainer dies after its third step; the replacement (same name) does not.
    joiner_env = clean_env(**{SAMPLE_LOG_ENV: "1", FAULT_ENV: "trainer2@+3#0"})
    run_dir, job, joiner, seen = job_and_joiner(tmp_path, job_env, joiner_env)
    job_out, joiner_out = finish(job, joiner)
    assert job.returncode == 0, "".join(seen) + job_out
    assert joiner.returncode == 0, joiner_out
    assert "replacement 1: trainer2 was killed (signal 9); starting a new trainer2" in joiner_out
    metrics = read_json(run_dir / "metrics.json")
    events = [e["event"] for e in metrics["membership"] if e["trainer"] == "trainer2"]
    assert events[:3] == ["joined", "left", "joined"], metrics["membership"]
    assert "trainer2" in metrics["losses"]  # the replacement's final report reached trainer0
    log = (run_dir / "logs" / "trainer2.log").read_text()
    assert "trainer2 replaces a trainer that died: continuing after its step" in log
    # At least once: the replacement starts at the step after the last one ps0 applied, so the
    # steps of both processes follow each other, with at most the one in flight repeated.
    steps, lines = steps_and_ids(run_dir, "trainer2")
    first = steps[:3]
    assert first == list(range(first[0], first[0] + 3))
    assert steps[3] in (first[-1], first[-1] + 1)
    assert steps[3:] == list(range(steps[3], steps[3] + len(steps) - 3))
    redone = first[-1] if steps[3] == first[-1] else None
    assert_at_least_once(run_dir, ["trainer0", "trainer1", "trainer2"], redone)
    for server, counts in metrics["updates_by_trainer"].items():
        assert counts["trainer0"] == counts["trainer1"] == STEPS, server
        assert counts["trainer2"] >= len(set(steps)) - 1, server  # both processes' updates, one in flight at most


def assert_at_least_once(run_dir, trainers, redone=None):
    """Within each epoch, no sample was trained by two steps (partitions are disjoint), except
    the ids of trainer2's step ``redone`` (trained again after its trainer died)."""
    seen = Counter()
    for name in trainers:
        for line in read_sample_log(run_dir, name):
            twice = name == "trainer2" and line["step"] == redone
            for i in line["ids"]:
                seen[(line["epoch"], i)] += 0.5 if twice else 1
    assert seen and max(seen.values()) == 1, [k for k, n in seen.items() if n > 1][:10]


@pytest.mark.timeout(300)
def test_a_server_killed_in_an_elastic_job_restarts_it_and_the_joiner_comes_back(tmp_path):
    # Attempt 0 waits at trainer0's step 1 until ps1 is gone (the test kills it once the joiner
    # is in); attempt 1 until the joiner came back, and at the end until it trained.
    job_env = clean_env(**{FAULT_ENV: "trainer0@1:hold_leave=ps1#0," + joiner_holds(1, attempt=1)})
    joiner_env = clean_env()
    run_dir, job, joiner, seen = job_and_joiner(
        tmp_path, job_env, joiner_env, "cluster.max_restarts=1", "checkpoint.every=0"
    )
    joiner_seen: list[str] = []
    try:
        read_until(joiner, "trainer2 joined the job (attempt 0)", joiner_seen)
        ps1 = [m for m in _PID.finditer((run_dir / "logs" / "ps1.log").read_text()) if m.group(1) == "ps1"]
        os.kill(int(ps1[-1].group(2)), signal.SIGKILL)
        read_until(joiner, "the job restarted (attempt 1): joining it again", joiner_seen)
        read_until(joiner, "trainer2 joined the job (attempt 1)", joiner_seen)
    finally:
        job_out, joiner_out = finish(job, joiner)
    joiner_out = "".join(joiner_seen) + joiner_out
    assert job.returncode == 0, "".join(seen) + job_out
    assert joiner.returncode == 0, joiner_out
    metrics = read_json(run_dir / "metrics.json")
    assert [(r["role"], r["reason"]) for r in metrics["restarts"]] == [("ps1", "killed by signal SIGKILL")]
    # metrics.json is the restarted attempt's: the joiner trained in it, on every server.
    assert [e["event"] for e in metrics["membership"] if e["trainer"] == "trainer2"][:1] == ["joined"]
    for server, counts in metrics["updates_by_trainer"].items():
        assert counts["trainer0"] == counts["trainer1"] == STEPS, server
        assert counts["trainer2"] > 0, server
    assert "trainer2" in metrics["losses"]
    assert not (run_dir / "elastic.json").exists()


class _Info:
    def __init__(self, name, rank):
        self.name, self.id = name, rank


def test_a_lagging_replacement_gets_the_epochs_as_they_were_fixed_and_skips_those_without_it():
    m = Membership(launched=2, num_servers=1, writer=NullWriter(), version=lambda: 0)
    for name, rank in (("trainer0", 1), ("trainer1", 2), ("trainer2", 3)):
        m.changed(_Info(name, rank), True)
    assert m.assignment(0, 0).wait() == Assignment(0, 0, 3)
    m.changed(_Info("trainer2", 3), False)  # the joiner dies: epochs 1..5 are fixed without it
    for epoch in range(1, 6):
        assert m.assignment(0, epoch).wait() == Assignment(epoch, 0, 2)
    m.changed(_Info("trainer2", 3), True)  # its replacement, still in epoch 0
    assert m.assignment(2, 0).wait() == Assignment(0, 2, 3)  # epoch 0 as it was fixed, long ago
    waiting = m.assignment(2, 1)  # 1..5 were fixed without it: the next epoch that takes it
    assert not waiting.done()
    assert m.assignment(1, 6).wait() == Assignment(6, 1, 3)
    assert waiting.wait() == Assignment(6, 2, 3)
    assert m.assignment(2, 3).wait() == Assignment(6, 2, 3)  # asked again: no epoch fixed anew
