"""CTR splits read from a prepared Criteo folder (``data.prepared``), memory-mapped.

``MappedCtrSplit`` is a ``CtrDataset`` over rows ``[start, stop)`` of the folder's arrays
(``np.load(mmap_mode="r")``): nothing is loaded up front; a batch reads its rows from the
page cache (or disk) and hashes their raw categorical values into table rows as
``read_criteo`` does -- row 0 for an empty value, ``1 + v % (size - 1)`` otherwise -- so the
same lines give the same batches, bit for bit, as training from the TSV files. A trainer
touches only the pages of the rows its batches hold; the operating system shares and evicts
those pages, so a process's own memory stays that of a batch whatever the dataset's size.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch
from torch import Tensor

from ps_train.workloads.ctr.data.criteo import EMPTY_ROW, NUM_CAT_FEATURES, NUM_INT_FEATURES, _table_sizes
from ps_train.workloads.ctr.data.prepared import CriteoManifest, PreparedDataError, read_manifest
from ps_train.workloads.ctr.data.split import held_out_count

__all__ = ["PreparedCriteo", "MappedCtrSplit", "load_prepared", "skipped_note"]

log = logging.getLogger("ps_train.workloads.ctr")

_BITS = np.arange(NUM_CAT_FEATURES, dtype=np.uint32)


class PreparedCriteo:
    """The four arrays of a prepared folder, memory-mapped (checked against its manifest)."""

    def __init__(self, folder: str, manifest: CriteoManifest | None = None) -> None:
        """``manifest``: the folder's, already checked (``read_manifest``); read here if None."""
        self.folder = folder
        self.manifest = manifest if manifest is not None else read_manifest(folder)
        arrays = {}
        for name, spec in self.manifest.arrays.items():
            a = np.load(os.path.join(folder, spec.file), mmap_mode="r")
            if a.dtype.str != spec.dtype or list(a.shape) != spec.shape:
                raise PreparedDataError(
                    f"{os.path.join(folder, spec.file)}: {a.dtype.str} {list(a.shape)}, but the "
                    f"manifest says {spec.dtype} {spec.shape}; prepare the folder again"
                )
            arrays[name] = a
        self.labels, self.dense = arrays["labels"], arrays["dense"]  # float32 [N], [N, 13]
        self.hashes, self.missing = arrays["hashes"], arrays["missing"]  # uint32 [N, 26], [N]

    def __len__(self) -> int:
        return self.manifest.rows


class MappedCtrSplit:
    """Rows ``[start, stop)`` of ``data`` with tables of ``table_sizes`` rows (a ``CtrDataset``)."""

    num_dense = NUM_INT_FEATURES
    num_tables = NUM_CAT_FEATURES

    def __init__(self, data: PreparedCriteo, start: int, stop: int, table_sizes: list[int]) -> None:
        if not 0 <= start <= stop <= len(data):
            raise ValueError(f"MappedCtrSplit: rows [{start}, {stop}) outside the {len(data)} of {data.folder}")
        self.data, self.start, self.stop = data, start, stop
        self.table_sizes = _table_sizes(table_sizes)
        self._mods = np.array(self.table_sizes, dtype=np.int64) - 1  # [26]

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: slice | Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(dense float32 [B, 13], ids int64 [B, 26], labels float32 [B])`` of the samples a
        slice (step 1) or an index tensor selects."""
        n = len(self)
        if isinstance(index, slice):
            lo, hi, step = index.indices(n)
            if step != 1:
                raise ValueError("MappedCtrSplit: slices must have step 1")
            rows: slice | np.ndarray = slice(self.start + lo, self.start + max(hi, lo))
        else:
            idx = index.numpy().astype(np.int64, copy=False)
            if idx.ndim != 1 or (len(idx) and (idx.min() < 0 or idx.max() >= n)):
                raise IndexError(f"MappedCtrSplit: indices must be a 1-d tensor in [0, {n})")
            rows = idx + self.start
        d = self.data
        ids = d.hashes[rows].astype(np.int64) % self._mods + 1  # [B, 26]
        empty = (d.missing[rows][:, None] >> _BITS) & 1  # [B, 26]
        ids[empty.astype(bool)] = EMPTY_ROW
        return (
            torch.from_numpy(np.array(d.dense[rows])),
            torch.from_numpy(ids),
            torch.from_numpy(np.array(d.labels[rows])),
        )

    def positive_rate(self) -> float:
        """Fraction of label-1 samples (reads every label of the split)."""
        if not len(self):
            return float("nan")
        return float(np.asarray(self.data.labels[self.start : self.stop], np.float64).mean())


def skipped_note(m: CriteoManifest, folder: str, skip_malformed: bool) -> str | None:
    """One line on the malformed lines ``prepare`` skipped in ``folder`` (None: it skipped
    none); raises ``PreparedDataError`` if it skipped some and ``skip_malformed`` is off:
    training from those files would have stopped at the first of them."""
    if not m.malformed:
        return None
    first = m.malformed_examples[0] if m.malformed_examples else "?"
    if not skip_malformed:
        raise PreparedDataError(
            f"data.prepared={folder!r}: prepare skipped {m.malformed} malformed of {m.lines} lines (first: "
            f"{first}); training from those files would stop at the first of them: set "
            "data.skip_malformed=true to train on the valid lines"
        )
    return f"data=criteo: skipped {m.malformed} malformed of {m.lines} lines when {folder} was prepared; first: {first}"


def load_prepared(
    folder: str,
    table_sizes: list[int],
    test_fraction: float,
    *,
    skip_malformed: bool = False,
    manifest: CriteoManifest | None = None,
) -> tuple[MappedCtrSplit, MappedCtrSplit]:
    """``(train, test)`` of prepared folder ``folder`` (``manifest``: its checked manifest, or
    None to read it): the last ``test_fraction`` of the rows are the test split, as
    ``load_criteo``'s ``time_split`` makes them.

    A folder prepared with malformed lines skipped is refused unless ``skip_malformed``:
    training from its TSV files would have stopped at the first of them.
    """
    data = PreparedCriteo(folder, manifest)
    note = skipped_note(data.manifest, folder, skip_malformed)
    if note:
        log.warning("%s", note)
    n = len(data)
    n_test = held_out_count(n, test_fraction)
    return (MappedCtrSplit(data, 0, n - n_test, table_sizes), MappedCtrSplit(data, n - n_test, n, table_sizes))
