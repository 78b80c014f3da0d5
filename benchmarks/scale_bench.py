"""Scale: what each ps_train process holds, and how long a job takes to start, as trainers grow.

    python -m benchmarks.scale_bench [--trainers 2 8 16 32] [--servers 2] [--steps 20]
                                     [--mode async] [--json scale.json] [--timeout 900]
                                     [ps_train overrides, e.g. model=cnn]

For each (trainers, servers) it runs ``python -m ps_train`` on this machine (loopback) and looks
at every role process every 0.25 s (``_procs.py``): threads, peak resident memory, connections
by the role at the other end. It prints per role kind the most seen at any look, and the
start-up time (the first role's ``starting`` line to the last role's ``joined the job``), with
the load average. For the cost model (``scale_model.py``, docs/scaling.md) ``--json`` also
records each run's samples/s, bytes per trainer step and server, each role's CPU seconds, and
the steady window between trainer0's first and last progress lines.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks._procs import cpu_seconds, role_kind, sample_roles
from benchmarks._results import add_result_option, run_recorded

_PID = re.compile(r"starting (\S+) \(rank \d+ of \d+, pid (\d+)\)")
_PROGRESS = re.compile(r"^\[trainer0\] step (\d+)/")
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_CONFIG = [
    "train.eval_every=0",
    "logging.progress=true",  # trainer0's "step N/M" lines mark the steady window
    "train.log_every=10",
    "logging.tensorboard=false",
    "checkpoint.every=0",
]


def _load() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _metrics(run_dir: Path) -> dict[str, Any]:
    """What the cost model needs of the run's metrics.json ({} if the run wrote none)."""
    try:
        m = json.loads((run_dir / "metrics.json").read_text())
    except (OSError, ValueError):
        return {}
    keys = ("samples_per_s", "samples", "steps", "wall_time_s", "server_updates", "server_bytes_per_step")
    return {k: m.get(k) for k in keys}


def _stamp(line: str) -> float | None:
    m = _STAMP.match(line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None


def _pids(logs: Path) -> dict[str, int]:
    found = {}
    for log in logs.glob("*.log"):
        try:
            m = _PID.search(log.read_text(errors="replace"))
        except OSError:
            continue
        if m:
            found[m.group(1)] = int(m.group(2))
    return found


def _startup(logs: Path) -> float | None:
    """Seconds from the first role's start to the last role's joining (all ranks up)."""
    starts, joins = [], []
    for log in logs.glob("*.log"):
        if log.name.startswith("__"):
            continue
        for line in log.read_text(errors="replace").splitlines():
            t = _stamp(line)
            if t is None:
                continue
            if _PID.search(line):
                starts.append(t)
            elif "joined the job" in line:
                joins.append(t)
    return max(joins) - min(starts) if starts and joins else None


class _Marks:
    """Reads the job's console; at each of trainer0's progress lines, notes the time and every
    role's CPU seconds right away: the steady window between the first and the last such line
    leaves out start-up, the first steps, trainer0's final evaluation and the shutdown."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.pids: dict[str, int] = {}
        self.lines: list[str] = []
        self.marks: list[tuple[int, float, dict[str, float]]] = []  # (trainer0's step, time, role -> CPU s)
        if proc.stdout is None:
            raise ValueError("_Marks needs the job's stdout as a pipe (Popen(stdout=PIPE))")
        self._out = proc.stdout
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self._out:
            self.lines.append(line.rstrip("\n"))
            m = _PROGRESS.match(line)
            if m:
                now, cpu = time.monotonic(), {}
                for role, pid in list(self.pids.items()):
                    try:
                        cpu[role] = cpu_seconds(pid)
                    except OSError:
                        continue
                self.marks.append((int(m.group(1)), now, cpu))

    def join(self) -> None:
        self._thread.join(timeout=30)

    def steady(self, trainers: int, batch: int | None) -> dict[str, Any] | None:
        """The window's steps (trainer0's), seconds, each role's CPU seconds, samples/s and cores."""
        if len(self.marks) < 2 or batch is None:
            return None
        (s0, t0, c0), (s1, t1, c1) = self.marks[0], self.marks[-1]
        cpu = {r: round(c1[r] - c0[r], 3) for r in c1 if r in c0}
        return {
            "steps": s1 - s0,
            "seconds": round(t1 - t0, 3),
            "cpu_s": cpu,
            "samples_per_s": trainers * batch * (s1 - s0) / (t1 - t0),
            "cores_used": round(sum(cpu.values()) / (t1 - t0), 3),
        }


def run_job(trainers: int, servers: int, steps: int, timeout: float, mode: str, extra: list[str]) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"scale_t{trainers}_s{servers}_"))
    cmd = [
        sys.executable,
        "-m",
        "ps_train",
        f"mode={mode}",
        *_CONFIG,
        f"cluster.num_trainers={trainers}",
        f"cluster.num_servers={servers}",
        f"train.steps={steps}",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]
    load_before, uptime_before, t0 = _load(), _uptime(), time.monotonic()
    loads: list[float] = []
    all_joined = False
    cpu_joined: dict[str, float] = {}  # role -> CPU seconds at the first look after all joined
    cpu_last: dict[str, float] = {}  # role -> CPU seconds at its last look
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marks = _Marks(proc)
    worst: dict[str, dict[str, int]] = {}
    trainer_peers: Counter[str] = Counter()  # the most connections any trainer had to each kind
    pids: dict[str, int] = {}
    while proc.poll() is None and time.monotonic() - t0 < timeout:
        if len(pids) < trainers + servers:
            pids = marks.pids = _pids(run_dir / "logs")
        all_joined = all_joined or (len(pids) == trainers + servers and _startup(run_dir / "logs") is not None)
        loads.append(_load())
        for role, s in sample_roles(pids).items():
            cpu_last[role] = s.cpu_s
            if all_joined:
                cpu_joined.setdefault(role, s.cpu_s)
            kind = role_kind(role)
            w = worst.setdefault(kind, {"threads": 0, "rss_peak_mb": 0, "connections": 0})
            w["threads"] = max(w["threads"], s.threads)
            w["rss_peak_mb"] = max(w["rss_peak_mb"], s.rss_peak_kb // 1024)
            w["connections"] = max(w["connections"], sum(s.peers.values()))
            if kind == "trainer":
                by_kind: Counter[str] = Counter()
                for peer, n in s.peers.items():
                    by_kind[role_kind(peer)] += n
                for k, n in by_kind.items():
                    trainer_peers[k] = max(trainer_peers[k], n)
        time.sleep(0.25)  # sampling period of the probe, not a wait for an event
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    marks.join()
    m = _metrics(run_dir)
    batch = m["samples"] // (trainers * m["steps"]) if m.get("samples") and m.get("steps") else None
    cpu = {
        role: {"total_s": round(c, 2), "training_s": round(c - cpu_joined.get(role, 0.0), 2)}
        for role, c in sorted(cpu_last.items())
    }
    train_wall = m.get("wall_time_s")
    return {
        "mode": mode,
        "overrides": extra,
        **m,
        "role_cpu": cpu,
        "steady": marks.steady(trainers, batch),
        "cores_used": round(sum(c["training_s"] for c in cpu.values()) / train_wall, 3) if train_wall else None,
        "load_mean": round(sum(loads) / len(loads), 2) if loads else None,
        "uptime_before": uptime_before,
        "uptime_after": _uptime(),
        "machine_cores": os.cpu_count(),
        "trainers": trainers,
        "servers": servers,
        "steps": steps,
        "exit_code": proc.returncode,
        "wall_s": round(time.monotonic() - t0, 2),
        "startup_s": _startup(run_dir / "logs"),
        "roles_seen": len(pids),
        "per_kind": worst,
        "trainer_connections_to": dict(trainer_peers),
        "load_before": load_before,
        "load_after": _load(),
        "run_dir": str(run_dir),
        "tail": marks.lines[-2:] if proc.returncode else [],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trainers", type=int, nargs="+", default=[2, 8, 16, 32])
    ap.add_argument("--servers", type=int, nargs="+", default=[2])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    ap.add_argument("--mode", default="async", help="ps_train's mode: async, sync or ssp")
    ap.add_argument("--json", type=Path, default=None, help="write every result here")
    ap.add_argument("extra", nargs="*", help="more ps_train overrides")
    add_result_option(ap, "scale_bench")
    args = ap.parse_args()
    results = []
    for servers in args.servers:
        for trainers in args.trainers:
            print(f"[scale] {trainers} trainers + {servers} servers ...", flush=True)
            r = run_job(trainers, servers, args.steps, args.timeout, args.mode, args.extra)
            results.append(r)
            print(
                f"[scale]   exit {r['exit_code']}, wall {r['wall_s']} s, start-up {r['startup_s']} s, "
                f"load {r['load_before']:.1f}->{r['load_after']:.1f}; per kind {r['per_kind']}; "
                f"a trainer's connections to {r['trainer_connections_to']}; "
                f"{r.get('samples_per_s') or 0:,.0f} samples/s, cores used {r['cores_used']}",
                flush=True,
            )
            if args.json:
                args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    sys.exit(run_recorded("scale_bench", main))
