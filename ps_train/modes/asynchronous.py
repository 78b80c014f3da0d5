"""``mode=async``: each trainer's gradients applied as they arrive, at a rate their staleness gives.

Server side. A read (a forward, a lookup) notes the version of the parameters it saw, the
step's first read on this server; an update then has staleness ``tau``, the updates the
server applied since, and steps the optimizer at ``optim.lr`` times ``lr_scale(tau)``
(``mode.staleness_rule``, ``ps_train.modes.aggregation``). A forward reads private copies of
the parameters (``clone`` keeps the gradient path), so an update applied while another
trainer's backward is still pending cannot invalidate the tensors that backward saved: the
upstream example's "modified by an inplace operation" failure cannot happen. With each update
a server notes the trainer's data position after that step (``ParameterServer.positions``),
under the same lock, so a checkpoint resumes each trainer after its own last step that the
saved parameters hold. While a checkpoint takes the servers' states, updates are held
(``hold_updates``): they wait, with their gradients, and are applied in arrival order once
every server's state is taken; so each trainer (which waits for every server's answer before
its next step) is at most its one step in flight ahead on some servers.

Trainer side: it waits for its updates before the next forward; the largest staleness of
the step's updates is its ``train/staleness``. Not reproducible: which version a read sees
and the order of updates follow process timing (see the ``ps_train`` package docstring).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from ps_train.modes.aggregation import lr_scale
from ps_train.modes.base import Mode, ModeServer, ModeTrainer, RunConfig, resolved

__all__ = ["AsyncMode"]


class HeldUpdate(NamedTuple):
    """An update that came while updates were held: applied, and answered, on release."""

    grads: dict[Tensor, Tensor]
    trainer: int
    step: int
    position: dict[str, int] | None
    answer: torch.futures.Future[Any]


class AsyncMode(Mode):
    name = "async"
    options: ClassVar[tuple[str, ...]] = ("staleness_rule",)
    per_trainer_positions = True
    answers_with_staleness = True
    unused_reasons = {"aggregate": ", which applies each trainer's gradient on its own; see mode.staleness_rule"}

    def __init__(self, run: RunConfig) -> None:
        super().__init__(run)
        self.staleness_rule = run.mode.staleness_rule
        self._read_version: dict[tuple[int, int], int] = {}  # (trainer, step) -> version its first read saw
        self.max_staleness_seen = 0
        self.updates_by_trainer: dict[int, int] = {}  # updates applied per trainer index
        self._held: list[HeldUpdate] | None = None  # None: updates apply as they come

    # -- server side ----------------------------------------------------------------------------
    def forward(self, server: ModeServer, shard: int, x: Tensor, trainer: int, step: int) -> Tensor:
        with server.lock:
            params = server.shard_copy(shard)  # private copies (see the module docstring)
            # The step's first read here: its gradient is as old as the oldest shard it read.
            self._read_version.setdefault((trainer, step), server.version)
        return server.run_shard_with(shard, params, x)

    def lookup(self, server: ModeServer, rows: Callable[[], Tensor], trainer: int, step: int) -> Tensor:
        with server.lock:  # rows read whole, never half updated
            self._read_version.setdefault((trainer, step), server.version)
            return rows()

    def update(
        self, server: ModeServer, context_id: int, trainer: int, step: int, position: dict[str, int] | None
    ) -> torch.futures.Future[Any]:
        grads = server.gradients(context_id)  # read now: a held update keeps them
        with server.lock:
            if self._held is not None:
                held = HeldUpdate(grads, trainer, step, position, torch.futures.Future())
                self._held.append(held)
                return held.answer
            return resolved(self._apply(server, grads, trainer, step, position))

    def _apply(
        self, server: ModeServer, grads: dict[Tensor, Tensor], trainer: int, step: int, position: dict[str, int] | None
    ) -> int:
        """One trainer's update; returns its staleness. The caller holds ``server.lock``."""
        staleness = server.version - self._read_version.pop((trainer, step), server.version)
        server.step(grads, lr_scale(staleness, self.staleness_rule))
        self.max_staleness_seen = max(self.max_staleness_seen, staleness)
        self.updates_by_trainer[trainer] = self.updates_by_trainer.get(trainer, 0) + 1
        if position is not None:  # with the parameters, under the same lock
            server.positions.completed(trainer, step, position)
        return staleness

    def answer_staleness(self, answer: Any) -> int:
        return int(answer)  # update answers with the staleness it applied

    def hold_updates(self, server: ModeServer) -> None:
        with server.lock:  # an update being applied completes first
            if self._held is None:
                self._held = []

    def release_updates(self, server: ModeServer) -> None:
        answers: list[tuple[torch.futures.Future[Any], int | BaseException]] = []
        with server.lock:
            held, self._held = self._held or [], None
            for u in held:
                try:
                    answers.append((u.answer, self._apply(server, u.grads, u.trainer, u.step, u.position)))
                except Exception as e:  # noqa: BLE001 - that trainer's answer carries it
                    answers.append((u.answer, e))
        for answer, result in answers:  # outside the lock: an answer may run the trainer's callbacks
            if isinstance(result, BaseException):
                answer.set_exception(result)
            else:
                answer.set_result(result)

    def stats(self) -> dict[str, Any]:
        return {
            "updates_by_trainer": {f"trainer{t}": n for t, n in sorted(self.updates_by_trainer.items())},
            "max_staleness": self.max_staleness_seen,
        }

    # -- trainer side ---------------------------------------------------------------------------
    def settled(self, trainer: ModeTrainer, results: list[Any], step: int) -> dict[str, float]:
        # Updates by other trainers between this step's forward and its update, on its stalest server.
        return {"staleness": float(max(results))}

    def train_scalars(self, last: Mapping[str, float], lr: float) -> dict[str, float]:
        # The rate the last update got on its stalest server.
        return {
            "train/lr": lr * lr_scale(int(last["staleness"]), self.staleness_rule),
            "train/staleness": last["staleness"],
        }
