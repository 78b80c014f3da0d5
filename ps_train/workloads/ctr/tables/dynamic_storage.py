"""Raw-id tables over another storage: the ``TableStorage`` of a server with dynamic tables
(``model.tables[i].kind=dynamic``).

A dynamic table's rows are a range of slots of the wrapped storage's rows
(``FusedLayout.row_offsets``); a request names each of its rows by the marker ``-(1 + t)``
and the raw id (``TableRequest.ids``). ``DynamicStorage`` turns each into its slot
(``ps_train.workloads.ctr.tables.dynamic``: admission, eviction), creating rows with ``dynamic_init_rows``
and fresh optimizer state (``TableStorage.assign``), or into the default zero row, whose
gradients ``step`` drops; then the wrapped storage answers. Slot maps and counts go into
the checkpoint beside the rows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor, nn

from ps_train.checkpoint.forked_writer import FrozenRows
from ps_train.workloads.ctr.tables.dynamic import DynamicCounts, DynamicTable
from ps_train.workloads.ctr.tables.rows import dynamic_init_rows
from ps_train.workloads.ctr.tables.storage import StorageSnapshot, TableRequest, TableStorage

T = TypeVar("T")

__all__ = ["DynamicStorage"]


class DynamicStorage(TableStorage):
    """``inner``'s rows with the dynamic tables ``tables`` (table -> its slots here) mapped
    by raw id. ``row_offsets`` [T + 1]: where each table's rows start in ``inner``;
    ``default_row``: the zero row of ids without a row; ``sizes``: the tables'
    ``num_embeddings`` (the initialisation's scale)."""

    def __init__(
        self,
        inner: TableStorage,
        tables: Mapping[int, DynamicTable],
        row_offsets: Sequence[int],
        default_row: int,
        seed: int,
        sizes: Sequence[int],
        where: str,
    ) -> None:
        self.inner, self.dynamic = inner, dict(tables)
        self.forks_writer = inner.forks_writer
        self.row_offsets, self.default_row = list(row_offsets), default_row
        self.seed, self.sizes, self.where = seed, list(sizes), where
        self.dim, self.num_rows = inner.dim, inner.num_rows
        self._lock = threading.Lock()  # lookups of several trainers run at once
        self.clock = 0  # the latest training lookup's step (dynamic tables advance with it)

    @property
    def handle(self) -> nn.Parameter:
        return self.inner.handle

    def lookup(self, req: TableRequest) -> Tensor:
        return self.inner.lookup(self._resolve(req))

    def read(self, req: TableRequest) -> Tensor:
        return self.inner.read(self._resolve(req))

    def prefetch(self, rows: Tensor) -> None:
        self.inner.prefetch(rows[rows >= 0])

    def _resolve(self, req: TableRequest) -> TableRequest:
        """``req`` with each marker ``-(1 + t)`` replaced by its id's storage row (or the
        default row); an evaluation read (``step`` None) creates nothing."""
        rows, ids = req.rows, req.ids
        # NumPy views: a step's few thousand rows make every pass mostly a call's fixed cost.
        rows_np = rows.numpy()
        marked = rows_np < 0
        n = int(np.count_nonzero(marked))
        if n == 0 and ids is None:
            return req
        if ids is None or ids.dtype != torch.int64 or len(ids) != n:
            raise ValueError(
                f"{self.where}: a request with {n} dynamic-table rows needs as many int64 ids, got "
                f"{None if ids is None else (ids.dtype, tuple(ids.shape))}"
            )
        tables = -(rows_np if n == len(rows_np) else rows_np[marked]) - 1  # [n]
        found = torch.full((n,), -1, dtype=torch.int64)  # storage rows
        found_np = found.numpy()
        with self._lock:
            step = req.step
            if step is not None and step > self.clock:
                for table in self.dynamic.values():
                    table.advance(step)
                self.clock = step
            for t, mine in _by_table(tables):
                if t not in self.dynamic:
                    raise ValueError(f"{self.where}: table {t} is not a dynamic table here")
                base = self.row_offsets[t]
                dyn = self.dynamic[t]
                its_ids = ids[mine] if isinstance(mine, slice) else ids[torch.from_numpy(mine)]
                if step is None:
                    local = dyn.read(its_ids)
                else:
                    res = dyn.lookup(its_ids, step, req.trainer)
                    local = res.slots
                    if len(res.created_slots):
                        self._create(t, res.created_slots + base, res.created_ids)
                local_np = local.numpy()
                found_np[mine] = np.where(local_np >= 0, local_np + base, self.default_row)
        if n == len(rows):
            return req.with_rows(found)
        out = rows.clone()
        out[torch.from_numpy(marked)] = found
        return req.with_rows(out)

    def _create(self, t: int, rows: Tensor, ids: Tensor) -> None:
        """New rows of dynamic table ``t``: storage rows ``rows`` [c] for ids ``ids`` [c]."""
        order = torch.from_numpy(np.argsort(rows.numpy()))  # ascending rows, as ``assign`` takes them
        rows, ids = rows[order], ids[order]
        self.inner.assign(rows, dynamic_init_rows(self.seed, t, self.sizes[t], self.dim, ids))

    def step(self, grad: Tensor, lr_factor: float = 1.0) -> int:
        return self.inner.step(_without_row(grad, self.default_row), lr_factor)

    def assign(self, rows: Tensor, values: Tensor) -> None:
        self.inner.assign(rows, values)

    def take_changed(self) -> Tensor:
        return self.inner.take_changed()

    def dynamic_counts(self) -> DynamicCounts:
        """The dynamic tables' counters, summed over them."""
        c = [d.counters() for d in self.dynamic.values()]
        return DynamicCounts(*(sum(x[i] for x in c) for i in range(4)))

    def _dynamic_state(self) -> dict[str, Any]:
        """The slot maps, counts and clock (a copy), for a checkpoint."""
        return {"clock": self.clock, "dynamic": {t: d.state_dict() for t, d in self.dynamic.items()}}

    def _load_dynamic(self, state: dict[str, Any]) -> None:
        saved = state.get("dynamic")
        if saved is None or sorted(saved) != sorted(self.dynamic):
            raise ValueError(
                f"{self.where}: the checkpoint's dynamic tables {None if saved is None else sorted(saved)} "
                f"are not this run's {sorted(self.dynamic)}; resume with the same model.tables"
            )
        for t, d in self.dynamic.items():
            d.load_state_dict(saved[t])
        self.clock = int(state["clock"])

    def begin_snapshot(self, name: str, base: str | None) -> StorageSnapshot:
        with self._lock:  # no lookup creates rows while the tables are frozen
            snapshot = self.inner.begin_snapshot(name, base)
            snapshot.state.update(self._dynamic_state())
            return snapshot

    def freeze_rows(self, name: str, base: str | None, take: Callable[[FrozenRows], T]) -> T:
        with self._lock:  # no lookup creates rows until ``take`` (the fork) returns

            def with_slots(rows: FrozenRows) -> T:
                rows.state.update(self._dynamic_state())
                return take(rows)

            return self.inner.freeze_rows(name, base, with_slots)

    def end_snapshot(self, written: bool) -> None:
        self.inner.end_snapshot(written)

    def load_state(self, state: dict[str, Any]) -> None:
        self.inner.load_state(state)
        self._load_dynamic(state)

    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        out = self.inner.state_dict(copy)
        with self._lock:
            out.update(self._dynamic_state())
        return out

    def counters(self) -> dict[str, Any]:
        c = self.dynamic_counts()
        return {
            **self.inner.counters(),
            "dynamic_rows_live": c.live,
            "dynamic_rows_created": c.created,
            "dynamic_rows_evicted": c.evicted,
            "dynamic_rows_admitted": c.admitted,
        }

    def close(self) -> None:
        self.inner.close()


def _by_table(tables: np.ndarray) -> list[tuple[int, slice | np.ndarray]]:
    """Each table of ``tables`` (int64 [n]) in ascending order, with where it is in
    ``tables``: a slice when its entries are consecutive (a plan sends each table's rows
    together), else a mask. The tables are independent, so their order changes nothing
    but is kept."""
    if len(tables) == 0:
        return []
    cuts = (np.flatnonzero(tables[1:] != tables[:-1]) + 1).tolist()
    bounds = [0, *cuts, len(tables)]
    firsts = tables[bounds[:-1]].tolist()
    if len(set(firsts)) == len(firsts):  # one run per table: slices (views), no masks
        return sorted((t, slice(lo, hi)) for t, lo, hi in zip(firsts, bounds[:-1], bounds[1:], strict=True))
    return [(t, tables == t) for t in sorted(set(firsts))]


def _without_row(grad: Tensor, row: int) -> Tensor:
    """A coalesced sparse gradient without row ``row``'s entry."""
    rows = grad.indices()[0]
    keep = rows != row
    if bool(keep.all()):
        return grad
    return torch.sparse_coo_tensor(
        rows[keep].unsqueeze(0), grad.values()[keep], tuple(grad.shape), is_coalesced=True, check_invariants=False
    )
