"""The table-storage interface: what a server's table service (``ps_train.workloads.ctr.tables.service``)
asks of the place its rows live.

A server's rows of every table form one address space, the *storage rows* of
``ps_train.workloads.ctr.tables.rows.FusedLayout`` (table after table; a dynamic table's slots; the default
zero row). A ``TableStorage`` holds their values and their optimizer state and answers, in
those row numbers:

- ``lookup`` / ``read``: one vector per single row and per pooled bag of a request
  (``TableRequest``: a trainer's ``ServerRequest``), with autograd (training: the backward
  leaves one coalesced sparse gradient ``[num_rows, dim]`` on ``handle``) or without
  (evaluation, which creates nothing);
- ``step``: the table optimizer applied to such a gradient;
- ``take_changed``: the rows changed since the last call (differential checkpoints);
- ``begin_snapshot`` / ``end_snapshot`` / ``load_state``: checkpoints and resume;
- ``counters``: cumulative counts for the metrics;
- ``prefetch``: a hint that rows are about to be asked for (a tier brings them in).

Implementations, one module each: ``fused_storage.FusedStorage`` (every row in one float32
tensor, built at start), ``tiered_storage.TieredStorage`` (lazy rows: created on first
touch; optionally under a RAM budget with a disk store below; optionally half-precision),
and ``dynamic_storage.DynamicStorage`` (raw-id tables: maps ids to slots of the storage it
wraps). ``tests/ps_train/test_table_storage.py`` is the contract every one passes; a new
storage is a subclass here plus an entry in that test's list (docs/tables.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from torch import Tensor, nn

from ps_train.checkpoint.files import ShardFile

if TYPE_CHECKING:
    from ps_train.checkpoint.forked_writer import FrozenRows

T = TypeVar("T")

__all__ = ["TableRequest", "StorageSnapshot", "TableStorage", "check_request"]


@dataclass(frozen=True)
class TableRequest:
    """A trainer's request to one server's tables (``ps_train.workloads.ctr.tables.plan.ServerRequest``).

    ``rows`` int64 [N]: storage rows; the first ``offsets[0]`` are single rows, the rest
    form the bags starting at ``offsets`` (int64 [B]); ``weights`` [N - offsets[0]]: the
    bags' per-row weights or None. A dynamic table's row is the marker ``-(1 + t)`` with its
    raw id in ``ids`` (int64, one per marker, in order). ``step``: the trainer's step
    (None: an evaluation read, which creates no row); ``trainer``: its rank."""

    rows: Tensor
    offsets: Tensor
    weights: Tensor | None = None
    ids: Tensor | None = None
    step: int | None = None
    trainer: int = 0

    def with_rows(self, rows: Tensor) -> TableRequest:
        """The same request naming ``rows`` (markers resolved) and no raw ids."""
        return TableRequest(rows, self.offsets, self.weights, None, self.step, self.trainer)


class StorageSnapshot(Protocol):
    """A checkpoint of a storage being written (``ps_train.table_service.TableCheckpoint``)."""

    @property
    def base(self) -> str | None: ...

    @property
    def state(self) -> dict[str, Any]: ...

    @property
    def row_count(self) -> int: ...

    @property
    def rows_copied_aside(self) -> int: ...

    def write(self, ckpt_dir: str, shard_name: str) -> ShardFile: ...


def check_request(req: TableRequest, num_rows: int, where: str) -> tuple[Tensor, Tensor | None]:
    """Validate ``req`` (markers resolved) against a storage of ``num_rows`` rows; returns
    its bags as ``F.embedding_bag`` takes them: offsets int64 [P] with every single row its
    own bag, and per-row weights [N] (1 for single rows) or None."""
    rows, offsets, weights = req.rows, req.offsets, req.weights
    n = len(rows)
    if rows.dtype != torch.int64 or rows.dim() != 1 or offsets.dtype != torch.int64 or offsets.dim() != 1:
        raise ValueError(
            f"a lookup needs int64 rows [N] and offsets [P], got {rows.dtype} "
            f"{tuple(rows.shape)} and {offsets.dtype} {tuple(offsets.shape)}"
        )
    if n and (int(rows.min()) < 0 or int(rows.max()) >= num_rows):
        raise IndexError(
            f"{where}: rows outside this server's {num_rows} storage rows (range {int(rows.min())}..{int(rows.max())})"
        )
    if len(offsets) and (int(offsets[0]) < 0 or int(offsets[-1]) > n or bool((offsets[1:] < offsets[:-1]).any())):
        raise ValueError(f"{where}: pooled bag offsets must be nondecreasing within 0..{n}")
    singles = int(offsets[0]) if len(offsets) else n
    if weights is not None and (weights.dim() != 1 or len(weights) != n - singles):
        raise ValueError(f"{where}: {tuple(weights.shape)} weights for {n - singles} pooled rows")
    full = torch.cat([torch.arange(singles, dtype=torch.int64), offsets]) if len(offsets) else torch.arange(n)
    if weights is None:
        return full, None
    return full, torch.cat([torch.ones(singles, dtype=weights.dtype), weights])


class TableStorage(ABC):
    """A server's rows of every table and their optimizer state (module docstring)."""

    dim: int  # values per row
    num_rows: int  # storage rows (the address space; a lazy storage holds only those touched)

    @property
    @abstractmethod
    def handle(self) -> nn.Parameter:
        """The leaf ``[num_rows, dim]`` that training lookups' gradients land on (in the
        caller's autograd context); the server hands it to the modes as the tables' parameter."""

    @abstractmethod
    def lookup(self, req: TableRequest) -> Tensor:
        """Training: [P, dim] float32, one vector per single row and pooled bag; its backward
        leaves on ``handle`` one coalesced sparse gradient with every touched row once."""

    @abstractmethod
    def read(self, req: TableRequest) -> Tensor:
        """Evaluation: ``lookup``'s vectors without autograd; creates and changes nothing."""

    @abstractmethod
    def step(self, grad: Tensor, lr_factor: float = 1.0) -> int:
        """Apply the table optimizer, at ``lr_factor`` times its rate, to coalesced sparse
        ``grad`` [num_rows, dim] (storage rows, each once); returns the rows it changed."""

    @abstractmethod
    def assign(self, rows: Tensor, values: Tensor) -> None:
        """Storage rows ``rows`` (int64 [c], ascending) start afresh at ``values`` [c, dim]
        with zero optimizer state (a dynamic table's slot given to a new id)."""

    @abstractmethod
    def take_changed(self) -> Tensor:
        """Rows changed (``step``, ``assign``) since the previous call, int64 ascending."""

    @abstractmethod
    def begin_snapshot(self, name: str, base: str | None) -> StorageSnapshot:
        """Freeze the rows for checkpoint ``name``: differential on checkpoint ``base`` if
        that is the one this storage counted changes from, else every row. The caller holds
        the server's lock (no update runs), then writes the snapshot while updates go on."""

    # Whether ``freeze_rows`` can hand a forked writer its rows: private, contiguous CPU
    # tensors that hold every row (a disk tier's rows live in its store, not in the image).
    forks_writer: bool = False

    def freeze_rows(self, name: str, base: str | None, take: Callable[[FrozenRows], T]) -> T:
        """As ``begin_snapshot``, without copying: call ``take`` with the live rows (all, or
        those changed since checkpoint ``base``) while nothing can change them, and return its
        result (``take`` forks the writer: ``ps_train.checkpoint.forked_writer``). Only for a
        storage whose ``forks_writer`` is true; ``end_snapshot`` once written."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot hand its rows to a forked writer; use checkpoint.writer=thread"
        )

    @abstractmethod
    def end_snapshot(self, written: bool) -> None:
        """The snapshot's files are written, or failed (the next checkpoint is then full)."""

    @abstractmethod
    def load_state(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint's table entry (a snapshot's ``state`` with ``rows_files``)."""

    @abstractmethod
    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        """The rows and optimizer state in memory (small tables, tests and tools)."""

    @abstractmethod
    def counters(self) -> dict[str, Any]:
        """Cumulative counts: ``table_bytes`` (values held in RAM), ``table_rows_live``
        (rows updated at least once); a tier adds ``tier`` (a dict)."""

    def prefetch(self, rows: Tensor) -> None:
        """Rows (int64, storage rows) a coming request will name; a storage with a slower
        tier may start bringing them in. Never required for correctness."""
        del rows

    def close(self) -> None:  # noqa: B027 -- most storages hold nothing to release
        """Release files and threads (the server is done)."""
