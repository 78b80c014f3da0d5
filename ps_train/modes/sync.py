"""``mode=sync``: every step, all trainers' gradients combined in rank order and applied once.

Server side. A trainer's update (``update``) waits, without holding a thread, until every
trainer handed in its step-``s`` gradients; the last one's combines them in trainer-rank
order (``mode.aggregate``: mean or sum, ``ps_train.modes.aggregation.combine``) and steps the
optimizer once; bit-reproducible. A step-``s`` read (a forward or a lookup) runs only once
the round of step ``s - 1`` is applied, so a trainer may send it without waiting for its
update's answer (``pipelined``). A failed update fails its round and everything waiting for
it, naming the step. Forwards through shards that update BatchNorm statistics run in trainer
order, so those statistics are the same every run; dropout masks are seeded by (seed, shard,
trainer, step) (``ParameterServer.run_shard``).

When the update rides on the backward (``in_backward``, ``cluster.update_in_backward=true``),
the server takes the gradients and answers the backward at once; the contribution that
completes a round applies it once that answer is written (``after_response``), in step
order, while the trainers go on with their next batch: what the separate update call's
pipelining overlaps, without its request. A trainer that must know the round is applied
(before it logs, evaluates or checkpoints) asks each server (``applied``).

Trainer side. Pipelined on rpc_core: the trainer leaves the step's autograd context and
sends the next forward at once, collecting the update's answer later. rpc_core tells a
worker that a context was released with the next message it sends there, which the worker
reads after the update request that came before it; torch's RPC sends its release at once,
and it could overtake the update, so on ``backend=torch`` the trainer waits for the update.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from ps_train.modes.aggregation import combine
from ps_train.modes.base import Mode, ModeServer, ModeTrainer, RunConfig, UpdateRequest, resolved

__all__ = ["SyncMode", "Round", "FailedRound"]


@dataclass
class Round:
    """One step's update on a server while trainers hand in their gradients."""

    grads: dict[int, dict[Tensor, Tensor]] = field(default_factory=dict)  # trainer -> its gradients
    # What every trainer of the step waits on: the server's version once the step is applied.
    done: torch.futures.Future[Any] = field(default_factory=torch.futures.Future)


class FailedRound(NamedTuple):
    """A step whose update failed, so no later step can run."""

    step: int
    error: BaseException


class SyncMode(Mode):
    name = "sync"
    options: ClassVar[tuple[str, ...]] = ("aggregate",)
    unused_reasons = {"staleness_rule": ", whose gradients are never stale; see mode.aggregate"}
    not_elastic = (
        "every sync round waits for every trainer's gradient, so a dead trainer stops the round; use "
        "cluster.max_restarts to restart a sync run from its latest checkpoint instead "
        "(docs/training_failures.md)"
    )

    applies_after_answer = True  # see in_backward

    def __init__(self, run: RunConfig) -> None:
        super().__init__(run)
        self.aggregate = run.mode.aggregate
        self.pipelined = run.backend == "rpc_core"  # see the module docstring
        self.rounds = 0  # steps whose update is applied (all trainers' gradients)
        self._rounds: dict[int, Round] = {}  # step -> its round, until every trainer handed in
        self._failed_round: FailedRound | None = None
        self._turn = threading.Condition()
        self._forwards_done: dict[tuple[int, int], int] = {}  # (shard, step) -> trainers whose forward ran
        self._applied_waiters: list[tuple[int, torch.futures.Future[Any]]] = []  # (step, its applied() answer)

    @classmethod
    def run_problems(cls, run: RunConfig) -> list[str]:
        m, c = run.model, run.cluster
        if not (m.has_batch_norm() and run.backend == "torch"):
            return []
        # BatchNorm shards' forwards run in trainer order: up to (trainers - 1) requests per
        # shard wait in server threads, and torch's RPC pool has a fixed size.
        stages = m.num_stages()
        per_server = 1 if c.placement == "balanced" else -(-stages // max(c.num_servers, 1))
        least = (c.num_trainers - 1) * per_server + 2
        if c.num_worker_threads >= least:
            return []
        return [
            f"cluster.num_worker_threads: {c.num_worker_threads} is too few for {m.name} in sync mode on "
            f"backend=torch with {c.num_trainers} trainers (forwards wait for their turn in server "
            f"threads); use cluster.num_worker_threads>={least}"
        ]

    # -- server side ----------------------------------------------------------------------------
    def forward(self, server: ModeServer, shard: int, x: Tensor, trainer: int, step: int) -> Tensor:
        self._await_round(server, step)
        if not server.has_running_stats or step < 0:
            return server.run_shard(shard, x, trainer, step)
        key = (shard, step)
        with self._turn:
            self._turn.wait_for(lambda: self._forwards_done.get(key, 0) == trainer)
        try:
            return server.run_shard(shard, x, trainer, step)
        finally:
            with self._turn:
                done = self._forwards_done.get(key, 0) + 1
                if done == self.num_trainers:
                    self._forwards_done.pop(key, None)
                else:
                    self._forwards_done[key] = done
                self._turn.notify_all()

    def lookup(self, server: ModeServer, rows: Callable[[], Tensor], trainer: int, step: int) -> Tensor:
        self._await_round(server, step)
        return rows()

    def _await_round(self, server: ModeServer, step: int) -> None:
        """Return once the round of step ``step - 1`` is applied (a step-``step`` read must
        see it); at once if it is."""
        if step <= self.rounds:
            return
        with self._turn:
            self._turn.wait_for(lambda: self.rounds >= step or self._failed_round is not None)
            if self.rounds < step:
                raise self._round_error(server, step, "forward")

    def _round_error(self, server: ModeServer, step: int, what: str = "update") -> RuntimeError:
        assert self._failed_round is not None  # asked for once an update failed
        failed, error = self._failed_round
        e = RuntimeError(
            f"ps{server.rank} cannot run the step-{step} {what}: the step-{failed} update "
            f"failed: {error!r}; sync mode cannot go on without it"
        )
        e.__cause__ = error
        return e

    def update(
        self, server: ModeServer, context_id: int, trainer: int, step: int, position: dict[str, int] | None
    ) -> torch.futures.Future[Any]:
        r, completed = self._hand_in(server, context_id, trainer, step)
        if completed:
            self._apply(server, step, r)
        return r.done

    def in_backward(self, server: ModeServer, context_id: int, request: UpdateRequest) -> torch.futures.Future[Any]:
        """The gradients are taken now and the answer goes back at once (its value: None); the
        trainer's last contribution applies the round after its answer is written
        (``ModeServer.after_answer``), while the trainers go on. Nothing reads the round early: a
        step-``s + 1`` forward waits for it (``_await_round``), and a trainer that must know
        it is applied (to log, evaluate or checkpoint) asks (``applied``)."""
        r, completed = self._hand_in(server, context_id, request.trainer, request.step)
        if completed:
            server.after_answer(lambda: self._apply(server, request.step, r))
        return resolved(None)

    def _hand_in(self, server: ModeServer, context_id: int, trainer: int, step: int) -> tuple[Round, bool]:
        """Add trainer ``trainer``'s step-``step`` gradients to the step's round; whether they
        completed it (every trainer's are in: this caller, and no other, applies it)."""
        if self._failed_round is not None:
            raise self._round_error(server, step)
        r = None
        try:
            grads = server.gradients(context_id)
            with server.lock:
                r = self._rounds.setdefault(step, Round())
                r.grads[trainer] = grads
                completed = len(r.grads) == self.num_trainers
                if completed:
                    del self._rounds[step]
            return r, completed
        except BaseException as e:
            self._fail_round(server, step, r, e)
            raise

    def _apply(self, server: ModeServer, step: int, r: Round) -> None:
        """Step the optimizer once with the complete round ``r`` of step ``step``, after the
        rounds before it (one applied after its answer may still be running)."""
        try:
            self._await_round(server, step)
            with server.lock:
                # Rank order: the same floats every run. Gradients taken from their contexts
                # (rpc_core) are summed into the first trainer's: no copy besides them.
                grads = combine(r.grads, self.aggregate, owned=server.owns_gradients)
                # The other trainers' gradients go now, not with the round (on torch: with
                # their autograd contexts, released as the next step starts).
                r.grads.clear()
                server.step(grads)
                del grads
        except BaseException as e:
            self._fail_round(server, step, r, e)
            raise
        with self._turn:
            self.rounds = max(self.rounds, step + 1)
            self._turn.notify_all()
            ready = [w for w in self._applied_waiters if w[0] < self.rounds]
            self._applied_waiters = [w for w in self._applied_waiters if w[0] >= self.rounds]
        r.done.set_result(server.version)
        for waited, fut in ready:
            self._settle_waiter(server, waited, fut)

    def _fail_round(self, server: ModeServer, step: int, r: Round | None, error: BaseException) -> None:
        """Round ``step`` can never be applied: the trainers and forwards waiting for it fail
        instead of hanging."""
        with self._turn:
            if self._failed_round is None:
                self._failed_round = FailedRound(step, error)
            self._turn.notify_all()
            ready, self._applied_waiters = self._applied_waiters, []
        for waited, fut in ready:
            self._settle_waiter(server, waited, fut)
        with server.lock:
            waiting = self._rounds.pop(step, None) or r
        if waiting is not None and not waiting.done.done():
            waiting.done.set_exception(self._round_error(server, step))

    def applied(self, server: ModeServer, step: int) -> torch.futures.Future[Any]:
        """Resolves to the server's version once the round of step ``step`` is applied here (or
        fails with the round that failed), without holding a thread meanwhile."""
        fut: torch.futures.Future[Any] = torch.futures.Future()
        with self._turn:
            if self.rounds <= step and self._failed_round is None:
                self._applied_waiters.append((step, fut))
                return fut
        self._settle_waiter(server, step, fut)
        return fut

    def _settle_waiter(self, server: ModeServer, step: int, fut: torch.futures.Future[Any]) -> None:
        if self.rounds > step:
            fut.set_result(server.version)
        else:
            fut.set_exception(self._round_error(server, step))

    def state_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds}

    def load_state_dict(self, state: Mapping[str, Any], version: int) -> None:
        self.rounds = state.get("rounds", version)  # older checkpoints: one update per round

    # -- trainer side ---------------------------------------------------------------------------
    def settled(self, trainer: ModeTrainer, results: list[Any], step: int) -> dict[str, float]:
        return {"staleness": 0.0}  # every server applied all trainers' step-``step`` gradients at once
