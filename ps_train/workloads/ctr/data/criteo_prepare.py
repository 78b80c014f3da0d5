"""``prepare_criteo``: Criteo TSV files (plain or gzip) -> a prepared folder of ``.npy`` arrays
that trainers memory-map (``data.prepared``; see ``ps_train.workloads.ctr.data.prepared`` for the format).

The input streams through in blocks of ``block_bytes`` of complete lines, so memory stays
bounded whatever its size: a reader thread reads (and decompresses) the next blocks, a pool
of ``workers`` threads parses blocks (``criteo_columns.parse_block``: pyarrow and numpy, both
run without the GIL most of the time), and the calling thread appends each block's rows to
the arrays in line order. Everything is written into a hidden folder beside ``dst`` and
renamed to ``dst`` only when complete, so ``dst`` is either absent or whole.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import shutil
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ps_train.workloads.ctr.data.criteo import (
    _MAX_EXAMPLES,
    NUM_CAT_FEATURES,
    NUM_INT_FEATURES,
    CriteoFormatError,
    CriteoStats,
    PathLike,
    find_criteo_files,
)
from ps_train.workloads.ctr.data.criteo_columns import CriteoColumns, parse_block, parse_lines
from ps_train.workloads.ctr.data.gunzip import AUTO, inflater
from ps_train.workloads.ctr.data.line_blocks import BLOCK_BYTES, LinePiece, PieceReader
from ps_train.workloads.ctr.data.prepared import (
    MANIFEST_NAME,
    NPY_HEADER_BYTES,
    CriteoManifest,
    PreparedArray,
    PreparedDataError,
    PreparedSource,
)
from ps_train.workloads.ctr.data.progress import Progress

__all__ = ["prepare_criteo", "BLOCK_BYTES"]

log = logging.getLogger("ps_train.workloads.ctr")

_ARRAYS = {  # name: (file, dtype, row shape)
    "labels": ("labels.npy", np.dtype("<f4"), ()),
    "dense": ("dense.npy", np.dtype("<f4"), (NUM_INT_FEATURES,)),
    "hashes": ("hashes.npy", np.dtype("<u4"), (NUM_CAT_FEATURES,)),
    "missing": ("missing.npy", np.dtype("<u4"), ()),
}


class _NpyWriter:
    """A ``.npy`` file written a block of rows at a time; the header (with the row count) is
    rewritten in place at the end -- it has the same size whatever the count."""

    def __init__(self, path: str, dtype: np.dtype, row_shape: tuple[int, ...]) -> None:
        self.path, self.dtype, self.row_shape, self.rows = path, dtype, row_shape, 0
        self.f = open(path, "wb")
        self._header()

    def _header(self) -> None:
        self.f.seek(0)
        np.lib.format.write_array_header_1_0(
            self.f, {"descr": self.dtype.str, "fortran_order": False, "shape": (self.rows, *self.row_shape)}
        )
        if self.f.tell() != NPY_HEADER_BYTES:
            raise AssertionError(f"{self.path}: a .npy header of {self.f.tell()} bytes, expected {NPY_HEADER_BYTES}")

    def append(self, rows: np.ndarray) -> None:
        if rows.dtype != self.dtype or rows.shape[1:] != self.row_shape:
            raise AssertionError(
                f"{self.path}: rows {rows.dtype} {rows.shape}, expected {self.dtype} [n, *{self.row_shape}]"
            )
        self.f.write(np.ascontiguousarray(rows).data)
        self.rows += len(rows)

    def close(self) -> PreparedArray:
        self._header()
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return PreparedArray(os.path.basename(self.path), self.dtype.str, [self.rows, *self.row_shape])


def _files(src: PathLike | Sequence[PathLike]) -> list[str]:
    """The source files in ``read_criteo``'s order: a file, a folder's day files, or a list."""
    if isinstance(src, (str, os.PathLike)):
        p = os.fspath(src)
        files = find_criteo_files(p) if os.path.isdir(p) else [p]
    else:
        files = [os.fspath(p) for p in src]
    if not files:
        raise ValueError("prepare criteo: no source files given")
    for p in files:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"prepare criteo: file not found: {p}")
    return [os.path.abspath(p) for p in files]


def _remove_stale_partials(parent: str, name: str) -> None:
    """Hidden folders left by a ``prepare`` of ``name`` that was killed (its process is gone)."""
    pattern = re.compile(rf"^\.{re.escape(name)}\.partial-(\d+)$")
    for entry in os.listdir(parent):
        m = pattern.match(entry)
        if m and int(m.group(1)) != os.getpid():
            try:
                os.kill(int(m.group(1)), 0)
            except ProcessLookupError:
                log.warning("prepare criteo: removing %s, left by an interrupted run", os.path.join(parent, entry))
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
            except PermissionError:
                pass  # another user's live process


class _Sink:
    """The consuming side: rows appended in line order, lines counted per file, malformed
    lines raised or counted (``skip_malformed``), progress shown."""

    def __init__(self, folder: str, files: list[str], skip_malformed: bool, progress: Progress | None) -> None:
        self.writers = {
            name: _NpyWriter(os.path.join(folder, file), dtype, shape) for name, (file, dtype, shape) in _ARRAYS.items()
        }
        self.skip_malformed, self.progress = skip_malformed, progress
        self.stats = CriteoStats(files=list(files))
        self.sizes = {p: os.path.getsize(p) for p in files}
        self.done_bytes = 0  # of the files already finished
        self.file_lines = self.file_rows = 0
        self.sources: list[PreparedSource] = []
        self.stat = {p: os.stat(p) for p in files}

    def add(self, path: str, cols: CriteoColumns) -> None:
        for i, problem in cols.malformed:
            line = self.file_lines + i + 1
            if not self.skip_malformed:
                raise CriteoFormatError(path, line, problem)
            st = self.stats
            st.malformed += 1
            st.malformed_per_file[path] = st.malformed_per_file.get(path, 0) + 1
            if len(st.examples) < _MAX_EXAMPLES:
                st.examples.append(f"{path}, line {line}: {problem}")
        for name, writer in self.writers.items():
            writer.append(getattr(cols, name))
        self.file_lines += cols.lines
        self.file_rows += len(cols)
        self.stats.lines += cols.lines
        self.stats.samples += len(cols)

    def piece_done(self, piece: LinePiece) -> None:
        if piece.problem:
            raise CriteoFormatError(piece.path, self.file_lines + 1, piece.problem, piece.remedy)
        if piece.end:
            before, now = self.stat[piece.path], os.stat(piece.path)
            if (now.st_size, now.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
                raise PreparedDataError(
                    f"prepare criteo: {piece.path} changed while it was being read; prepare again once it is complete"
                )
            malformed = self.stats.malformed_per_file.get(piece.path, 0)
            self.sources.append(
                PreparedSource(
                    piece.path, before.st_size, before.st_mtime_ns, self.file_lines, self.file_rows, malformed
                )
            )
            self.done_bytes += self.sizes[piece.path]
            self.file_lines = self.file_rows = 0
        if self.progress is not None:
            pos = 0 if piece.end else piece.pos
            self.progress.update(self.stats.lines, self.done_bytes + pos, os.path.basename(piece.path))

    def close(self) -> dict[str, PreparedArray]:
        return {name: writer.close() for name, writer in self.writers.items()}

    def discard(self) -> None:
        for writer in self.writers.values():
            writer.f.close()


def prepare_criteo(
    src: PathLike | Sequence[PathLike],
    dst: PathLike,
    *,
    skip_malformed: bool = False,
    force: bool = False,
    workers: int | None = None,
    block_bytes: int = BLOCK_BYTES,
    progress: Progress | bool = True,
    gunzip: str = AUTO,
) -> CriteoManifest:
    """Convert the Criteo files ``src`` (a file, a folder of day files, or a list, in
    ``read_criteo``'s order) into the prepared folder ``dst`` and return its manifest.

    A malformed line raises ``CriteoFormatError`` (file, line, problem) unless
    ``skip_malformed``, which counts and skips it (the manifest records how many). ``dst``
    must not exist unless ``force`` (then it is replaced once the new one is complete).
    ``progress``: True for a progress line on stderr, or a ``Progress``. ``gunzip``: the
    inflater of gzip files (``ps_train.workloads.ctr.data.gunzip``: ``auto``, ``isal`` or ``zlib``).
    """
    t0, cpu0 = time.perf_counter(), time.process_time()
    inflate = inflater(gunzip)
    files = _files(src)
    dst = os.path.abspath(os.fspath(dst))
    parent, name = os.path.split(dst)
    if os.path.exists(dst):
        if not force:
            raise FileExistsError(
                f"prepare criteo: {dst} exists; remove it, choose another destination, or pass --force to replace it"
            )
        inside = [f for f in files if os.path.commonpath([f, dst]) == dst]
        if inside:
            raise ValueError(
                f"prepare criteo: --force would replace {dst}, which holds the source {inside[0]}; "
                "choose another destination"
            )
    os.makedirs(parent, exist_ok=True)
    _remove_stale_partials(parent, name)
    partial = os.path.join(parent, f".{name}.partial-{os.getpid()}")
    os.makedirs(partial)
    bar = (
        Progress(sum(os.path.getsize(p) for p in files), label="prepare criteo")
        if progress is True
        else progress or None
    )
    workers = max(1, workers if workers is not None else (os.cpu_count() or 1))
    reader = PieceReader(files, block_bytes, depth=workers + 1, inflate=inflate)
    sink: _Sink | None = None
    try:
        sink = _Sink(partial, files, skip_malformed, bar)
        reader.start()
        with ThreadPoolExecutor(workers, thread_name_prefix="prepare-parse") as pool:
            pending: collections.deque[tuple[LinePiece, Future[CriteoColumns] | None]] = collections.deque()
            try:
                while True:
                    item = reader.out.get()
                    if item is None:
                        break
                    if isinstance(item, BaseException):
                        raise item
                    job = None
                    if item.block:
                        job = pool.submit(parse_block, item.block)
                    elif item.last:
                        job = pool.submit(parse_lines, [item.last])
                    pending.append((item, job))
                    while len(pending) > workers:
                        _consume(sink, *pending.popleft())
                while pending:
                    _consume(sink, *pending.popleft())
            finally:
                for _, job in pending:
                    if job is not None:
                        job.cancel()
        arrays = sink.close()
        if bar is not None:
            bar.close()
        stats = sink.stats
        if stats.samples == 0:
            raise ValueError(
                f"prepare criteo: no valid samples in {', '.join(files)} "
                f"({stats.lines} lines, {stats.malformed} malformed)"
            )
        if stats.malformed:
            log.warning(
                "prepare criteo: skipped %d malformed of %d lines (%s); first: %s",
                stats.malformed,
                stats.lines,
                ", ".join(f"{os.path.basename(p)}: {c}" for p, c in stats.malformed_per_file.items()),
                stats.examples[0],
            )
        manifest = CriteoManifest(
            rows=stats.samples,
            lines=stats.lines,
            malformed=stats.malformed,
            skip_malformed=skip_malformed,
            arrays=arrays,
            sources=sink.sources,
            malformed_examples=list(stats.examples),
            created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            seconds=round(time.perf_counter() - t0, 3),
            cpu_seconds=round(time.process_time() - cpu0, 3),
        )
        _write_manifest(partial, manifest)
        _replace(partial, dst)
        return manifest
    except BaseException:
        reader.stop.set()
        if sink is not None:
            sink.discard()
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        reader.stop.set()


def _consume(sink: _Sink, piece: LinePiece, job: Future[CriteoColumns] | None) -> None:
    if job is not None:
        sink.add(piece.path, job.result())
    sink.piece_done(piece)


def _write_manifest(folder: str, manifest: CriteoManifest) -> None:
    path = os.path.join(folder, MANIFEST_NAME)
    with open(path, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())


def _replace(partial: str, dst: str) -> None:
    """``partial`` becomes ``dst`` (renames within one folder: atomic)."""
    old = None
    if os.path.exists(dst):
        old = f"{partial}.old"
        os.rename(dst, old)
    os.rename(partial, dst)
    fd = os.open(os.path.dirname(dst), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if old is not None:
        shutil.rmtree(old)
