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
"""

from __future__ import annotations

import copy as copy_module
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ps_train.config import Config, CtrDataConfig, DLRMConfig
from ps_train.ctr.optimizers import make_table_optimizer
from ps_train.ctr.shards import TableShards

__all__ = ["TableServer", "make_table_server"]

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
                seen = grad.indices()[0]
                self.rows_live += int((~self._row_seen[seen]).sum())
                self._row_seen[seen] = True
            coalesced.append(grad)
        self.optimizer.step(coalesced, lr_factor)

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


def make_table_server(cfg: Config, rank: int) -> TableServer | None:
    """The tables of server ``rank`` if the model has any (model=dlrm), else None."""
    if isinstance(cfg.model, DLRMConfig) and isinstance(cfg.data, CtrDataConfig):
        return TableServer(cfg.model, cfg.data, cfg, rank)
    return None
