"""The manifest of a prepared Criteo folder (``python -m ps_train.prepare criteo SRC DST``) and
the checks ``data.prepared`` gets before a trainer maps its arrays.

A prepared folder holds four ``.npy`` arrays (row ``i`` of each is line ``i`` of the valid
lines, in the order ``read_criteo`` reads them) and ``manifest.json``: the format version, the
arrays' files, dtypes and shapes, the source files with their sizes and modification times,
and the line counts (read, kept, malformed). The checks stat files only; they read no rows.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "PREPARED_FORMAT",
    "PREPARED_VERSION",
    "MANIFEST_NAME",
    "NPY_HEADER_BYTES",
    "PREPARED_ARRAYS",
    "PreparedArray",
    "PreparedSource",
    "CriteoManifest",
    "PreparedDataError",
    "read_manifest",
]

PREPARED_FORMAT = "ps_train/criteo-prepared"
PREPARED_VERSION = 1
MANIFEST_NAME = "manifest.json"
NPY_HEADER_BYTES = 128  # the .npy header the writer reserves, whatever the row count
PREPARED_ARRAYS = ("labels", "dense", "hashes", "missing")
_REMEDY = "prepare it again: python -m ps_train.prepare criteo <Criteo file or folder> {folder}"


class PreparedDataError(ValueError):
    """A prepared folder cannot be used as it is (says what, where and how to fix)."""


@dataclass
class PreparedArray:
    """One array of a prepared folder: ``file`` (in the folder), numpy ``dtype`` string
    (e.g. ``<u4``) and ``shape`` (rows first)."""

    file: str
    dtype: str
    shape: list[int]

    def nbytes(self) -> int:
        itemsize = int(self.dtype[2:])  # a numpy type string: byte order, kind, size (<f4, <u4)
        n = 1
        for s in self.shape:
            n *= s
        return n * itemsize


@dataclass
class PreparedSource:
    """A source file as it was when prepared: size and mtime tell whether it changed since."""

    path: str
    size: int
    mtime_ns: int
    lines: int
    rows: int
    malformed: int


@dataclass
class CriteoManifest:
    """What ``manifest.json`` records. ``rows`` = valid lines = the arrays' first dimension;
    ``lines`` = ``rows + malformed``; ``skip_malformed``: whether malformed lines were skipped
    (else there are none)."""

    rows: int
    lines: int
    malformed: int
    skip_malformed: bool
    arrays: dict[str, PreparedArray]
    sources: list[PreparedSource]
    malformed_examples: list[str] = field(default_factory=list)
    dense: str = "log(max(x, 0) + 1) of each integer feature, empty = 0, float32"
    hashes: str = "each categorical's hex value as uint32, 0 where empty; missing bit k = C(k+1) empty"
    format: str = PREPARED_FORMAT
    version: int = PREPARED_VERSION
    created: str = ""
    seconds: float = 0.0  # the conversion's wall time
    cpu_seconds: float = 0.0  # and its CPU time, all threads

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CriteoManifest:
        d = dict(d)
        d["arrays"] = {k: PreparedArray(**v) for k, v in d["arrays"].items()}
        d["sources"] = [PreparedSource(**s) for s in d["sources"]]
        return cls(**d)


def read_manifest(folder: str) -> CriteoManifest:
    """The manifest of prepared folder ``folder``, after checking that the folder is one, in
    this version of the format, with every array whole, and that no source file still
    present has changed since (one moved away is fine: the arrays are all training needs).
    Raises ``FileNotFoundError`` / ``PreparedDataError`` saying what is wrong and how to fix it."""
    remedy = _REMEDY.format(folder=folder)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"data.prepared={folder!r} is not a folder; {remedy}")
    path = os.path.join(folder, MANIFEST_NAME)
    if not os.path.isfile(path):
        raise PreparedDataError(
            f"data.prepared={folder!r} has no {MANIFEST_NAME}, so it is not a folder written by "
            f"python -m ps_train.prepare (Criteo TSV files are read with data.root=...); {remedy}"
        )
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise PreparedDataError(f"{path}: cannot be read as JSON ({e}); {remedy}") from None
    if not isinstance(raw, dict) or raw.get("format") != PREPARED_FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else None
        raise PreparedDataError(
            f"{path}: not a prepared Criteo manifest (format {found!r}, expected {PREPARED_FORMAT!r}); {remedy}"
        )
    if raw.get("version") != PREPARED_VERSION:
        raise PreparedDataError(
            f"{path}: format version {raw.get('version')!r}, but this ps_train reads version "
            f"{PREPARED_VERSION}; {remedy}"
        )
    try:
        manifest = CriteoManifest.from_dict(raw)
    except (TypeError, KeyError, AttributeError) as e:
        raise PreparedDataError(f"{path}: incomplete or damaged manifest ({e}); {remedy}") from None
    if sorted(manifest.arrays) != sorted(PREPARED_ARRAYS):
        raise PreparedDataError(
            f"{path}: arrays {sorted(manifest.arrays)}, expected {sorted(PREPARED_ARRAYS)}; {remedy}"
        )
    for name, array in manifest.arrays.items():
        file = os.path.join(folder, array.file)
        want = NPY_HEADER_BYTES + array.nbytes()
        have = os.path.getsize(file) if os.path.isfile(file) else None
        if array.shape[:1] != [manifest.rows] or have != want:
            raise PreparedDataError(
                f"{file}: the {name} array is missing, truncated or changed ({have} bytes, the "
                f"manifest says {want} for {manifest.rows} rows); {remedy}"
            )
    for src in manifest.sources:
        try:
            st = os.stat(src.path)
        except FileNotFoundError:
            continue
        if (st.st_size, st.st_mtime_ns) != (src.size, src.mtime_ns):
            raise PreparedDataError(
                f"data.prepared={folder!r} was made from {src.path} ({src.size} bytes, modified at "
                f"{src.mtime_ns / 1e9:.0f} s), which has changed since ({st.st_size} bytes, modified at "
                f"{st.st_mtime_ns / 1e9:.0f} s); the arrays may not hold its lines: {remedy}"
            )
    return manifest
