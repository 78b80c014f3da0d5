"""The disk tier's store: a server's table rows that do not fit its RAM budget, in RocksDB.

Chosen by measurement (``benchmarks/table_store_bench.py``, docs/tables.md): for batched
gets and puts of rows with Zipf-skewed ids, RocksDB (through ``rocksdict``, as FBGEMM's SSD
tables and TorchRec's key-value tables use it) against LMDB and memory-mapped row files.

A row is one key-value pair: the key its storage row as 8 big-endian bytes (so the store
iterates in row order), the value its bytes as ``TieredStorage`` packs them (the row's
values in the table dtype, then its optimizer state). ``RowStore`` puts and gets batches,
takes RocksDB's own checkpoint (hard links of its immutable files: milliseconds, whatever
the size), and names the setting to change when the disk is full.

The folder holds ``ps_train_store.json`` (format version, the row layout, the run) beside
RocksDB's files: a store left by another run or by another format is refused, never
mixed with this run's rows.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import rocksdict

__all__ = ["RowStore", "StoreError", "STORE_FORMAT", "STORE_RAM_BYTES", "iter_store"]

STORE_FORMAT = 1
_META = "ps_train_store.json"
_KEY = struct.Struct(">q")
_BLOCK_CACHE = 16 << 20  # bytes
_MEMTABLE = 16 << 20  # bytes per memtable
_MEMTABLES = 2  # at most, the one being written and the one being flushed
_METADATA_BLOCK = 4096  # bytes per partition of a file's index and bloom filter
# What RocksDB's block cache (data blocks, index and bloom filter partitions) and memtables
# take at most, whatever the rows stored: a budget that can pay for them besides one step's
# rows does (``TieredStorage``), so the rows' share is smaller by it.
STORE_RAM_BYTES = _BLOCK_CACHE + _MEMTABLES * _MEMTABLE


class StoreError(RuntimeError):
    """The disk tier cannot be used or written (a foreign store, a full disk)."""


def _options() -> rocksdict.Options:
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    # Rows are written once per eviction and read back at random: no compression (row
    # values do not compress), a bloom filter so that a row never stored costs no read.
    opts.set_compression_type(rocksdict.DBCompressionType.none())
    table = rocksdict.BlockBasedOptions()
    table.set_bloom_filter(10, False)
    # The RAM pool is the rows' cache, so RocksDB's own is kept small: a 16 MB block cache,
    # memtables of 16 MB, at most 2 (the defaults allow 2 x 64 MB of memtables besides the
    # cache); the budget pays for them (STORE_RAM_BYTES).
    table.set_block_cache(rocksdict.Cache(_BLOCK_CACHE))
    # The files' bloom filters and index blocks go inside that cache, in partitions of
    # _METADATA_BLOCK bytes loaded as reads need them: outside it (RocksDB's default) every
    # open file kept its whole filter and index resident, ~2.6 bytes per stored row version,
    # growing with the rows written (~50 MB per server after 300 steps of preset=dlrmv2).
    # Pinned in the cache, so that a read finds its partition without a disk read first:
    # each file's top-level index of its partitions (an entry per 4 KB partition, ~1/100 of
    # its metadata) and the whole metadata of the few small level-0 files.
    table.set_cache_index_and_filter_blocks(True)
    table.set_index_type(rocksdict.BlockBasedIndexType.two_level_index_search())
    table.set_partition_filters(True)
    table.set_metadata_block_size(_METADATA_BLOCK)
    table.set_pin_top_level_index_and_filter(True)
    table.set_pin_l0_filter_and_index_blocks_in_cache(True)
    opts.set_block_based_table_factory(table)
    opts.set_write_buffer_size(_MEMTABLE)
    opts.set_max_write_buffer_number(_MEMTABLES)
    return opts


class RowStore:
    """The rows at ``path`` (a folder, created here); ``layout``: what a row's bytes hold
    (checked against a store found there); ``where``: the server, for messages."""

    def __init__(self, path: Path, layout: dict[str, Any], where: str) -> None:
        self.path, self.where, self.layout = path, where, layout
        meta = path / _META
        if path.exists() and any(path.iterdir()):
            found: Any = None
            if meta.is_file():
                try:
                    found = json.loads(meta.read_text())
                except ValueError:
                    found = None
            if not isinstance(found, dict) or found.get("format") != STORE_FORMAT:
                raise StoreError(
                    f"{where}: {path} holds a table store of another format or program ({found!r}); this ps_train "
                    f"writes format {STORE_FORMAT}. Delete that folder or start the run in a new folder "
                    "(checkpoints, not the store, are what resume reads)"
                )
            raise StoreError(
                f"{where}: {path} holds a table store left by another run ({found.get('layout')}); a run's "
                "store starts empty (resume restores the tables from a checkpoint). Delete that folder or start "
                "the run in a new folder"
            )
        path.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps({"format": STORE_FORMAT, "layout": layout}))
        self.db = rocksdict.Rdict(str(path / "rocksdb"), _options())
        self.bytes_written = 0
        self.bytes_read = 0

    def get(self, rows: Sequence[int]) -> list[bytes | None]:
        """Each row's bytes, or None where the store has none."""
        if not rows:
            return []
        out: list[bytes | None] = list(self.db.get([_KEY.pack(r) for r in rows]) or [])
        self.bytes_read += sum(len(v) for v in out if v is not None)
        return out

    def put(self, rows: Sequence[int], values: Sequence[bytes]) -> None:
        """Store each row's bytes (one write batch)."""
        if not rows:
            return
        batch = rocksdict.WriteBatch(raw_mode=True)
        for r, v in zip(rows, values, strict=True):
            batch.put(_KEY.pack(r), v)
        try:
            self.db.write(batch)
        except Exception as e:  # rocksdict raises a plain Exception carrying RocksDB's status
            raise StoreError(
                f"{self.where}: the table store at {self.path} could not write {len(rows)} rows ({e}). If the disk "
                "is full, free space there or raise model.table_memory_budget (fewer rows go to disk); the "
                "latest complete checkpoint still resumes"
            ) from e
        self.bytes_written += sum(len(v) for v in values)

    def memory(self) -> dict[str, int]:
        """RocksDB's own memory now, in bytes: ``table_readers`` (what its open files hold
        outside the block cache: a few KB a file), ``block_cache`` (data blocks and index and
        filter partitions: 16 MB at most, but for pinned entries), ``block_cache_pinned`` (the
        pinned ones) and ``memtables``."""
        props = {
            "table_readers": "rocksdb.estimate-table-readers-mem",
            "block_cache": "rocksdb.block-cache-usage",
            "block_cache_pinned": "rocksdb.block-cache-pinned-usage",
            "memtables": "rocksdb.cur-size-all-mem-tables",
        }
        return {name: int(self.db.property_int_value(prop) or 0) for name, prop in props.items()}

    def checkpoint(self, path: Path) -> None:
        """RocksDB's checkpoint of the store at ``path`` (hard links; a new folder)."""
        try:
            rocksdict.Checkpoint(self.db).create_checkpoint(str(path))
        except Exception as e:
            raise StoreError(f"{self.where}: could not checkpoint the table store into {path} ({e})") from e

    def clear(self) -> None:
        """Drop every row (a restore starts from an empty store)."""
        self.db.close()
        shutil.rmtree(self.path / "rocksdb", ignore_errors=True)
        self.db = rocksdict.Rdict(str(self.path / "rocksdb"), _options())

    def close(self) -> None:
        self.db.close()


def iter_store(path: Path, batch: int = 4096) -> Iterator[tuple[list[int], list[bytes]]]:
    """The rows of a store checkpoint at ``path`` (``RowStore.checkpoint``), ascending, in
    batches of ``batch``: (rows, their bytes)."""
    db = rocksdict.Rdict(str(path), _options())
    try:
        rows: list[int] = []
        values: list[bytes] = []
        for k, v in db.items():
            assert isinstance(k, bytes) and isinstance(v, bytes)  # raw mode
            rows.append(_KEY.unpack(k)[0])
            values.append(v)
            if len(rows) == batch:
                yield rows, values
                rows, values = [], []
        if rows:
            yield rows, values
    finally:
        db.close()
