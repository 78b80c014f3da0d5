"""Saving a server's table rows while training goes on: changed-row tracking and
copy-on-write snapshots by blocks.

A checkpoint of the tables must hold the rows (and their optimizer state) exactly as they
were when it was taken, yet the optimizer keeps changing them while the file is written.
Copying gigabytes first would stall every update for seconds; so:

- ``RowSnapshot`` freezes the live tensors (*columns*: weights ``[R, d]`` and per-row
  optimizer state, all ``[R, ...]``) at the moment it is made, restricted to some rows
  (all of them, or the rows changed since the last checkpoint). Each of those rows is
  captured once, copy-on-write: by the writer, which copies ``BLOCK_ROWS`` rows at a time
  and writes the copy, or, if an update is about to change it first (``before_update``),
  by that update, which copies that row aside for the writer. Either copy is the row before
  any change after the snapshot, so the file holds the snapshot's state; an update waits at
  most for a copy of its own rows not captured yet (what it is about to write anyway),
  never for the file. (Copying whole blocks aside would not do: Zipf ids touch a few tail
  rows of nearly every block at every step.)
- The writer takes the hottest blocks (most changed rows since the last checkpoint) first,
  so that updates find their frequent rows captured already; rows copied aside live until
  written, so the extra memory is at most the rows updates change during the write.
- ``TableServer`` (``ps_train.workloads.ctr.tables.service``) marks every row an update changes in a
  bitmap (one byte per row); a differential checkpoint writes the rows marked since the
  previous checkpoint, and resets the bitmap.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ps_train.checkpoint.files import ShardFile
from ps_train.checkpoint.rows_file import RowChunk, RowsHeader, write_rows_file

__all__ = ["BLOCK_ROWS", "RowSnapshot", "TableSnapshot"]

BLOCK_ROWS = 4096  # rows the writer copies at a time: 1 MiB of dim-64 float32 rows


class RowSnapshot:
    """The rows ``wanted`` (bool [R]; None: all) of ``columns`` as they are now, handed out
    in chunks (``chunks``) while the columns keep changing, provided every change is
    announced first with ``before_update``. ``hot`` (bool [R]): rows changed recently, whose
    blocks are written first."""

    def __init__(
        self, columns: Mapping[str, Tensor], wanted: Tensor | None, hot: Tensor | None = None, block: int = BLOCK_ROWS
    ) -> None:
        self.columns = tuple(columns.values())
        self.num_rows = int(self.columns[0].shape[0])
        self.block = block
        self.wanted = wanted
        # A row is captured once: by the writer, or copied aside by an update first.
        self._taken = torch.zeros(self.num_rows, dtype=torch.bool) if wanted is None else ~wanted
        self.rows = self.num_rows if wanted is None else int(wanted.sum())
        nblocks = math.ceil(self.num_rows / block)
        if wanted is None:
            blocks = torch.arange(nblocks)
        else:
            blocks = torch.unique_consecutive(torch.div(wanted.nonzero().squeeze(1), block, rounding_mode="floor"))
        self._order = self._hot_first(blocks, hot)
        self._aside: list[RowChunk] = []
        self._lock = threading.Lock()
        self.rows_copied_aside = 0

    def _hot_first(self, blocks: Tensor, hot: Tensor | None) -> list[int]:
        if hot is None or len(blocks) == 0:
            return blocks.tolist()
        padded = torch.zeros(math.ceil(self.num_rows / self.block) * self.block, dtype=torch.int32)
        padded[: self.num_rows] = hot
        counts = padded.view(-1, self.block).sum(1)[blocks]  # changed rows per block
        return blocks[torch.argsort(counts, descending=True, stable=True)].tolist()

    def _capture(self, rows: Tensor) -> RowChunk:
        """Copies of ``rows`` (ascending) of every column; marks them taken. Under the lock."""
        self._taken[rows] = True
        return RowChunk(rows, tuple(c.index_select(0, rows) for c in self.columns))

    def before_update(self, rows: Tensor) -> None:
        """Call before changing ``rows`` (int64 [U], ascending) of the columns: copies aside
        those the writer has not captured yet (the update's own rows only)."""
        # Racy read, safe: a row only ever becomes taken, under the lock, so one seen taken
        # here stays so; one seen not taken is checked again under the lock.
        if bool(self._taken[rows].all()):
            return
        with self._lock:
            pending = rows[~self._taken[rows]]
            if len(pending):
                self._aside.append(self._capture(pending))
                self.rows_copied_aside += len(pending)

    def chunks(self) -> Iterator[RowChunk]:
        """The snapshot's rows, a block at a time, and the rows updates copied aside (for
        the writer; once). Every row comes exactly once."""
        for b in self._order:
            lo, hi = b * self.block, min(self.num_rows, (b + 1) * self.block)
            with self._lock:
                aside, self._aside = self._aside, []
                free = ~self._taken[lo:hi]  # [hi - lo]: rows of the block still to capture
                if bool(free.all()):  # the whole block: a slice copy
                    self._taken[lo:hi] = True
                    chunk = RowChunk(torch.arange(lo, hi), tuple(c[lo:hi].clone() for c in self.columns))
                else:
                    chunk = self._capture(free.nonzero().squeeze(1) + lo)
            yield from aside
            if len(chunk.rows):
                yield chunk
        with self._lock:
            aside, self._aside = self._aside, []
        yield from aside


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
