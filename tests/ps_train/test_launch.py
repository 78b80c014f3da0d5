"""Launching: a dead role stops the run naming it (and resuming works), torchrun-style env
ranks (under torchrun itself: test_restarts.py), Hydra -m sweeps with a port and folder per job."""

import os
import re
import subprocess
import sys
import time

import pytest

from ps_train.faults import FAULT_ENV
from ps_train.launch.failures import RoleFailed
from ps_train.launch.ports import free_port
from tests.ps_train._app import (
    BASELINE,
    BASELINE_STEPS,
    QUICK,
    assert_same_weights,
    final_weights,
    finish_clis,
    read_json,
    rendezvous_port,
    run_app,
    start_cli,
)

# Ranks started as separate programs each import everything: spare them TensorBoard.
LIGHT = ("logging.tensorboard=false",)
KILL_STEP = 6  # BASELINE checkpoints every 4 steps: the last complete one is step 4


def finish_ok(procs, deadline):
    """Wait until ``deadline`` (time.monotonic) for the ranks to exit, kill any still running,
    and check each exited 0 (showing its output if not)."""
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        kill_all(procs)
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{out}\n{err}"


def kill_all(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def killed_at(log_text):
    """Unix time the fault-injection hook logged just before SIGKILLing its process."""
    m = re.search(r"test fault injection, killing \S+ \(pid \d+\) at step \d+ at unix time ([0-9.]+)", log_text)
    assert m, "the role did not log the injected fault"
    return float(m.group(1))


@pytest.mark.timeout(120)
def test_killed_trainer_stops_the_run_naming_it_and_the_checkpoint_and_resume_matches_uninterrupted(
    tmp_path, monkeypatch, sync_baseline
):
    killed = tmp_path / "killed"
    monkeypatch.setenv(FAULT_ENV, f"trainer1@{KILL_STEP}")
    with pytest.raises(RoleFailed) as err:
        run_app(killed, *BASELINE)
    stopped = time.time()
    monkeypatch.delenv(FAULT_ENV)
    msg = str(err.value)
    assert msg.startswith("trainer1 (rank 3, killed by signal SIGKILL; log: "), msg
    assert f"the latest complete checkpoint is {killed / 'checkpoints' / 'step_000000004'}" in msg
    assert f"continue with resume={killed}" in msg
    assert stopped - killed_at((killed / "logs" / "trainer1.log").read_text()) < 10.0

    base_dir, base = sync_baseline
    resumed = run_app(tmp_path / "resumed", *BASELINE, f"resume={killed}")
    assert resumed["steps"] == BASELINE_STEPS
    for trainer, losses in base["losses"].items():
        assert resumed["losses"][trainer] == losses[4:]
    assert_same_weights(final_weights(tmp_path / "resumed"), final_weights(base_dir), exact=True)


@pytest.mark.timeout(90)
def test_killed_server_stops_the_run_naming_it(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv(FAULT_ENV, "ps1@5")  # after its 5th update, i.e. during step 5
    with pytest.raises(RoleFailed) as err:
        run_app(run_dir, *BASELINE)
    stopped = time.time()
    msg = str(err.value)
    assert msg.startswith("ps1 (rank 1, killed by signal SIGKILL; log: "), msg
    assert "step_000000004" in msg
    assert stopped - killed_at((run_dir / "logs" / "ps1.log").read_text()) < 10.0


@pytest.mark.timeout(60)
def test_run_that_exceeds_its_timeout_is_stopped_naming_the_roles_still_running(tmp_path):
    with pytest.raises(
        RoleFailed,
        match=r"did not finish within its time limit; roles still running: "
        r"\['ps0', 'ps1', 'trainer0', 'trainer1'\]",
    ):
        run_app(tmp_path / "run", "train.steps=100000", timeout=3.0)


@pytest.mark.timeout(120)
def test_env_ranks_from_torchrun_style_variables_meet_though_some_start_later_than_the_rpc_timeout(tmp_path):
    # Four ranks given RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, as torchrun
    # gives them (torchrun itself: test_restarts.py); the trainers start after the servers
    # waited longer than cluster.rpc_timeout, within cluster.init_timeout.
    run_dir = tmp_path / "job"  # every rank is told the same run folder
    port = free_port()
    args = [
        sys.executable,
        "-m",
        "ps_train",
        "cluster=env",
        f"hydra.run.dir={run_dir}",
        "train.steps=2",
        "cluster.rpc_timeout=2",
        "cluster.init_timeout=60",
        *QUICK,
        *LIGHT,
    ]
    common = dict(
        os.environ,
        WORLD_SIZE="4",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RPC_CORE_AUTH_SECRET=os.urandom(16).hex(),
    )
    common.pop(FAULT_ENV, None)

    def start(rank):
        return subprocess.Popen(
            args,
            cwd=tmp_path,
            env=dict(common, RANK=str(rank), LOCAL_RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    procs = [start(0), start(1)]
    try:
        ps0_log = run_dir / "logs" / "ps0.log"
        deadline = time.monotonic() + 60
        while not (ps0_log.is_file() and "rendezvous at" in ps0_log.read_text()):
            assert time.monotonic() < deadline and procs[0].poll() is None, "ps0 did not reach its rendezvous"
            time.sleep(0.05)
        time.sleep(3.0)  # the scenario itself: the trainers start after one rpc_timeout has passed
    except BaseException:
        kill_all(procs)
        raise
    procs += [start(2), start(3)]
    finish_ok(procs, time.monotonic() + 90)
    metrics = read_json(run_dir / "metrics.json")  # written by trainer0 (rank 2)
    assert metrics["steps"] == 2 and metrics["num_trainers"] == 2 and metrics["server_updates"] == [2, 2]
    for role in ("ps0", "ps1", "trainer0", "trainer1"):
        assert rendezvous_port(run_dir, role) == port
    assert read_json(run_dir / "provenance.json")["config"]["cluster"]["launcher"] == "env"
    assert (run_dir / "checkpoints" / "step_000000002" / "manifest.json").is_file()


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    """The two ``python -m ps_train`` commands of the tests below, started at once (each an
    interpreter importing torch on one core), each in a fresh folder: name -> (folder, result)."""
    folders = {name: tmp_path_factory.mktemp(name) for name in ("no_secret", "sweep", "alone")}
    no_secret = {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    alone = {**no_secret, "MASTER_PORT": str(free_port()), "RPC_CORE_AUTH_SECRET": os.urandom(16).hex()}
    procs = {
        "no_secret": start_cli(
            "cluster=env",
            f"hydra.run.dir={folders['no_secret'] / 'job'}",
            cwd=folders["no_secret"],
            env={**no_secret, "RPC_CORE_AUTH_SECRET": ""},
        ),
        # ps0 started, the other three ranks never: it gives up after init_timeout, naming them.
        "alone": start_cli(
            "cluster=env",
            "cluster.init_timeout=3",
            f"hydra.run.dir={folders['alone'] / 'job'}",
            *QUICK,
            *LIGHT,
            cwd=folders["alone"],
            env=alone,
        ),
        "sweep": start_cli(
            "-m",
            "optim.lr=0.01,0.1",
            "train.steps=2",
            *QUICK,
            *LIGHT,
            f"hydra.sweep.dir={folders['sweep'] / 'sweep'}",
            cwd=folders["sweep"],
        ),
    }
    return {name: (folders[name], r) for name, r in finish_clis(procs).items()}


@pytest.mark.timeout(120)
def test_a_rank_that_never_joins_is_named_by_its_role_on_the_console(commands):
    tmp_path, r = commands["alone"]
    assert r.returncode != 0
    assert "missing ranks [1, 2, 3]" in r.stderr and "[missing: ps1, trainer0, trainer1]" in r.stderr, r.stderr
    assert "[missing: ps1, trainer0, trainer1]" in (tmp_path / "job" / "logs" / "ps0.log").read_text()


@pytest.mark.timeout(120)
def test_env_launcher_needs_the_shared_auth_secret(commands):
    tmp_path, r = commands["no_secret"]
    assert r.returncode == 2
    assert "set RPC_CORE_AUTH_SECRET to the same secret on every rank" in r.stderr
    assert not (tmp_path / "job" / "logs").exists()


@pytest.mark.timeout(120)
def test_multirun_sweep_gives_each_job_its_own_folder_port_and_overrides(commands):
    tmp_path, r = commands["sweep"]
    sweep = tmp_path / "sweep"
    assert r.returncode == 0, r.stdout + r.stderr
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert [j.name for j in jobs] == ["0", "1"]
    for job, lr in zip(jobs, ("0.01", "0.1"), strict=True):
        assert read_json(job / "metrics.json")["steps"] == 2
        prov = read_json(job / "provenance.json")
        assert f"optim.lr={lr}" in prov["overrides"] and prov["config"]["optim"]["lr"] == float(lr)
        assert prov["config"]["cluster"]["master_port"] == 0  # so the launcher picked one per job
    ports = [rendezvous_port(job) for job in jobs]
    assert all(ports) and ports[0] != ports[1]
