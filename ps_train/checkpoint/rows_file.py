"""Table rows on disk: a server's embedding rows and their per-row optimizer state, in chunks.

A rows file (``ps<r>.rows`` in a checkpoint folder) holds, for some rows of a server's fused
table storage, every *column*: the weights ``[R, d]`` and each per-row optimizer tensor
(Adagrad's sums ``[R, d]``, row-wise Adagrad's ``[R]``, ...). A *full* file has every row; a
*differential* one only the rows changed since the checkpoint it builds on. Layout, all
little-endian::

    b"PSROWS1\\n"
    uint32 header length, then the header: JSON {"num_rows": R, "full": bool,
        "columns": [{"name", "dtype", "shape"}, ...]}   (shape: one row's, e.g. [64] or [])
    chunks, each: int64 n, int64 rows[n] (ascending within the chunk),
        then per column, in header order, its n rows' values (n * prod(shape) of dtype)
    int64 -1                                               (the end: a truncated file has none)

Chunks are written as a writer produces them (one per block of rows), so neither writing
nor reading holds more than a chunk beside the live tensors. The checkpoint manifest
records each file's size and checksum (``ps_train.checkpoint.files``). ``RowsStream`` gives
the same bytes from plain arrays, for a writer that must not use torch (a forked child,
``ps_train.checkpoint.forked_writer``).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np
import torch
from torch import Tensor

from ps_train.checkpoint.checksums import ALGORITHM, Checksum, hasher
from ps_train.checkpoint.direct_io import write_file_direct

__all__ = [
    "RowsHeader",
    "RowChunk",
    "RowsFileError",
    "write_rows_file",
    "rows_file_pieces",
    "read_rows_header",
    "apply_rows_file",
    "rows_file_chunks",
    "load_rows",
]

MAGIC = b"PSROWS1\n"
_END = -1


class RowsFileError(ValueError):
    """A rows file is malformed or does not fit the tensors it is loaded into."""


@dataclass(frozen=True)
class RowsHeader:
    num_rows: int
    full: bool
    columns: tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, dtype, one row's shape)
    # Lazy tables: the file holds every row that differs from its initial value; the others
    # are created again when touched (ps_train.workloads.ctr.tables.tiered_storage).
    lazy: bool = False

    @staticmethod
    def of(columns: Mapping[str, Tensor], full: bool) -> RowsHeader:
        """The header for live tensors ``columns`` (each [R, ...], the same R)."""
        sizes = {int(t.shape[0]) for t in columns.values()}
        if len(sizes) != 1:
            raise ValueError(f"row columns of different lengths: { {k: tuple(t.shape) for k, t in columns.items()} }")
        cols = tuple(
            (k, str(t.dtype).removeprefix("torch."), tuple(int(s) for s in t.shape[1:])) for k, t in columns.items()
        )
        return RowsHeader(sizes.pop(), full, cols)

    def to_json(self) -> str:
        out = {"num_rows": self.num_rows, "full": self.full, "columns": [list(c) for c in self.columns]}
        if self.lazy:
            out["lazy"] = True
        return json.dumps(out)

    def preamble(self) -> bytes:
        """The file's first bytes: the magic and this header."""
        encoded = self.to_json().encode("utf-8")
        return MAGIC + struct.pack("<I", len(encoded)) + encoded


class RowChunk(NamedTuple):
    rows: Tensor  # int64 [n], ascending
    values: tuple[Tensor, ...]  # per column, [n, *shape]


def write_rows_file(path: Path, header: RowsHeader, chunks: Iterable[RowChunk]) -> tuple[int, str]:
    """Write ``chunks`` under ``header`` atomically; the file's size and checksum. Around the
    page cache where the filesystem allows (``ps_train.checkpoint.direct_io``): a server's
    writer thread then spends a copy at memory speed per byte, not the page cache's copy and
    the flusher's write-back on the cores that train."""

    def pieces() -> Iterator[bytes | memoryview]:
        yield header.preamble()
        for chunk in chunks:
            yield struct.pack("<q", len(chunk.rows))
            # Views of the chunk's tensors, not copies: [n] int64, then [n, *shape] per column
            # (DirectFile copies each into its staging buffer before the next is asked for).
            yield chunk.rows.contiguous().numpy().data.cast("B")
            for v in chunk.values:
                yield _numpy(v.contiguous()).data.cast("B")
        yield struct.pack("<q", _END)

    size, digest, _ = write_file_direct(path, pieces(), hasher(ALGORITHM))
    return size, Checksum.of(ALGORITHM, digest)


def rows_file_pieces(
    header: RowsHeader, columns: Sequence[np.ndarray], wanted: np.ndarray | None, block: int
) -> Iterator[bytes | memoryview]:
    """A rows file's bytes, in order, for the rows ``wanted`` (bool [R]; None: all) of the
    arrays ``columns`` (each [R, ...], ``header``'s columns in order), ``block`` rows a chunk.
    NumPy only, no torch: a forked child writes with it (``ps_train.checkpoint.forked_writer``).
    A full file's values are views of ``columns``, not copies."""
    yield header.preamble()
    for lo in range(0, header.num_rows, block):
        hi = min(header.num_rows, lo + block)
        if wanted is None:
            rows = np.arange(lo, hi, dtype="<i8")
            values = [c[lo:hi] for c in columns]  # [n, *shape] views
        else:
            rows = np.flatnonzero(wanted[lo:hi]).astype("<i8") + lo
            if len(rows) == 0:
                continue
            values = [c[rows] for c in columns]  # [n, *shape] copies of the chosen rows
        yield struct.pack("<q", len(rows))
        yield rows.data.cast("B")
        for v in values:
            yield np.ascontiguousarray(v).data.cast("B")
    yield struct.pack("<q", _END)


def _numpy(t: Tensor) -> np.ndarray:
    """``t``'s values as numpy sees them (bfloat16, which numpy lacks, as its 16 bits)."""
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def _read_exact(f: BinaryIO, n: int, path: Path) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise RowsFileError(f"{path}: truncated (wanted {n} more bytes at offset {f.tell()})")
    return data


def _read_header(f: BinaryIO, path: Path) -> RowsHeader:
    if f.read(len(MAGIC)) != MAGIC:
        raise RowsFileError(f"{path} is not a ps_train rows file (bad magic)")
    (n,) = struct.unpack("<I", _read_exact(f, 4, path))
    try:
        raw = json.loads(_read_exact(f, n, path))
        cols = tuple((str(c[0]), str(c[1]), tuple(int(s) for s in c[2])) for c in raw["columns"])
        return RowsHeader(int(raw["num_rows"]), bool(raw["full"]), cols, bool(raw.get("lazy", False)))
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise RowsFileError(f"{path}: unreadable header: {e}") from e


def read_rows_header(path: str | os.PathLike[str]) -> RowsHeader:
    with open(path, "rb") as f:
        return _read_header(f, Path(path))


def _chunks(f: BinaryIO, header: RowsHeader, path: Path) -> Iterator[RowChunk]:
    # bfloat16, which numpy lacks, is read as its 16 bits and viewed back.
    dtypes = [np.dtype("int16" if c[1] == "bfloat16" else c[1]) for c in header.columns]
    while True:
        (n,) = struct.unpack("<q", _read_exact(f, 8, path))
        if n == _END:
            return
        if n < 0:
            raise RowsFileError(f"{path}: bad chunk length {n}")
        rows = torch.from_numpy(np.frombuffer(_read_exact(f, 8 * n, path), dtype="<i8").copy())
        values = []
        for (_, name, shape), dt in zip(header.columns, dtypes, strict=True):
            count = n * int(np.prod(shape, dtype=np.int64))
            raw = torch.from_numpy(np.frombuffer(_read_exact(f, count * dt.itemsize, path), dtype=dt).copy())
            if name == "bfloat16":
                raw = raw.view(torch.bfloat16)
            values.append(raw.reshape(n, *shape))
        yield RowChunk(rows, tuple(values))


def rows_file_chunks(path: str | os.PathLike[str]) -> Iterator[RowChunk]:
    """The chunks of rows file ``path``, in file order (``read_rows_header`` gives its columns)."""
    p = Path(path)
    with open(p, "rb") as f:
        header = _read_header(f, p)
        yield from _chunks(f, header, p)


def apply_rows_file(path: str | os.PathLike[str], columns: Mapping[str, Tensor], expect_full: bool) -> int:
    """Copy the rows of file ``path`` into the live tensors ``columns`` (by name; they must be
    the file's columns with its shapes); ``expect_full``: the file must hold every row (the
    first link of a chain). Returns the number of rows copied."""
    p = Path(path)
    with open(p, "rb") as f:
        header = _read_header(f, p)
        if header.lazy:
            raise RowsFileError(
                f"{p} holds lazy tables (only the rows touched); resume with the same model.lazy_rows, "
                "model.table_memory_budget and model.table_dtype"
            )
        mine = RowsHeader.of(columns, header.full)
        if mine.num_rows != header.num_rows or sorted(mine.columns) != sorted(header.columns):
            raise RowsFileError(
                f"{p} holds {header.num_rows} rows of {list(header.columns)}, this server's tables have "
                f"{mine.num_rows} rows of {list(mine.columns)}; resume with the same tables, "
                "model.embedding_dim, model.table_optim and cluster.num_servers"
            )
        if expect_full and not header.full:
            raise RowsFileError(f"{p} is differential; a chain must start with a full rows file")
        targets = [columns[c[0]] for c in header.columns]
        copied = 0
        with torch.no_grad():
            for chunk in _chunks(f, header, p):
                if len(chunk.rows) and (int(chunk.rows.min()) < 0 or int(chunk.rows.max()) >= header.num_rows):
                    raise RowsFileError(f"{p}: a chunk names rows outside 0..{header.num_rows - 1}")
                for target, v in zip(targets, chunk.values, strict=True):
                    target.index_copy_(0, chunk.rows, v)
                copied += len(chunk.rows)
        if header.full and copied != header.num_rows:
            raise RowsFileError(f"{p} is marked full but holds {copied} of {header.num_rows} rows")
    return copied


def load_rows(paths: Iterable[str | os.PathLike[str]]) -> dict[str, Tensor]:
    """The columns a chain of rows files (full one first) restores, as new tensors."""
    columns: dict[str, Tensor] = {}
    for i, path in enumerate(paths):
        if i == 0:
            header = read_rows_header(path)
            columns = {
                name: torch.zeros(header.num_rows, *shape, dtype=getattr(torch, dtype))
                for name, dtype, shape in header.columns
            }
        apply_rows_file(path, columns, expect_full=i == 0)
    return columns
