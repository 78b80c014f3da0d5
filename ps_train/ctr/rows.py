"""Row-sharded embedding tables: which server owns which row, and how a trainer asks for rows.

A table of ``num_rows`` rows is split across ``S`` servers by rows, one of two ways
(``model.table_sharding``):

- ``range``: server ``s`` owns the contiguous rows ``[s * per, (s + 1) * per)`` with
  ``per = ceil(num_rows / S)`` (the last server may own fewer). Local row = ``id - s * per``.
- ``mod``: server ``s`` owns the rows ``id % S == s``. Local row = ``id // S``. Hot ids
  (power-law traffic) spread evenly over the servers, whatever their numbering.

A table's values do not depend on ``S``: row ``r`` is drawn from a generator seeded by
``(seed, table, r // INIT_BLOCK)``, so a server builds its shard block by block (seconds for
gigabytes, never the whole table at once) and the same seed gives the same table for any
number of servers.

Per step a trainer deduplicates the batch's ids of each table (``plan_lookup``), sends each
server only the local rows it owns that the batch uses, and scatters the rows it gets back
into place (``assemble``); the backward sends back the gradients of exactly those rows.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["INIT_BLOCK", "RowSharding", "TableLookup", "plan_lookup", "assemble", "init_rows"]

# Rows drawn per seeded generator when a table is built: small enough that building a
# shard never holds much more than the shard, large enough that seeding costs nothing.
INIT_BLOCK = 1 << 16
SHARDING_KINDS = ("range", "mod")


@dataclass(frozen=True)
class RowSharding:
    """How one table's rows are split across ``num_servers`` servers."""

    kind: str
    num_rows: int
    num_servers: int

    def __post_init__(self) -> None:
        if self.kind not in SHARDING_KINDS:
            raise ValueError(f"table sharding must be one of {SHARDING_KINDS}, got {self.kind!r}")
        if self.num_rows < 1 or self.num_servers < 1:
            raise ValueError(f"a table needs >= 1 row and >= 1 server, got {self.num_rows} rows, "
                             f"{self.num_servers} servers")

    @property
    def _per(self) -> int:
        return math.ceil(self.num_rows / self.num_servers)

    def owner(self, ids: Tensor) -> Tensor:
        """The server of each id (int64, same shape as ``ids``)."""
        if self.kind == "range":
            return torch.div(ids, self._per, rounding_mode="floor")
        return torch.remainder(ids, self.num_servers)

    def local(self, ids: Tensor) -> Tensor:
        """Each id's row index within its owner's shard."""
        if self.kind == "range":
            return ids - self.owner(ids) * self._per
        return torch.div(ids, self.num_servers, rounding_mode="floor")

    def rows_of(self, server: int) -> int:
        """How many rows ``server`` owns."""
        if self.kind == "range":
            return max(0, min(self.num_rows, (server + 1) * self._per) - server * self._per)
        return (self.num_rows - server + self.num_servers - 1) // self.num_servers

    def global_ids(self, server: int, start: int = 0, stop: int | None = None) -> Tensor:
        """Global ids of ``server``'s local rows ``start:stop`` (int64 [stop - start])."""
        stop = self.rows_of(server) if stop is None else stop
        local = torch.arange(start, stop, dtype=torch.int64)
        if self.kind == "range":
            return local + server * self._per
        return local * self.num_servers + server


def init_rows(seed: int, table: int, num_rows: int, dim: int, ids: Tensor) -> Tensor:
    """The initial values of rows ``ids`` (sorted ascending) of table ``table``: float32
    [len(ids), dim], uniform in +-sqrt(1 / num_rows) (DLRM's rule). Generated block by block
    of ``INIT_BLOCK`` rows, each block from its own seeded generator, so a row's value
    depends on (seed, table, row) only."""
    bound = math.sqrt(1.0 / num_rows)
    out = torch.empty(len(ids), dim, dtype=torch.float32)
    if len(ids) == 0:
        return out
    blocks = torch.div(ids, INIT_BLOCK, rounding_mode="floor")
    g = torch.Generator()
    # ids are sorted, so each block's rows are one contiguous run of ``out``.
    starts = torch.searchsorted(blocks, torch.unique_consecutive(blocks))
    bounds = starts.tolist() + [len(ids)]
    for i, block in enumerate(torch.unique_consecutive(blocks).tolist()):
        lo, hi = bounds[i], bounds[i + 1]
        g.manual_seed(_block_seed(seed, table, block))
        first = block * INIT_BLOCK
        n = min(INIT_BLOCK, num_rows - first)
        values = torch.rand(n, dim, generator=g)  # [n, dim] in [0, 1)
        out[lo:hi] = values[ids[lo:hi] - first]
    return out.mul_(2 * bound).sub_(bound)


def _block_seed(seed: int, table: int, block: int) -> int:
    # A fixed mix of the three (no Python hash(): it is salted per process for strings and
    # must give the same value on every server).
    x = (seed * 0x9E3779B97F4A7C15 + table * 0xBF58476D1CE4E5B9 + block * 0x94D049BB133111EB) & ((1 << 63) - 1)
    return x


@dataclass
class TableLookup:
    """One table's part of a step, as the trainer plans it.

    ``inverse``: int64 [B], position of each sample's id among the table's unique ids.
    ``positions[s]``: int64 [U_s], where server s's rows go among the unique ids.
    ``local[s]``: int64 [U_s], the local rows to ask server s for (deduplicated).
    """

    num_unique: int
    inverse: Tensor
    positions: list[Tensor]
    local: list[Tensor]


def plan_lookup(ids: Tensor, sharding: RowSharding) -> TableLookup:
    """Deduplicate one table's ids of a batch (int64 [B]) and split them by owner."""
    unique, inverse = torch.unique(ids, return_inverse=True)  # [U], [B]
    owner = sharding.owner(unique)
    local = sharding.local(unique)
    positions, per_server = [], []
    for s in range(sharding.num_servers):
        where = torch.nonzero(owner == s, as_tuple=True)[0]  # [U_s]
        positions.append(where)
        per_server.append(local[where])
    return TableLookup(len(unique), inverse, positions, per_server)


def assemble(plan: TableLookup, rows: Sequence[Tensor]) -> Tensor:
    """Each sample's embedding, [B, dim], from ``rows[s]`` ([U_s, dim], the rows server s
    returned for ``plan.local[s]``). Differentiable: the gradient of each returned row is
    the sum over the samples that used it."""
    nonempty = [(p, r) for p, r in zip(plan.positions, rows, strict=True) if len(p)]
    dim = rows[0].shape[1]
    if not nonempty:
        return rows[0].new_zeros(len(plan.inverse), dim)
    # One index_copy_ per server rather than one of their concatenation: the backward then
    # gives every server's rows a gradient of its own ([U_s, dim], index_select), where a
    # concatenation's backward hands out views of one [U, dim] gradient, and a view that
    # spans most of its storage is sent whole (the other servers' rows too).
    unique_rows = rows[0].new_zeros(plan.num_unique, dim)  # [U, dim]
    for p, r in nonempty:
        unique_rows.index_copy_(0, p, r)
    return unique_rows[plan.inverse]

