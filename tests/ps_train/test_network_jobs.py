"""ps_train jobs whose roles sit on emulated hosts (tests/netns.py): each rank is its own
``python -m ps_train cluster=env`` program, started with ``ip netns exec`` in a host's network
namespace and in a pid namespace of its own (so, as between machines, no same-host shortcut
applies), with torchrun-style variables and MASTER_ADDR the first host's address.

- A server whose link is cut for longer than rpc_core's heartbeat timeout makes every rank
  exit, bounded in time, with code 1 and one line naming the failed role.
- Started again (``resume=auto``, as a requeued job does) on delayed (5 +- 1 ms each way),
  lossy (1 % of packets) links, with a server's link down for 1.5 s mid-run (shorter than
  rpc_core's heartbeat timeout), the job resumes from its latest checkpoint and ends with the
  per-step losses and final weights of the same job on loopback: nothing lost, nothing
  applied twice.

One test does both: every job here starts four interpreters that import torch, so the
restart is also the lossy job.

Needs root, ip and iptables; skipped, with the reason, where unavailable.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.netns import RELAY_PORT, Network, unavailable_reason
from tests.ps_train._app import BASELINE, BASELINE_STEPS, QUICK, assert_same_weights, final_weights, read_json

ROLES = ("ps0", "ps1", "trainer0", "trainer1")  # rank r runs on host r
MASTER_PORT = 29500  # free by construction: nothing else lives in these namespaces
LIGHT = ("logging.tensorboard=false",)  # each rank imports everything itself: spare it TensorBoard
# s for one job of 4 ranks: ~40 s on the 2-core machine, but each rank imports torch and, once
# done, tears its interpreter down (a full garbage collection): at a load average of 14-20
# that took 100-150 s.
JOB_TIMEOUT = 300.0
BLIP = 1.5  # s a server's link is down in the restarted job: well under the 30 s heartbeat timeout
# s, rpc_core's heartbeat timeout in the cut job (RPC_CORE_HEARTBEAT_TIMEOUT). Not shorter:
# ranks starved of CPU (a load average of 20 on 2 cores) went 2 s without answering.
HEARTBEAT = 5.0
RESUMED_FROM = 4  # BASELINE checkpoints every 4 of its 8 steps


@pytest.fixture(scope="module")
def net():
    reason = unavailable_reason()
    for tool, package in (("unshare", "util-linux"), ("ss", "iproute2")):
        if reason is None and shutil.which(tool) is None:
            reason = f"`{tool}` not found (apt-get install -y {package})"
    if reason is not None:
        pytest.skip(f"no emulated network here: {reason}")
    network = Network(len(ROLES))
    yield network
    network.close()


class Job:
    """The ranks of one ``cluster=env`` job, rank r on host r; output in ``<run_dir>.<role>.out``."""

    def __init__(self, net: Network, run_dir: Path, *overrides: str, env: dict[str, str] | None = None) -> None:
        self.run_dir = run_dir
        common = {k: v for k, v in os.environ.items() if k != "PS_TRAIN_FAULT"}
        common.update(
            WORLD_SIZE=str(len(ROLES)),
            MASTER_ADDR=net.address(0),
            MASTER_PORT=str(MASTER_PORT),
            RPC_CORE_AUTH_SECRET=os.urandom(16).hex(),
            PYTHONFAULTHANDLER="1",
            **(env or {}),
        )
        args = ["cluster=env", *QUICK, *LIGHT, *BASELINE, *overrides, f"hydra.run.dir={run_dir}"]
        self.outputs = [run_dir.parent / f"{run_dir.name}.{role}.out" for role in ROLES]
        self.procs: list[subprocess.Popen[bytes]] = []
        for rank, out in enumerate(self.outputs):
            with open(out, "wb") as f:
                # unshare: pid 1 of a pid namespace (a peer's pid names nothing here); its child
                # is killed with it (--kill-child), so killing the Popen ends the rank.
                self.procs.append(
                    subprocess.Popen(
                        [
                            "ip",
                            "netns",
                            "exec",
                            net.hosts[rank],
                            "unshare",
                            "--pid",
                            "--kill-child",
                            sys.executable,
                            "-m",
                            "ps_train",
                            *args,
                        ],
                        cwd=run_dir.parent,
                        env=dict(common, RANK=str(rank)),
                        stdout=f,
                        stderr=subprocess.STDOUT,
                    )
                )

    def wait(self, timeout: float) -> list[float]:
        """Wait up to ``timeout`` s for every rank to exit; when each was seen gone (monotonic)."""
        deadline = time.monotonic() + timeout
        gone = []
        for rank, p in enumerate(self.procs):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.dump_stacks()
                self.kill()
                raise AssertionError(
                    f"{ROLES[rank]} did not exit within {timeout:g} s; outputs:\n" + self.describe()
                ) from None
            gone.append(time.monotonic())
        return gone

    def output(self, rank: int) -> str:
        return self.outputs[rank].read_text(errors="replace")

    def describe(self) -> str:
        """Each rank's exit code, output and the end of its log (tracebacks go there)."""
        parts = []
        for r, (role, p) in enumerate(zip(ROLES, self.procs, strict=True)):
            log = self.run_dir / "logs" / f"{role}.log"
            tail = log.read_text(errors="replace")[-3000:] if log.is_file() else "(no log)"
            parts.append(f"--- {role} (exit {p.returncode}):\n{self.output(r)[-2000:]}\n--- {log}:\n{tail}")
        return "\n".join(parts)

    def dump_stacks(self) -> None:
        """Have the ranks still running write their threads' stacks to their output: SIGABRT
        to the Python process (the only child of ``unshare``), which PYTHONFAULTHANDLER=1
        answers with a dump before dying."""
        for p in self.procs:
            if p.poll() is not None:
                continue
            try:
                with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
                    for child in f.read().split():
                        os.kill(int(child), signal.SIGABRT)
            except OSError:
                continue
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def wait_for_line(path: Path, text: str, timeout: float, job: Job, after: int = 0) -> None:
    """Until ``path`` (a role's log) has a line containing ``text`` past its first ``after``
    characters (what an earlier job wrote there): looked at every 10 ms, failing after
    ``timeout`` s or as soon as a rank exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and text in path.read_text(errors="replace")[after:]:
            return
        if any(p.poll() is not None for p in job.procs):
            raise AssertionError(f"a rank exited before {path.name} said {text!r}:\n{job.describe()}")
        time.sleep(0.01)  # polling a file the job writes; bounded by the deadline
    raise AssertionError(f"{path} did not say {text!r} within {timeout:g} s:\n{job.describe()}")


def listeners(net: Network, host: int) -> list[str]:
    """The local addresses of the TCP sockets listening in ``host``'s namespace (the relay's aside)."""
    out = subprocess.run(
        ["ip", "netns", "exec", net.hosts[host], "ss", "-Htln"], capture_output=True, text=True, timeout=20, check=True
    ).stdout
    return [line.split()[3] for line in out.splitlines() if not line.split()[3].endswith(f":{RELAY_PORT}")]


def assert_like_baseline(run_dir: Path, sync_baseline: Any, from_step: int = 0) -> None:
    """Steps ``from_step+1 ..`` had the loopback run's losses, and the final weights are its own."""
    base_dir, base = sync_baseline
    metrics = read_json(run_dir / "metrics.json")
    assert metrics["steps"] == BASELINE_STEPS
    for trainer, losses in base["losses"].items():
        assert metrics["losses"][trainer] == losses[from_step:], trainer
    assert_same_weights(final_weights(run_dir), final_weights(base_dir), exact=True)


@pytest.mark.timeout(1000)
def test_a_server_cut_off_stops_every_rank_and_the_restart_on_lossy_links_with_a_blip_ends_as_on_loopback(
    net, tmp_path, sync_baseline
):
    net.reset()
    net.shape(delay=0.005, jitter=0.001)  # slower steps: the cut lands well before the end
    run_dir = tmp_path / "job"
    env = {"RPC_CORE_HEARTBEAT_TIMEOUT": str(HEARTBEAT)}
    try:
        job = Job(net, run_dir, env=env)
        try:
            wait_for_line(run_dir / "logs" / "trainer0.log", f"checkpoint after step {RESUMED_FROM}", JOB_TIMEOUT, job)
            net.link_down(1)  # ps1's host: nothing gets through, nothing reports an error
            cut = time.monotonic()
            # Every rank listens on its host's address (reachable from the others), none on loopback.
            bound = [listeners(net, h) for h in range(len(ROLES))]
            gone = job.wait(60)
        finally:
            job.kill()
        net.heal()
        assert all(p.returncode == 1 for p in job.procs), job.describe()
        named = []
        for rank, role in enumerate(ROLES):
            assert any(a.startswith(f"{net.address(rank)}:") for a in bound[rank]), (role, bound[rank])
            assert all(a.startswith(f"{net.address(rank)}:") for a in bound[rank]), (role, bound[rank])
            # A prompt exit: the heartbeat timeout (and a quarter), the teardown, a loaded machine.
            assert gone[rank] - cut < 1.5 * HEARTBEAT + 20, (role, gone[rank] - cut)
            lines = [x for x in job.output(rank).splitlines() if x.startswith("error: ")]
            assert len(lines) == 1, (role, job.output(rank)[-3000:])
            assert "Traceback" not in job.output(rank), role  # the traceback is in the role's own log
            m = re.match(rf"error: (\w+) failed \(seen by {role} \(rank {rank}\)\): (\w+): ", lines[0])
            assert m is not None, lines[0]
            assert f"step_00000000{RESUMED_FROM}" in lines[0], lines[0]
            named.append((m.group(1), "sent nothing for" in lines[0]))
        # Each rank names the peer it saw fail first (docs/training_failures.md): ps1 sees the others go
        # silent, and once a rank exits, its peers may see it leave before ps1's silence. The
        # first rank to notice anything beyond ps1 notices ps1's silence, and says so.
        assert any(named[rank] == ("ps1", True) for rank in (0, 2, 3)), named
        assert named[1][0] != "ps1", named
        # Started again (a requeued job), with rpc_core's default heartbeat timeout (30 s), on
        # delayed, lossy links: from the step-4 checkpoint to the end. As it begins to train,
        # ps1's link goes down for BLIP s with calls in flight, then comes back: TCP
        # retransmits, nothing is lost or run twice, nobody gives up.
        net.reset()
        net.shape(loss=0.01, delay=0.005, jitter=0.001)
        log = run_dir / "logs" / "trainer0.log"
        first_job = len(log.read_text(errors="replace"))  # the log is appended to: skip these lines
        again = Job(net, run_dir, "resume=auto")
        try:
            wait_for_line(log, "trainer0 joined the job: all 4 ranks are up", JOB_TIMEOUT, again, after=first_job)
            net.link_down(1)
            time.sleep(BLIP)  # the outage itself
            net.heal()
            running = [p.poll() is None for p in again.procs]
            finished = (run_dir / "checkpoints" / f"step_00000000{BASELINE_STEPS}").exists()
            again.wait(JOB_TIMEOUT)
        finally:
            again.kill()
        relayed = net.relayed_connections()
    finally:
        net.reset()
    assert [p.returncode for p in again.procs] == [0] * len(ROLES), again.describe()
    assert all(running) and not finished  # the blip hit the run, not its end
    assert f"resuming from {run_dir}/checkpoints/step_00000000{RESUMED_FROM}" in again.output(0)
    assert_like_baseline(run_dir, sync_baseline, from_step=RESUMED_FROM)
    assert relayed >= 4  # the trainers' connections to both servers went through the delaying relays
