"""Which on-disk store for the tables' disk tier: RocksDB (rocksdict), LMDB, or a
memory-mapped row file, for the tier's access pattern.

Each store holds ``--rows`` rows of ``--dim`` half-precision values plus one float32 of
row-wise Adagrad state (the row's stored bytes), written once. Then ``--batches`` batches of
``--batch`` ids drawn with Zipf skew (exponent ``--zipf``) over the rows: a batched get of
the batch's distinct rows (what a miss brings back), and a batched put of half of them (the
dirty rows an eviction writes back). Printed per store: rows/s and MB/s of gets and puts,
the initial load's rate, and the bytes on disk. Run: ``python -m benchmarks.table_store_bench``
(about a minute on 2 cores); docs/tables.md has the figures that chose RocksDB.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import rocksdict


def zipf_ids(rng: np.random.Generator, n: int, rows: int, a: float) -> np.ndarray:
    """``n`` ids in [0, rows) with P(rank k) ~ 1 / k^a, ranks scattered over the ids."""
    ranks = np.minimum(rng.zipf(a, n) - 1, rows - 1)
    return (ranks * 2654435761) % rows  # a fixed permutation: hot ids are not the first rows


def disk_bytes(path: Path) -> int:
    return sum(os.stat(p).st_blocks * 512 for p in path.rglob("*") if p.is_file())


class Rocks:
    name = "rocksdict (RocksDB)"

    def __init__(self, path: Path, row_bytes: int, rows: int) -> None:
        opts = rocksdict.Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.set_compression_type(rocksdict.DBCompressionType.none())
        self.db = rocksdict.Rdict(str(path), opts)

    def put(self, ids: np.ndarray, values: list[bytes]) -> None:
        batch = rocksdict.WriteBatch(raw_mode=True)
        for i, v in zip(ids.tolist(), values, strict=True):
            batch.put(i.to_bytes(8, "big"), v)
        self.db.write(batch)

    def get(self, ids: np.ndarray) -> list[bytes | None]:
        return list(self.db.get([i.to_bytes(8, "big") for i in ids.tolist()]) or [])

    def close(self) -> None:
        self.db.close()


class Lmdb:
    name = "lmdb"

    def __init__(self, path: Path, row_bytes: int, rows: int) -> None:
        import lmdb  # optional (the store-bench extra): imported here so that --help and the other stores need none

        self.env = lmdb.open(str(path), map_size=4 * rows * (row_bytes + 64) + (1 << 26), sync=False, writemap=True)

    def put(self, ids: np.ndarray, values: list[bytes]) -> None:
        with self.env.begin(write=True) as txn:
            for i, v in zip(ids.tolist(), values, strict=True):
                txn.put(i.to_bytes(8, "big"), v)

    def get(self, ids: np.ndarray) -> list[bytes | None]:
        with self.env.begin() as txn:
            return [txn.get(i.to_bytes(8, "big")) for i in ids.tolist()]

    def close(self) -> None:
        self.env.close()


class RowFile:
    name = "memory-mapped row file"

    def __init__(self, path: Path, row_bytes: int, rows: int) -> None:
        path.mkdir()
        self.arr = np.lib.format.open_memmap(path / "rows.npy", "w+", np.uint8, (rows, row_bytes))

    def put(self, ids: np.ndarray, values: list[bytes]) -> None:
        self.arr[ids] = np.frombuffer(b"".join(values), np.uint8).reshape(len(ids), -1)

    def get(self, ids: np.ndarray) -> list[bytes | None]:
        block = self.arr[ids]
        return [block[i].tobytes() for i in range(len(ids))]

    def close(self) -> None:
        self.arr.flush()
        del self.arr


def run(store_cls: type[Rocks | Lmdb | RowFile], args: argparse.Namespace, root: Path) -> None:
    row_bytes = args.dim * 2 + 4
    path = root / store_cls.__name__
    store = store_cls(path, row_bytes, args.rows)
    rng = np.random.default_rng(0)
    payload = rng.integers(0, 256, (16384, row_bytes), dtype=np.uint8)
    values = [payload[i].tobytes() for i in range(len(payload))]
    t0 = time.perf_counter()
    for start in range(0, args.rows, len(values)):
        ids = np.arange(start, min(args.rows, start + len(values)))
        store.put(ids, values[: len(ids)])
    load = args.rows / (time.perf_counter() - t0)
    t_get = t_put = 0.0
    n_get = n_put = 0
    for _ in range(args.batches):
        ids = np.unique(zipf_ids(rng, args.batch, args.rows, args.zipf))
        t0 = time.perf_counter()
        got = store.get(ids)
        t_get += time.perf_counter() - t0
        assert all(v is not None and len(v) == row_bytes for v in got)
        dirty = ids[::2]
        t0 = time.perf_counter()
        store.put(dirty, values[: len(dirty)])
        t_put += time.perf_counter() - t0
        n_get, n_put = n_get + len(ids), n_put + len(dirty)
    store.close()
    mb = row_bytes / 1e6
    print(
        f"| {store_cls.name} | {n_get / t_get:,.0f} | {n_get * mb / t_get:.1f} | {n_put / t_put:,.0f} | "
        f"{n_put * mb / t_put:.1f} | {load:,.0f} | {disk_bytes(path) / 1e6:.0f} |",
        flush=True,
    )
    shutil.rmtree(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=65536, help="ids per batch (before dropping repeats)")
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--dir", default=None, help="where the stores go (default: a temporary folder)")
    args = p.parse_args()
    print(
        f"{args.rows:,} rows of {args.dim * 2 + 4} bytes; {args.batches} batches of {args.batch} Zipf({args.zipf}) ids"
    )
    print("| store | get rows/s | get MB/s | put rows/s | put MB/s | load rows/s | disk MB |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for cls in (Rocks, Lmdb, RowFile):
            if cls is Lmdb and importlib.util.find_spec("lmdb") is None:
                print("| lmdb | skipped: not installed (pip install -e '.[store-bench]') | | | | | |", flush=True)
                continue
            run(cls, args, Path(d))


if __name__ == "__main__":
    main()
