"""Row-sharded embedding tables: which server owns which row, and how a trainer asks for rows.

A table of ``num_rows`` rows is split across ``S`` servers by rows, one of two ways
(``model.table_sharding``):

- ``range``: server ``s`` owns the contiguous rows ``[s * per, (s + 1) * per)`` with
  ``per = ceil(num_rows / S)`` (the last server may own fewer). Local row = ``id - s * per``.
- ``mod``: server ``s`` owns the rows ``id % S == s``. Local row = ``id // S``. Hot ids
  (power-law traffic) spread evenly over the servers, whatever their numbering.

A table's values do not depend on ``S``: row ``r``'s initial value is a hash of ``(seed,
table, r, column)`` (``init_rows``), so a server builds its shard block by block of
``INIT_BLOCK`` rows (seconds for gigabytes, never the whole table at once), a lazy storage
creates a row when first touched with the same value, and the same seed gives the same
table for any number of servers.

A server keeps its rows of every table in one storage (``FusedLayout``), so one gather
serves a step's lookup of all tables; ``ps_train.workloads.ctr.tables.plan`` is how a trainer asks for them.

A *dynamic* table (``model.tables[i].kind=dynamic``, ``ps_train.workloads.ctr.tables.dynamic``) has no row
numbers: id ``x`` belongs to server ``dynamic_owner(x)`` (a fixed hash of the id, mod S),
which keeps it in one of its ``max_rows`` slots of that table, created on first use with
``dynamic_init_rows`` (a counter-based hash of (seed, table, id, column), so a row's initial
value does not depend on when or in which order ids arrive). Its slots follow the fixed
tables' rows in the storage, and one more row, always zero, is what ids without a row read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["INIT_BLOCK", "RowSharding", "FusedLayout", "init_rows", "dynamic_owner", "dynamic_init_rows"]

# Rows initialised at a time when a table is built eagerly: building a shard never holds
# much more than the shard.
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

    def global_of(self, server: int, local: Tensor) -> Tensor:
        """Global ids of ``server``'s local rows ``local`` (int64, any shape)."""
        if self.kind == "range":
            return local + server * self._per
        return local * self.num_servers + server

    def global_ids(self, server: int, start: int = 0, stop: int | None = None) -> Tensor:
        """Global ids of ``server``'s local rows ``start:stop`` (int64 [stop - start])."""
        stop = self.rows_of(server) if stop is None else stop
        local = torch.arange(start, stop, dtype=torch.int64)
        if self.kind == "range":
            return local + server * self._per
        return local * self.num_servers + server


def init_rows(seed: int, table: int, num_rows: int, dim: int, ids: Tensor) -> Tensor:
    """The initial values of rows ``ids`` (int64 [n], any order) of table ``table``: float32
    [n, dim], uniform in +-sqrt(1 / num_rows) (DLRM's rule). Value (i, j) is a hash of (seed,
    table, ids[i], j), so a row's value depends on (seed, table, row) only: not on the
    server, the storage tier, or when or in which order rows are created."""
    return _hashed_uniform(seed, table, _FIXED_SALT, num_rows, dim, ids)


_U64 = (1 << 64) - 1


def _mix64(x: np.ndarray) -> np.ndarray:
    # SplitMix64's finaliser: a bijection on uint64 with full avalanche (uint64 array ops wrap).
    return _mix64_(x + np.uint64(0x9E3779B97F4A7C15))


def _mix64_(x: np.ndarray, low_bits: bool = True) -> np.ndarray:
    """``_mix64`` without its first addition, in place in ``x`` (uint64): the finaliser's
    passes over a [n, dim] block reuse one scratch array instead of making six.
    ``low_bits`` False: only bits 33-63 are right (the last xor-shift, by 31, changes no
    higher bit), for callers that keep only the top bits."""
    tmp = np.empty_like(x)
    np.right_shift(x, np.uint64(30), out=tmp)
    x ^= tmp
    x *= np.uint64(0xBF58476D1CE4E5B9)
    np.right_shift(x, np.uint64(27), out=tmp)
    x ^= tmp
    x *= np.uint64(0x94D049BB133111EB)
    if low_bits:
        np.right_shift(x, np.uint64(31), out=tmp)
        x ^= tmp
    return x


def _as_u64(ids: Tensor) -> np.ndarray:
    """int64 ids as uint64 (the same 64 bits), for hashing."""
    return ids.to(torch.int64).contiguous().numpy().view(np.uint64)


def dynamic_owner(ids: Tensor, num_servers: int) -> Tensor:
    """The server of each id of a dynamic table (int64, same shape): a fixed hash of the id's
    64 bits, mod ``num_servers``, so consecutive or strided ids spread over the servers."""
    h = _mix64(_as_u64(ids) ^ np.uint64(0x5851F42D4C957F2D)) >> np.uint64(1)  # < 2**63: fits int64
    return torch.from_numpy((h % np.uint64(num_servers)).astype(np.int64))


def dynamic_init_rows(seed: int, table: int, num_embeddings: int, dim: int, ids: Tensor) -> Tensor:
    """The initial rows of ids ``ids`` (int64 [n], any order, any 64-bit values) of dynamic
    table ``table``: float32 [n, dim], uniform in +-sqrt(1 / num_embeddings) (DLRM's rule).
    Value (i, j) is a hash of (seed, table, ids[i], j): the same id gets the same row whatever
    the other ids, their order or the server."""
    return _hashed_uniform(seed, table, 0, num_embeddings, dim, ids)


_FIXED_SALT = 0x2545F4914F6CDD1D  # fixed tables' rows hash apart from a dynamic table's ids


def _hashed_uniform(seed: int, table: int, salt: int, num_rows: int, dim: int, ids: Tensor) -> Tensor:
    """float32 [n, dim] uniform in +-sqrt(1 / num_rows), value (i, j) a hash of (seed, table,
    salt, ids[i], j)."""
    bound = math.sqrt(1.0 / num_rows)
    if len(ids) == 0:
        return torch.empty(0, dim, dtype=torch.float32)
    key = _mix64(np.array([(seed * 0x9E3779B97F4A7C15 + table * 0xD1B54A32D192ED03 + salt) & _U64], dtype=np.uint64))
    h = _mix64(_as_u64(ids) ^ key)  # [n]
    # Column j's input: h ^ (j + 1) * C, plus _mix64's constant (added here, in the same pass).
    cols = (np.arange(1, dim + 1, dtype=np.uint64) * np.uint64(0xBF58476D1CE4E5B9)).reshape(1, dim)
    bits = np.empty((len(h), dim), dtype=np.uint64)  # [n, dim]
    np.bitwise_xor(h.reshape(-1, 1), cols, out=bits)
    bits += np.uint64(0x9E3779B97F4A7C15)
    bits = _mix64_(bits, low_bits=False)
    bits >>= np.uint64(40)  # 24 bits, exact in float32
    # (bits / 2^24) * 2 bound - bound in float32, as one product and a difference: scaling
    # by a power of two is exact, so folding 2^-24 into the factor rounds the same.
    u = bits.astype(np.float32)
    u *= np.float32(2 * bound / (1 << 24))
    u -= np.float32(bound)
    return torch.from_numpy(u)


@dataclass(frozen=True)
class FusedLayout:
    """Where every table's rows live: table ``t`` split by ``kind`` over ``num_servers``
    servers, and each server's rows of all tables in one storage, table after table
    (``row_offsets``). Trainers and servers build the same layout from the config, so a
    trainer names a row by its place in its server's storage.

    ``dynamic_rows``: per table, its slots per server if it is dynamic, else 0 (empty: no
    dynamic tables). With any, the storage ends with one zero row (``default_row``)."""

    kind: str
    table_sizes: tuple[int, ...]
    num_servers: int
    dynamic_rows: tuple[int, ...] = ()

    def is_dynamic(self, t: int) -> bool:
        return bool(self.dynamic_rows) and self.dynamic_rows[t] > 0

    def shardings(self) -> list[RowSharding]:
        return [RowSharding(self.kind, n, self.num_servers) for n in self.table_sizes]

    def row_offsets(self, server: int) -> list[int]:
        """[T + 1]: table t's rows (a dynamic table's slots) on ``server`` are its storage
        rows ``row_offsets[t] : row_offsets[t + 1]``."""
        out = [0]
        for t, sh in enumerate(self.shardings()):
            out.append(out[-1] + (self.dynamic_rows[t] if self.is_dynamic(t) else sh.rows_of(server)))
        return out

    def storage_rows(self, server: int) -> int:
        """Rows of ``server``'s storage: every table's, and the default row if any table is dynamic."""
        return self.row_offsets(server)[-1] + (1 if any(self.dynamic_rows) else 0)

    def default_row(self, server: int) -> int | None:
        """The storage row ids without a row read (zeros; never updated), or None."""
        return self.row_offsets(server)[-1] if any(self.dynamic_rows) else None

    def initial_rows(self, server: int, seed: int, dim: int, rows: Tensor) -> Tensor:
        """The initial values of ``server``'s storage rows ``rows`` (int64 [n], any order):
        float32 [n, dim], ``init_rows`` of each fixed table's rows; zeros for a dynamic
        table's slots (they get their id's row when given out) and the default row."""
        out = torch.zeros(len(rows), dim, dtype=torch.float32)
        offsets = self.row_offsets(server)
        table = torch.bucketize(rows, torch.tensor(offsets[1:]), right=True)  # [n]: each row's table
        for t in torch.unique(table).tolist():
            if t >= len(self.table_sizes) or self.is_dynamic(t):
                continue
            mine = table == t
            ids = self.shardings()[t].global_of(server, rows[mine] - offsets[t])
            out[mine] = init_rows(seed, t, self.table_sizes[t], dim, ids)
        return out
