"""Elastic trainers (``cluster.elastic=true``, async/ssp): ps0's record of who trains.

An elastic run is a dynamic rpc_core group (``init_rpc(..., world_size=None)``) founded by
ps0, which is also its registry: every join and every leave goes through ps0, and a member
whose connection drops without a leave (killed, or killed by the launcher after it froze)
is removed there at once. ``Membership`` hangs on those events (``rpc_core.add_membership_listener``), so the
servers never wait for a trainer that is gone:

- **staleness accounting** (ssp): ``counted()`` is the trainers that are in the group and
  not finished; ps0's clock takes the slowest of those only, and a leave releases the
  trainers it held back at once. ps0 watches every member with rpc_core's heartbeats, so a
  trainer that freezes or is cut off is removed within ``RPC_CORE_HEARTBEAT_TIMEOUT`` (30 s)
  to 1.5 times that, as one that dies is at once (a joiner too, which no launcher watches);
- **where each trainer stands**: with every update, the trainer sends the data position
  after that step, which ps0 notes as it applies it (its ``positions``, the record every
  server keeps for checkpoints: ``ps_train.checkpoint.positions``); a replacement for a dead
  trainer (same name, started by the local launcher) asks ``resume_point`` and continues with
  the next step of the same partition, so every sample of it is trained once;
- **partitions per epoch**: the first trainer to reach epoch ``e`` fixes its members
  (``assignment``): the launched trainers not yet finished (a dead one will be replaced)
  plus the joiners then present, in index order; trainer ``slot`` of ``world`` reads
  ``ps_train.data.partition(n, slot, world, seed, e)``. A joiner waits for the next epoch
  that takes it; epoch 0 of a fresh run is the launched trainers alone, as without
  elasticity;
- **the end**: the job is over once every launched trainer finished; joiners are then told
  to stop, and trainer0 collects everyone's final report (``final_reports``).

The events are also the ``train/num_trainers`` curve in ps0's TensorBoard folder (steps:
ps0's update count) and ``membership`` in metrics.json.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from ps_train import backend
from ps_train.checkpoint.positions import TrainerPositions, trainer_name
from ps_train.config import ClusterConfig
from ps_train.metrics import MetricsWriter
from ps_train.observe.console import CONSOLE
from rpc_core.functions import async_execution

__all__ = [
    "Assignment",
    "Membership",
    "set_current",
    "follow",
    "keep_membership",
    "serve_elastic",
    "request_stop",
    "stop_requested",
]

log = logging.getLogger("ps_train.membership")


@backend.called_by_name  # ps0's answer to ``assignment``
class Assignment(NamedTuple):
    """Trainer ``slot`` of ``world`` reads ``partition(n, slot, world, seed, epoch)`` in ``epoch``."""

    epoch: int
    slot: int
    world: int


class Membership:
    """ps0's side. ``launched``: the trainers the launcher started (indices ``0..T-1``);
    ``index_of``: a worker name's trainer index, None for a server; ``positions``: ps0's record
    of where each trainer stands (``ParameterServer.positions``; its ``start``: where this
    attempt started)."""

    def __init__(
        self,
        launched: int,
        num_servers: int,
        writer: MetricsWriter,
        version: Callable[[], int],
        positions: TrainerPositions | None = None,
    ) -> None:
        self.launched = set(range(launched))
        self.num_servers = num_servers
        self.writer = writer
        self._version = version  # () -> ps0's update count: the step of the membership curve
        self.cond = threading.Condition()
        self.present: set[int] = set()
        self.finished: set[int] = set()
        self.reports: dict[int, dict[str, Any]] = {}
        self.positions = positions if positions is not None else TrainerPositions()
        self.epochs: dict[int, list[int]] = {}  # epoch -> its trainers, slot order
        self.waiting: list[tuple[int, torch.futures.Future[Any]]] = []  # joiners waiting for an epoch
        self.report_waiters: list[torch.futures.Future[Any]] = []
        self.events: list[dict[str, Any]] = []
        self.listeners: list[Callable[[int, bool], None]] = []  # called with (trainer, joined) after each change
        self.done = False
        self.closed = False  # the writer is: later changes are kept in ``events`` only
        self._t0 = time.monotonic()
        self.start_step = 0  # the resumed checkpoint's step (trainer0's), 0 for a fresh run

    def index_of(self, rank: int) -> int | None:
        return rank - self.num_servers if rank >= self.num_servers else None

    # -- joins and leaves (rpc_core.add_membership_listener, on ps0) -----------------------------------
    def changed(self, info: Any, joined: bool) -> None:
        trainer = self.index_of(info.id)
        if trainer is None:
            return
        with self.cond:
            if joined:
                self.present.add(trainer)
            else:
                self.present.discard(trainer)
            count = len(self.present)
            self.events.append(
                {
                    "time_s": round(time.monotonic() - self._t0, 3),
                    "trainer": info.name,
                    "event": "joined" if joined else "left",
                    "num_trainers": count,
                    "server_updates": self._version(),
                }
            )
            if not self.closed:  # trainers leave after the job's end too, until ps0 shuts down
                self.writer.add_scalar("train/num_trainers", count, self._version())
                self.writer.flush()
            ready = self._reports_ready()
        # On the console too (ps_train.observe.console), also with logging=quiet.
        log.warning("%s %s the job; %d trainer(s) now", info.name, "joined" if joined else "left", count, extra=CONSOLE)
        for listener in self.listeners:
            listener(trainer, joined)
        self._resolve(ready)

    def close(self) -> None:
        """Close the TensorBoard writer (once ps0 has left the group: no change comes after)."""
        with self.cond:
            if not self.closed:
                self.closed = True
                self.writer.close()

    def counted(self) -> set[int]:
        """The trainers ssp's clock waits for: in the group and not finished."""
        with self.cond:
            return self.present - self.finished

    # -- positions -----------------------------------------------------------------------------
    def resume_point(self, trainer: int) -> dict[str, Any]:
        """Where ``trainer`` starts: ``{"step", "position"}``, the step after its last one ps0
        applied and the data position after it (it is a replacement); else ``{"step",
        "data_state"}``, where this attempt started (its own step and position in the resumed
        checkpoint, or step 0)."""
        last = self.positions.last(trainer)
        if last is not None:
            return {"step": last.step, "position": last.position}
        data_state = self.positions.start.get(trainer_name(trainer))
        step = data_state.get("step", self.start_step) if data_state else self.start_step
        return {"step": step, "data_state": data_state}

    def join_step(self) -> int:
        """A joiner's first step number: the slowest counted trainer's, so ssp's clock does not
        hold the others back until the joiner has caught up with steps it never had."""
        steps = self.positions.steps()
        with self.cond:
            counted = self.present - self.finished
        return min((n for t, n in steps.items() if t in counted), default=0)

    # -- partitions ----------------------------------------------------------------------------
    def assignment(self, trainer: int, epoch: int) -> torch.futures.Future[Any]:
        """``trainer``'s ``Assignment`` in ``epoch`` (fixing the epoch's members if it is the
        first to ask), or in the first later epoch that takes it; None once the job is over.
        ``epoch=-1``: the next epoch not yet fixed (a joiner's first)."""
        fut: torch.futures.Future[Any] = torch.futures.Future()
        with self.cond:
            answer: Any = None
            if self.done:
                pass
            elif epoch >= 0 and epoch not in self.epochs:
                answer = self._fix(epoch, trainer)
            elif epoch >= 0 and trainer in self.epochs[epoch]:
                answer = self._assignment(epoch, trainer)
            elif epoch >= 0 and (later := [e for e in sorted(self.epochs) if e > epoch and trainer in self.epochs[e]]):
                # Fixed without it (it was dead, or not yet in the job), and so were later ones,
                # e.g. a replacement that lags behind: the first epoch that takes it.
                answer = self._assignment(later[0], trainer)
            else:
                self.waiting.append((trainer, fut))
                return fut
        fut.set_result(answer)
        return fut

    def _fix(self, epoch: int, asking: int) -> Assignment | None:
        # Caller holds self.cond.
        members = sorted((self.launched - self.finished) | (self.present - self.finished) | {asking})
        # Kept for the whole job (a few ints an epoch): a replacement that lags behind asks for
        # old epochs, and one fixed again with other members would overlap what was trained.
        self.epochs[epoch] = members
        log.info("epoch %d: trainers %s", epoch, members)
        still = []
        for trainer, fut in self.waiting:
            if trainer in members:
                fut.set_result(self._assignment(epoch, trainer))
            else:
                still.append((trainer, fut))
        self.waiting = still
        return self._assignment(epoch, asking)

    def _assignment(self, epoch: int, trainer: int) -> Assignment:
        members = self.epochs[epoch]
        return Assignment(epoch, members.index(trainer), len(members))

    # -- the end -------------------------------------------------------------------------------
    def finish(self, trainer: int, stats: dict[str, Any]) -> None:
        """``trainer`` trained its last step; ``stats``: its totals for metrics.json."""
        with self.cond:
            self.finished.add(trainer)
            self.reports[trainer] = stats
            ending = not self.done and self.launched <= self.finished
            if ending:
                self.done = True
                waiting, self.waiting = self.waiting, []
                joiners = sorted(self.present - self.launched - self.finished)
            ready = self._reports_ready()
        if ending:
            for _, fut in waiting:
                fut.set_result(None)
            for j in joiners:  # they stop after their current step
                try:
                    backend.rpc().rpc_async(f"trainer{j}", request_stop).then(_ignore)
                except Exception as e:  # noqa: BLE001 - it left already: nothing to stop
                    log.info("trainer%d did not take the stop request: %s", j, e)
        self._resolve(ready)

    def final_reports(self) -> torch.futures.Future[Any]:
        """Resolves to ``{trainer: stats}`` once the job is over and every trainer still in the
        group has reported."""
        fut: torch.futures.Future[Any] = torch.futures.Future()
        with self.cond:
            self.report_waiters.append(fut)
            ready = self._reports_ready()
        self._resolve(ready)
        return fut

    def _reports_ready(self) -> list[torch.futures.Future[Any]]:
        # Caller holds self.cond.
        if not self.done or not self.present <= set(self.reports):
            return []
        ready, self.report_waiters = self.report_waiters, []
        return ready

    def _resolve(self, futs: list[torch.futures.Future[Any]]) -> None:
        if futs:
            with self.cond:
                reports = {t: dict(s) for t, s in sorted(self.reports.items())}
            for f in futs:
                f.set_result(reports)


def _ignore(fut: torch.futures.Future[Any]) -> None:
    """A joiner that left before hearing the job is over needs no telling."""
    try:
        fut.wait()
    except Exception as e:  # noqa: BLE001 - it is gone either way
        log.info("a joiner did not take the stop request: %s", e)


_current: Membership | None = None


def set_current(membership: Membership) -> None:
    """On ps0, before ``init_rpc``: the membership the trainers' calls below work on."""
    global _current
    _current = membership


def follow(membership: Membership) -> None:
    """On ps0, right after ``init_rpc``: follow the group's joins and leaves."""
    agent = backend.rpc()._get_current_rpc_agent()
    backend.rpc().add_membership_listener(membership.changed)
    # ps0, the group's registry, watches every member with heartbeats: one that freezes or is
    # cut off (not only one that dies) is removed, so ssp's clock stops waiting for it.
    backend.rpc().watch_all_peers(lambda: not membership.closed)
    for info in agent.get_worker_infos():  # members that joined before the hook was in place
        if info.id != agent.get_worker_info().id and membership.index_of(info.id) not in membership.present:
            membership.changed(info, True)


# -- ps0's role in an elastic run (ps_train.launch.run_rank) ---------------------------------------
class ElasticServer(Protocol):
    """What an elastic run uses of a server (``ps_train.roles.server.ParameterServer``)."""

    membership: Membership | None  # ps0's, set by keep_membership

    @property
    def positions(self) -> TrainerPositions:
        """Where each trainer stands after its last update applied here."""

    @property
    def version(self) -> int:
        """Updates it applied so far (the step of the membership curve)."""

    def trainer_changed(self, trainer: int, joined: bool) -> None:
        """A trainer joined or left (ssp's clock counts only the trainers in the job)."""

    def wait_released(self) -> None:
        """Return once trainer0 has written the run's results."""

    def member_left(self, name: str) -> None:
        """``name`` left the group (trainer0 in the middle of a checkpoint: held updates go on)."""


def keep_membership(
    ps: ElasticServer,
    cluster: ClusterConfig,
    run_dir: str,
    resume_state: dict[str, Any] | None,
    writer: MetricsWriter,
) -> None:
    """ps0 of an elastic run, before ``init_rpc``: the trainer membership (ps_train.elastic.membership),
    ready before any trainer can ask for it; it knows where this attempt started. ``writer``:
    ps0's TensorBoard writer (one writer per folder)."""
    ps.membership = Membership(
        cluster.num_trainers, cluster.num_servers, writer, lambda: ps.version, positions=ps.positions
    )
    if resume_state is not None:  # ps.positions.start holds the trainers' own (load_server_state)
        ps.membership.start_step = resume_state["step"]
    ps.membership.listeners.append(ps.trainer_changed)
    set_current(ps.membership)


def serve_elastic(ps: ElasticServer) -> None:
    """A server of an elastic run, in the group: ps0 follows its joins and leaves; every server
    stays until trainer0 has written the results (each member of a dynamic group leaves on
    its own, so a server's shutdown would not wait for the trainers)."""

    def left(info: Any, joined: bool) -> None:
        if not joined:
            ps.member_left(info.name)

    backend.rpc().add_membership_listener(left)
    if ps.membership is not None:
        follow(ps.membership)
    ps.wait_released()


# -- a joiner's stop flag (set by ps0 over RPC once the job is over) ----------------------------------
_stop = threading.Event()


@backend.called_by_name
def request_stop() -> None:
    _stop.set()


def stop_requested() -> bool:
    return _stop.is_set()


def membership() -> Membership:
    """ps0's ``Membership`` (what the functions below, called by trainers, work on)."""
    if _current is None:
        raise RuntimeError("this worker keeps no trainer membership: it is not ps0 of a cluster.elastic=true job")
    return _current


# -- what trainers call on ps0 -------------------------------------------------------------------------
@backend.called_by_name
def resume_point(trainer: int) -> dict[str, Any]:
    return membership().resume_point(trainer)


@backend.called_by_name
def join_step() -> int:
    return membership().join_step()


@async_execution
@backend.called_by_name
def assignment(trainer: int, epoch: int) -> torch.futures.Future[Any]:
    return membership().assignment(trainer, epoch)


@backend.called_by_name
def finish(trainer: int, stats: dict[str, Any]) -> None:
    membership().finish(trainer, stats)


@async_execution
@backend.called_by_name
def final_reports() -> torch.futures.Future[Any]:
    return membership().final_reports()


@backend.called_by_name
def events() -> list[dict[str, Any]]:
    with membership().cond:
        return list(membership().events)
