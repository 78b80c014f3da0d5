"""Lazy rows, a disk tier under a RAM budget, half-precision rows: the ``TableStorage`` for
tables larger than memory (``model.lazy_rows``, ``model.table_memory_budget``,
``model.table_dtype``).

- **Lazy rows.** Nothing is allocated per row at start but a 4-byte slot index; a row is
  created when a batch first touches it, at ``FusedLayout.initial_rows`` (a hash of (seed,
  table, row): the value the eager storage starts from, whichever server, tier or order
  creates it). A row never updated is never written anywhere.
- **Disk tier.** With a budget, the RAM pool (``ps_train.workloads.ctr.tables.row_pool``) holds as many rows
  (values and optimizer state) as the budget pays for, the least recently used leave for
  the store (``ps_train.workloads.ctr.tables.row_store``, RocksDB under ``<run>/tables/ps<r>``), dirty ones
  written back, and come back bit-identical when touched again. ``prefetch`` (the trainer
  names its next batch's rows while the current step runs) brings rows in on a background
  thread; a request never depends on it.
- **Half precision.** Rows in RAM and on disk in float16 or bfloat16, updated in float32
  and stochastically rounded (``ps_train.workloads.ctr.tables.half_rows``); optimizer state float32.

Lookups gather the request's distinct rows into a float32 block and pool it; the backward
leaves the usual sparse gradient, named by storage rows, on ``handle`` (a stride-0 tensor of
the address space's shape that costs nothing). Checkpoints write the rows that differ from
their initial values into a lazy rows file: with a tier, the dirty rows are flushed and the
store's own checkpoint (RocksDB's hard links, milliseconds) is copied out by the writer
while training goes on; without one, the touched rows are copied under the lock.
"""

from __future__ import annotations

import queue
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ps_train.checkpoint.files import ShardFile
from ps_train.checkpoint.rows_file import RowChunk, RowsHeader, read_rows_header, rows_file_chunks, write_rows_file
from ps_train.config import DLRMConfig, OptimConfig
from ps_train.workloads.ctr.tables.half_rows import TABLE_DTYPES, HalfRows
from ps_train.workloads.ctr.tables.optimizers import RowsOptimizer, RowTarget, make_table_optimizer
from ps_train.workloads.ctr.tables.row_pool import BudgetError, RowPool, pack_rows, unpack_rows
from ps_train.workloads.ctr.tables.row_store import STORE_RAM_BYTES, RowStore, iter_store
from ps_train.workloads.ctr.tables.rows import FusedLayout
from ps_train.workloads.ctr.tables.shards import rows_gradient
from ps_train.workloads.ctr.tables.storage import StorageSnapshot, TableRequest, TableStorage, check_request

__all__ = ["TierSettings", "TieredStorage"]

_SLOT_OVERHEAD = 26  # bytes per RAM slot besides the row: its row, last use, flags, free-list entry


@dataclass(frozen=True)
class TierSettings:
    """What ``TieredStorage`` takes of the config."""

    dim: int
    dtype: str  # model.table_dtype
    optimizer: str  # model.table_optim
    optim: OptimConfig
    lr: float | None  # model.table_lr
    seed: int
    budget: int | None  # bytes per server (None: no disk tier)
    budget_text: str | None  # model.table_memory_budget as written
    store_dir: Path | None  # where the disk tier's stores go (<run>/tables)
    step_rows: int  # the most rows one step can touch on a server (all trainers' lookups)

    @staticmethod
    def of(model: DLRMConfig, optim: OptimConfig, seed: int, store_dir: Path | None, step_rows: int) -> TierSettings:
        return TierSettings(
            model.embedding_dim,
            model.table_dtype,
            model.table_optim,
            optim,
            model.table_lr,
            seed,
            model.memory_budget_bytes(),
            model.table_memory_budget,
            store_dir,
            step_rows,
        )


class _CompactLookup(torch.autograd.Function):
    """``embedding_bag`` over a request's distinct rows ``compact`` [U, dim]; its backward is
    the sparse gradient of the whole storage (``uniq`` [U]: those rows' storage rows)."""

    @staticmethod
    def forward(
        ctx: Any,
        handle: Tensor,
        compact: Tensor,
        inverse: Tensor,
        offsets: Tensor,
        weights: Tensor | None,
        uniq: Tensor,
    ) -> Tensor:
        ctx.save_for_backward(inverse, offsets, weights, uniq)
        ctx.shape = tuple(handle.shape)
        return F.embedding_bag(inverse, compact, offsets, mode="sum", per_sample_weights=weights)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        inverse, offsets, weights, uniq = ctx.saved_tensors
        g = rows_gradient(inverse, offsets, weights, grad.contiguous(), len(uniq))
        rows = uniq[g.indices()[0]].unsqueeze(0)  # ascending, as uniq is
        full = torch.sparse_coo_tensor(rows, g.values(), ctx.shape, is_coalesced=True, check_invariants=False)
        return full, None, None, None, None, None


class TieredStorage(TableStorage):
    """Server ``server``'s rows of ``layout`` (module docstring)."""

    def __init__(
        self, layout: FusedLayout, server: int, settings: TierSettings, where: str, start_rows: int = 1024
    ) -> None:
        """``start_rows``: the RAM pool's first size without a budget (it doubles as rows arrive)."""
        self.layout, self.server, self.settings, self.where = layout, server, settings, where
        self.start_rows = start_rows
        self.dim, self.num_rows = settings.dim, layout.storage_rows(server)
        self.dtype = TABLE_DTYPES[settings.dtype]
        self._handle = nn.Parameter(torch.zeros(1, self.dim).expand(self.num_rows, self.dim))
        carrier = [nn.Parameter(torch.zeros(0, self.dim))]  # the state's shape; rows come with resize_rows
        optimizer = make_table_optimizer(settings.optimizer, carrier, settings.optim, settings.lr)
        if not isinstance(optimizer, RowsOptimizer):
            raise ValueError(f"model.table_optim={settings.optimizer}: lazy and tiered tables need a rows optimizer")
        self.optimizer = optimizer
        self.generator = torch.Generator()  # stochastic rounding's, seeded per step
        self.lock = threading.RLock()
        # Rows changed since the last ``take_changed``: one bit per storage row ([ceil(R / 8)]
        # uint8, 12.8 MB for 102 M rows), fixed. A list of each step's row numbers grew by a
        # step's rows x 8 bytes every step (0.8 MB at preset=dlrmv2) until a checkpoint.
        self.changed = torch.zeros((self.num_rows + 7) // 8, dtype=torch.uint8)
        self.rows_live = 0
        self.store: RowStore | None = None
        capacity = None
        if settings.budget is not None:
            # What a row costs, from a pool of one row: a pool of the whole address space would
            # allocate (and fill) another 4-byte index of every row just to be dropped.
            probe = self._new_pool(1, num_rows=1)
            capacity = self._capacity(settings.budget, probe.row_bytes())
            if settings.store_dir is None:
                raise ValueError(f"{where}: model.table_memory_budget needs a run folder for its disk store")
            self.store = RowStore(settings.store_dir / where, _store_layout(self.num_rows, probe), where)
        self.pool = self._new_pool(capacity)
        self._prefetches: queue.Queue[Tensor | None] = queue.Queue(maxsize=4)
        self._prefetcher: threading.Thread | None = None

    def _new_pool(self, capacity: int | None, num_rows: int | None = None) -> RowPool:
        init = lambda rows: self.layout.initial_rows(self.server, self.settings.seed, self.dim, rows)  # noqa: E731
        return RowPool(
            self.num_rows if num_rows is None else num_rows, self.dim, self.dtype, self.optimizer, init,
            capacity, self.store, self.where, self.settings.budget_text, self.start_rows,
        )  # fmt: skip

    def _capacity(self, budget: int, row_bytes: int) -> int:
        """Rows the budget holds after the slot index and RocksDB's caches; a clear error
        below one step's rows."""
        per_row = row_bytes + _SLOT_OVERHEAD
        need = self.settings.step_rows
        rows_share = budget - 4 * self.num_rows
        # RocksDB's block cache and memtables (STORE_RAM_BYTES, 48 MiB) come out of the budget
        # when it holds them besides one step's rows; a smaller budget (a toy run's, a test's)
        # leaves them outside, as its rows would not fit otherwise.
        if rows_share - STORE_RAM_BYTES >= need * per_row:
            rows_share -= STORE_RAM_BYTES
        capacity = rows_share // per_row
        if capacity < need:
            minimum = 4 * self.num_rows + need * per_row
            raise BudgetError(
                f"{self.where}: model.table_memory_budget={self.settings.budget_text} ({budget:,} bytes) is too small: "
                f"one step can touch {need:,} rows of {per_row} bytes here, besides the 4-byte index of its "
                f"{self.num_rows:,} rows; set it to at least {minimum / 1e6:.1f}MB"
            )
        return int(capacity)

    @property
    def handle(self) -> nn.Parameter:
        return self._handle

    # -- lookups --------------------------------------------------------------------------------
    def lookup(self, req: TableRequest) -> Tensor:
        full, w = check_request(req, self.num_rows, self.where)
        uniq, inverse = torch.unique(req.rows, return_inverse=True)
        with self.lock:
            slots = self.pool.ensure(uniq)  # first: bringing rows in may grow the pool's tensors
            compact = self.pool.values.index_select(0, slots).float()  # [U, dim]
        return _CompactLookup.apply(self._handle, compact, inverse, full, w, uniq)

    def read(self, req: TableRequest) -> Tensor:
        full, w = check_request(req, self.num_rows, self.where)
        uniq, inverse = torch.unique(req.rows, return_inverse=True)
        with self.lock:
            compact = self.pool.peek(uniq)
        return F.embedding_bag(inverse, compact, full, mode="sum", per_sample_weights=w)

    def prefetch(self, rows: Tensor) -> None:
        if self.store is None:
            return  # every row is in RAM or created in no time
        if self._prefetcher is None:
            self._prefetcher = threading.Thread(target=self._prefetch_loop, name=f"{self.where}-prefetch", daemon=True)
            self._prefetcher.start()
        try:
            self._prefetches.put_nowait(rows)
        except queue.Full:
            pass  # behind already: the lookups bring their rows in themselves

    def _prefetch_loop(self) -> None:
        while (rows := self._prefetches.get()) is not None:
            uniq = torch.unique(rows)
            with self.lock:
                away = uniq[self.pool.slot_of[uniq] < 0]
                if len(away) and (self.pool.capacity is None or len(away) <= self.pool.capacity // 2):
                    self.pool.ensure(away, count=False)

    # -- updates --------------------------------------------------------------------------------
    def _target(self) -> RowTarget:
        if self.dtype == torch.float32:
            return self.pool.values
        # Seeded by (seed, server, step): a resumed run rounds as the uninterrupted one.
        self.generator.manual_seed((self.settings.seed * 1_000_003 + self.server) * 1_000_033 + self.optimizer.steps)
        return HalfRows(self.pool.values, self.generator)

    def step(self, grad: Tensor, lr_factor: float = 1.0) -> int:
        rows = grad.indices()[0]
        with self.lock:
            slots = self.pool.ensure(rows)
            self.rows_live += int((~self.pool.touched[slots]).sum())
            self.optimizer.step_rows(self._target(), slots, grad.values(), lr_factor)
            self._mark(rows if grad.is_coalesced() else torch.unique(rows), slots)
        return len(rows)

    def _mark(self, rows: Tensor, slots: Tensor) -> None:
        """``rows``: distinct (a coalesced gradient's), so that their new bits add as an OR."""
        self.pool.dirty[slots] = True
        self.pool.touched[slots] = True
        byte, bit = rows // 8, (rows % 8).to(torch.uint8)
        mask = torch.ones_like(bit) << bit
        new = (self.changed[byte] & mask) == 0
        self.changed.index_add_(0, byte[new], mask[new])

    def assign(self, rows: Tensor, values: Tensor) -> None:
        with self.lock, torch.no_grad():
            slots = self.pool.ensure(rows)
            self.pool.values.index_copy_(0, slots, values.to(self.dtype))
            for s in self.optimizer.row_state().values():
                s.index_fill_(0, slots, 0)
            self._mark(torch.unique(rows), slots)

    def take_changed(self) -> Tensor:
        with self.lock:
            changed, self.changed = self.changed, torch.zeros_like(self.changed)
        found = []
        bits = torch.ones(8, dtype=torch.uint8) << torch.arange(8, dtype=torch.uint8)
        for start in range(0, len(changed), 1 << 20):  # 1 M bytes at a time: an [8 M] bool transient
            chunk = changed[start : start + (1 << 20)]
            hit = (chunk.unsqueeze(1) & bits) != 0  # [bytes, 8]: row (start + i) * 8 + j
            found.append(torch.nonzero(hit.flatten()).squeeze(1) + start * 8)
        return torch.cat(found) if found else torch.zeros(0, dtype=torch.int64)

    # -- checkpoints ----------------------------------------------------------------------------
    def _header(self) -> RowsHeader:
        cols = tuple((n, str(d).removeprefix("torch."), s) for n, d, s in self.pool.column_specs())
        return RowsHeader(self.num_rows, True, cols, lazy=True)

    def begin_snapshot(self, name: str, base: str | None) -> StorageSnapshot:
        del base  # every checkpoint holds every touched row
        with self.lock:
            self.changed.zero_()
            state = {"format": "lazy_rows", "base": None, "optimizer": self.optimizer.scalar_state()}
            if self.store is not None:
                self.pool.flush()  # every row that differs from its start is in the store now
                frozen = self.store.path.parent / f"{self.where}.checkpoint-{name}"
                shutil.rmtree(frozen, ignore_errors=True)
                self.store.checkpoint(frozen)
                return _LazySnapshot(self._header(), state, self.pool.column_specs(), frozen, None)
            slots = torch.nonzero(self.pool.touched).squeeze(1)
            rows = self.pool.slot_row[slots]
            order = torch.argsort(rows)
            chunk = RowChunk(rows[order], tuple(c.index_select(0, slots[order]) for c in self.pool.columns()))
            return _LazySnapshot(self._header(), state, self.pool.column_specs(), None, chunk)

    def end_snapshot(self, written: bool) -> None:
        del written  # nothing to forget: the next checkpoint is complete anyway

    def load_state(self, state: dict[str, Any]) -> None:
        if state.get("format") != "lazy_rows":
            raise ValueError(
                f"{self.where}: the checkpoint's tables were saved by the eager storage; resume with the same "
                "model.lazy_rows, model.table_memory_budget and model.table_dtype"
            )
        files = state["rows_files"]
        header = read_rows_header(files[-1])
        if header != self._header():
            raise ValueError(
                f"{self.where}: the checkpoint's rows ({header.num_rows} rows of {list(header.columns)}) do not fit "
                f"this server's ({self.num_rows} of {list(self._header().columns)}); resume with the same tables, "
                "model.embedding_dim, model.table_optim, model.table_dtype and cluster.num_servers"
            )
        with self.lock:
            self.optimizer.load_scalar_state(state["optimizer"])
            if self.store is not None:
                self.store.clear()
            self.pool = self._new_pool(self.pool.capacity)
            self.rows_live = 0
            for chunk in rows_file_chunks(files[-1]):
                if self.store is not None:
                    self.store.put(chunk.rows.tolist(), pack_rows(list(chunk.values)))
                else:
                    slots = self.pool.ensure(chunk.rows, count=False)
                    for c, v in zip(self.pool.columns(), chunk.values, strict=True):
                        c.index_copy_(0, slots, v)
                    self.pool.touched[slots] = True
                self.rows_live += len(chunk.rows)

    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        del copy
        raise NotImplementedError(f"{self.where}: lazy tables are saved by checkpoints (begin_snapshot) only")

    # -- metrics --------------------------------------------------------------------------------
    def counters(self) -> dict[str, Any]:
        with self.lock:
            c = self.pool.counts
            out: dict[str, Any] = {
                "table_bytes": self.pool.values.numel() * self.pool.values.element_size(),
                "table_rows_live": self.rows_live,
            }
            tier: dict[str, Any] = {
                "rows_in_ram": self.pool.held(),
                "ram_bytes": self.pool.nbytes() + 4 * self.num_rows,
                "rows_created": c.created,
                "hits": c.hits,
                "misses": c.misses,
                "hit_rate": c.hits / max(1, c.hits + c.misses),
            }
            if self.store is not None:
                tier.update(
                    rows_evicted=c.evicted,
                    rows_read_back=c.read_back,
                    rows_written=c.written,
                    bytes_written=self.store.bytes_written,
                    bytes_read=self.store.bytes_read,
                    budget_bytes=self.settings.budget,
                    **{f"store_{k}_bytes": v for k, v in self.store.memory().items()},
                )
            out["tier"] = tier
        return out

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetches.put(None)
            self._prefetcher.join()
        if self.store is not None:
            self.store.close()


def _store_layout(num_rows: int, pool: RowPool) -> dict[str, Any]:
    """What a row's stored bytes hold (recorded with the store)."""
    specs = pool.column_specs()
    return {"rows": num_rows, "columns": [[n, str(d).removeprefix("torch."), list(s)] for n, d, s in specs]}


class _LazySnapshot:
    """A checkpoint of lazy tables being written: from a frozen copy of the store (``frozen``,
    deleted once written) or from rows copied already (``chunk``)."""

    def __init__(
        self,
        header: RowsHeader,
        state: dict[str, Any],
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
        frozen: Path | None,
        chunk: RowChunk | None,
    ) -> None:
        self.header, self._state, self.specs, self.frozen, self.chunk = header, state, specs, frozen, chunk
        self.rows_written = 0

    @property
    def base(self) -> str | None:
        return None

    @property
    def state(self) -> dict[str, Any]:
        return self._state

    @property
    def row_count(self) -> int:
        return self.rows_written

    @property
    def rows_copied_aside(self) -> int:
        return 0

    def _chunks(self) -> Iterator[RowChunk]:
        if self.chunk is not None:
            self.rows_written += len(self.chunk.rows)
            yield self.chunk
        if self.frozen is not None:
            for rows, blobs in iter_store(self.frozen):
                self.rows_written += len(rows)
                yield RowChunk(torch.tensor(rows, dtype=torch.int64), tuple(unpack_rows(blobs, self.specs)))

    def write(self, ckpt_dir: str, shard_name: str) -> ShardFile:
        file = f"{shard_name}.rows"
        try:
            size, digest = write_rows_file(Path(ckpt_dir) / file, self.header, self._chunks())
        finally:
            if self.frozen is not None:
                shutil.rmtree(self.frozen, ignore_errors=True)
        return ShardFile(file, file, size, digest)
