"""``mode=ssp`` (stale synchronous parallel): async updates, and no trainer more than
``mode.staleness`` steps ahead of the slowest.

Server side, on ps0: the clock. After each step a trainer tells ps0 how many steps it has
completed (``clock``); the answer comes once every counted trainer completed at least that
many minus ``mode.staleness``, and says how far ahead it was then. A trainer that finished
no longer holds the others back; in an elastic run only the trainers in the job count
(``Membership.counted``), and one that leaves releases those it held back at once. Updates
are async's. When the update rides on the backward (``in_backward``), ps0's clock does too: its
answer comes back with the backward (``ClockedUpdate``), so a step sends ps0 no clock call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from ps_train.modes.asynchronous import AsyncMode
from ps_train.modes.base import ModeOptions, ModeServer, ModeTrainer, RunConfig, UpdateRequest

__all__ = ["SspMode", "ClockedUpdate"]

_FINISHED = 1 << 60  # the steps a finished trainer counts as having completed


class ClockWaiter(NamedTuple):
    """A trainer waiting at the clock: the steps it completed, and its answer."""

    completed: int
    future: torch.futures.Future[Any]


class ClockedUpdate(NamedTuple):
    """ps0's answer to an update that rode on the backward: the update's staleness, and the
    clock's (how far the trainer was ahead of the slowest when it was let go on)."""

    staleness: int
    steps_ahead: int


class SspMode(AsyncMode):
    name = "ssp"
    options = ("staleness", "staleness_rule")

    def __init__(self, run: RunConfig) -> None:
        super().__init__(run)
        self.staleness_bound = run.mode.staleness
        self._clock: dict[int, int] = {}  # trainer -> steps it completed
        self._clock_waiters: list[ClockWaiter] = []

    @classmethod
    def option_problems(cls, options: ModeOptions) -> list[str]:
        if options.staleness < 0:
            return [f"mode.staleness: {options.staleness} must be >= 0 in ssp mode"]
        return []

    # -- server side (ps0) ----------------------------------------------------------------------
    def clock(self, server: ModeServer, trainer: int, completed: int) -> torch.futures.Future[Any]:
        """Resolves (to the steps ``trainer`` is ahead of the slowest) once every trainer
        completed at least ``completed - mode.staleness`` steps."""
        fut: torch.futures.Future[Any] = torch.futures.Future()
        with server.lock:
            self._clock[trainer] = completed
            self._clock_waiters.append(ClockWaiter(completed, fut))
        self._release_clock(server)
        return fut

    def _release_clock(self, server: ModeServer) -> None:
        """Resolve the clock waiters the slowest trainer no longer holds back."""
        with server.lock:
            if server.membership is None:
                slowest = min(self._clock.get(t, 0) for t in range(self.num_trainers))
            else:  # elastic: only the trainers in the job count (ps_train.elastic.membership)
                counted = server.membership.counted()
                slowest = min((c for t, c in self._clock.items() if t in counted), default=_FINISHED)
            ready = [w for w in self._clock_waiters if w.completed - self.staleness_bound <= slowest]
            self._clock_waiters = [w for w in self._clock_waiters if w.completed - self.staleness_bound > slowest]
        for w in ready:
            w.future.set_result(max(0, w.completed - slowest))

    def in_backward(self, server: ModeServer, context_id: int, request: UpdateRequest) -> torch.futures.Future[Any]:
        """The update, and on ps0 also the clock of the step it completes: the trainer's
        backward returns once it may go on (the clock's wait holds no thread)."""
        update = super().in_backward(server, context_id, request)
        if server.rank != 0:
            return update
        # The update answers at once, or once a checkpoint lets held updates go on
        # (``hold_updates``): chained, so no thread waits for it.
        answer: torch.futures.Future[Any] = torch.futures.Future()

        def clocked(staleness: int, clock: torch.futures.Future[Any]) -> None:
            try:
                answer.set_result(ClockedUpdate(staleness, clock.value()))
            except Exception as e:  # noqa: BLE001 - the trainer's backward raises it
                answer.set_exception(e)

        def updated(f: torch.futures.Future[Any]) -> None:
            try:
                staleness = f.value()
            except Exception as e:  # noqa: BLE001 - the trainer's backward raises it
                answer.set_exception(e)
                return
            clock = self.clock(server, request.trainer, request.step + 1)
            clock.add_done_callback(lambda c: clocked(staleness, c))

        update.add_done_callback(updated)
        return answer

    def answer_staleness(self, answer: Any) -> int:
        # ps0's update in the backward answers with the clock's answer too (in_backward)
        return int(answer.staleness if isinstance(answer, ClockedUpdate) else answer)

    def trainer_finished(self, server: ModeServer, trainer: int) -> None:
        self.clock(server, trainer, _FINISHED)

    def trainer_changed(self, server: ModeServer, trainer: int, joined: bool) -> None:
        if not joined:  # its clock no longer counts
            with server.lock:
                self._clock.pop(trainer, None)
            self._release_clock(server)

    # -- trainer side ---------------------------------------------------------------------------
    def settled(self, trainer: ModeTrainer, results: list[Any], step: int) -> dict[str, float]:
        first = results[0]
        if isinstance(first, ClockedUpdate):  # the clock's answer came with the backward
            out = super().settled(trainer, [first.staleness, *results[1:]], step)
            out["steps_ahead"] = float(first.steps_ahead)
            return out
        out = super().settled(trainer, results, step)
        # Waits while this trainer is more than mode.staleness steps ahead of the slowest;
        # returns how far ahead it is when released.
        out["steps_ahead"] = float(trainer.servers[0].rpc_sync().clock(trainer.index, step + 1))
        return out

    def trainer_done(self, trainer: ModeTrainer) -> None:
        trainer.servers[0].rpc_sync().finish(trainer.index)  # it no longer holds the others back

    def train_scalars(self, last: Mapping[str, float], lr: float) -> dict[str, float]:
        out = super().train_scalars(last, lr)
        if "steps_ahead" in last:
            out["train/steps_ahead"] = last["steps_ahead"]
        return out
