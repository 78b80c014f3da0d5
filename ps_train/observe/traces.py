"""Profiler traces of a run, one per role, that tools read as one job.

With ``profile.enabled=true`` every trainer records ``profile.steps`` steps after
``profile.warmup`` ones with ``rpc_core.profiler`` (``ProfileWindow``, a step hook). The
profile holds the trainer's own operators and RPCs, and what each server ran for those RPCs
(its remote events); the trainer writes its part to ``traces/<trainer>.json`` and hands each
server its part (``deposit``), which the server writes to ``traces/ps<r>.json`` when it
stops (``write_served``). A server's trace is thus what it ran for the profiled steps.

Each file is a Chrome trace (Perfetto, chrome://tracing) with Kineto's job fields, what
Holistic Trace Analysis reads to put a job's traces side by side: ``distributedInfo``
(``rank``: the role's rank, distinct per file; ``world_size``; ``backend``),
``baseTimeNanoseconds`` (wall clock of ``ts`` 0) and ``traceName``. Events are complete
(``"ph": "X"``) slices, ``cat`` ``cpu_op`` or ``rpc``, ``pid`` the rank. ``load_job_traces``
reads a run's folder back, checking those fields.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from ps_train import backend
from ps_train.files import atomic_write_text

__all__ = [
    "TraceEvent",
    "RoleTrace",
    "JobTrace",
    "TraceError",
    "ProfileWindow",
    "deposit",
    "write_served",
    "write_trace",
    "load_job_traces",
]

TRACES = "traces"


class TraceEvent(NamedTuple):
    name: str
    start_us: float  # wall clock, microseconds
    dur_us: float
    thread: int
    cat: str  # cpu_op | rpc


class RoleTrace(NamedTuple):
    role: str
    rank: int
    world_size: int
    events: list[TraceEvent]  # times on the wall clock


class JobTrace(NamedTuple):
    roles: dict[int, RoleTrace]  # by rank

    def events(self) -> list[tuple[int, TraceEvent]]:
        """Every role's events on one timeline: (rank, event), by start time."""
        return sorted(((r, e) for r, t in self.roles.items() for e in t.events), key=lambda re: re[1].start_us)


class TraceError(ValueError):
    """A traces folder that cannot be read as one job."""


def write_trace(path: Path, role: str, rank: int, world_size: int, events: list[TraceEvent]) -> None:
    base_us = min((e.start_us for e in events), default=0.0)
    doc = {
        "schemaVersion": 1,
        "traceName": role,
        "distributedInfo": {"backend": "rpc_core", "rank": rank, "world_size": world_size},
        "baseTimeNanoseconds": int(base_us * 1000),
        "displayTimeUnit": "ms",
        "traceEvents": [{"ph": "M", "name": "process_name", "pid": rank, "args": {"name": role}}]
        + [
            {
                "ph": "X",
                "cat": e.cat,
                "name": e.name,
                "pid": rank,
                "tid": e.thread,
                "ts": round(e.start_us - base_us, 3),
                "dur": round(e.dur_us, 3),
            }
            for e in sorted(events, key=lambda e: e.start_us)
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(doc))


def load_job_traces(folder: str | Path) -> JobTrace:
    """Every ``*.json`` trace in ``folder`` as one job; ``TraceError`` if a file lacks the
    job fields, two files claim one rank, or they disagree on the world size."""
    roles: dict[int, RoleTrace] = {}
    files = sorted(Path(folder).glob("*.json"))
    if not files:
        raise TraceError(f"{folder}: no *.json traces; run with profile.enabled=true")
    for path in files:
        doc = json.loads(path.read_text())
        info = doc.get("distributedInfo")
        if not isinstance(info, dict) or not isinstance(info.get("rank"), int) or "world_size" not in info:
            raise TraceError(f"{path}: no distributedInfo with rank and world_size; not a ps_train job trace")
        rank = info["rank"]
        if rank in roles:
            raise TraceError(f"{path}: rank {rank} is also {roles[rank].role}'s; one trace per rank")
        base_us = doc.get("baseTimeNanoseconds", 0) / 1000
        events = [
            TraceEvent(e["name"], base_us + e["ts"], e["dur"], e["tid"], e.get("cat", ""))
            for e in doc["traceEvents"]
            if e.get("ph") == "X"
        ]
        roles[rank] = RoleTrace(doc.get("traceName", path.stem), rank, int(info["world_size"]), events)
    sizes = {t.world_size for t in roles.values()}
    if len(sizes) != 1:
        raise TraceError(f"{folder}: the traces disagree on the world size: {sorted(sizes)}")
    return JobTrace(roles)


# -- on a server: the events trainers hand in ---------------------------------------------------------
_served: list[TraceEvent] = []
_served_lock = threading.Lock()


@backend.called_by_name
def deposit(events: list[tuple[Any, ...]]) -> None:
    """Called by a trainer on a server (over RPC): what this server ran in its profiled steps."""
    with _served_lock:
        _served.extend(TraceEvent._make(e) for e in events)


def write_served(run_dir: str, role: str, rank: int, world_size: int) -> bool:
    """A server's trace, if trainers deposited events here; returns whether it wrote one."""
    with _served_lock:
        events = list(_served)
        _served.clear()
    if not events:
        return False
    write_trace(Path(run_dir) / TRACES / f"{role}.json", role, rank, world_size, events)
    return True


# -- on a trainer: the profiled window -------------------------------------------------------------------
class ProfiledTrainer(Protocol):
    """What the window uses of a trainer (``ps_train.roles.trainer.Trainer``)."""

    name: str
    steps: int

    def settle(self) -> dict[str, float]: ...


class ProfileWindow:
    """A step hook (``on_step(trainer, step)``): profiles the steps after ``warmup`` up to
    ``warmup + steps`` (fewer if the run is shorter), then writes the trace and deposits the
    servers' parts. ``call(worker, fn, args)``: a blocking RPC (the trainer's backend)."""

    def __init__(
        self, run_dir: str, rank: int, world_size: int, warmup: int, steps: int, call: Callable[..., Any]
    ) -> None:
        self.run_dir, self.rank, self.world_size = run_dir, rank, world_size
        self.warmup, self.steps, self.call = warmup, steps, call
        self._prof: Any = None
        self._end = 0
        self.written: Path | None = None

    def __call__(self, trainer: ProfiledTrainer, step: int) -> None:
        if self.written is not None:
            return
        if self._prof is None:
            # Start after the warm-up, or early enough that a short run still records a window.
            first = max(1, min(self.warmup, trainer.steps - self.steps))
            if step == first and step < trainer.steps:
                import rpc_core.profiler

                trainer.settle()  # no update of an unprofiled step in flight
                self._prof = rpc_core.profiler.profile()
                self._prof.__enter__()
                self._end = min(step + self.steps, trainer.steps)
            return
        if step >= self._end:
            trainer.settle()  # every RPC of the window has completed
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)
            self._write(trainer.name, prof.function_events)

    def _write(self, name: str, events: Any) -> None:
        base = float(events.base_us)
        own: list[TraceEvent] = []
        served: dict[str, list[tuple[Any, ...]]] = {}
        for e in events:
            if e.name == "[memory]":
                continue
            ev = TraceEvent(
                e.name,
                base + e.time_range.start,
                e.time_range.elapsed_us(),
                int(e.thread),
                "rpc" if e.is_async else "cpu_op",
            )
            if e.is_remote:
                served.setdefault(events.node_names.get(e.node_id, f"node{e.node_id}"), []).append(tuple(ev))
            else:
                own.append(ev)
        self.written = Path(self.run_dir) / TRACES / f"{name}.json"
        write_trace(self.written, name, self.rank, self.world_size, own)
        for worker, evs in served.items():
            self.call(worker, deposit, (evs,))
