"""``mode=hybrid``: the dense layers in sync, the embedding rows async (Persia's split).

A CTR model's dense MLPs are small, touched by every sample and sensitive to stale
gradients; its embedding tables are large, each row touched by few samples, and tolerate
staleness. Persia (Lian et al., "Persia: An Open, Hybrid System Scaling Deep Learning-based
Recommenders up to 100 Trillion Parameters", KDD 2022) therefore trains the first
synchronously and the second asynchronously. Here, on every server:

- **Dense parameters** (``ModeServer.dense_params``): sync's rounds. A trainer's step-``s``
  dense gradients wait until every trainer handed in its own; then they are combined in
  trainer-rank order (``mode.aggregate``) and stepped once, bit for bit as ``mode=sync``.
  A step-``s`` forward runs once round ``s - 1`` is applied (inherited from ``SyncMode``).
- **Table rows**: each trainer's sparse gradient is applied the moment its update arrives,
  at ``optim.lr`` times ``lr_scale(tau)`` (``mode.staleness_rule``) where ``tau`` counts the
  table updates this server applied between the step's lookup and this update, as async.
- **Bounded staleness** (``mode.staleness`` = b): a step-``s`` lookup of trainer ``k`` runs
  once this server applied trainer ``k``'s own table updates of every step before ``s``
  (a trainer always reads its own writes) and every other trainer's of the steps before
  ``s - b``. With b = 0 a lookup sees every trainer's earlier steps, as in sync, but each
  trainer's rows move on their own; with b >= 1 a trainer's lookups need not wait for the
  others' latest updates, only the dense forward waits for the round.

The update's answer comes once the round of its dense gradients is applied (so a trainer
never runs its next dense forward on parameters without its own update), carrying the
table staleness. By the time a round completes every trainer's table gradients of that
step are applied too, so a checkpoint taken after a settled step holds a consistent state.

With one trainer this is exactly ``mode=sync``: the round has one member, its table update
has staleness 0, and the same gradients reach the same optimizers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from ps_train.modes.aggregation import combine, lr_scale
from ps_train.modes.base import Mode, ModeOptions, ModeServer, ModeTrainer, RunConfig
from ps_train.modes.sync import FailedRound, SyncMode

__all__ = ["HybridMode"]


@dataclass
class DenseRound:
    """One step's dense update on a server while trainers hand in their gradients."""

    grads: dict[int, dict[Tensor, Tensor]] = field(default_factory=dict)  # trainer -> its dense gradients
    answers: dict[int, torch.futures.Future[Any]] = field(default_factory=dict)  # trainer -> its answer
    staleness: dict[int, int] = field(default_factory=dict)  # trainer -> its table update's staleness


class HybridMode(SyncMode):
    name = "hybrid"
    options: ClassVar[tuple[str, ...]] = ("aggregate", "staleness", "staleness_rule")
    not_elastic = (
        "its dense parameters update in sync rounds that wait for every trainer; use "
        "cluster.max_restarts to restart from the latest checkpoint instead (docs/training_failures.md)"
    )

    # Its update answers with the tables' staleness, once applied: not sync's early answer.
    applies_after_answer = False
    in_backward = Mode.in_backward

    def __init__(self, run: RunConfig) -> None:
        super().__init__(run)
        self.staleness_bound = run.mode.staleness
        self.staleness_rule = run.mode.staleness_rule
        self._dense_rounds: dict[int, DenseRound] = {}
        self._tables_turn = threading.Condition()
        # trainer -> steps whose table update is applied here (the next one it will send).
        self._tables_applied: dict[int, int] = {}
        self._table_version = 0  # table updates applied here so far
        self._read_version: dict[tuple[int, int], int] = {}  # (trainer, step) -> table version its lookup saw
        self.max_staleness_seen = 0

    @classmethod
    def option_problems(cls, options: ModeOptions) -> list[str]:
        if options.staleness < 0:
            return [f"mode.staleness: {options.staleness} must be >= 0 in hybrid mode (0: no lag)"]
        return []

    @classmethod
    def run_problems(cls, run: RunConfig) -> list[str]:
        if not run.model.needs_ctr_data():
            return [
                f"mode=hybrid splits dense parameters from embedding tables, and model={run.model.name} has no "
                "tables: use mode=sync (the same for an all-dense model) or model=dlrm"
            ]
        return super().run_problems(run)

    # -- server side ----------------------------------------------------------------------------
    def lookup(self, server: ModeServer, rows: Callable[[], Tensor], trainer: int, step: int) -> Tensor:
        if step >= 0:
            self._await_tables(server, trainer, step)
        with server.lock:  # rows read whole, never half updated
            self._read_version.setdefault((trainer, step), self._table_version)
            return rows()

    def _applied(self, trainer: int) -> int:
        return self._tables_applied.get(trainer, self.rounds)  # resumed: every step before the round

    def _await_tables(self, server: ModeServer, trainer: int, step: int) -> None:
        """Return once this trainer's table updates before ``step`` and every trainer's
        before ``step - mode.staleness`` are applied here (see the module docstring)."""

        def ready() -> bool:
            if self._applied(trainer) < step:
                return False
            need = step - self.staleness_bound
            return all(self._applied(t) >= need for t in range(self.num_trainers))

        with self._tables_turn:
            self._tables_turn.wait_for(lambda: ready() or self._failed_round is not None)
            if not ready():
                raise self._round_error(server, step, "lookup")

    def update(
        self, server: ModeServer, context_id: int, trainer: int, step: int, position: dict[str, int] | None
    ) -> torch.futures.Future[Any]:
        if self._failed_round is not None:
            raise self._round_error(server, step)
        answer: torch.futures.Future[Any] = torch.futures.Future()
        r: DenseRound | None = None
        try:
            grads = server.gradients(context_id)
            dense_ids = {id(p) for p in server.dense_params}
            dense = {p: g for p, g in grads.items() if id(p) in dense_ids}
            rows = {p: g for p, g in grads.items() if id(p) not in dense_ids}
            with server.lock:
                # The rows now, on their own (async).
                staleness = self._table_version - self._read_version.pop((trainer, step), self._table_version)
                if rows:
                    server.step(rows, lr_scale(staleness, self.staleness_rule))
                self._table_version += 1
                self.max_staleness_seen = max(self.max_staleness_seen, staleness)
                # The dense gradients join the step's round (sync).
                r = self._dense_rounds.setdefault(step, DenseRound())
                r.grads[trainer], r.answers[trainer], r.staleness[trainer] = dense, answer, staleness
                complete = len(r.grads) == self.num_trainers
                if complete:
                    del self._dense_rounds[step]
                    combined = combine(r.grads, self.aggregate)  # rank order: the same floats every run
                    if combined:
                        server.step(combined)
            with self._tables_turn:
                self._tables_applied[trainer] = max(self._applied(trainer), step + 1)
                self._tables_turn.notify_all()
        except BaseException as e:
            self._fail(server, step, e, r)
            raise
        if complete:
            with self._turn:
                self.rounds = max(self.rounds, step + 1)
                self._turn.notify_all()
            for t, fut in r.answers.items():
                fut.set_result(r.staleness[t])
        return answer

    def _fail(self, server: ModeServer, step: int, error: BaseException, r: DenseRound | None) -> None:
        """This round can never complete: whoever waits for it (answers, forwards, lookups)
        fails instead of hanging."""
        for cond in (self._turn, self._tables_turn):
            with cond:
                self._failed_round = FailedRound(step, error)
                cond.notify_all()
        with server.lock:
            waiting = self._dense_rounds.pop(step, None) or r
        if waiting is not None:
            for fut in waiting.answers.values():
                if not fut.done():
                    fut.set_exception(self._round_error(server, step))

    def stats(self) -> dict[str, Any]:
        return {"updates_by_trainer": {}, "max_staleness": self.max_staleness_seen}

    # -- trainer side ---------------------------------------------------------------------------
    def settled(self, trainer: ModeTrainer, results: list[Any], step: int) -> dict[str, float]:
        # The table staleness of this step's update on its stalest server.
        return {"staleness": float(max(results))}

    def train_scalars(self, last: Mapping[str, float], lr: float) -> dict[str, float]:
        return {
            "train/lr": lr,
            "train/table_lr_scale": lr_scale(int(last["staleness"]), self.staleness_rule),
            "train/staleness": last["staleness"],
        }
