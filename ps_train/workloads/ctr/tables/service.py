"""A parameter server's part of the embedding tables: its rows of every table, in one storage
(``TableShards``), and the sparse optimizer that updates them.

``ps_train.roles.server.ParameterServer`` owns one ``TableServer`` (its ``TablePart``,
``ps_train.table_service``) when
the model has tables (model=dlrm; the launcher builds it with ``make_table_server``). The
server's updates (``ParameterServer.update``, as its mode applies them) treat the table
weights like any other parameter: they read each trainer's gradients from its autograd
context and combine them in sync mode (``mode.aggregate``); ``step`` then hands them to the
table optimizer (``model.table_optim``, ``ps_train.workloads.ctr.tables.optimizers``). The gradient is sparse
(``TableShards.lookup``'s backward: the touched rows of the storage, each once), so a step
is one coalesce and one optimizer step over the rows trainers used, whatever the number of
tables, and the optimizer updates only those rows.

Dynamic tables (``model.tables[i].kind=dynamic``): their ids come as raw ids, each request
row of such a table being a marker ``-(1 + t)``; ``_resolve`` turns them into slots of the
storage (``ps_train.workloads.ctr.tables.dynamic``: admission, eviction), creating rows with
``dynamic_init_rows`` and fresh optimizer state, or into the default zero row, whose
gradients ``step`` drops.

Checkpoints (``begin_snapshot``) do not stop the updates: every update marks the rows it
changes, and a checkpoint freezes the rows (all, or those changed since the previous
checkpoint) copy-on-write by blocks while a thread writes them (``ps_train.workloads.ctr.tables.snapshot``).
"""

from __future__ import annotations

import copy as copy_module
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ps_train.checkpoint.files import ShardFile
from ps_train.checkpoint.rows_file import RowsHeader, apply_rows_file, write_rows_file
from ps_train.config import Config, CtrDataConfig, DLRMConfig
from ps_train.workloads.ctr.tables.dynamic import DynamicCounts, DynamicSpec, DynamicTable
from ps_train.workloads.ctr.tables.optimizers import make_table_optimizer
from ps_train.workloads.ctr.tables.rows import dynamic_init_rows
from ps_train.workloads.ctr.tables.shards import TableShards
from ps_train.workloads.ctr.tables.snapshot import RowSnapshot

__all__ = ["TableServer", "TableSnapshot", "make_table_server"]


@dataclass
class TableSnapshot:
    """A checkpoint of a server's tables being written: ``differential`` (the rows changed
    since checkpoint ``base``) or full; ``state`` goes into the server's ``.pt`` file, the
    rows into ``ps<r>.rows`` (``write``)."""

    name: str  # the checkpoint folder's name
    base: str | None  # the checkpoint a differential one builds on
    rows: RowSnapshot
    header: RowsHeader
    state: dict[str, Any]  # optimizer scalars, counters, the rows file's name

    @property
    def differential(self) -> bool:
        return self.base is not None

    @property
    def row_count(self) -> int:
        """Rows the file holds."""
        return self.rows.rows

    @property
    def rows_copied_aside(self) -> int:
        """Rows updates copied aside before the writer got to them, so far."""
        return self.rows.rows_copied_aside

    def write(self, ckpt_dir: str, shard_name: str) -> ShardFile:
        file = f"{shard_name}.rows"
        size, digest = write_rows_file(Path(ckpt_dir) / file, self.header, self.rows.chunks())
        return ShardFile(f"{shard_name}.rows", file, size, digest)


log = logging.getLogger("ps_train.server")


class TableServer:
    """Server ``rank``'s rows of every table (``TableShards``) and their optimizer."""

    def __init__(self, model: DLRMConfig, data: CtrDataConfig, cfg: Config, rank: int) -> None:
        t0 = time.perf_counter()
        sizes = data.sizes()
        bags = data.max_bag_sizes()
        self.dynamic: dict[int, DynamicTable] = {}  # table -> its slots here (dynamic tables only)
        for t in model.dynamic_tables():
            decl = model.tables[t]
            assert decl.max_rows is not None  # validated
            spare = cfg.cluster.num_trainers * cfg.train.batch_size * bags[t]  # one step's new ids, at most
            self.dynamic[t] = DynamicTable(
                DynamicSpec(decl.max_rows, decl.admit_after, decl.eviction, decl.ttl_steps, spare)
            )
        dynamic_rows = [self.dynamic[t].spec.max_rows if t in self.dynamic else 0 for t in range(len(sizes))]
        self.shards = TableShards(
            sizes,
            model.embedding_dim,
            model.table_sharding,
            rank,
            cfg.cluster.num_servers,
            cfg.seed,
            dynamic_rows if self.dynamic else (),
        )
        self.seed, self.sizes, self.rank = cfg.seed, sizes, rank
        self.default_row = self.shards.layout.default_row(rank)
        self._dynamic_lock = threading.Lock()  # lookups of several trainers run at once
        self.clock = 0  # the latest training lookup's step (dynamic tables advance with it)
        log.info(
            "ps%d: built its rows of %d tables (%s sharding): %d rows, %.3f GB, in %.1f s",
            rank,
            self.shards.num_tables,
            model.table_sharding,
            self.shards.weight.shape[0],
            self.nbytes() / 1e9,
            time.perf_counter() - t0,
        )
        self.params: list[nn.Parameter] = [self.shards.weight]
        self.optimizer = make_table_optimizer(model.table_optim, self.params, cfg.optim, model.table_lr)
        self.rows_updated = 0  # rows the optimizer changed so far, summed over tables and steps
        self.rows_read = 0  # rows trainers looked up for training so far
        # Rows changed since the checkpoint ``self.since`` (None: since no complete one; the
        # next checkpoint is then full), one byte per row; and the snapshot being written.
        self.changed = torch.zeros(self.shards.weight.shape[0], dtype=torch.bool)
        self.since: str | None = None
        self.snapshot: TableSnapshot | None = None
        # Rows updated at least once by this process (server/rows_live in TensorBoard): 1 byte per row.
        self._row_seen = torch.zeros(self.shards.weight.shape[0], dtype=torch.bool)
        self.rows_live = 0

    def lookup(
        self,
        rows: Tensor,
        offsets: Tensor,
        weights: Tensor | None,
        ids: Tensor | None = None,
        step: int = -1,
        trainer: int = 0,
    ) -> Tensor:
        """Training lookup of a ``ServerRequest`` (``ps_train.workloads.ctr.tables.plan``): one vector per single
        row and pooled bag, [P, dim], whose backward leaves the storage's sparse gradient in
        the caller's autograd context. ``ids``: the raw ids of the dynamic tables' rows (the
        request's negative rows, in order), by ``trainer`` at ``step``."""
        rows = self._resolve(rows, ids, step, trainer)
        self.rows_read += len(rows)
        return self.shards.lookup(rows, offsets, weights)

    def read(self, rows: Tensor, offsets: Tensor, weights: Tensor | None, ids: Tensor | None = None) -> Tensor:
        """Evaluation lookup: the same vectors, without autograd; ids without a row read zeros."""
        return self.shards.read(self._resolve(rows, ids, None, 0), offsets, weights)

    def _resolve(self, rows: Tensor, ids: Tensor | None, step: int | None, trainer: int) -> Tensor:
        """``rows`` with each dynamic marker ``-(1 + t)`` replaced by its id's storage row (or
        the default row); ``step`` None: an evaluation read, which creates nothing."""
        marked = rows < 0
        n = int(marked.sum())
        if n == 0 and ids is None:
            return rows
        if ids is None or ids.dtype != torch.int64 or len(ids) != n:
            raise ValueError(
                f"ps{self.rank}: a request with {n} dynamic-table rows needs as many int64 ids, got "
                f"{None if ids is None else (ids.dtype, tuple(ids.shape))}"
            )
        tables = -rows[marked] - 1  # [n]
        found = torch.full((n,), -1, dtype=torch.int64)  # storage rows
        with self._dynamic_lock:
            if step is not None and step > self.clock:
                for table in self.dynamic.values():
                    table.advance(step)
                self.clock = step
            for t in torch.unique(tables).tolist():
                if t not in self.dynamic:
                    raise ValueError(f"ps{self.rank}: table {t} is not a dynamic table here")
                mine = tables == t
                base = self.shards.row_offsets[t]
                dyn = self.dynamic[t]
                if step is None:
                    local = dyn.read(ids[mine])
                else:
                    res = dyn.lookup(ids[mine], step, trainer)
                    local = res.slots
                    if len(res.created_slots):
                        self._create(t, res.created_slots + base, res.created_ids)
                found[mine] = torch.where(local >= 0, local + base, int(self.default_row or 0))
        out = rows.clone()
        out[marked] = found
        return out

    def _create(self, t: int, rows: Tensor, ids: Tensor) -> None:
        """New rows of dynamic table ``t``: storage rows ``rows`` [c] for ids ``ids`` [c] get
        their initial values and fresh optimizer state (a slot may have held another id)."""
        order = torch.argsort(rows)
        rows, ids = rows[order], ids[order]
        snapshot = self.snapshot
        if snapshot is not None:  # a checkpoint being written holds these slots as they were
            snapshot.rows.before_update(rows)
        with torch.no_grad():
            self.shards.weight.index_copy_(
                0, rows, dynamic_init_rows(self.seed, t, self.sizes[t], self.shards.dim, ids)
            )
        self.optimizer.reset_rows(rows)
        self.changed[rows] = True

    def dynamic_counts(self) -> DynamicCounts:
        """The dynamic tables' counters, summed over them."""
        c = [d.counters() for d in self.dynamic.values()]
        return DynamicCounts(*(sum(x[i] for x in c) for i in range(4)))

    def step(self, grads: Mapping[Tensor, Tensor], lr_factor: float = 1.0) -> None:
        """Apply the optimizer, at ``lr_factor`` times its rate, to the rows ``grads`` (the
        trainers' sparse gradients, by table weight) name; the caller holds the server's lock."""
        coalesced: list[Tensor | None] = []
        for p in self.params:
            grad = grads.get(p)
            if grad is not None:
                # Duplicate indices (one entry per trainer in sync mode) are one row.
                grad = grad.coalesce()
                if self.default_row is not None:
                    grad = _without_row(grad, self.default_row)  # ids without a row: their gradient goes
                self.rows_updated += grad._nnz()
                rows = grad.indices()[0]  # [U]: the storage rows this step changes
                snapshot = self.snapshot
                if snapshot is not None:
                    snapshot.rows.before_update(rows)
                self.changed[rows] = True
                self.rows_live += int((~self._row_seen[rows]).sum())
                self._row_seen[rows] = True
            coalesced.append(grad)
        self.optimizer.step(coalesced, lr_factor)

    def columns(self) -> dict[str, Tensor]:
        """The live per-row tensors a checkpoint holds: the rows and the optimizer's
        per-row state, each [rows, ...]."""
        return {"weight": self.shards.weight.detach(), **self.optimizer.row_state()}

    def begin_snapshot(self, name: str, base: str | None) -> TableSnapshot:
        """Freeze the tables for checkpoint ``name``: the rows changed since checkpoint
        ``base`` if that is the one this server counted changes from, else all rows. The
        caller holds the server's lock (no update runs) and then writes the snapshot
        (``TableSnapshot.write``) while updates go on, and calls ``end_snapshot``."""
        if self.snapshot is not None:
            raise RuntimeError(f"checkpoint {name}: the tables of {self.snapshot.name} are still being written")
        with self._dynamic_lock:  # no lookup creates rows while the tables are frozen
            return self._freeze(name, base)

    def _freeze(self, name: str, base: str | None) -> TableSnapshot:
        differential = base is not None and base == self.since
        changed, self.changed = self.changed, torch.zeros_like(self.changed)
        columns = self.columns()
        self.snapshot = TableSnapshot(
            name,
            base if differential else None,
            RowSnapshot(columns, changed if differential else None, hot=changed),
            RowsHeader.of(columns, full=not differential),
            {
                "format": "rows",
                "base": base if differential else None,
                "optimizer": self.optimizer.scalar_state(),
                "rows_updated": self.rows_updated,
                **self._dynamic_state(),
            },
        )
        self.since = name
        return self.snapshot

    def end_snapshot(self, written: bool) -> None:
        """The snapshot's files are written (``written``), or failed: then the rows changed
        since the previous checkpoint are no longer known, and the next checkpoint is full."""
        self.snapshot = None
        if not written:
            self.since = None

    def nbytes(self) -> int:
        return self.shards.nbytes()

    def stats(self) -> dict[str, int]:
        out = {
            "table_bytes": self.nbytes(),
            "table_rows_updated": self.rows_updated,
            "table_rows_read": self.rows_read,
            "table_rows_live": self.rows_live,
        }
        if self.dynamic:
            c = self.dynamic_counts()
            out.update(
                dynamic_rows_live=c.live,
                dynamic_rows_created=c.created,
                dynamic_rows_evicted=c.evicted,
                dynamic_rows_admitted=c.admitted,
            )
        return out

    def _dynamic_state(self) -> dict[str, Any]:
        """The dynamic tables' slot maps, counts and clock (a copy), for a checkpoint."""
        if not self.dynamic:
            return {}
        return {"clock": self.clock, "dynamic": {t: d.state_dict() for t, d in self.dynamic.items()}}

    def _load_dynamic(self, state: dict[str, Any]) -> None:
        if not self.dynamic:
            return
        saved = state.get("dynamic")
        if saved is None or sorted(saved) != sorted(self.dynamic):
            raise ValueError(
                f"ps{self.rank}: the checkpoint's dynamic tables {None if saved is None else sorted(saved)} "
                f"are not this run's {sorted(self.dynamic)}; resume with the same model.tables"
            )
        for t, d in self.dynamic.items():
            d.load_state_dict(saved[t])
        self.clock = int(state["clock"])

    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        """The rows (``weights``: each table's, views of the one storage) and optimizer state;
        ``copy=False``: the live tensors themselves (the caller keeps updates off while it
        uses them), for tables too large to copy."""
        weights = [self.shards.table(t) for t in range(self.shards.num_tables)]
        opt = self.optimizer.state_dict()
        if copy:
            weights, opt = [w.clone() for w in weights], copy_module.deepcopy(opt)
        with self._dynamic_lock:
            dynamic = self._dynamic_state()
        return {"weights": weights, "optimizer": opt, "rows_updated": self.rows_updated, **dynamic}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``state``: a ``state_dict``, or a checkpoint's table entry (``begin_snapshot``'s
        ``state``) with ``rows_files``, its chain of rows files, full one first."""
        self.changed.zero_()
        self.since = None
        if state.get("format") == "rows":
            self._load_rows(state["optimizer"], state["rows_files"])
            self.rows_updated = int(state.get("rows_updated", 0))
            self._load_dynamic(state)
            return
        weights = state["weights"]
        shapes = [tuple(w.shape) for w in weights]
        mine = [tuple(self.shards.table(t).shape) for t in range(self.shards.num_tables)]
        if shapes != mine:
            raise ValueError(
                f"the checkpoint's table shards {shapes} do not match this "
                f"server's {mine}; resume with the same tables, "
                "model.embedding_dim, model.table_sharding and cluster.num_servers"
            )
        with torch.no_grad():
            for t, w in enumerate(weights):
                self.shards.table(t).copy_(w)
        self.optimizer.load_state_dict(state["optimizer"])
        self.rows_updated = int(state.get("rows_updated", 0))
        self._load_dynamic(state)

    def _load_rows(self, optimizer: dict[str, Any], files: Sequence[str]) -> None:
        if not files:
            raise ValueError("a table checkpoint needs at least one rows file")
        self.optimizer.load_scalar_state(optimizer)
        columns = self.columns()
        for i, path in enumerate(files):
            apply_rows_file(path, columns, expect_full=i == 0)


def _without_row(grad: Tensor, row: int) -> Tensor:
    """A coalesced sparse gradient without row ``row``'s entry."""
    rows = grad.indices()[0]
    keep = rows != row
    if bool(keep.all()):
        return grad
    return torch.sparse_coo_tensor(
        rows[keep].unsqueeze(0), grad.values()[keep], tuple(grad.shape), is_coalesced=True, check_invariants=False
    )


def make_table_server(cfg: Config, rank: int) -> TableServer | None:
    """The tables of server ``rank`` if the model has any (model=dlrm), else None."""
    if isinstance(cfg.model, DLRMConfig) and isinstance(cfg.data, CtrDataConfig):
        return TableServer(cfg.model, cfg.data, cfg, rank)
    return None
