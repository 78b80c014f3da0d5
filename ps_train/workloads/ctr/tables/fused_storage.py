"""Every row in RAM, in one float32 tensor built at start: the ``TableStorage`` of tables
that fit (``model.table_memory_budget=null`` and ``model.lazy_rows=false``, the default).

The rows are ``TableShards.weight`` (``ps_train.workloads.ctr.tables.shards``: one ``F.embedding_bag`` per
request over every table, a sparse gradient of the touched rows); the gradient's leaf is
that tensor itself. Checkpoints do not stop the updates: every update marks the rows it
changes (one byte per row), and a checkpoint freezes the rows (all, or those changed
since the previous checkpoint) copy-on-write by blocks while a thread writes them
(``ps_train.workloads.ctr.tables.snapshot``).
"""

from __future__ import annotations

import copy as copy_module
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from ps_train.checkpoint.forked_writer import FrozenRows
from ps_train.checkpoint.rows_file import RowsHeader, apply_rows_file
from ps_train.workloads.ctr.tables.optimizers import TableOptimizer
from ps_train.workloads.ctr.tables.shards import TableShards
from ps_train.workloads.ctr.tables.snapshot import RowSnapshot, TableSnapshot
from ps_train.workloads.ctr.tables.storage import TableRequest, TableStorage

T = TypeVar("T")

__all__ = ["FusedStorage"]


class FusedStorage(TableStorage):
    """``shards``' rows updated by ``optimizer`` (built over ``[shards.weight]``)."""

    def __init__(self, shards: TableShards, optimizer: TableOptimizer, where: str) -> None:
        self.shards, self.optimizer, self.where = shards, optimizer, where
        self.dim = shards.dim
        self.num_rows = int(shards.weight.shape[0])
        # Rows changed since the checkpoint ``self.since`` (None: since no complete one; the
        # next checkpoint is then full), one byte per row; and the snapshot being written.
        self.changed = torch.zeros(self.num_rows, dtype=torch.bool)
        self.since: str | None = None
        self.snapshot: TableSnapshot | None = None
        # Rows updated at least once by this process (server/rows_live): 1 byte per row.
        self._row_seen = torch.zeros(self.num_rows, dtype=torch.bool)
        self.rows_live = 0

    @property
    def handle(self) -> nn.Parameter:
        return self.shards.weight

    def lookup(self, req: TableRequest) -> Tensor:
        return self.shards.lookup(req.rows, req.offsets, req.weights)

    def read(self, req: TableRequest) -> Tensor:
        return self.shards.read(req.rows, req.offsets, req.weights)

    def _before_change(self, rows: Tensor) -> None:
        snapshot = self.snapshot
        if snapshot is not None:  # a checkpoint being written holds these rows as they were
            snapshot.rows.before_update(rows)
        self.changed[rows] = True

    def step(self, grad: Tensor, lr_factor: float = 1.0) -> int:
        rows = grad.indices()[0]  # [U]: the storage rows this step changes
        self._before_change(rows)
        self.rows_live += int((~self._row_seen[rows]).sum())
        self._row_seen[rows] = True
        self.optimizer.step([grad], lr_factor)
        return len(rows)

    def assign(self, rows: Tensor, values: Tensor) -> None:
        self._before_change(rows)
        with torch.no_grad():
            self.shards.weight.index_copy_(0, rows, values)
        self.optimizer.reset_rows(rows)

    def take_changed(self) -> Tensor:
        changed, self.changed = self.changed, torch.zeros_like(self.changed)
        return changed.nonzero().squeeze(1)

    def columns(self) -> dict[str, Tensor]:
        """The live per-row tensors a checkpoint holds: the rows and the optimizer's per-row
        state, each [rows, ...]."""
        return {"weight": self.shards.weight.detach(), **self.optimizer.row_state()}

    def begin_snapshot(self, name: str, base: str | None) -> TableSnapshot:
        if self.snapshot is not None:
            raise RuntimeError(f"checkpoint {name}: the tables of {self.snapshot.name} are still being written")
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
            },
        )
        self.since = name
        return self.snapshot

    forks_writer = True  # every row lives in one private CPU tensor per column

    def freeze_rows(self, name: str, base: str | None, take: Callable[[FrozenRows], T]) -> T:
        if self.snapshot is not None:
            raise RuntimeError(f"checkpoint {name}: the tables of {self.snapshot.name} are still being written")
        differential = base is not None and base == self.since
        changed, self.changed = self.changed, torch.zeros_like(self.changed)
        rows = FrozenRows(
            self.columns(),
            changed if differential else None,
            base if differential else None,
            {"format": "rows", "base": base if differential else None, "optimizer": self.optimizer.scalar_state()},
        )
        self.since = name
        return take(rows)

    def end_snapshot(self, written: bool) -> None:
        self.snapshot = None
        if not written:
            self.since = None

    def load_state(self, state: dict[str, Any]) -> None:
        self.changed.zero_()
        self.since = None
        if state.get("format") == "rows":
            files: Sequence[str] = state["rows_files"]
            if not files:
                raise ValueError("a table checkpoint needs at least one rows file")
            self.optimizer.load_scalar_state(state["optimizer"])
            columns = self.columns()
            for i, path in enumerate(files):
                apply_rows_file(path, columns, expect_full=i == 0)
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

    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        weights = [self.shards.table(t) for t in range(self.shards.num_tables)]
        opt = self.optimizer.state_dict()
        if copy:
            weights, opt = [w.clone() for w in weights], copy_module.deepcopy(opt)
        return {"weights": weights, "optimizer": opt}

    def counters(self) -> dict[str, Any]:
        return {"table_bytes": self.shards.nbytes(), "table_rows_live": self.rows_live}
