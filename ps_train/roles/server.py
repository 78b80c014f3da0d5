"""The parameter server: hosts shards of the model and applies updates to them.

Every server builds the whole seeded model (cheap, and identical everywhere) and keeps the
shards placed on it. Trainers call it through an RRef:

- ``forward(shard, x, trainer, step)``: the shard's forward; under distributed autograd the
  parameters' gradients land in the trainer's context on this server.
- ``update(context_id, trainer, step, position)``: apply this trainer's step-``step``
  gradients; the answer comes once they are applied (in sync mode: once every trainer's
  are, combined).
- ``clock(trainer, completed)`` (on ps0, ssp mode): returns once no trainer is more than
  ``mode.staleness`` steps behind ``completed``.
- ``lookup(rows, offsets, weights, trainer, step)`` (model=dlrm): the rows of this server's
  tables that a trainer's batch uses, single or pooled into bags (its ``TablePart``,
  ``ps_train.workloads.ctr.tables.service``). The updates apply the tables' sparse gradients along with
  the dense ones.

When a read (a forward, a lookup) may run and on which copy of the parameters, how
gradients become optimizer steps, and what a trainer waits for between steps is the update
mode's (``ps_train.modes``: sync, async, ssp), which this server hands every such request;
the server does the work the mode asks for (``run_shard``, ``shard_copy``, ``step``). Sync
mode is bit-reproducible; async/ssp are not (see the ``ps_train`` package docstring for
exactly what they do and do not reproduce).

Its parts: the shards and their forwards (``ps_train.roles.shards``), the writing of its part
of a checkpoint (``ps_train.roles.checkpointing``), and what it takes of a model's tables
(``ps_train.table_service``).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ps_train import backend
from ps_train.checkpoint.files import SaveStarted, ShardFile
from ps_train.checkpoint.positions import TrainerPositions
from ps_train.config import ClusterConfig, DataConfig, ModeConfig, ModelConfig, OptimConfig
from ps_train.elastic.membership import Membership
from ps_train.faults import maybe_inject_fault
from ps_train.metrics import peak_rss_bytes
from ps_train.modes import make_mode
from ps_train.modes.aggregation import scaled_lr
from ps_train.modes.base import UPDATE_IN_BACKWARD, UpdateRequest
from ps_train.observe.server_metrics import UpdateCounters
from ps_train.roles.checkpointing import CheckpointWriter
from ps_train.roles.server_optimizer import make_server_optimizer
from ps_train.roles.shards import ServerShards
from ps_train.stage_sharding import model_shards, shards_of_server
from ps_train.table_service import TablePart
from rpc_core.functions import async_execution

log = logging.getLogger("ps_train.server")

_server: ParameterServer | None = None


@dataclass(frozen=True)
class ServerSettings:
    """What a parameter server reads of the run's config, built where the whole config is
    (``ps_train.launch.rank.server_settings``). Its ``mode``, ``cluster``, ``model`` and
    ``backend`` are what the update mode reads (``ps_train.modes.base.RunConfig``)."""

    model: ModelConfig  # with data, cluster and seed: the model's shards and which are this server's
    data: DataConfig
    cluster: ClusterConfig
    mode: ModeConfig
    optim: OptimConfig  # the dense parameters' optimizer
    checkpoint_writer: str  # checkpoint.writer: how it writes its part of a checkpoint
    backend: str
    seed: int


@backend.called_by_name
class ParameterServer:
    """``tables``: the model's embedding tables on this server, if it has any (model=dlrm)."""

    def __init__(self, settings: ServerSettings, rank: int, tables: TablePart | None = None) -> None:
        self.rank = rank
        self.mode = make_mode(settings)  # when reads run, how updates apply (ps_train.modes)
        self.lock = threading.Lock()
        self.version = 0  # updates applied so far: the version of every shard here (they step together)
        # Every server builds the whole seeded model and keeps its own shards (module docstring).
        shards = model_shards(settings.model, settings.data, settings.cluster, settings.seed)
        self.held = ServerShards(shards_of_server(shards, rank), settings.seed, self.lock, lambda: self.version)
        self.shards: dict[int, nn.Module] = self.held.modules
        self.dense_params = [p for m in self.shards.values() for p in m.parameters()]
        self.tables = tables
        self.params: list[nn.Parameter] = self.dense_params + (self.tables.params if self.tables is not None else [])
        self._param_ids = frozenset(id(p) for p in self.params)  # gradients(): which of a context's leaves are ours
        self.owns_gradients = backend.gradients_handed_over()  # gradients() hands over the context's tensors
        self.has_running_stats = self.held.has_running_stats  # BatchNorm (see ServerShards)
        self.optimizer = make_server_optimizer(settings.optim, self.dense_params) if self.dense_params else None
        self.updates = {i: 0 for i in self.shards}
        self.membership: Membership | None = None  # ps0 of a cluster.elastic=true job (ps_train.elastic.membership)
        # async/ssp: each trainer's data position after its last update applied here (the mode
        # notes it under self.lock); a checkpoint saves it, ps0's membership reads it
        self.positions = TrainerPositions()
        self._released = threading.Event()  # elastic: trainer0 is done with the servers
        self.checkpoints = CheckpointWriter(
            self, settings.checkpoint_writer
        )  # the checkpoint being written (begin_save .. finish_save)
        # autograd context -> (rows [H], gradients [H, d]) pushed for it by a trainer's row cache
        self._pushed: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._pushed_lock = threading.Lock()
        # Per update, for the sampled TensorBoard metrics (ps_train.observe.server_metrics).
        self.counters = UpdateCounters()
        self.stale_updates = self.mode.answers_with_staleness  # async and ssp

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, shard: int, x: torch.Tensor, trainer: int = -1, step: int = -1) -> torch.Tensor:
        return self.mode.forward(self, shard, x, trainer, step)

    def run_shard(self, shard: int, x: torch.Tensor, trainer: int, step: int) -> torch.Tensor:
        """``shard``'s forward on the live parameters (``ServerShards.run``)."""
        return self.held.run(shard, x, trainer, step)

    def shard_copy(self, shard: int) -> dict[str, torch.Tensor]:
        """Private copies of ``shard``'s parameters (``ServerShards.copy``). The caller holds ``self.lock``."""
        return self.held.copy(shard)

    def run_shard_with(self, shard: int, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``shard``'s forward on ``params`` (from ``shard_copy``)."""
        return self.held.run_with(shard, params, x)

    def after_answer(self, fn: Callable[[], Any]) -> None:
        backend.after_response(fn)

    def predict(self, shard: int, x: torch.Tensor) -> torch.Tensor:
        return self.held.predict(shard, x)

    def lookup(
        self,
        rows: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        trainer: int = -1,
        step: int = -1,
        ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The vectors of a trainer's request to the tables held here (``TablePart.lookup``);
        ``ids``: the raw ids of its dynamic tables' rows."""
        tables = self._tables()
        return self.mode.lookup(
            self, lambda: tables.lookup(rows, offsets, weights, ids, step, max(trainer, 0)), trainer, step
        )

    def read_rows(
        self, rows: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None, ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``lookup`` for evaluation: no autograd, no step bookkeeping."""
        tables = self._tables()
        with self.lock:
            return tables.read(rows, offsets, weights, ids)

    def prefetch_rows(self, rows: torch.Tensor) -> None:
        """A trainer's next request will name ``rows``: the tables may bring them in now."""
        self._tables().prefetch(rows)

    def _tables(self) -> TablePart:
        if self.tables is None:
            raise RuntimeError(f"ps{self.rank} holds no embedding tables: the model is not model=dlrm")
        return self.tables

    def parameter_rrefs(self) -> list[Any]:
        rpc = backend.rpc()
        return [rpc.RRef(p) for p in self.params]

    # -- updates ----------------------------------------------------------------------------------
    def gradients(self, context_id: int) -> dict[torch.Tensor, torch.Tensor]:
        """This server's parameters' gradients in autograd context ``context_id``, with the
        table rows' gradients a trainer pushed for it (``push_gradients``) added."""
        # Taken from the context where the backend allows (rpc_core): the server's copy is
        # then the only one, freed as soon as the update is done with it.
        grads = backend.take_gradients(context_id)
        # By identity: a Parameter's __hash__ is a Python call, and the context holds no other leaves as a rule.
        mine = self._param_ids
        out: dict[torch.Tensor, torch.Tensor] = {p: g for p, g in grads.items() if id(p) in mine}
        with self._pushed_lock:
            pushed = self._pushed.pop(context_id, [])
        if pushed:
            storage = self._tables().params[
                0
            ]  # the fused storage of every table (ps_train.workloads.ctr.tables.shards)
            for rows, values in pushed:
                g = torch.sparse_coo_tensor(rows.unsqueeze(0), values, tuple(storage.shape), check_invariants=False)
                out[storage] = out[storage] + g if storage in out else g
        return out

    def push_gradients(self, context_id: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        """A trainer's gradients of table rows it read from its cache (``ps_train.workloads.ctr.tables.cache``):
        ``values`` [H, d] of its storage rows ``rows`` [H], for its autograd context
        ``context_id``; its update (sent after this returns) applies them with the rest."""
        tables = self._tables()
        if len(tables.params) != 1 or values.shape[1:] != tables.params[0].shape[1:]:
            raise ValueError(f"ps{self.rank}: pushed row gradients {tuple(values.shape)} do not fit the tables")
        with self._pushed_lock:
            self._pushed.setdefault(context_id, []).append((rows, values))

    def step(self, grads: Mapping[torch.Tensor, torch.Tensor], lr_factor: float = 1.0) -> None:
        """One optimizer step with ``grads`` at ``lr_factor`` times the configured rates. The
        caller (the mode) holds ``self.lock``."""
        if self.optimizer is None and self.tables is None:
            return
        t0 = time.perf_counter()
        # By identity, as in gradients(): a Parameter's __hash__ is a Python call per lookup.
        by_id = {id(p): g for p, g in grads.items()}
        dense_grads = False
        for p in self.dense_params:
            g = by_id.get(id(p))
            p.grad = g
            dense_grads = dense_grads or g is not None
        # A part none of whose parameters has a gradient is left alone (mode=hybrid steps
        # the tables and the dense shards apart): its optimizer counts no step.
        if self.optimizer is not None and dense_grads:
            if lr_factor == 1.0:
                self.optimizer.step()
            else:
                with scaled_lr(self.optimizer, lr_factor):
                    self.optimizer.step()
        if self.tables is not None and any(id(p) in by_id for p in self.tables.params):
            self.tables.step(grads, lr_factor)
        for p in self.dense_params:
            p.grad = None
        self.version += 1
        for i in self.updates:
            self.updates[i] += 1
        self.counters.applied(time.perf_counter() - t0)
        maybe_inject_fault(f"ps{self.rank}", self.version)  # test-only, see ps_train.faults

    @async_execution
    def update(
        self, context_id: int, trainer: int, step: int, position: dict[str, int] | None = None
    ) -> torch.futures.Future[Any]:
        """Apply trainer ``trainer``'s step-``step`` gradients (in its context ``context_id``)
        as the mode does; ``position`` (elastic, on ps0): its data position after this step."""
        return self.counted(lambda: self.mode.update(self, context_id, trainer, step, position))

    def counted(self, update: Callable[[], torch.futures.Future[Any]]) -> torch.futures.Future[Any]:
        """Run an update request (``update()``: its answer), counted as one contribution (and,
        async/ssp, its staleness: the answer's value) for the sampled metrics."""
        self.counters.contributed()  # first: the update it completes may be sampled at once
        answer = update()
        if self.stale_updates:
            counters = self.counters

            def record(f: torch.futures.Future[Any]) -> None:
                if f.done() and not _failed(f):
                    answer = f.value()  # the staleness; ssp's ps0 in the backward: with the clock's answer
                    counters.stale(self.mode.answer_staleness(answer))

            answer.add_done_callback(record)
        return answer

    @async_execution
    def applied(self, step: int) -> torch.futures.Future[Any]:
        """Resolves to this server's version once the step-``step`` update is applied here
        (sync, whose update in the backward is applied after its answer: ``SyncMode.applied``)."""
        return self.mode.applied(self, step)

    @async_execution
    def clock(self, trainer: int, completed: int) -> torch.futures.Future[Any]:
        """SSP barrier: resolves (to how far ``trainer`` is ahead of the slowest) once every
        trainer completed at least ``completed - mode.staleness`` steps."""
        return self.mode.clock(self, trainer, completed)

    def trainer_changed(self, trainer: int, joined: bool) -> None:
        """Elastic, ps0: a trainer left (its clock no longer counts) or joined."""
        self.mode.trainer_changed(self, trainer, joined)

    def release(self) -> None:
        """Elastic: trainer0 wrote the run's results; this server may leave the group."""
        self._released.set()

    def wait_released(self) -> None:
        self._released.wait()

    def finish(self, trainer: int) -> None:
        """A trainer is done: it no longer holds back the others in ssp mode."""
        self.mode.trainer_finished(self, trainer)

    # -- state ------------------------------------------------------------------------------------
    def table_counts(self) -> dict[str, float]:
        """Cumulative table counts for the sampled metrics (empty without tables)."""
        if self.tables is None:
            return {}
        st = self.tables.stats()
        out = {
            "rows_read": st["table_rows_read"],
            "rows_updated": st["table_rows_updated"],
            "rows_live": st.get("table_rows_live", 0),
        }
        for key in ("live", "created", "evicted", "admitted"):  # dynamic tables only
            if f"dynamic_rows_{key}" in st:
                out[f"dynamic_rows_{key}"] = st[f"dynamic_rows_{key}"]
        for key, value in st.get("tier", {}).items():  # a disk tier's counts (hit_rate: a fraction)
            out[f"tier_{key}"] = value
        return out

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "version": self.version,
            "updates": dict(self.updates),
            **self.mode.stats(),
            "peak_rss_bytes": peak_rss_bytes(),
            "update_seconds": self.counters.snapshot().update_seconds,
        }
        if self.tables is not None:
            out.update(self.tables.stats())
        if backend.name() == "rpc_core":
            from rpc_core import connection_stats

            conns = connection_stats()
            out["bytes_sent"] = conns.bytes_sent
            out["bytes_received"] = conns.bytes_received
            out["requests_received"] = conns.requests_received  # calls served so far (benchmarks/e2e_bench.py)
        return out

    def state_dict(self) -> dict[str, Any]:
        with self.lock:
            return self.take_state(copy_tables=True)

    def take_state(self, copy_tables: bool | None) -> dict[str, Any]:
        """This server's state; ``copy_tables`` None: without the tables. The caller holds ``self.lock``."""
        tables = None
        if self.tables is not None and copy_tables is not None:
            tables = self.tables.state_dict(copy=copy_tables)
        return {
            "shards": {i: copy.deepcopy(m.state_dict()) for i, m in self.shards.items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()) if self.optimizer else None,
            "version": self.version,
            **self.mode.state_dict(),
            "updates": dict(self.updates),
            "tables": tables,
        }

    def begin_save(self, ckpt_dir: str, base: str | None = None) -> SaveStarted:
        """Start writing this server's part of the checkpoint in folder ``ckpt_dir``
        (``ps<rank>.pt``; with tables also ``ps<rank>.rows``) as it is now; returns once that
        state is fixed, and ``finish_save`` once the files are written. The tables are
        written by a thread while updates go on (``TableServer.begin_snapshot``): only the
        rows changed since checkpoint ``base`` (a folder name) if this server counted the
        changes from there, else all. The checkpoint coordinator
        (``ps_train.checkpoint.protocol``) calls both through the server's RRef."""
        return self.checkpoints.begin(ckpt_dir, base)

    def saving(self) -> bool:
        """A checkpoint's files are still being written."""
        return self.checkpoints.saving()

    @async_execution
    def finish_save(self, ckpt_dir: str) -> torch.futures.Future[list[ShardFile]]:
        """Resolves to the files ``begin_save(ckpt_dir)`` wrote, once they are written; the
        coordinator calls it once every server's state is taken, so the updates held since
        ``begin_save`` (async/ssp) go on now."""
        return self.checkpoints.finish(ckpt_dir)

    def member_left(self, name: str) -> None:
        """Elastic: ``name`` left the group. trainer0 coordinates checkpoints: if it died
        between ``begin_save`` and ``finish_save``, the updates held for its checkpoint go on
        (that checkpoint stays incomplete)."""
        self.checkpoints.member_left(name)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.lock:
            for i, sd in state["shards"].items():
                self.shards[int(i)].load_state_dict(sd)
            if self.optimizer is not None and state.get("optimizer") is not None:
                self.optimizer.load_state_dict(state["optimizer"])
            self.version = state.get("version", 0)
            self.mode.load_state_dict(state, self.version)
            self.held.forget_eval_copies()
            self.updates = {int(k): v for k, v in state.get("updates", {}).items()} or self.updates
            if self.tables is not None:
                if state.get("tables") is None:
                    raise ValueError(
                        f"ps{self.rank}: the checkpoint holds no embedding tables; resume a model=dlrm run"
                    )
                self.tables.load_state_dict(state["tables"])


_remove_hook: Any = None


def create(settings: ServerSettings, rank: int, tables: TablePart | None = None) -> ParameterServer:
    """This process's server. On rpc_core its updates ride on the trainers' backward:
    a hook runs the mode's ``in_backward`` once a context's gradients are all here."""
    global _server, _remove_hook
    _server = ParameterServer(settings, rank, tables)
    if _remove_hook is not None:
        _remove_hook()
        _remove_hook = None
    if backend.name() == "rpc_core":
        _remove_hook = backend.dist_autograd().on_backward_done(UPDATE_IN_BACKWARD, _update_in_backward)
    return _server


def _update_in_backward(context_id: int, request: UpdateRequest) -> torch.futures.Future[Any]:
    server = local_server()
    return server.counted(lambda: server.mode.in_backward(server, context_id, request))


def _failed(f: torch.futures.Future[Any]) -> bool:
    try:
        f.value()
    except Exception:  # noqa: BLE001 - whatever failed the update, its requester sees it; not counted
        return True
    return False


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
