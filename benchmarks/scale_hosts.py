"""A ps_train job on emulated hosts with shaped links (tests/netns.py), against the cost model.

    sudo python -m benchmarks.scale_hosts --constants ps_train/scaling/calibration.json \\
        [--rate-kbit 200] [--trainers 1] [--servers 1] [--steps 60] [--json hosts.json] \\
        [--cores 0.25] [--mode sync]

One rank per host (network namespaces on a bridge, ``cluster=env``), every host's link held to
``--rate-kbit`` both ways by a token bucket (``tbf`` queues, it adds no latency). Prints the
measured samples/s (``metrics.json``) next to the model's prediction for the same cluster and
writes both with the run's byte counts. ``--cores C`` gives every host a CPU budget of C cores
(a cgroup v1 ``cpu`` quota) and tells the model so; it binds only while the machine has C cores
to spare for every host at once (the report says how many periods each host was held back).

``--straggler-cores C2`` gives the last trainer's host C2 cores instead (a straggler: the same
work on less CPU). ``--kill-trainer K --kill-after-step N [--kill-delay D]`` SIGKILLs trainer K
D seconds after the checkpoint of step N is written, stops the other ranks and starts the job
again in the same folder, as ``torchrun --max-restarts=1`` would (it resumes from that
checkpoint); ``elapsed_s`` then spans both attempts. ``scale_check.py`` compares both with the
simulator.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from benchmarks._results import add_result_option, run_recorded
from ps_train.scaling.cost_model import Cluster, load_calibration, predict
from ps_train.scaling.shapes import mlp
from tests.netns import Network, unavailable_reason

HERE = Path(__file__).resolve().parent
LINK_BURST_BYTES = 8 * 1024  # every host's token bucket, each way (tc's "8kb"): the cost model's link_burst_bytes
CPU_PERIOD_S = 0.1  # the CFS period of every host's CPU quota (Network.limit_cpu's default): Cluster.cpu_period_s

JOB = [
    "model=mlp",
    "data=digits",
    "train.eval_every=0",
    "logging.progress=false",
    "logging.tensorboard=false",
    "checkpoint.every=0",
]


@dataclass(frozen=True)
class KillPlan:
    """A trainer SIGKILLed ``delay_s`` after trainer0 wrote the checkpoint of step ``after_step``;
    then, as ``torchrun --max-restarts=1`` does, every other rank is stopped and the whole job
    started again in the same run folder (``TORCHELASTIC_RESTART_COUNT=1``: it resumes from the
    latest checkpoint by itself). The job must checkpoint every ``after_step`` steps or fewer."""

    trainer: int  # 0..T-1
    after_step: int
    delay_s: float


Rank = tuple[subprocess.Popen[bytes], BinaryIO]  # a rank's process and its output file


def _launch(net: Network, world: int, args: list[str], env: dict[str, str], run_dir: Path, attempt: int) -> list[Rank]:
    procs: list[Rank] = []
    for rank in range(world):
        out = open(run_dir / f"rank{rank}.{attempt}.out", "wb")  # noqa: SIM115 (closed with the process below)
        cmd = net.command(rank, "unshare", "--pid", "--kill-child", *args)
        procs.append((subprocess.Popen(cmd, env=dict(env, RANK=str(rank)), stdout=out, stderr=subprocess.STDOUT), out))
    return procs


def _reap(
    procs: list[Rank], deadline: float, kill: KillPlan | None, servers: int, run_dir: Path
) -> dict[int, tuple[int, float]]:
    """Wait for every rank (SIGKILL them at ``deadline``); with ``kill``, kill its trainer when
    due and then the others at once. Rank -> (exit code, CPU seconds of its whole tree)."""
    # Reaped with wait4, not Popen.wait: its rusage holds the CPU of the rank's whole process
    # tree (unshare reaps the Python it forked), what scale_calibrate.py fits on.
    ended: dict[int, tuple[int, float]] = {}
    due: float | None = None
    victim = servers + kill.trainer if kill is not None else None
    marker = run_dir / "checkpoints" / f"step_{kill.after_step:09d}" / "manifest.json" if kill else None
    while len(ended) < len(procs) and time.monotonic() < deadline:
        if marker is not None and due is None and marker.exists():
            due = time.monotonic() + kill.delay_s if kill else None
        if victim is not None and due is not None and time.monotonic() >= due:
            procs[victim][0].kill()
            for rank, (p, _) in enumerate(procs):  # the agent's part: a dead worker stops the others
                if rank not in ended:
                    p.kill()
            victim = marker = None
        for rank, (p, _) in enumerate(procs):
            if rank not in ended:
                pid, status, usage = os.wait4(p.pid, os.WNOHANG)
                if pid:
                    ended[rank] = (os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime)
        time.sleep(0.1)  # polling the ranks' exit and the checkpoint, not waiting for an event
    for rank, (p, out) in enumerate(procs):
        if rank not in ended:
            p.kill()
            _, status, usage = os.wait4(p.pid, 0)
            ended[rank] = (os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime)
        p.returncode = ended[rank][0]  # reaped here: Popen must not wait for it again
        out.close()
    return ended


def run(
    trainers: int,
    servers: int,
    steps: int,
    rate_kbit: float,
    timeout: float,
    cores: float | None,
    mode: str,
    straggler_cores: float | None = None,
    kill: KillPlan | None = None,
) -> dict:
    """The job's ``metrics.json`` (its last attempt's) with each rank's CPU seconds, the
    periods each host was throttled, and ``elapsed_s``: from the first launch until every rank
    of the last attempt exited. ``straggler_cores``: the last trainer's host gets this CPU
    budget instead of ``cores`` (a straggler: the same work on less CPU)."""
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"no emulated hosts here: {reason}")
    if kill is not None and not 0 <= kill.trainer < trainers:
        raise SystemExit(f"--kill-trainer {kill.trainer}: the job has trainers 0..{trainers - 1}")
    if kill is not None and not 0 < kill.after_step < steps:
        raise SystemExit(f"--kill-after-step {kill.after_step}: must be between 0 and --steps {steps}")
    world = servers + trainers
    net = Network(world)
    run_dir = Path(tempfile.mkdtemp(prefix="scale_hosts_"))
    try:
        for host in range(world):
            # Queue for up to 5 s: at these rates a step's request waits that long in the bucket.
            net.limit_link(host, f"{rate_kbit}kbit", burst=f"{LINK_BURST_BYTES // 1024}kb", latency="5s")
            budget = straggler_cores if straggler_cores is not None and host == world - 1 else cores
            if budget is not None:
                net.limit_cpu(host, budget)
        env = {k: v for k, v in os.environ.items() if k not in ("PS_TRAIN_FAULT", "TORCHELASTIC_RESTART_COUNT")}
        env.update(
            WORLD_SIZE=str(world),
            MASTER_ADDR=net.address(0),
            MASTER_PORT="29500",
            RPC_CORE_AUTH_SECRET=os.urandom(16).hex(),
        )
        args = [
            sys.executable,
            "-m",
            "ps_train",
            "cluster=env",
            *JOB,
            f"mode={mode}",
            f"cluster.num_servers={servers}",
            f"cluster.num_trainers={trainers}",
            f"train.steps={steps}",
            f"hydra.run.dir={run_dir}",
        ]
        if kill is not None:  # the restarted attempt resumes from the checkpoint the kill follows
            args.append(f"checkpoint.every={kill.after_step}")
        started = time.monotonic()
        deadline = started + timeout
        ended = _reap(_launch(net, world, args, env, run_dir, 0), deadline, kill, servers, run_dir)
        if kill is not None:
            ended = _reap(
                _launch(net, world, args, dict(env, TORCHELASTIC_RESTART_COUNT="1"), run_dir, 1),
                deadline, None, servers, run_dir,
            )  # fmt: skip
        elapsed = time.monotonic() - started
        codes = [ended[r][0] for r in range(world)]
        throttled = [net.cpu_throttled(h) for h in range(world)] if cores is not None else []
    finally:
        net.close()
    if codes != [0] * world:
        raise SystemExit(f"the job failed (exit codes {codes}); outputs in {run_dir}")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    metrics["periods_throttled"] = throttled
    metrics["rank_cpu_s"] = [ended[r][1] for r in range(world)]  # ranks 0..S-1 the servers, then the trainers
    metrics["elapsed_s"] = elapsed
    shutil.rmtree(run_dir, ignore_errors=True)  # what it held is in the metrics returned
    return metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--constants", type=Path, required=True)
    ap.add_argument("--rate-kbit", type=float, default=200.0)
    ap.add_argument("--trainers", type=int, default=1)
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cores", type=float, default=None, help="CPU budget of every host (cores); default none")
    ap.add_argument("--mode", choices=("async", "sync"), default="async")
    ap.add_argument("--straggler-cores", type=float, default=None, help="the last trainer's host's CPU budget")
    ap.add_argument("--kill-trainer", type=int, default=None, help="SIGKILL this trainer once, then restart the job")
    ap.add_argument("--kill-after-step", type=int, default=None, help="...once the checkpoint of this step is written")
    ap.add_argument("--kill-delay", type=float, default=0.0, help="...and this many seconds more")
    add_result_option(ap, "scale_hosts")
    args = ap.parse_args()
    if args.cores is not None and args.cores <= 0:
        raise SystemExit(f"--cores must be > 0, got {args.cores}")
    if args.straggler_cores is not None and not (args.cores is not None and 0 < args.straggler_cores):
        raise SystemExit("--straggler-cores needs --cores (the others' budget) and a budget > 0")
    kill = None
    if args.kill_trainer is not None:
        if args.kill_after_step is None:
            raise SystemExit("--kill-trainer needs --kill-after-step (the checkpoint the restart resumes from)")
        kill = KillPlan(args.kill_trainer, args.kill_after_step, args.kill_delay)
    m = run(
        args.trainers, args.servers, args.steps, args.rate_kbit, args.timeout, args.cores, args.mode,
        args.straggler_cores, kill,
    )  # fmt: skip
    c = load_calibration(args.constants).constants
    cores = args.cores if args.cores is not None else 1.0
    cl = Cluster(
        args.trainers, args.servers, args.rate_kbit * 1e3, 0.0, cores, cores, None, args.mode,
        LINK_BURST_BYTES, CPU_PERIOD_S,
    )  # fmt: skip
    p = predict(c, mlp(), cl)
    err = (p.samples_per_s - m["samples_per_s"]) / m["samples_per_s"]
    print(
        f"[hosts] {args.mode} T={args.trainers} S={args.servers} at {args.rate_kbit:g} kbit/s, "
        f"{cores:g} core(s) a host: measured "
        f"{m['samples_per_s']:,.1f} samples/s, predicted {p.samples_per_s:,.1f} ({err:+.0%}), binds: {p.binding}; "
        f"bytes per step per server {m.get('server_bytes_per_step')}; "
        f"periods throttled per host {m['periods_throttled'] or '-'}"
    )
    if args.json:
        record = {
            "trainers": args.trainers,
            "servers": args.servers,
            "rate_kbit": args.rate_kbit,
            "mode": args.mode,
            "cores_per_host": args.cores,
            "periods_throttled": m["periods_throttled"],
            "steps": m["steps"],
            "measured_samples_per_s": m["samples_per_s"],
            "predicted_samples_per_s": p.samples_per_s,
            "binding": p.binding,
            "server_bytes_per_step": m.get("server_bytes_per_step"),
            "wall_time_s": m["wall_time_s"],
            "elapsed_s": m["elapsed_s"],
            "straggler_cores": args.straggler_cores,
            "kill": None
            if kill is None
            else {
                "trainer": kill.trainer,
                "after_step": kill.after_step,
                "delay_s": kill.delay_s,
                "restarts": m.get("restarts"),
            },
        }
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(run_recorded("scale_hosts", main))
