"""Saving a server's table rows while training goes on: changed-row tracking and
copy-on-write snapshots by blocks.

A checkpoint of the tables must hold the rows (and their optimizer state) exactly as they
were when it was taken, yet the optimizer keeps changing them while the file is written.
Copying gigabytes first would stall every update for seconds; so:

- ``RowSnapshot`` freezes the live tensors (*columns*: weights ``[R, d]`` and per-row
  optimizer state, all ``[R, ...]``) at the moment it is made, restricted to some rows
  (all of them, or the rows changed since the last checkpoint), by blocks of
  ``BLOCK_ROWS`` rows. A block is *pending* until it is captured, once: either by the
  writer, which copies its selected rows when it gets to it and writes that copy, or by an
  update about to change one of its rows first (``before_update``), which copies it aside
  for the writer. Either way the copy is of the block before any change after the snapshot,
  so the file is the snapshot's state; an update waits at most for the copy of the blocks
  it touches (a few MB), never for the file.
- The writer takes the hottest blocks (most changed rows since the last checkpoint) first,
  so few updates meet a pending block; blocks copied aside live until written, so the
  extra memory is at most the snapshot's rows, and in practice the hot blocks only.
- ``TableServer`` (``ps_train.ctr.table_server``) marks every row an update changes in a
  bitmap (one byte per row); a differential checkpoint writes the rows marked since the
  previous checkpoint, and resets the bitmap.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping

import torch
from torch import Tensor

from ps_train.checkpoint.rows_file import RowChunk

__all__ = ["BLOCK_ROWS", "RowSnapshot"]

BLOCK_ROWS = 4096  # 1 MiB of dim-64 float32 rows: a copy-on-write costs ~0.1 ms
_OUT, _PENDING, _TAKEN = 0, 1, 2


class RowSnapshot:
    """The rows ``selected`` (int64 [K], ascending; None: all) of ``columns`` as they are now,
    handed out block by block (``chunks``) while the columns keep changing, provided every
    change is announced first with ``before_update``. ``hot`` (bool [R]): rows changed
    recently, whose blocks are written first."""

    def __init__(
        self, columns: Mapping[str, Tensor], selected: Tensor | None, hot: Tensor | None = None, block: int = BLOCK_ROWS
    ) -> None:
        self.columns = tuple(columns.values())
        self.num_rows = int(self.columns[0].shape[0])
        self.block = block
        nblocks = math.ceil(self.num_rows / block)
        self.selected = selected
        self._state = torch.zeros(nblocks, dtype=torch.uint8)
        if selected is None:
            blocks = torch.arange(nblocks)
            self._bounds = None
        else:
            of = torch.div(selected, block, rounding_mode="floor")
            blocks = torch.unique_consecutive(of)
            starts = torch.searchsorted(of, blocks)
            # block b's selected rows: selected[_bounds[b, 0]:_bounds[b, 1]]
            self._bounds = torch.zeros(nblocks, 2, dtype=torch.int64)
            self._bounds[blocks, 0] = starts
            self._bounds[blocks, 1] = torch.cat([starts[1:], torch.tensor([len(selected)])])
        self._state[blocks] = _PENDING
        self._order = self._hot_first(blocks, hot)
        self._aside: dict[int, RowChunk] = {}
        self._lock = threading.Lock()
        self.blocks_copied_aside = 0

    @property
    def rows(self) -> int:
        """Rows in the snapshot."""
        return self.num_rows if self.selected is None else len(self.selected)

    def _hot_first(self, blocks: Tensor, hot: Tensor | None) -> list[int]:
        if hot is None or len(blocks) == 0:
            return blocks.tolist()
        padded = torch.zeros(len(self._state) * self.block, dtype=torch.int32)
        padded[: self.num_rows] = hot
        counts = padded.view(-1, self.block).sum(1)[blocks]  # changed rows per block
        return blocks[torch.argsort(counts, descending=True, stable=True)].tolist()

    def _capture(self, b: int) -> RowChunk:
        lo, hi = b * self.block, min(self.num_rows, (b + 1) * self.block)
        if self._bounds is None or self.selected is None:
            return RowChunk(torch.arange(lo, hi), tuple(c[lo:hi].clone() for c in self.columns))
        rows = self.selected[int(self._bounds[b, 0]) : int(self._bounds[b, 1])]
        return RowChunk(rows, tuple(c.index_select(0, rows) for c in self.columns))

    def before_update(self, rows: Tensor) -> None:
        """Call before changing ``rows`` (int64 [U]) of the columns: copies aside the
        pending blocks among theirs."""
        blocks = torch.unique(torch.div(rows, self.block, rounding_mode="floor"))
        # Racy read, safe: a block only ever leaves _PENDING, under the lock, so one seen
        # not pending here stays so; a stale "pending" is checked again under the lock.
        hit = blocks[self._state[blocks] == _PENDING]
        if len(hit) == 0:
            return
        with self._lock:
            for b in hit.tolist():
                if self._state[b] == _PENDING:
                    self._aside[b] = self._capture(b)
                    self._state[b] = _TAKEN
                    self.blocks_copied_aside += 1

    def chunks(self) -> Iterator[RowChunk]:
        """The snapshot's rows, a block at a time (for the writer; once)."""
        for b in self._order:
            with self._lock:
                chunk = self._aside.pop(b, None)
                if chunk is None:
                    chunk = self._capture(b)
                    self._state[b] = _TAKEN
            yield chunk
