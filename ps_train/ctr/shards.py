"""A server's shards of the embedding tables: built in seeded blocks, read row by row.

Server ``s`` of ``S`` holds, for every table ``t``, the rows ``RowSharding(kind, rows_t,
S)`` gives it, as one float32 parameter ``[rows_of(s), dim]``. ``lookup`` returns the rows
a trainer asked for through ``F.embedding(..., sparse=True)``, so under distributed
autograd the backward leaves a sparse gradient (only the touched rows) in the trainer's
context here, and any optimizer that takes sparse gradients (SGD, Adagrad, SparseAdam)
updates only those rows.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ps_train.ctr.rows import INIT_BLOCK, RowSharding, init_rows

__all__ = ["TableShards"]


class TableShards(nn.Module):
    def __init__(self, table_sizes: Sequence[int], dim: int, kind: str, server: int, num_servers: int,
                 seed: int) -> None:
        super().__init__()
        self.dim = dim
        self.server = server
        self.shardings = [RowSharding(kind, n, num_servers) for n in table_sizes]
        self.weights = nn.ParameterList()
        for t, (n, sh) in enumerate(zip(table_sizes, self.shardings, strict=True)):
            rows = sh.rows_of(server)
            weight = torch.empty(rows, dim)
            # Block by block: the shard is the only large allocation, whatever the table size.
            for start in range(0, rows, INIT_BLOCK):
                stop = min(rows, start + INIT_BLOCK)
                weight[start:stop] = init_rows(seed, t, n, dim, sh.global_ids(server, start, stop))
            self.weights.append(nn.Parameter(weight))

    def lookup(self, local_ids: list[Tensor]) -> list[Tensor]:
        """Rows ``local_ids[t]`` (int64 [U_t]) of each table: [U_t, dim] each."""
        if len(local_ids) != len(self.weights):
            raise ValueError(f"a lookup names {len(local_ids)} tables; this server holds {len(self.weights)}")
        out = []
        for t, (ids, weight) in enumerate(zip(local_ids, self.weights, strict=True)):
            if ids.dtype != torch.int64 or ids.dim() != 1:
                raise ValueError(f"table {t}: ids must be int64 [U], got {ids.dtype} {tuple(ids.shape)}")
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= weight.shape[0]):
                raise IndexError(f"table {t}: ids outside this server's {weight.shape[0]} rows "
                                 f"(range {int(ids.min())}..{int(ids.max())})")
            out.append(F.embedding(ids, weight, sparse=True))
        return out

    def nbytes(self) -> int:
        """Bytes of the table values held here (not counting optimizer state)."""
        return sum(w.numel() * w.element_size() for w in self.weights)
