"""Where a local run's wall time goes: each process marks when it reached each point of its
life, the launcher puts them together into ``metrics.json``'s ``phases``.

A role marks (``mark``) when it started, began and ended the rendezvous, and -- trainer0 --
its first step, the final evaluation, the final checkpoint and the shutdown; it writes its
marks (with its CPU time at each) to ``<run_dir>/phases/<role>.json`` as it exits. The launcher marks its own start (the
process's, from the kernel), the launch, the fork server's readiness and the roles' exit,
and ``run_phases`` turns all of it into consecutive phases along the run's critical path:
each phase ends when the last process that had to get there did (``PHASES``). Marks are
wall-clock times (``time.time()``): the processes share one machine and its clock.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ps_train.files import atomic_write_text

__all__ = ["PHASES", "Phase", "mark", "marks", "process_start_time", "run_phases", "write_marks"]


@dataclass(frozen=True)
class Phase:
    """One phase of ``PHASES``: it ends at ``end`` (a mark, see ``run_phases``)."""

    name: str
    end: str
    meaning: str


# In order; each starts where the one before ended. ``max:`` = the latest of every role's mark.
PHASES = (
    Phase("launcher start-up", "launch", "the launcher's interpreter, imports and config, to the launch"),
    Phase("preload", "preloaded", "the fork server imports what roles need and the launcher has not"),
    Phase("role start", "max:started", "forking every role, to the last one running"),
    Phase("set-up", "max:rendezvous", "each role's set-up before the rendezvous (a server builds its shards)"),
    Phase("rendezvous", "max:joined", "init_rpc: until the last rank knows every other"),
    Phase("trainer set-up", "loop_start", "trainer0 builds its data and model, to its first step"),
    Phase("first step", "first_step", "trainer0's first step"),
    Phase("training loop", "eval_start", "trainer0's other steps, then waiting for every trainer's stats"),
    Phase("final evaluation", "eval_end", "trainer0 evaluates on the test split"),
    Phase("shutdown", "exited", "rpc shutdown rounds, to the last role's exit"),
    Phase("collect", "finished", "the launcher stops the fork server and collects trainer0's metrics"),
)
CHECKPOINT = "checkpoint"  # carved out of the training loop: trainer0's final checkpoint

# The phase whose CPU time a role's mark ends: a role's CPU time between two of its marks
# counts for the phase of the later one.
_MARK_PHASE = {
    "started": "role start",
    "rendezvous": "set-up",
    "joined": "rendezvous",
    "loop_start": "trainer set-up",
    "first_step": "first step",
    "checkpoint_start": "training loop",
    "checkpoint_end": CHECKPOINT,
    "eval_start": "training loop",
    "eval_end": "final evaluation",
    "shutdown": "training loop",
    "shut_down": "shutdown",
    "serving": "training loop",  # a server: until it enters shutdown
    "served": "training loop",  # and in it, until every worker has (the trainers' steps)
    "exiting": "shutdown",
}

_WALL: dict[str, float] = {}
_CPU: dict[str, float] = {}


def mark(name: str) -> None:
    """This process reached ``name`` now (the latest mark of a name counts)."""
    _WALL[name], _CPU[name] = time.time(), time.process_time()


def marks() -> dict[str, dict[str, float]]:
    """``{"wall": {mark: time.time()}, "cpu": {mark: this process's CPU seconds}}``."""
    return {"wall": dict(_WALL), "cpu": dict(_CPU)}


def write_marks(run_dir: str, role: str) -> None:
    """This role's marks, to ``<run_dir>/phases/<role>.json``, with what the kernel counted of
    it (``process``: its threads and context switches, where the CPU goes with many roles)."""
    folder = Path(run_dir) / "phases"
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / f"{role}.json", json.dumps({**marks(), "process": process_counts()}))


def process_counts() -> dict[str, int]:
    """This process's threads and voluntary/involuntary context switches (``/proc``; empty elsewhere)."""
    wanted = {"Threads": "threads", "voluntary_ctxt_switches": "voluntary", "nonvoluntary_ctxt_switches": "involuntary"}
    counts = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in wanted:
                counts[wanted[key]] = int(value.split()[0])
    except (OSError, ValueError):
        return {}
    return counts


def process_start_time() -> float:
    """When this process started (wall clock), from ``/proc``; now where there is no ``/proc``."""
    try:
        stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        booted = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        return booted + int(stat[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time in ticks since boot
    except (OSError, IndexError, ValueError, AttributeError):
        return time.time()


def run_phases(
    run_dir: str, launcher: dict[str, float], launcher_cpu: dict[str, float], trainer0: str
) -> dict[str, Any]:
    """``metrics.json``'s ``phases``: ``{"phases": [{"name", "wall_s", "cpu_s"}, ...], "wall_s":
    s, "roles": n}``: each phase's wall time and the CPU time every process spent in it, in
    order; the wall time of them all; how many roles recorded marks.

    ``launcher``: the launcher's marks (``start``, ``launch``, ``preloaded``, ``exited``,
    ``finished``); ``launcher_cpu``: CPU seconds of the launcher (``launcher start-up``,
    ``collect``) and of the fork server (``preload``). A phase whose end no process marked
    (e.g. a role died) lasts 0 s.
    """
    roles = {}
    for path in sorted((Path(run_dir) / "phases").glob("*.json")):
        try:
            roles[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError):  # a role killed while writing: its marks are lost
            continue
    chief = roles.get(trainer0, {}).get("wall", {})

    def at(end: str) -> float | None:
        if end.startswith("max:"):
            found = [r["wall"][end[4:]] for r in roles.values() if end[4:] in r["wall"]]
            return max(found) if found else None
        return launcher.get(end, chief.get(end))

    seconds: dict[str, float] = {}
    last = launcher["start"]
    for phase in PHASES:
        end = at(phase.end)
        seconds[phase.name] = max(0.0, end - last) if end is not None else 0.0
        last = max(last, end) if end is not None else last
    seconds[CHECKPOINT] = 0.0
    if "checkpoint_start" in chief and "checkpoint_end" in chief:
        took = max(0.0, chief["checkpoint_end"] - chief["checkpoint_start"])
        seconds[CHECKPOINT] = min(took, seconds["training loop"])
        seconds["training loop"] -= seconds[CHECKPOINT]
    cpu = dict.fromkeys(seconds, 0.0)
    for name, used in launcher_cpu.items():
        cpu[name] += used
    for role in roles.values():
        before = 0.0
        for name in sorted(role["wall"], key=role["wall"].__getitem__):
            used = role["cpu"][name]
            cpu[_MARK_PHASE.get(name, "training loop")] += max(0.0, used - before)
            before = used
    order = [p.name for p in PHASES]
    order.insert(order.index("training loop") + 1, CHECKPOINT)
    counted = [r.get("process", {}) for r in roles.values()]
    return {
        "phases": [{"name": n, "wall_s": round(seconds[n], 4), "cpu_s": round(cpu[n], 4)} for n in order],
        "wall_s": round(last - launcher["start"], 4),
        "roles": len(roles),
        # summed over the roles, as each exited
        "role_processes": {k: sum(c.get(k, 0) for c in counted) for k in ("threads", "voluntary", "involuntary")},
    }
