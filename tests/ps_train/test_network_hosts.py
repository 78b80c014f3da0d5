"""A ``cluster=env`` job on emulated hosts with budgets (tests/netns.py): one rank per host, one
host's link limited to 20 Mbit/s both ways, another host held to a tenth of a core by its cgroup.
The job must complete, the limited link must never have carried more than its rate allows,
and the CPU budget must have held its host back."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.netns import CPU_CGROUPS, Network, unavailable_reason
from tests.ps_train._app import QUICK, read_json

ROLES = ("ps0", "ps1", "trainer0", "trainer1")  # rank r on host r
LIMITED, SLOW = 2, 3  # trainer0's link is shaped; trainer1 gets a quarter of a core
# A budget below what a rank gets while the others wait for it (the suite runs one test at a
# time: trainer1 starts alone on a core), so the quota binds from its first import; at a tenth
# of a core the start alone (~9 s of CPU for torch, Hydra and ps_train) took 90 s.
CORES = 0.25
RATE_BITS, BURST = 20e6, 32 * 1024
# A model whose pushes and pulls (~0.5 MB a step for a trainer) outrun 20 Mbit/s.
JOB = (
    "mode=async",
    "model=mlp",
    "model.hidden_sizes=[256,256]",
    "data=digits",
    "cluster.num_servers=2",
    "cluster.num_trainers=2",
    "train.steps=20",
    "checkpoint.every=0",
    "logging.tensorboard=false",
)
TIMEOUT = 400.0  # each rank imports torch itself; trainer1 does so on half a core, on a shared machine


@pytest.fixture
def net():
    reason = unavailable_reason()
    if reason is None and shutil.which("unshare") is None:
        reason = "`unshare` not found (apt-get install -y util-linux)"
    if reason is None and not os.path.isdir(CPU_CGROUPS):
        reason = f"no cgroup v1 cpu controller at {CPU_CGROUPS}"
    if reason is not None:
        pytest.skip(f"no emulated hosts here: {reason}")
    network = Network(len(ROLES))
    yield network
    network.close()


def highest_rate(samples: list[tuple[float, int]], window: float = 1.0) -> float:
    """The most bytes per second over any ``window`` s between two samples (time, bytes)."""
    best = 0.0
    for i, (t0, b0) in enumerate(samples):
        for t1, b1 in samples[i + 1 :]:
            if t1 - t0 >= window:
                best = max(best, (b1 - b0) / (t1 - t0))
                break
    return best


@pytest.mark.timeout(TIMEOUT + 60)
def test_a_job_on_hosts_with_a_slow_link_and_a_tenth_of_a_core_completes_within_its_budgets(net, tmp_path):
    net.limit_link(LIMITED, "20mbit", burst="32kb")
    net.limit_cpu(SLOW, CORES)
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "PS_TRAIN_FAULT"}
    env.update(
        WORLD_SIZE=str(len(ROLES)),
        MASTER_ADDR=net.address(0),
        MASTER_PORT="29500",
        RPC_CORE_AUTH_SECRET=os.urandom(16).hex(),
    )
    args = [sys.executable, "-m", "ps_train", "cluster=env", *QUICK, *JOB, f"hydra.run.dir={run_dir}"]
    procs = []
    for rank in range(len(ROLES)):
        with open(tmp_path / f"{ROLES[rank]}.out", "wb") as out:
            procs.append(
                subprocess.Popen(
                    net.command(rank, "unshare", "--pid", "--kill-child", *args),
                    cwd=tmp_path,
                    env=dict(env, RANK=str(rank)),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    sent: list[tuple[float, int]] = []
    received: list[tuple[float, int]] = []
    deadline = time.monotonic() + TIMEOUT
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            c = net.link_counters(LIMITED)
            now = time.monotonic()
            sent.append((now, c.tx_bytes))
            received.append((now, c.rx_bytes))
            time.sleep(0.2)  # the sampling period of the link's counters
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    outputs = {role: (tmp_path / f"{role}.out").read_text(errors="replace")[-2000:] for role in ROLES}
    assert [p.returncode for p in procs] == [0] * len(ROLES), outputs
    metrics = read_json(run_dir / "metrics.json")
    assert metrics["steps"] == 20, metrics
    counters = net.link_counters(LIMITED)
    # Traffic on the link was more than the burst: the limit had something to hold back, and did.
    assert counters.tx_bytes > 10 * BURST and counters.rx_bytes > 10 * BURST, counters
    assert counters.overlimits > 0, counters
    # Over any second the link carried at most its rate plus one bucket (and frame headers, 5 %).
    limit = RATE_BITS / 8 * 1.05 + BURST
    assert highest_rate(sent) <= limit, (highest_rate(sent), limit)
    assert highest_rate(received) <= limit, (highest_rate(received), limit)
    assert net.cpu_throttled(SLOW) > 0  # trainer1's host ran into its budget
