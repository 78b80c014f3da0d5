"""A parameter server's part of the embedding tables: the table service over one
``TableStorage`` (``ps_train.workloads.ctr.tables.storage``) holding its rows of every table.

``ps_train.roles.server.ParameterServer`` owns one ``TableServer`` (its ``TablePart``,
``ps_train.table_service``) when the model has tables (model=dlrm; the launcher builds it
with ``make_table_server``). The server's updates (``ParameterServer.update``, as its mode
applies them) treat the storage's gradient leaf (``TableStorage.handle``) like any other
parameter: they read each trainer's gradients from its autograd context and combine them
in sync mode (``mode.aggregate``); ``step`` then hands the one coalesced sparse gradient
(the touched rows, each once) to the storage, whose table optimizer (``model.table_optim``,
``ps_train.workloads.ctr.tables.optimizers``) updates only those rows.

Which storage (``make_storage``): every row in RAM at start (``FusedStorage``), or lazy rows
under an optional RAM budget with a disk tier below and optional half-precision rows
(``TieredStorage``: ``model.lazy_rows``, ``model.table_memory_budget``,
``model.table_dtype``); with dynamic tables, ``DynamicStorage`` maps their raw ids to rows
of either. The service counts rows read and updated, and takes checkpoints through the
storage (``begin_snapshot``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from torch import Tensor, nn

from ps_train.checkpoint.forked_writer import FrozenRows
from ps_train.config import CtrDataConfig, DataConfig, DLRMConfig, ModelConfig
from ps_train.table_service import TableSettings
from ps_train.workloads.ctr.tables.dynamic import DynamicCounts, DynamicSpec, DynamicTable
from ps_train.workloads.ctr.tables.dynamic_storage import DynamicStorage
from ps_train.workloads.ctr.tables.fused_storage import FusedStorage
from ps_train.workloads.ctr.tables.half_rows import TABLE_DTYPES
from ps_train.workloads.ctr.tables.optimizers import make_table_optimizer
from ps_train.workloads.ctr.tables.rows import FusedLayout
from ps_train.workloads.ctr.tables.shards import TableShards
from ps_train.workloads.ctr.tables.storage import StorageSnapshot, TableRequest, TableStorage

__all__ = ["TableServer", "make_storage", "make_table_server"]

T = TypeVar("T")

log = logging.getLogger("ps_train.server")


def _dynamic_tables(model: DLRMConfig, data: CtrDataConfig, run: TableSettings) -> dict[int, DynamicTable]:
    """The dynamic tables' slot maps on one server (table -> its slots)."""
    bags = data.max_bag_sizes()
    out: dict[int, DynamicTable] = {}
    for t in model.dynamic_tables():
        decl = model.tables[t]
        if decl.max_rows is None:
            raise ValueError(f"model.tables[{t}].max_rows: a dynamic table needs its row slots per server")
        spare = run.num_trainers * run.batch_size * bags[t]  # one step's new ids, at most
        out[t] = DynamicTable(DynamicSpec(decl.max_rows, decl.admit_after, decl.eviction, decl.ttl_steps, spare))
    return out


def make_storage(
    model: DLRMConfig, data: CtrDataConfig, run: TableSettings, rank: int, store_dir: Path | None = None
) -> TableStorage:
    """Server ``rank``'s table storage as the config asks (module docstring); ``store_dir``:
    where a disk tier keeps its store (``model.table_memory_budget``)."""
    sizes = data.sizes()
    where = f"ps{rank}"
    dynamic = _dynamic_tables(model, data, run)
    dynamic_rows = tuple(dynamic[t].spec.max_rows if t in dynamic else 0 for t in range(len(sizes)))
    layout = FusedLayout(model.table_sharding, tuple(sizes), run.num_servers, dynamic_rows if dynamic else ())
    storage: TableStorage
    if model.tiered():
        from ps_train.workloads.ctr.tables.tiered_storage import TieredStorage, TierSettings

        # The most rows one step can touch here: every trainer's every lookup, all distinct.
        step_rows = run.num_trainers * run.batch_size * sum(data.max_bag_sizes())
        settings = TierSettings.of(model, run.optim, run.seed, store_dir, min(step_rows, layout.storage_rows(rank)))
        storage = TieredStorage(layout, rank, settings, where)
    else:
        shards = TableShards(
            sizes,
            model.embedding_dim,
            model.table_sharding,
            rank,
            run.num_servers,
            run.seed,
            dynamic_rows if dynamic else (),
        )
        optimizer = make_table_optimizer(model.table_optim, [shards.weight], run.optim, model.table_lr)
        storage = FusedStorage(shards, optimizer, where)
    if dynamic:
        default = layout.default_row(rank)
        assert default is not None  # a layout with dynamic tables has one
        storage = DynamicStorage(storage, dynamic, layout.row_offsets(rank), default, run.seed, sizes, where)
    return storage


class TableServer:
    """Server ``rank``'s rows of every table (its ``TableStorage``) and the service's counts."""

    def __init__(
        self, model: DLRMConfig, data: CtrDataConfig, run: TableSettings, rank: int, store_dir: Path | None = None
    ) -> None:
        t0 = time.perf_counter()
        self.rank = rank
        self.storage = make_storage(model, data, run, rank, store_dir)
        self.params: list[nn.Parameter] = [self.storage.handle]
        # Half-precision rows travel in their dtype: the answers [P, dim] leave in it, and
        # autograd brings their gradients back in it (the trainer widens them to float32).
        self.wire_dtype = TABLE_DTYPES[model.table_dtype]
        self.rows_updated = 0  # rows the optimizer changed so far, summed over tables and steps
        self.rows_read = 0  # rows trainers looked up for training so far
        self._count_lock = threading.Lock()
        log.info(
            "ps%d: built its rows of %d tables (%s sharding, %s): %d storage rows, %.3f GB in RAM, in %.1f s",
            rank,
            len(data.sizes()),
            model.table_sharding,
            type(self.storage).__name__,
            self.storage.num_rows,
            self.nbytes() / 1e9,
            time.perf_counter() - t0,
        )

    def lookup(
        self,
        rows: Tensor,
        offsets: Tensor,
        weights: Tensor | None,
        ids: Tensor | None = None,
        step: int = -1,
        trainer: int = 0,
    ) -> Tensor:
        """Training lookup of a ``ServerRequest`` (``ps_train.workloads.ctr.tables.plan``): one
        vector per single row and pooled bag, [P, dim] in the rows' dtype (``model.table_dtype``),
        whose backward leaves the storage's sparse gradient in the caller's autograd context.
        ``ids``: the raw ids of the dynamic tables' rows (the request's negative rows, in
        order), by ``trainer`` at ``step``."""
        with self._count_lock:
            self.rows_read += len(rows)
        return self.storage.lookup(TableRequest(rows, offsets, weights, ids, step, trainer)).to(self.wire_dtype)

    def read(self, rows: Tensor, offsets: Tensor, weights: Tensor | None, ids: Tensor | None = None) -> Tensor:
        """Evaluation lookup: the same vectors, without autograd; ids without a row read zeros."""
        return self.storage.read(TableRequest(rows, offsets, weights, ids, None, 0)).to(self.wire_dtype)

    def prefetch(self, rows: Tensor) -> None:
        """A hint: a coming request names ``rows`` (storage rows; dynamic markers are skipped)."""
        self.storage.prefetch(rows)

    def dynamic_counts(self) -> DynamicCounts:
        """The dynamic tables' counters, summed over them (zeros without dynamic tables)."""
        if isinstance(self.storage, DynamicStorage):
            return self.storage.dynamic_counts()
        return DynamicCounts(0, 0, 0, 0)

    def step(self, grads: Mapping[Tensor, Tensor], lr_factor: float = 1.0) -> None:
        """Apply the optimizer, at ``lr_factor`` times its rate, to the rows ``grads`` (the
        trainers' sparse gradients, by table leaf) name; the caller holds the server's lock."""
        grad = grads.get(self.storage.handle)
        if grad is None:
            return
        # Duplicate indices (one entry per trainer in sync mode) are one row.
        self.rows_updated += self.storage.step(grad.coalesce(), lr_factor)

    def begin_snapshot(self, name: str, base: str | None) -> StorageSnapshot:
        """Freeze the tables for checkpoint ``name``: the rows changed since checkpoint
        ``base`` if that is the one this server counted changes from, else all rows. The
        caller holds the server's lock (no update runs) and then writes the snapshot
        (``write``) while updates go on, and calls ``end_snapshot``."""
        snapshot = self.storage.begin_snapshot(name, base)
        snapshot.state["rows_updated"] = self.rows_updated
        return snapshot

    @property
    def forks_writer(self) -> bool:
        """Whether a forked writer may write these tables (``TablePart.forks_writer``)."""
        return self.storage.forks_writer

    def freeze_rows(self, name: str, base: str | None, take: Callable[[FrozenRows], T]) -> T:
        """``TablePart.freeze_rows``: the storage's live rows handed to ``take`` (which forks
        a writer) while nothing can change them; no copy-on-write here."""

        def counted(rows: FrozenRows) -> T:
            rows.state["rows_updated"] = self.rows_updated
            return take(rows)

        return self.storage.freeze_rows(name, base, counted)

    def end_snapshot(self, written: bool) -> None:
        """The snapshot's files are written (``written``), or failed: then the rows changed
        since the previous checkpoint are no longer known, and the next checkpoint is full."""
        self.storage.end_snapshot(written)

    def nbytes(self) -> int:
        """Bytes of table values held in RAM (not counting optimizer state)."""
        return int(self.storage.counters()["table_bytes"])

    def stats(self) -> dict[str, Any]:
        return {"table_rows_updated": self.rows_updated, "table_rows_read": self.rows_read, **self.storage.counters()}

    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        """The rows (``weights``: each table's) and optimizer state; ``copy=False``: the live
        tensors themselves (the caller keeps updates off while it uses them)."""
        return {**self.storage.state_dict(copy), "rows_updated": self.rows_updated}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``state``: a ``state_dict``, or a checkpoint's table entry (``begin_snapshot``'s
        ``state``) with ``rows_files``, its chain of rows files, full one first."""
        self.storage.load_state(state)
        self.rows_updated = int(state.get("rows_updated", 0))

    def close(self) -> None:
        self.storage.close()


def make_table_server(
    model: ModelConfig, data: DataConfig, run: TableSettings, rank: int, run_dir: str | None = None
) -> TableServer | None:
    """The tables of server ``rank`` if the model has any (model=dlrm), else None; a disk
    tier keeps its store under ``run_dir``/tables."""
    if isinstance(model, DLRMConfig) and isinstance(data, CtrDataConfig):
        store = Path(run_dir) / "tables" if run_dir is not None else None
        return TableServer(model, data, run, rank, store)
    return None
