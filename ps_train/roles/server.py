"""The parameter server: hosts shards of the model and applies updates to them.

Every server builds the whole seeded model (cheap, and identical everywhere) and keeps the
shards placed on it. Trainers call it through an RRef:

- ``forward(shard, x, trainer)``: the shard's forward; under distributed autograd the
  parameters' gradients land in the trainer's context on this server.
- ``apply_sync(context_id, trainer, step)``: sync mode. Waits (without holding a thread)
  until every trainer handed in its step-``step`` gradients, averages (or sums, per
  ``mode.aggregate``) them in trainer-rank order, and steps the optimizer once;
  bit-reproducible. A sync-mode forward of step ``s`` runs only once the round of step
  ``s - 1`` is applied, so a trainer may send it without waiting for its update's answer
  (see ``ps_train.roles.trainer``).
- ``apply_async(context_id, trainer, step)``: async/ssp modes. Applies this trainer's
  gradients now, at a learning rate scaled by their staleness (``mode.staleness_rule``);
  returns the staleness: the updates this server applied since the trainer's step-``step``
  forward first read one of its shards.
- ``clock(trainer, completed)`` (on ps0, ssp mode): returns once no trainer is more than
  ``staleness`` steps behind ``completed``.
- ``lookup(ids, trainer, step)`` (model=dlrm): this server's rows of every table that a
  trainer's batch uses (its ``TablePart``, ``ps_train.ctr.table_server``); like a forward, a
  sync-mode lookup of step ``s`` runs once the round of step ``s - 1`` is applied. The
  updates above apply the tables' sparse gradients along with the dense ones.

In async/ssp modes a forward reads a private copy of the parameters (``clone`` keeps the
gradient path), so an update applied while another trainer's backward is still pending
cannot invalidate the tensors that backward saved: the upstream example's "modified by an
inplace operation" failure cannot happen.

The update arithmetic (averaging, the staleness rule, and why 8 async trainers need the
latter) is ``ps_train.modes.aggregation``. Sync mode is bit-reproducible; async/ssp are not (see
the ``ps_train`` package docstring for exactly what they do and do not reproduce).
"""
from __future__ import annotations

import copy
import logging
import threading
from typing import Any, Protocol

import torch
from torch import nn
from torch.func import functional_call

from ps_train import backend
from ps_train.checkpoint.files import ShardFile, save_shard_state
from ps_train.config import Config, optimizer_spec
from ps_train.elastic.membership import Membership
from ps_train.faults import maybe_inject_fault
from ps_train.metrics import peak_rss_bytes
from ps_train.modes.aggregation import combine, lr_scale, scaled_lr
from ps_train.stage_sharding import model_shards, shards_of_server
from rpc_core.functions import async_execution

log = logging.getLogger("ps_train.server")

_server: ParameterServer | None = None


class TablePart(Protocol):
    """A model's embedding tables on one server, split by rows: its rows of every table and
    their optimizer (model=dlrm: ``ps_train.ctr.table_server.TableServer``)."""

    @property
    def params(self) -> list[nn.Parameter]: ...

    def lookup(self, local_ids: list[torch.Tensor]) -> list[torch.Tensor]:
        """Rows ``local_ids[t]`` (int64 [U_t]) of each table, [U_t, dim] each, for training."""

    def read(self, local_ids: list[torch.Tensor]) -> list[torch.Tensor]:
        """The same rows without autograd, for evaluation."""

    def step(self, lr_factor: float = 1.0) -> None:
        """Update the rows named by the tables' ``.grad`` (sparse), at ``lr_factor`` times the rate."""

    def stats(self) -> dict[str, int]: ...

    def state_dict(self, copy: bool = True) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ParameterServer:
    """``tables``: the model's embedding tables on this server, if it has any (model=dlrm)."""

    def __init__(self, cfg: Config, rank: int, tables: TablePart | None = None) -> None:
        self.rank = rank
        self.mode = cfg.mode.name
        self.staleness_bound = cfg.mode.staleness
        self.num_trainers = cfg.cluster.num_trainers
        self.aggregate = cfg.mode.aggregate
        self.staleness_rule = cfg.mode.staleness_rule
        # Every server builds the whole seeded model and keeps its own shards (module docstring).
        shards = shards_of_server(model_shards(cfg), rank)
        self.shards: dict[int, nn.Module] = {s.index: s.module for s in shards}
        dense = [p for m in self.shards.values() for p in m.parameters()]
        self.tables = tables
        self.params: list[nn.Parameter] = dense + (self.tables.params if self.tables is not None else [])
        self.seed = cfg.seed
        self.has_dropout = any(isinstance(x, nn.Dropout) and x.p > 0 for m in self.shards.values() for x in m.modules())
        cls, kwargs = optimizer_spec(cfg.optim)
        self.optimizer = cls(dense, **kwargs) if dense else None
        self.lock = threading.Lock()
        self._eval_copies: dict[int, Any] = {}  # shard -> (version, eval-mode copy)
        self.forward_lock = threading.Lock()
        self.version = 0  # updates applied so far: the version of every shard here (they step together)
        self.updates = {i: 0 for i in self.shards}
        self._read_version: dict[tuple[int, int], int] = {}  # (trainer, step) -> version its first forward read
        self._rounds: dict[int, dict[str, Any]] = {}
        self._clock: dict[int, int] = {}
        self._clock_waiters: list[Any] = []
        self.max_staleness_seen = 0
        self.updates_by_trainer: dict[int, int] = {}  # async/ssp: updates applied per trainer index
        self.membership: Membership | None = None  # ps0 of a cluster.elastic=true job (ps_train.elastic.membership)
        self._released = threading.Event()  # elastic: trainer0 is done with the servers
        # BatchNorm updates its running statistics in place during the forward: in sync mode
        # the trainers' forwards of a step run on each shard in trainer-rank order, so those
        # statistics are the same every run (and never updated by two threads at once).
        self.ordered_forwards = self.mode == "sync" and any(
            isinstance(x, nn.modules.batchnorm._NormBase) and x.track_running_stats
            for m in self.shards.values() for x in m.modules())
        self._turn = threading.Condition()
        self.rounds = 0  # sync mode: steps whose update is applied (all trainers' gradients)
        self._failed_round: tuple[int, BaseException] | None = None  # (step, error) of an update that failed
        self._forwards_done: dict[tuple[int, int], int] = {}  # (shard, step) -> trainers whose forward ran

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, shard: int, x: torch.Tensor, trainer: int = -1, step: int = -1) -> torch.Tensor:
        module = self.shards[shard]
        if self.mode == "sync":
            self._await_round(step)
            if not self.ordered_forwards or step < 0:
                return self._sync_forward(module, shard, x, trainer, step)
            key = (shard, step)
            with self._turn:
                self._turn.wait_for(lambda: self._forwards_done.get(key, 0) == trainer)
            try:
                return self._sync_forward(module, shard, x, trainer, step)
            finally:
                with self._turn:
                    done = self._forwards_done.get(key, 0) + 1
                    if done == self.num_trainers:
                        self._forwards_done.pop(key, None)
                    else:
                        self._forwards_done[key] = done
                    self._turn.notify_all()
        with self.lock:
            # Private copies of the parameters for this forward (see module docstring).
            params = {n: p.clone() for n, p in module.named_parameters()}
            # The step's first forward here: its gradient is as old as the oldest shard it read.
            self._read_version.setdefault((trainer, step), self.version)
        # functional_call swaps the module's parameters while it runs: one at a time.
        with self.forward_lock:
            return functional_call(module, params, (x,))

    def _await_round(self, step: int) -> None:
        """Sync mode: return once the round of step ``step - 1`` is applied (a step-``step``
        read must see it); at once if it is."""
        if step <= self.rounds:
            return
        with self._turn:
            self._turn.wait_for(lambda: self.rounds >= step or self._failed_round is not None)
            if self.rounds < step:
                raise self._round_error(step, "forward")

    def _round_error(self, step: int, what: str = "update") -> RuntimeError:
        assert self._failed_round is not None  # asked for once an update failed
        failed, error = self._failed_round
        e = RuntimeError(f"ps{self.rank} cannot run the step-{step} {what}: the step-{failed} update "
                         f"failed: {error!r}; sync mode cannot go on without it")
        e.__cause__ = error
        return e

    def _sync_forward(self, module: nn.Module, shard: int, x: torch.Tensor, trainer: int, step: int) -> torch.Tensor:
        if not self.has_dropout or step < 0:
            return module(x)
        # Dropout draws from a generator seeded by (seed, shard, trainer, step), so masks do
        # not depend on which trainer's request this server happened to serve first.
        with self.lock, torch.random.fork_rng(devices=[]):
            torch.manual_seed(hash((self.seed, shard, trainer, step)) & 0x7FFF_FFFF_FFFF_FFFF)
            return module(x)

    def predict(self, shard: int, x: torch.Tensor) -> torch.Tensor:
        with self.lock, self.forward_lock:
            # An eval-mode copy, so evaluation never disturbs training forwards; reused by
            # every batch of an evaluation while no update changed the weights.
            cached = self._eval_copies.get(shard)
            if cached is None or cached[0] != self.version:
                module = copy.deepcopy(self.shards[shard]).eval()
                self._eval_copies[shard] = cached = (self.version, module)
        with torch.no_grad():
            return cached[1](x)

    def lookup(self, local_ids: list[torch.Tensor], trainer: int = -1, step: int = -1) -> list[torch.Tensor]:
        """Rows ``local_ids[t]`` (int64 [U_t]) of every table held here: [U_t, dim] each."""
        tables = self._tables()
        if self.mode == "sync":
            self._await_round(step)
            return tables.lookup(local_ids)
        with self.lock:  # rows read whole, never half updated
            self._read_version.setdefault((trainer, step), self.version)
            return tables.lookup(local_ids)

    def read_rows(self, local_ids: list[torch.Tensor]) -> list[torch.Tensor]:
        """``lookup`` for evaluation: no autograd, no step bookkeeping."""
        tables = self._tables()
        with self.lock:
            return tables.read(local_ids)

    def _tables(self) -> TablePart:
        if self.tables is None:
            raise RuntimeError(f"ps{self.rank} holds no embedding tables: the model is not model=dlrm")
        return self.tables

    def parameter_rrefs(self) -> list[Any]:
        rpc = backend.rpc()
        return [rpc.RRef(p) for p in self.params]

    # -- updates ----------------------------------------------------------------------------------
    def _grads(self, context_id: int) -> dict[nn.Parameter, torch.Tensor]:
        grads = backend.dist_autograd().get_gradients(context_id)
        return {p: grads[p] for p in self.params if p in grads}

    def _step(self, grads: dict[nn.Parameter, torch.Tensor], lr_factor: float = 1.0) -> None:
        # Caller holds self.lock.
        if self.optimizer is None and self.tables is None:
            return
        for p in self.params:
            p.grad = grads.get(p)
        if self.optimizer is not None:
            with scaled_lr(self.optimizer, lr_factor):
                self.optimizer.step()
        if self.tables is not None:
            self.tables.step(lr_factor)
        for p in self.params:
            p.grad = None
        self.version += 1
        for i in self.updates:
            self.updates[i] += 1
        maybe_inject_fault(f"ps{self.rank}", self.version)  # test-only, see ps_train.faults

    @async_execution
    def apply_sync(self, context_id: int, trainer: int, step: int) -> torch.futures.Future[Any]:
        if self._failed_round is not None:
            raise self._round_error(step)
        r = None
        try:
            grads = self._grads(context_id)
            with self.lock:
                r = self._rounds.setdefault(step, {"grads": {}, "future": torch.futures.Future()})
                r["grads"][trainer] = grads
                complete = len(r["grads"]) == self.num_trainers
                if complete:
                    del self._rounds[step]
                    self._step(combine(r["grads"], self.aggregate))  # rank order: the same floats every run
        except BaseException as e:
            # This round can never complete: the trainers waiting for it and forwards waiting
            # for it fail instead of hanging.
            with self._turn:
                self._failed_round = (step, e)
                self._turn.notify_all()
            with self.lock:
                waiting = self._rounds.pop(step, None) or r
            if waiting is not None and not waiting["future"].done():
                waiting["future"].set_exception(self._round_error(step))
            raise
        if complete:
            with self._turn:
                self.rounds = max(self.rounds, step + 1)
                self._turn.notify_all()
            r["future"].set_result(self.version)
        return r["future"]

    def apply_async(self, context_id: int, trainer: int, step: int = -1,
                    position: dict[str, int] | None = None) -> int:
        """``position`` (elastic, on ps0): the trainer's data position after this step."""
        grads = self._grads(context_id)
        with self.lock:
            staleness = self.version - self._read_version.pop((trainer, step), self.version)
            self._step(grads, lr_scale(staleness, self.staleness_rule))
            self.max_staleness_seen = max(self.max_staleness_seen, staleness)
            self.updates_by_trainer[trainer] = self.updates_by_trainer.get(trainer, 0) + 1
        if self.membership is not None and position is not None:
            self.membership.completed(trainer, step, position)
        return staleness

    @async_execution
    def clock(self, trainer: int, completed: int) -> torch.futures.Future[Any]:
        """SSP barrier: resolves (to the current staleness) once every trainer completed at
        least ``completed - staleness_bound`` steps."""
        fut: torch.futures.Future[Any] = torch.futures.Future()
        with self.lock:
            self._clock[trainer] = completed
            self._clock_waiters.append((completed, fut))
        self._release_clock()
        return fut

    def _release_clock(self) -> None:
        """Resolve the clock waiters the slowest trainer no longer holds back."""
        with self.lock:
            if self.membership is None:
                slowest = min(self._clock.get(t, 0) for t in range(self.num_trainers))
            else:  # elastic: only the trainers in the job count (ps_train.elastic.membership)
                counted = self.membership.counted()
                slowest = min((c for t, c in self._clock.items() if t in counted), default=1 << 60)
            ready = [(c, f) for c, f in self._clock_waiters if c - self.staleness_bound <= slowest]
            self._clock_waiters = [(c, f) for c, f in self._clock_waiters if c - self.staleness_bound > slowest]
        for c, f in ready:
            f.set_result(max(0, c - slowest))

    def trainer_changed(self, trainer: int, joined: bool) -> None:
        """Elastic, ps0: a trainer left (its clock no longer counts) or joined."""
        if not joined:
            with self.lock:
                self._clock.pop(trainer, None)
            self._release_clock()

    def release(self) -> None:
        """Elastic: trainer0 wrote the run's results; this server may leave the group."""
        self._released.set()

    def wait_released(self) -> None:
        self._released.wait()

    def finish(self, trainer: int) -> None:
        """A trainer is done: it no longer holds back the others in ssp mode."""
        self.clock(trainer, 1 << 60)

    # -- state ------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.version, "updates": dict(self.updates),
                               "updates_by_trainer": {f"trainer{t}": n
                                                      for t, n in sorted(self.updates_by_trainer.items())},
                               "max_staleness": self.max_staleness_seen, "peak_rss_bytes": peak_rss_bytes()}
        if self.tables is not None:
            out.update(self.tables.stats())
        if backend.name() == "rpc_core":
            from rpc_core.agent import connection_stats

            conns = connection_stats()
            out["bytes_sent"] = conns.bytes_sent
            out["bytes_received"] = conns.bytes_received
        return out

    def state_dict(self) -> dict[str, Any]:
        with self.lock:
            return self._state(copy_tables=True)

    def _state(self, copy_tables: bool) -> dict[str, Any]:
        # Caller holds self.lock.
        tables = self.tables.state_dict(copy=copy_tables) if self.tables is not None else None
        return {
            "shards": {i: copy.deepcopy(m.state_dict()) for i, m in self.shards.items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()) if self.optimizer else None,
            "version": self.version,
            "rounds": self.rounds,
            "updates": dict(self.updates),
            "tables": tables,
        }

    def save_state(self, ckpt_dir: str) -> ShardFile:
        """Write this server's shards and optimizer state into the checkpoint folder
        ``ckpt_dir`` as ``ps<rank>.pt``; returns the file's manifest entry. The checkpoint
        coordinator (``ps_train.checkpoint.protocol``) calls it through the server's RRef."""
        if self.tables is None:
            return save_shard_state(ckpt_dir, f"ps{self.rank}", self.state_dict())
        # Tables are too large to copy: updates wait while they are written out.
        with self.lock:
            return save_shard_state(ckpt_dir, f"ps{self.rank}", self._state(copy_tables=False))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.lock:
            for i, sd in state["shards"].items():
                self.shards[int(i)].load_state_dict(sd)
            if self.optimizer is not None and state.get("optimizer") is not None:
                self.optimizer.load_state_dict(state["optimizer"])
            self.version = state.get("version", 0)
            self.rounds = state.get("rounds", self.version)  # older checkpoints: one update per round
            self._eval_copies.clear()
            self.updates = {int(k): v for k, v in state.get("updates", {}).items()} or self.updates
            if self.tables is not None:
                if state.get("tables") is None:
                    raise ValueError(f"ps{self.rank}: the checkpoint holds no embedding tables; resume a "
                                     "model=dlrm run")
                self.tables.load_state_dict(state["tables"])


def create(cfg: Config, rank: int, tables: TablePart | None = None) -> ParameterServer:
    global _server
    _server = ParameterServer(cfg, rank, tables)
    return _server


def local_server() -> ParameterServer:
    """This process's ParameterServer (for functions that trainers call on a server)."""
    if _server is None:
        raise RuntimeError("this worker hosts no ParameterServer (is it a trainer?)")
    return _server


def get_server_rref() -> Any:
    """Called by trainers over RPC: an RRef to this process's ParameterServer."""
    if _server is None:
        raise RuntimeError("this worker hosts no ParameterServer (is it a trainer?)")
    return backend.rpc().RRef(_server)
