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

A server keeps its rows of every table in one storage (``FusedLayout``), so one gather
serves a step's lookup of all tables; ``ps_train.ctr.plan`` is how a trainer asks for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["INIT_BLOCK", "RowSharding", "FusedLayout", "init_rows"]

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
            raise ValueError(
                f"a table needs >= 1 row and >= 1 server, got {self.num_rows} rows, {self.num_servers} servers"
            )

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


@dataclass(frozen=True)
class FusedLayout:
    """Where every table's rows live: table ``t`` split by ``kind`` over ``num_servers``
    servers, and each server's rows of all tables in one storage, table after table
    (``row_offsets``). Trainers and servers build the same layout from the config, so a
    trainer names a row by its place in its server's storage."""

    kind: str
    table_sizes: tuple[int, ...]
    num_servers: int

    def shardings(self) -> list[RowSharding]:
        return [RowSharding(self.kind, n, self.num_servers) for n in self.table_sizes]

    def row_offsets(self, server: int) -> list[int]:
        """[T + 1]: table t's rows on ``server`` are its storage rows
        ``row_offsets[t] : row_offsets[t + 1]``; the last entry is the storage's row count."""
        out = [0]
        for sh in self.shardings():
            out.append(out[-1] + sh.rows_of(server))
        return out
