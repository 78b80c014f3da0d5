"""cluster.max_restarts: a run whose role dies or freezes restarts from its latest checkpoint
in the same run folder and, in sync mode, ends exactly like an uninterrupted run."""

import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from ps_train import faults
from ps_train.config import ConfigError
from ps_train.faults import ATTEMPT_ENV, FAULT_ENV, REPLACED_ENV, Fault, fault_at, maybe_inject_fault, parse_faults
from ps_train.launch.failures import RoleFailed
from ps_train.launch.heartbeat import process_state
from ps_train.launch.ports import free_port
from ps_train.launch.restarts import RESTARTS_FILE, start_checkpoint
from tests.ps_train._app import (
    BASELINE,
    BASELINE_STEPS,
    QUICK,
    assert_same_weights,
    final_weights,
    make_cfg,
    read_json,
    rendezvous_port,
    run_app,
    scalars,
)

FAIL_STEP = 5  # ps1's 5th update, i.e. during step 5; BASELINE checkpoints every 4 steps
RESUMED_FROM = 4


def assert_like_the_baseline(run_dir, metrics, sync_baseline):
    """The restarted run's last attempt ran steps 5..8 with the baseline's losses, ended with
    its weights, and TensorBoard shows every step once, with the baseline's loss."""
    base_dir, base = sync_baseline
    assert metrics["steps"] == BASELINE_STEPS
    for trainer, losses in base["losses"].items():
        assert metrics["losses"][trainer] == losses[RESUMED_FROM:]
        curve = scalars(run_dir / "tb" / trainer)["train/loss"]  # both attempts' event files
        assert [step for step, _ in curve] == list(range(1, BASELINE_STEPS + 1))
        assert [value for _, value in curve] == pytest.approx(losses, rel=1e-6)  # stored as float32
    assert_same_weights(final_weights(run_dir), final_weights(base_dir), exact=True)
    assert read_json(run_dir / "metrics.json")["restarts"] == metrics["restarts"]
    assert read_json(run_dir / RESTARTS_FILE) == metrics["restarts"]
    assert scalars(run_dir / "tb" / "trainer0")["train/restarts"] == [(0, 0.0), (RESUMED_FROM, 1.0)]


@pytest.mark.timeout(180)
def test_killed_server_is_restarted_from_the_latest_checkpoint_and_ends_like_an_uninterrupted_run(
    tmp_path, monkeypatch, sync_baseline, caplog
):
    run_dir = tmp_path / "run"
    monkeypatch.setenv(FAULT_ENV, f"ps1@{FAIL_STEP}#0")  # the first attempt only
    with caplog.at_level("WARNING", logger="ps_train"):
        metrics = run_app(run_dir, *BASELINE, "cluster.max_restarts=1", timeout=150)
    checkpoint = str(run_dir / "checkpoints" / "step_000000004")
    assert metrics["restarts"] == [
        {"role": "ps1", "reason": "killed by signal SIGKILL", "from_step": RESUMED_FROM, "checkpoint": checkpoint}
    ]
    assert (
        f"restart 1 of 1: ps1 failed (killed by signal SIGKILL); stopped the other roles; restarting the run "
        f"from its checkpoint after step 4 ({checkpoint})"
    ) in caplog.text
    assert_like_the_baseline(run_dir, metrics, sync_baseline)


@pytest.mark.timeout(180)
def test_frozen_server_is_detected_by_its_missing_heartbeat_and_the_run_restarted(tmp_path, monkeypatch, sync_baseline):
    run_dir = tmp_path / "run"
    monkeypatch.setenv(FAULT_ENV, f"ps1@{FAIL_STEP}:freeze#0")  # SIGSTOP: alive, silent
    metrics = run_app(run_dir, *BASELINE, "cluster.max_restarts=1", "cluster.role_timeout=5", timeout=150)
    [restart] = metrics["restarts"]
    assert (restart["role"], restart["from_step"]) == ("ps1", RESUMED_FROM)
    assert restart["reason"].startswith("unresponsive: no heartbeat for ")
    assert restart["reason"].endswith(", the process is stopped by a signal (SIGSTOP)")
    silent = float(restart["reason"].split("no heartbeat for ", 1)[1].split(" s", 1)[0])
    assert 5.0 <= silent < 15.0  # detected once role_timeout passed, not after an RPC timeout (60 s)
    assert_like_the_baseline(run_dir, metrics, sync_baseline)


@pytest.mark.timeout(180)
def test_a_run_that_keeps_failing_stops_after_max_restarts_naming_the_role(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv(FAULT_ENV, f"ps1@{FAIL_STEP}")  # every attempt
    with pytest.raises(RoleFailed) as err:
        run_app(run_dir, *BASELINE, "cluster.max_restarts=1", timeout=150)
    msg = str(err.value)
    assert msg.startswith("ps1 (rank 1, killed by signal SIGKILL; log: "), msg
    assert msg.endswith("(after 1 restart(s), the most cluster.max_restarts=1 allows)")
    assert err.value.role == "ps1" and err.value.checkpoint == str(run_dir / "checkpoints" / "step_000000004")
    assert [r["from_step"] for r in read_json(run_dir / RESTARTS_FILE)] == [RESUMED_FROM]
    assert not (run_dir / "metrics.json").exists()


def test_fault_specs_parse_and_bad_ones_say_the_format():
    assert parse_faults("ps1@5:freeze#0, trainer1@7") == [
        Fault("ps1", 5, "freeze", 0),
        Fault("trainer1", 7, "kill", None),
    ]
    assert parse_faults("trainer2@+3:freeze") == [Fault("trainer2", 3, "freeze", None, relative=True)]
    assert parse_faults("trainer1@5:partial#0") == [Fault("trainer1", 5, "partial", 0)]
    assert parse_faults("trainer0@1:hold_waiting=trainer2#1,trainer0@9:hold_steps=trainer2*3") == [
        Fault("trainer0", 1, "hold_waiting", 1, peer="trainer2"),
        Fault("trainer0", 9, "hold_steps", None, peer="trainer2", updates=3),
    ]
    with pytest.raises(
        ValueError,
        match=r"'ps1@x' is not <role>@\[\+\]<step>\[:kill\|:freeze\|:stall\|:partial\|:checkpoint\|:eval\|:restore"
        r"\|:hold_waiting=<name>\|:hold_steps=<name>\*<n>\|:hold_leave=<name>\]\[#<attempt>\]",
    ):
        parse_faults("ps1@x")
    # A hold names whom it waits for (and :hold_steps how many updates); the others name nobody.
    for bad in ("ps1@2:explode", "trainer0@1:hold_waiting", "trainer0@1:hold_steps=trainer2", "ps1@2:kill=ps0"):
        with pytest.raises(ValueError, match=f"'{re.escape(bad)}' is not"):
            parse_faults(bad)


class _LocalRpc:
    """``backend.rpc()`` for a hold in one process: a call to ps0 runs here, on ``_Server``."""

    def __init__(self, server):
        self.server = server

    def rpc_sync(self, to, func, args):
        assert to == "ps0"
        return func(*args)

    def _get_current_rpc_agent(self):
        return self

    def get_worker_infos(self):
        return [SimpleNamespace(name=name) for name in ("ps0", "ps1", "trainer0", "trainer2")]


class _Server:
    """ps0's ParameterServer as a hold sees it (through ``_Ps0Ref``): each ``stats()`` answers
    that one more update of trainer2 was applied."""

    membership = None  # not an elastic run

    def __init__(self):
        self.asked = 0

    def stats(self):
        self.asked += 1
        return {"updates_by_trainer": {"trainer0": 7, "trainer2": self.asked - 1}}


class _Ps0Ref:
    def __init__(self, server):
        self.server = server

    def owner(self):
        return "ps0"

    def local_value(self):
        return self.server


def test_a_hold_waits_until_ps0_sees_its_event_and_gives_up_after_its_timeout(monkeypatch, caplog):
    server = _Server()
    monkeypatch.setattr(faults.backend, "rpc", lambda: _LocalRpc(server))
    monkeypatch.setenv(FAULT_ENV, "trainer0@4:hold_steps=trainer2*3")
    maybe_inject_fault("trainer0", 3, _Ps0Ref(server))  # not its step: no hold, no question
    assert server.asked == 0
    with caplog.at_level("WARNING", logger="ps_train"):
        maybe_inject_fault("trainer0", 4, _Ps0Ref(server))
    assert server.asked == 4  # 0, 1, 2, then 3 updates of trainer2: it goes on
    assert "holding trainer0 at step 4 until ps0 applied 3 update(s) of trainer2" in caplog.text
    assert "ps0 applied 3 update(s) of trainer2; trainer0 trains on" in caplog.text
    monkeypatch.setenv(FAULT_ENV, "trainer0@4:hold_leave=ps1,trainer1@4:hold_leave=ps3")
    caplog.clear()
    with caplog.at_level("WARNING", logger="ps_train"):
        maybe_inject_fault("trainer1", 4, _Ps0Ref(server))  # ps3 is not in the group
        assert "ps3 left the group; trainer1 trains on" in caplog.text
        monkeypatch.setattr(faults, "HOLD_TIMEOUT", 0.0)
        maybe_inject_fault("trainer0", 4, _Ps0Ref(server))  # ps1 stays
    assert "gave up holding trainer0 after 0 s: not seen that ps1 left the group" in caplog.text
    with pytest.raises(ValueError, match="ps1 cannot hold until ps3 left the group: only a trainer knows ps0"):
        monkeypatch.setenv(FAULT_ENV, "ps1@4:hold_leave=ps3")
        maybe_inject_fault("ps1", 4)  # a server has no ps0 to ask


def test_a_fault_fires_at_its_point_and_attempt_and_a_replacement_skips_relative_ones(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "ps1@4:restore#1,trainer7@+1:partial")
    monkeypatch.setenv(ATTEMPT_ENV, "1")
    assert fault_at("ps1", 4, "restore") and not fault_at("ps1", 4, "partial") and not fault_at("ps0", 4, "restore")
    assert fault_at("trainer7", 3, "partial")  # its first step in this process
    monkeypatch.setenv(REPLACED_ENV, "1")  # a process started in place of a dead one
    assert not fault_at("trainer7", 3, "partial")
    monkeypatch.setenv(ATTEMPT_ENV, "0")
    assert not fault_at("ps1", 4, "restore")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["cluster.max_restarts=-1"], "cluster.max_restarts: -1 must be >= 0"),
        (["cluster.role_timeout=-1"], "cluster.role_timeout: -1.0 must be >= 0 seconds"),
        (["cluster.init_timeout=0"], "cluster.init_timeout: 0.0 must be > 0 seconds"),
        (["cluster=env", "cluster.max_restarts=2"], r"let torchrun restart them \(torchrun --max-restarts=N"),
    ],
)
def test_restart_settings_are_checked_before_anything_starts(overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_cfg(*overrides)


def test_restart_settings_default_to_no_restarts_and_a_30_s_heartbeat_timeout():
    cfg = make_cfg()
    assert (cfg.cluster.max_restarts, cfg.cluster.role_timeout) == (0, 30.0)
    assert make_cfg("resume=auto").resume == "auto"


# Ranks started as separate programs each import everything: spare them TensorBoard.
LIGHT = ("logging.tensorboard=false",)
ENV_ARGS = ("-m", "ps_train", "cluster=env", *QUICK, *LIGHT, *BASELINE)


def job_env(**extra):
    """The test's environment (less any fault of its own) with a fresh secret and ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    return dict(env, RPC_CORE_AUTH_SECRET=os.urandom(16).hex(), **extra)


@pytest.mark.timeout(300)
def test_torchrun_max_restarts_restarts_the_job_and_it_resumes_from_the_latest_checkpoint(tmp_path, sync_baseline):
    run_dir = tmp_path / "job"
    port = free_port()
    env = job_env(**{FAULT_ENV: f"ps1@{FAIL_STEP}#0"})  # TORCHELASTIC_RESTART_COUNT=0 only
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            "--nproc-per-node=4",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "--max-restarts=1",
            *ENV_ARGS,
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # torchrun's agent listens on MASTER_PORT itself: rank 0 handed the other ranks another port.
    ports = {rendezvous_port(run_dir, role) for role in ("ps0", "ps1", "trainer0", "trainer1")}
    assert len(ports) == 1 and port not in ports
    assert "killing ps1" in (run_dir / "logs" / "ps1.log").read_text()  # the fault did fire
    metrics = read_json(run_dir / "metrics.json")
    [restart] = metrics["restarts"]
    # Who failed is what a surviving rank noted before torchrun stopped it, if one had the time.
    assert (restart["role"], restart["from_step"]) in (("ps1", RESUMED_FROM), ("unknown", RESUMED_FROM))
    assert restart["checkpoint"] == str(run_dir / "checkpoints" / "step_000000004")
    base_dir, base = sync_baseline
    for trainer, losses in base["losses"].items():
        assert metrics["losses"][trainer] == losses[RESUMED_FROM:]
    assert_same_weights(final_weights(run_dir), final_weights(base_dir), exact=True)


@pytest.mark.timeout(200)
def test_env_ranks_of_a_job_whose_server_died_exit_promptly_non_zero_with_one_line_naming_it(tmp_path):
    # No torchrun: nothing kills the survivors for them.
    run_dir = tmp_path / "job"
    common = job_env(
        WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **{FAULT_ENV: f"ps1@{FAIL_STEP}"}
    )
    procs = [
        subprocess.Popen(
            [sys.executable, *ENV_ARGS, f"hydra.run.dir={run_dir}"],
            cwd=tmp_path,
            env=dict(common, RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(4)
    ]
    outputs, exited = [], []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=180))
            exited.append(time.time())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    killed = float(re.search(r"at unix time ([0-9.]+)", (run_dir / "logs" / "ps1.log").read_text()).group(1))
    assert procs[1].returncode == -signal.SIGKILL
    for rank in (0, 2, 3):
        _, err = outputs[rank]
        assert procs[rank].returncode == 1, err[-3000:]
        [line] = [x for x in err.splitlines() if x.startswith("error: ")]
        # A trainer's call to ps1 fails: it names ps1. ps0, idle in its shutdown, sees whichever
        # peer leaves first: ps1, or a trainer that has just given up.
        culprit = "ps1" if rank >= 2 else "(ps1|trainer[01])"
        assert re.match(rf"error: {culprit} failed \(seen by \w+ \(rank {rank}\)\): ", line), line
        assert "the latest complete checkpoint is" in line and "step_000000004" in line
        assert "Traceback" not in err  # the traceback is in the rank's own log
        assert exited[rank] - killed < 30.0
    assert "this rank failed" in (run_dir / "logs" / "trainer0.log").read_text()


def test_where_an_attempt_starts(tmp_path):
    import torch

    from ps_train.checkpoint.files import save_checkpoint

    run_dir, other = tmp_path / "run", str(tmp_path / "other" / "checkpoints" / "step_000000002")
    assert start_checkpoint(None, str(run_dir), restarted=False) is None
    assert start_checkpoint("auto", str(run_dir), restarted=False) is None  # nothing yet: from scratch
    assert start_checkpoint(other, str(run_dir), restarted=True) == other  # failed before its first checkpoint
    save_checkpoint(run_dir, 3, {"ps0": {"w": torch.zeros(1)}})
    save_checkpoint(run_dir, 6, {"ps0": {"w": torch.ones(1)}})
    latest = str(run_dir / "checkpoints" / "step_000000006")
    assert start_checkpoint("auto", str(run_dir), restarted=False) == latest
    assert start_checkpoint(other, str(run_dir), restarted=True) == latest
    assert start_checkpoint(None, str(run_dir), restarted=True) == latest
    assert start_checkpoint(other, str(run_dir), restarted=False) == other  # a fresh start honours resume=


@pytest.mark.timeout(30)
def test_process_state_tells_a_stopped_process_from_a_sleeping_one():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        os.kill(child.pid, signal.SIGSTOP)
        # A signal to another process arrives asynchronously: wait until the kernel reports the
        # stop (waitpid with WUNTRACED) rather than guessing a delay.
        _, status = os.waitpid(child.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        assert process_state(child.pid) == "stopped by a signal (SIGSTOP)"
        os.kill(child.pid, signal.SIGCONT)
    finally:
        child.kill()
        child.wait()
    assert process_state(child.pid) is None  # gone


@pytest.mark.timeout(200)
def test_env_ranks_of_a_job_whose_server_froze_exit_within_the_rpc_timeout_naming_it(tmp_path):
    run_dir = tmp_path / "job"
    common = job_env(
        WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **{FAULT_ENV: f"ps1@{FAIL_STEP}:freeze"}
    )
    procs = [
        subprocess.Popen(
            [sys.executable, *ENV_ARGS, "cluster.rpc_timeout=5", f"hydra.run.dir={run_dir}"],
            cwd=tmp_path,
            env=dict(common, RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(4)
    ]
    survivors = [procs[r] for r in (0, 2, 3)]
    outputs, exited = [], []
    try:
        for p in survivors:
            outputs.append(p.communicate(timeout=150))
            exited.append(time.time())
    finally:
        for p in procs:  # ps1 stays stopped until killed, as torchrun or SLURM would
            if p.poll() is None:
                p.kill()
                p.wait()
    froze = float(
        re.search(
            r"freezing ps1 \(pid \d+\) at step \d+ at unix time ([0-9.]+)", (run_dir / "logs" / "ps1.log").read_text()
        ).group(1)
    )
    for rank, p, (_, err), t in zip((0, 2, 3), survivors, outputs, exited, strict=True):
        assert p.returncode == 1, err[-3000:]
        [line] = [x for x in err.splitlines() if x.startswith("error: ")]
        culprit = "ps1" if rank >= 2 else "(ps1|trainer[01])"
        assert re.match(rf"error: {culprit} failed \(seen by \w+ \(rank {rank}\)\): ", line), line
        if rank >= 2:
            assert "RpcTimeoutError: RPC ran for more than set timeout (5000 ms)" in line, line
        assert t - froze < 5 + 30.0  # the RPC timeout, then a prompt exit
