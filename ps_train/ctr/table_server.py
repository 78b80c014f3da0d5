"""A parameter server's part of the embedding tables: its rows of every table, in one storage
(``TableShards``), and the sparse optimizer that updates them.

``ps_train.roles.server.ParameterServer`` owns one ``TableServer`` (its ``TablePart``) when
the model has tables (model=dlrm; the launcher builds it with ``make_table_server``). The
server's updates (``ParameterServer.update``, as its mode applies them) treat the table
weights like any other parameter: they read each trainer's gradients from its autograd
context and combine them in sync mode (``mode.aggregate``); ``step`` then hands them to the
table optimizer (``model.table_optim``, ``ps_train.ctr.optimizers``). The gradient is sparse
(``TableShards.lookup``'s backward: the touched rows of the storage, each once), so a step
is one coalesce and one optimizer step over the rows trainers used, whatever the number of
tables, and the optimizer updates only those rows.

Checkpoints (``begin_snapshot``) do not stop the updates: every update marks the rows it
changes, and a checkpoint freezes the rows (all, or those changed since the previous
checkpoint) copy-on-write by blocks while a thread writes them (``ps_train.ctr.snapshot``).
"""

from __future__ import annotations

import copy as copy_module
import logging
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
from ps_train.ctr.optimizers import make_table_optimizer
from ps_train.ctr.shards import TableShards
from ps_train.ctr.snapshot import RowSnapshot

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
        self.shards = TableShards(
            data.sizes(), model.embedding_dim, model.table_sharding, rank, cfg.cluster.num_servers, cfg.seed
        )
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

    def lookup(self, rows: Tensor, offsets: Tensor, weights: Tensor | None) -> Tensor:
        """Training lookup of a ``ServerRequest`` (``ps_train.ctr.plan``): one vector per single
        row and pooled bag, [P, dim], whose backward leaves the storage's sparse gradient in
        the caller's autograd context."""
        self.rows_read += len(rows)
        return self.shards.lookup(rows, offsets, weights)

    def read(self, rows: Tensor, offsets: Tensor, weights: Tensor | None) -> Tensor:
        """Evaluation lookup: the same vectors, without autograd."""
        return self.shards.read(rows, offsets, weights)

    def step(self, grads: Mapping[Tensor, Tensor], lr_factor: float = 1.0) -> None:
        """Apply the optimizer, at ``lr_factor`` times its rate, to the rows ``grads`` (the
        trainers' sparse gradients, by table weight) name; the caller holds the server's lock."""
        coalesced: list[Tensor | None] = []
        for p in self.params:
            grad = grads.get(p)
            if grad is not None:
                # Duplicate indices (one entry per trainer in sync mode) are one row.
                grad = grad.coalesce()
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
        return {
            "table_bytes": self.nbytes(),
            "table_rows_updated": self.rows_updated,
            "table_rows_read": self.rows_read,
            "table_rows_live": self.rows_live,
        }

    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        """The rows (``weights``: each table's, views of the one storage) and optimizer state;
        ``copy=False``: the live tensors themselves (the caller keeps updates off while it
        uses them), for tables too large to copy."""
        weights = [self.shards.table(t) for t in range(self.shards.num_tables)]
        opt = self.optimizer.state_dict()
        if copy:
            weights, opt = [w.clone() for w in weights], copy_module.deepcopy(opt)
        return {"weights": weights, "optimizer": opt, "rows_updated": self.rows_updated}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``state``: a ``state_dict``, or a checkpoint's table entry (``begin_snapshot``'s
        ``state``) with ``rows_files``, its chain of rows files, full one first."""
        self.changed.zero_()
        self.since = None
        if state.get("format") == "rows":
            self._load_rows(state["optimizer"], state["rows_files"])
            self.rows_updated = int(state.get("rows_updated", 0))
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

    def _load_rows(self, optimizer: dict[str, Any], files: Sequence[str]) -> None:
        if not files:
            raise ValueError("a table checkpoint needs at least one rows file")
        self.optimizer.load_scalar_state(optimizer)
        columns = self.columns()
        for i, path in enumerate(files):
            apply_rows_file(path, columns, expect_full=i == 0)


def make_table_server(cfg: Config, rank: int) -> TableServer | None:
    """The tables of server ``rank`` if the model has any (model=dlrm), else None."""
    if isinstance(cfg.model, DLRMConfig) and isinstance(cfg.data, CtrDataConfig):
        return TableServer(cfg.model, cfg.data, cfg, rank)
    return None
