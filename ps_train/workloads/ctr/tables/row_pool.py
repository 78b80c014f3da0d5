"""The RAM tier of a lazy table storage: a pool of row slots, which storage row each holds,
and what moves between it and the disk store.

A slot holds one row: its values (``values`` [C, dim], the table dtype) and its optimizer
state (the rows optimizer's per-row tensors, float32, aligned with the slots:
``RowsOptimizer.resize_rows``). ``slot_of`` [num_rows] (int32, -1: not in RAM) is the only
cost of a row never touched (4 bytes). A row comes into a slot when a request or an update
needs it (``ensure``): from the store if it was evicted there, else created with its
initial value (``init``: a function of (seed, table, row) only) and zero state. Without a
budget the pool grows as rows arrive; with one it holds its ``capacity`` slots from the
start (their values' pages mapped as rows are written; a budget beyond a quarter of the
machine's RAM grows as without one) and, once they are full, the least recently
used rows outside the current request leave: written to the store if *dirty* (changed
since they were last stored), dropped otherwise (an untouched row is re-created equal, a
clean one is in the store). A row's bytes go to disk and back unchanged (``pack`` /
``unpack``): evicted and read back, it is bit-identical, optimizer state included.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from ps_train.workloads.ctr.tables.optimizers import RowsOptimizer
from ps_train.workloads.ctr.tables.row_store import RowStore

__all__ = ["RowPool", "TierCounts", "BudgetError", "pack_rows", "unpack_rows"]


# Rows per write batch when the pool is flushed to the store (~17 MB of preset=dlrmv2's rows).
FLUSH_ROWS = 1 << 16


class BudgetError(ValueError):
    """``model.table_memory_budget`` cannot hold the rows one request needs."""


class TierCounts(NamedTuple):
    hits: int  # rows a request or update found in RAM
    misses: int  # rows it had to bring in (from disk, or created)
    created: int  # rows created with their initial value
    read_back: int  # rows read back from disk
    evicted: int  # rows that left RAM
    written: int  # rows written to disk (the dirty ones among the evicted and flushed)


def pack_rows(columns: list[Tensor]) -> list[bytes]:
    """One ``bytes`` per row of ``columns`` (each [n, ...]): the row's bytes of each, in order."""
    n = len(columns[0])
    buf = torch.cat([c.contiguous().view(torch.uint8).reshape(n, -1) for c in columns], dim=1).numpy()
    return [buf[i].tobytes() for i in range(n)]


def unpack_rows(blobs: list[bytes], specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[Tensor]:
    """``pack_rows``' inverse: the columns [n, *shape] of rows ``blobs``, as ``specs`` say."""
    n = len(blobs)
    buf = torch.from_numpy(np.frombuffer(b"".join(blobs), dtype=np.uint8).reshape(n, -1).copy())
    out, at = [], 0
    for _, dtype, shape in specs:
        width = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
        out.append(buf[:, at : at + width].contiguous().view(dtype).reshape(n, *shape))
        at += width
    return out


_SLOT_BYTES = 30  # a slot's bookkeeping besides its values: row, last use, free-list entry, flags


def _reservable() -> int:
    """The most bytes a budgeted pool reserves at start: a quarter of the machine's RAM."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4


class RowPool:
    """RAM slots for ``num_rows`` storage rows of ``dim`` values in ``dtype``, with the
    per-row state of ``optimizer`` (module docstring). ``capacity`` None: no budget (grows);
    ``store`` None: nothing ever leaves RAM. ``budget``: the setting's text, for errors."""

    def __init__(
        self,
        num_rows: int,
        dim: int,
        dtype: torch.dtype,
        optimizer: RowsOptimizer,
        init: Callable[[Tensor], Tensor],
        capacity: int | None,
        store: RowStore | None,
        where: str,
        budget: str | None = None,
        start: int = 1024,
    ) -> None:
        self.num_rows, self.dim, self.dtype = num_rows, dim, dtype
        self.optimizer, self.init, self.store, self.where = optimizer, init, store, where
        self.capacity, self.budget = capacity, budget
        self.slot_of = torch.full((num_rows,), -1, dtype=torch.int32)
        if capacity is not None and capacity * (dim * dtype.itemsize + _SLOT_BYTES) <= _reservable():
            # Under a budget the machine can hold, every slot is taken at once, the values
            # uninitialised: the OS maps their pages only when a row is written there, so RAM
            # follows the rows held, and the pool never grows (a doubling step holds the old
            # and the new arrays at once: up to 1.5x the budget's rows). A slot's values are
            # written before they are read. A larger budget (one that means "no eviction")
            # grows as without one.
            start = capacity
            self.values = torch.empty(start, dim, dtype=dtype)
        else:
            start = start if capacity is None else min(capacity, start)
            self.values = torch.zeros(start, dim, dtype=dtype)
        self.slot_row = torch.full((start,), -1, dtype=torch.int64)
        self.dirty = torch.zeros(start, dtype=torch.bool)  # changed since last stored
        self.touched = torch.zeros(start, dtype=torch.bool)  # differs from its initial value
        self.last_used = torch.zeros(start, dtype=torch.int64)
        self.free = torch.arange(start - 1, -1, -1, dtype=torch.int64)  # a stack
        self.optimizer.resize_rows(start)
        self.tick = 0
        self.counts = TierCounts(0, 0, 0, 0, 0, 0)

    # -- bytes of a row -------------------------------------------------------------------------
    def columns(self) -> list[Tensor]:
        return [self.values, *(s for _, s in sorted(self.optimizer.row_state().items()))]

    def row_bytes(self) -> int:
        """Bytes of one row as stored: its values and its optimizer state."""
        return sum(c[0].numel() * c.element_size() for c in self.columns())

    def column_specs(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, one row's shape) of each stored column: ``weight``, then the
        optimizer's per-row state by name."""
        state = sorted(self.optimizer.row_state().items())
        cols = [("weight", self.values)] + state
        return [(name, c.dtype, tuple(c.shape[1:])) for name, c in cols]

    def pack(self, slots: Tensor) -> list[bytes]:
        """The stored bytes of the rows in ``slots``."""
        return pack_rows([c.index_select(0, slots) for c in self.columns()])

    def unpack(self, slots: Tensor, blobs: list[bytes]) -> None:
        """Write stored bytes ``blobs`` (one per slot) into ``slots``."""
        for c, v in zip(self.columns(), unpack_rows(blobs, self.column_specs()), strict=True):
            c.index_copy_(0, slots, v)

    # -- slots ----------------------------------------------------------------------------------
    def _grow(self, want: int) -> None:
        old = len(self.slot_row)
        new = max(want, 2 * old) if self.capacity is None else min(self.capacity, max(want, 2 * old))
        if new <= old:
            return
        extra = new - old
        values = self.values.new_empty(new, self.dim)  # not cat: no third copy of the new rows
        values[:old] = self.values
        values[old:].zero_()
        self.values = values
        self.slot_row = torch.cat([self.slot_row, torch.full((extra,), -1, dtype=torch.int64)])
        self.dirty = torch.cat([self.dirty, torch.zeros(extra, dtype=torch.bool)])
        self.touched = torch.cat([self.touched, torch.zeros(extra, dtype=torch.bool)])
        self.last_used = torch.cat([self.last_used, torch.zeros(extra, dtype=torch.int64)])
        self.free = torch.cat([torch.arange(new - 1, old - 1, -1, dtype=torch.int64), self.free])
        self.optimizer.resize_rows(new)

    def _take(self, n: int, protect: Tensor) -> Tensor:
        """``n`` free slots, growing or evicting (never the slots ``protect``)."""
        if n > len(self.free):
            self._grow(len(self.slot_row) + n - len(self.free))
        short = n - len(self.free)
        if short > 0:
            held = self.slot_row >= 0
            held[protect] = False
            candidates = int(held.sum())
            if candidates < short:
                raise self._too_small(n + len(protect))
            # A few more than needed, so that the next misses find free slots without a scan.
            k = min(candidates, short + len(self.slot_row) // 32)
            age = torch.where(held, self.last_used, torch.iinfo(torch.int64).max)
            self.evict(torch.topk(age, k, largest=False).indices)
        take = self.free[len(self.free) - n :].flip(0)
        self.free = self.free[: len(self.free) - n]
        return take

    def _too_small(self, rows: int) -> BudgetError:
        need = rows * (self.row_bytes() + 30) + 4 * self.num_rows
        return BudgetError(
            f"{self.where}: model.table_memory_budget={self.budget} holds {self.capacity} rows of "
            f"{self.row_bytes()} bytes here, but one request needs {rows} rows in RAM at once; raise it to at "
            f"least {need / 1e6:.1f}MB"
        )

    def evict(self, slots: Tensor) -> None:
        """Rows in ``slots`` leave RAM; the dirty ones are written to the store first."""
        if len(slots) == 0:
            return
        if self.store is None:
            raise RuntimeError(f"{self.where}: rows cannot leave RAM without a disk tier")
        dirty = slots[self.dirty[slots]]
        if len(dirty):
            self.store.put(self.slot_row[dirty].tolist(), self.pack(dirty))
        self.slot_of[self.slot_row[slots]] = -1
        self.slot_row[slots] = -1
        self.dirty[slots] = False
        self.touched[slots] = False
        self.free = torch.cat([self.free, slots.flip(0)])
        c = self.counts
        self.counts = c._replace(evicted=c.evicted + len(slots), written=c.written + len(dirty))

    def ensure(self, rows: Tensor, count: bool = True) -> Tensor:
        """Slots (int64 [n]) of ``rows`` (int64 [n], unique), bringing in those not in RAM;
        ``count``: count them as hits and misses (a prefetch does not)."""
        self.tick += 1
        slots = self.slot_of[rows].to(torch.int64)
        miss = slots < 0
        n_miss = int(miss.sum())
        if n_miss:
            new_rows = rows[miss]
            protect = slots[~miss]
            if self.capacity is not None and len(rows) > self.capacity:
                raise self._too_small(len(rows))
            take = self._take(n_miss, protect)
            self._bring_in(new_rows, take)
            slots[miss] = take
        self.last_used[slots] = self.tick
        if count:
            c = self.counts
            self.counts = c._replace(hits=c.hits + len(rows) - n_miss, misses=c.misses + n_miss)
        return slots

    def _bring_in(self, rows: Tensor, slots: Tensor) -> None:
        stored = self.store.get(rows.tolist()) if self.store is not None else [None] * len(rows)
        found = torch.tensor([b is not None for b in stored], dtype=torch.bool)
        with torch.no_grad():
            for s in self.optimizer.row_state().values():
                s.index_fill_(0, slots, 0)
            if bool(found.any()):
                self.unpack(slots[found], [b for b in stored if b is not None])
            fresh = ~found
            if bool(fresh.any()):
                self.values.index_copy_(0, slots[fresh], self.init(rows[fresh]).to(self.dtype))
        self.slot_row[slots] = rows
        self.slot_of[rows] = slots.to(torch.int32)
        self.dirty[slots] = False
        self.touched[slots] = found
        c = self.counts
        n_found = int(found.sum())
        self.counts = c._replace(read_back=c.read_back + n_found, created=c.created + len(rows) - n_found)

    def peek(self, rows: Tensor) -> Tensor:
        """float32 [n, dim] values of ``rows`` (any), bringing nothing into RAM."""
        slots = self.slot_of[rows].to(torch.int64)
        out = torch.empty(len(rows), self.dim, dtype=torch.float32)
        here = slots >= 0
        out[here] = self.values.index_select(0, slots[here]).float()
        away = torch.nonzero(~here).squeeze(1)
        if len(away):
            stored = self.store.get(rows[away].tolist()) if self.store is not None else [None] * len(away)
            width = self.dim * self.values.element_size()
            for i, b in zip(away.tolist(), stored, strict=True):
                if b is not None:
                    out[i] = torch.frombuffer(bytearray(b[:width]), dtype=self.dtype).float()
            missing = torch.tensor([b is None for b in stored], dtype=torch.bool)
            if bool(missing.any()):
                out[away[missing]] = self.init(rows[away[missing]]).to(self.dtype).float()
        return out

    def flush(self) -> int:
        """Write every dirty row to the store (they stay in RAM, clean); returns how many."""
        if self.store is None:
            return 0
        dirty = torch.nonzero(self.dirty).squeeze(1)
        # In write batches of FLUSH_ROWS: a checkpoint flushes up to the whole pool (the
        # budget's worth of rows), and one batch of it held the rows three more times at once
        # (their columns gathered, a bytes object per row, RocksDB's write batch): 1.5 GB
        # above the budget for preset=dlrmv2's 1 GB. A failed batch leaves the rest dirty.
        for start in range(0, len(dirty), FLUSH_ROWS):
            part = dirty[start : start + FLUSH_ROWS]
            self.store.put(self.slot_row[part].tolist(), self.pack(part))
            self.dirty[part] = False
            self.counts = self.counts._replace(written=self.counts.written + len(part))
        return len(dirty)

    def held(self) -> int:
        """Rows in RAM now."""
        return int((self.slot_row >= 0).sum())

    def nbytes(self) -> int:
        """Bytes of the pool's values and per-row state (what the budget holds)."""
        return sum(c.numel() * c.element_size() for c in self.columns())
