"""Where a run's wall time goes, from the launcher's start to its exit, at several sizes.

    python -m benchmarks.phases_bench                       # 2+2, 8+2, 32+2, 64+3
    python -m benchmarks.phases_bench --shapes 8+2 --rounds 2 --png docs/phases.png

Per shape (T trainers + S servers) it times ``python -c "import torch"`` (the yardstick: the
fixed cost's targets are multiples of it, measured under the same load), then runs
``python -m ps_train data=synthetic mode=async train.steps=30 checkpoint.every=0`` and reads
the phases the run recorded (``metrics.json``'s ``phases``); "exit" is the command's wall time
minus the phases'. Tables (medians over rounds): wall time, training loop (``wall_time_s``),
fixed cost (wall minus loop) and it over the import of torch, CPU seconds of every process of
the run, memory used (the rise of MemTotal - MemAvailable, what ``free`` calls used; other jobs
move it too), the summed PSS of the run's processes (shared pages counted once) and the sum of
the roles' peak RSS (torch's shared pages once per role); then each phase's wall and CPU
seconds. ``--png``: the phases as stacked bars per shape.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._results import add_result_option, run_recorded

COMMAND = ["data=synthetic", "mode=async", "checkpoint.every=0", "logging.progress=false"]


@dataclass(frozen=True)
class Shape:
    trainers: int
    servers: int

    @property
    def label(self) -> str:
        return f"{self.trainers}+{self.servers}"


@dataclass(frozen=True)
class Measured:
    wall_s: float
    cpu_s: float  # the command and every process it waited for
    used_bytes: int  # peak of MemTotal - MemAvailable over the run, minus before it
    pss_bytes: int  # peak of the summed PSS of the run's processes
    metrics: dict[str, Any]


def _shape(text: str) -> Shape:
    try:
        t, s = (int(x) for x in text.split("+"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes: {text!r} is not TRAINERS+SERVERS, e.g. 8+2") from None
    if t < 1 or s < 1:
        raise argparse.ArgumentTypeError(f"--shapes: {text!r} needs at least one trainer and one server")
    return Shape(t, s)


def _used_bytes() -> int:
    """What ``free`` calls used: MemTotal - MemAvailable."""
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        info[key] = int(value.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


def _tree_pss(root: int) -> int:
    """The summed PSS of ``root`` and its descendants: each shared page counted once over all
    of them (torch's pages are shared by every role forked from the fork server)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, ppid in parents.items() if ppid in tree} - tree
        tree |= more
        grew = bool(more)
    total = 0
    for pid in tree:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def _run(cmd: list[str], cwd: str) -> tuple[float, float, int, int]:
    """Run ``cmd``: its wall seconds, the CPU seconds of its process tree (the kernel's
    accounting of reaped children, read around the run), the peak memory used (``free``)
    above what was used before it started, and the peak PSS of its process tree."""
    before = _used_bytes()
    peak, pss = [before], [0]
    done = threading.Event()
    c0, t0 = os.times(), time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def sample() -> None:
        while not done.wait(0.2):
            peak[0] = max(peak[0], _used_bytes())
            pss[0] = max(pss[0], _tree_pss(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = proc.communicate()[0]
    wall, c1 = time.perf_counter() - t0, os.times()
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed with exit code {proc.returncode}:\n{out[-3000:]}")
    cpu = (c1.children_user - c0.children_user) + (c1.children_system - c0.children_system)
    return wall, cpu, peak[0] - before, pss[0]


def import_torch() -> tuple[float, float]:
    wall, cpu, _, _ = _run([sys.executable, "-c", "import torch"], os.getcwd())
    return wall, cpu


def run_shape(shape: Shape, steps: int, folder: str) -> Measured:
    run_dir = Path(folder) / f"run_{shape.label}_{time.monotonic_ns()}"
    cmd = [
        sys.executable,
        "-m",
        "ps_train",
        *COMMAND,
        f"train.steps={steps}",
        f"cluster.num_trainers={shape.trainers}",
        f"cluster.num_servers={shape.servers}",
        f"hydra.run.dir={run_dir}",
    ]
    wall, cpu, used, pss = _run(cmd, os.getcwd())
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return Measured(wall, cpu, used, pss, metrics)


def _median(values: list[float]) -> float:
    return statistics.median(values)


def report(shapes: list[Shape], torch_s: list[float], torch_cpu: list[float], runs: dict[str, list[Measured]]) -> None:
    yard, yard_cpu = _median(torch_s), _median(torch_cpu)
    print(f'python -c "import torch": {yard:.2f} s wall, {yard_cpu:.2f} s CPU (median of {len(torch_s)})')
    print()
    print(
        "| shape | wall s | loop s | fixed s | fixed / import torch | samples/s | CPU s | "
        "memory used MB | PSS MB | sum of peak RSS MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    fixed_of = {}
    for shape in shapes:
        ms = runs[shape.label]
        wall = _median([m.wall_s for m in ms])
        loop = _median([m.metrics["wall_time_s"] for m in ms])
        fixed = _median([m.wall_s - m.metrics["wall_time_s"] for m in ms])
        fixed_of[shape.label] = fixed
        rss = _median([sum(m.metrics.get("peak_rss_bytes", {}).values()) / 2**20 for m in ms])
        print(
            f"| {shape.label} | {wall:.1f} | {loop:.2f} | {fixed:.1f} | {fixed / yard:.2f}x | "
            f"{_median([m.metrics['samples_per_s'] for m in ms]):,.0f} | {_median([m.cpu_s for m in ms]):.1f} | "
            f"{_median([m.used_bytes / 2**20 for m in ms]):,.0f} | {_median([m.pss_bytes / 2**20 for m in ms]):,.0f} | "
            f"{rss:,.0f} |"
        )
    if "8+2" in fixed_of and "64+3" in fixed_of:
        print()
        print(f"fixed cost of 64+3 / 8+2: {fixed_of['64+3'] / fixed_of['8+2']:.2f}x")
    print()
    print("Training with more trainers than cores (median):")
    print()
    print(
        "| shape | samples | training CPU ms / 1k samples | involuntary context switches / trainer step | voluntary |"
    )
    print("|---|---|---|---|---|")
    for shape in shapes:
        ms = runs[shape.label]
        samples = _median([m.metrics["samples"] for m in ms])
        total_steps = _median([float(m.metrics["steps"] * shape.trainers) for m in ms])
        procs = [m.metrics["phases"]["role_processes"] for m in ms]
        print(
            f"| {shape.label} | {samples:,.0f} | {1e6 * _phase(ms, 'training loop', 'cpu_s') / samples:.1f} | "
            f"{_median([p['involuntary'] for p in procs]) / total_steps:.1f} | "
            f"{_median([p['voluntary'] for p in procs]) / total_steps:.1f} |"
        )
    for key, unit in (("wall_s", "wall s"), ("cpu_s", "CPU s")):
        print()
        print(f"Phases ({unit}, median):")
        print()
        print("| phase | " + " | ".join(s.label for s in shapes) + " |")
        print("|---|" + "---|" * len(shapes))
        for name in _phase_names(runs[shapes[0].label][0]) + (["exit"] if key == "wall_s" else []):
            cells = [_phase(runs[s.label], name, key) for s in shapes]
            print(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


def _phase_names(m: Measured) -> list[str]:
    return [p["name"] for p in m.metrics["phases"]["phases"]]


def _phase(ms: list[Measured], name: str, key: str = "wall_s") -> float:
    """The median over rounds of phase ``name``'s ``key``; "exit": after metrics.json."""
    if name == "exit":
        return _median([m.wall_s - m.metrics["phases"]["wall_s"] for m in ms])
    return _median([next(p[key] for p in m.metrics["phases"]["phases"] if p["name"] == name) for m in ms])


def plot(shapes: list[Shape], runs: dict[str, list[Measured]], yard: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [*_phase_names(runs[shapes[0].label][0]), "exit"]
    fig, ax = plt.subplots(figsize=(9, 0.9 * len(shapes) + 2.2))
    left = [0.0] * len(shapes)
    cmap = plt.get_cmap("tab20")
    for k, name in enumerate(names):
        widths = [max(0.0, _phase(runs[s.label], name)) for s in shapes]
        ax.barh([s.label for s in shapes], widths, left=left, label=name, color=cmap(k % 20))
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.axvline(yard, color="black", linestyle="--", linewidth=1)
    ax.axvline(2 * yard, color="black", linestyle=":", linewidth=1)
    ax.text(yard, -0.6, " import torch", fontsize=8, va="top")
    ax.text(2 * yard, -0.6, " 2x", fontsize=8, va="top")
    ax.set_xlabel("seconds (wall) from the launcher's start")
    ax.set_ylabel("trainers + servers")
    ax.invert_yaxis()
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    ax.set_title(f"Where a 30-step run's time goes (load average {os.getloadavg()[0]:.1f})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}", file=sys.stderr)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", type=_shape, default=[_shape(s) for s in ("2+2", "8+2", "32+2", "64+3")])
    p.add_argument("--steps", type=int, default=30, help="train.steps per trainer (default 30)")
    p.add_argument("--rounds", type=int, default=1, help="rounds; every other one runs the shapes in reverse")
    p.add_argument("--png", help="write the stacked phases plot here (needs the plot extra: matplotlib)")
    add_result_option(p, "phases_bench")
    args = p.parse_args()
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be at least 1")
    print(f"load average at start: {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores")
    torch_s: list[float] = []
    torch_cpu: list[float] = []
    runs: dict[str, list[Measured]] = {s.label: [] for s in args.shapes}
    with tempfile.TemporaryDirectory(prefix="phases_bench_") as folder:
        for r in range(args.rounds):
            order = args.shapes if r % 2 == 0 else list(reversed(args.shapes))
            for shape in order:
                wall, cpu = import_torch()  # before each run: the load moves within a round
                torch_s.append(wall)
                torch_cpu.append(cpu)
                m = run_shape(shape, args.steps, folder)
                runs[shape.label].append(m)
                print(
                    f"round {r + 1}: {shape.label} {m.wall_s:.1f} s (load {os.getloadavg()[0]:.1f})",
                    file=sys.stderr,
                    flush=True,
                )
    report(args.shapes, torch_s, torch_cpu, runs)
    print()
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    if args.png:
        plot(args.shapes, runs, _median(torch_s), args.png)
    return 0


if __name__ == "__main__":
    sys.exit(run_recorded("phases_bench", main))
