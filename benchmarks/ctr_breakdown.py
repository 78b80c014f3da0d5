"""Where a CTR step's CPU goes: process CPU per training step of every role of a ps_train run
against the one-process loop, measured so that load on the machine distorts it little.

    python -m benchmarks.ctr_breakdown                       # model=dlrm 2+2, sync
    python -m benchmarks.ctr_breakdown --cluster 1 1 --extra mode=hybrid

Wall time on a shared machine drifts with its load; CPU time per step does far less. Each
way runs twice, with ``--steps`` and with ``--base-steps`` training steps, interleaved; a
role's CPU per step is the difference of its CPU at exit over the difference of steps, so
start-up, rendezvous, data loading and shutdown cancel out. A role's CPU is read from
``/proc/<pid>/stat`` (all threads, user + kernel) while it runs; a role is told apart by the
log file it holds open (``<run>/logs/<role>.log``). The one-process loop (ctr_bench's
``--single-worker``) reports its own loop CPU.

"all roles / single" is the CPU the cluster spends per trainer step over the one-process
loop's: with C cores and T trainers the cluster reaches ``T x single CPU / all roles CPU`` of
one process when it has the cores to itself (``C`` cores busy), the ceiling of the wall ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks._ctr_runs import COMMON, REPO
from benchmarks._format import fmt
from benchmarks._results import add_result_option, run_recorded

TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK


def _role_of(pid: int, logs: str) -> str | None:
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(logs) and target.endswith(".log"):
                return os.path.basename(target)[: -len(".log")]
    except OSError:
        pass
    return None


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def run_cluster(overrides: list[str], steps: int, timeout: float) -> dict[str, float]:
    """CPU seconds of each role over one ``python -m ps_train`` run of ``steps`` steps."""
    with tempfile.TemporaryDirectory(prefix="ctr_breakdown_") as run_dir:
        logs = os.path.join(run_dir, "logs") + os.sep
        cmd = [
            sys.executable,
            "-m",
            "ps_train",
            *overrides,
            f"train.steps={steps}",
            f"train.log_every={steps}",
            f"hydra.run.dir={run_dir}",
        ]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        pids: dict[int, str] = {}
        cpu: dict[str, float] = {}
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"timeout after {timeout:.0f} s: {' '.join(cmd)}")
            for pid in _descendants(proc.pid):
                if pid not in pids:
                    role = _role_of(pid, logs)
                    if role is None:
                        continue
                    pids[pid] = role
                c = _cpu_s(pid)
                if c is not None:
                    cpu[pids[pid]] = max(cpu.get(pids[pid], 0.0), c)
            time.sleep(0.02)  # a poll, not a wait for an event: how fresh the last reading is
        err = proc.stderr.read() if proc.stderr else ""
        if proc.returncode != 0:
            raise RuntimeError(f"exit code {proc.returncode}: {err.strip().splitlines()[-1:] or ''}")
        return cpu


def run_single(steps: int, timeout: float) -> float:
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [sys.executable, "-m", "benchmarks.ctr_bench", "--single-worker", "small", str(steps), out.name]
        subprocess.run(cmd, cwd=REPO, timeout=timeout, check=True, stdout=subprocess.DEVNULL)
        return float(json.load(out)["cpu_time_s"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", nargs=2, type=int, default=(2, 2), metavar=("SERVERS", "TRAINERS"))
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--base-steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--extra", nargs="*", default=[], help="more ps_train overrides (one way more: 'A/B' apart)")
    ap.add_argument("--timeout", type=float, default=900.0)
    add_result_option(ap, "ctr_breakdown")
    args = ap.parse_args()
    return run_recorded("ctr_breakdown", lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    S, T = args.cluster
    ways = [w.split() for w in (" ".join(args.extra).split("/") if args.extra else [""])]
    base = ["model=dlrm", "data=synthetic_ctr", *COMMON, f"cluster.num_servers={S}", f"cluster.num_trainers={T}"]
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    n = args.steps - args.base_steps
    single: list[float] = []
    per_way: list[list[dict[str, float]]] = [[] for _ in ways]
    for _ in range(args.rounds):
        single.append((run_single(args.steps, args.timeout) - run_single(args.base_steps, args.timeout)) / n)
        for i, way in enumerate(ways):
            long = run_cluster([*base, *way], args.steps, args.timeout)
            short = run_cluster([*base, *way], args.base_steps, args.timeout)
            per_way[i].append({k: (long[k] - short.get(k, 0.0)) / n for k in long})
    one = sorted(single)[len(single) // 2]
    print()
    print(f"CPU ms per training step (each trainer's step: batch x 1), {S} servers + {T} trainers, sync unless set:")
    print()
    roles = sorted({k for w in per_way for d in w for k in d})
    print("| way | " + " | ".join(roles) + " | all roles per trainer step | single process | all / single |")
    print("|---|" + "---|" * (len(roles) + 3))
    for way, runs in zip(ways, per_way, strict=True):
        med = {k: sorted(d[k] for d in runs)[len(runs) // 2] for k in roles}
        total = sum(med.values()) / T
        cells = [fmt(med[k] * 1e3) for k in roles]
        print(
            f"| {' '.join(way) or 'default'} | "
            + " | ".join(cells)
            + f" | {fmt(total * 1e3)} | {fmt(one * 1e3)} | {total / one:.2f}x |"
        )
    print()
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
