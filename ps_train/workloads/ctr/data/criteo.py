"""Reader for the Criteo display-advertising logs (``data=criteo``) from local files.

Format (the Kaggle ``train.txt`` and the Terabyte ``day_0`` .. ``day_23`` files alike): one
sample per line, 40 tab-separated fields -- the label (0 or 1), 13 integer features I1..I13
and 26 categorical features C1..C26, each a hex string (8 characters in the released data;
any length is accepted). Any feature may be empty. Files may be plain text or gzip
(recognised by the gzip magic bytes, whatever the file is called).

What a line becomes:

- dense: an empty integer is 0, a negative one is clamped to 0, then ``log(x + 1)`` (as DLRM's
  loaders do): counts span orders of magnitude and the log keeps them in a trainable range;
- ids: for a table of ``size`` rows, an empty categorical goes to row 0 and a value ``v``
  (the hex parsed as an integer) to row ``1 + v % (size - 1)``. Row 0 is reserved so
  "missing" -- informative in itself -- never shares a row with a real value; the values
  are already 32-bit hashes, so the modulo spreads them evenly (DLRM's ``max-ind-range``
  does the same). Every id is in ``[0, size)`` by construction.

A malformed line (not 40 fields, a label other than 0/1, a non-integer I field, a non-hex
C field) raises ``CriteoFormatError`` naming the file, the 1-based line number and the
problem; with ``skip_malformed=True`` (the config's ``data.skip_malformed=true``) such
lines are counted in ``CriteoStats`` and skipped, and one warning gives the count. A line
ending in ``\\r\\n`` is accepted.

Speed and size: this is a plain Python parser (tens of thousands of lines per second)
that holds everything in memory -- right for test files and samples of a few million
lines. For the full files (~45M lines in Kaggle's, ~195M in a Terabyte day),
``python -m ps_train.prepare criteo`` converts them once, with the same semantics, into
memory-mapped arrays (``ps_train.workloads.ctr.data.criteo_prepare``, ``ps_train.workloads.ctr.data.mapped``).
"""

from __future__ import annotations

import array
import gzip
import logging
import os
import re
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO, Union

import numpy as np

if TYPE_CHECKING:
    from ps_train.workloads.ctr.data.split import CtrSplit

__all__ = [
    "CriteoFormatError",
    "CriteoStats",
    "read_criteo",
    "load_criteo",
    "find_criteo_files",
    "check_criteo_files",
    "criteo_row",
    "NUM_INT_FEATURES",
    "NUM_CAT_FEATURES",
    "EMPTY_ROW",
]

log = logging.getLogger("ps_train.workloads.ctr")

NUM_INT_FEATURES = 13
NUM_CAT_FEATURES = 26
_NUM_FIELDS = 1 + NUM_INT_FEATURES + NUM_CAT_FEATURES
EMPTY_ROW = 0  # the row of an empty categorical field, in every table
_HEX_DIGITS = b"0123456789abcdefABCDEF"
_MAX_EXAMPLES = 5  # malformed-line messages kept in CriteoStats
CHECKED_LINES = 1000  # lines of each file check_criteo_files parses: milliseconds, before any role starts

PathLike = Union[str, "os.PathLike[str]"]


class CriteoFormatError(ValueError):
    """A line (or a compressed stream) of a Criteo file is not in the expected format.

    ``path`` and ``line`` (1-based) say where; ``problem`` says what is wrong.
    """

    def __init__(self, path: str, line: int, problem: str, remedy: str | None = None) -> None:
        self.path, self.line, self.problem = path, line, problem
        remedy = remedy or (
            "fix or delete that line, or set data.skip_malformed=true (read_criteo(..., "
            "skip_malformed=True)) to count and skip malformed lines with a warning"
        )
        super().__init__(
            f"{path}, line {line}: {problem}. Expected 40 tab-separated fields: label "
            f"0/1, 13 integers I1-I13, 26 hex strings C1-C26 (any may be empty except "
            f"the label); {remedy}"
        )


@dataclass
class CriteoStats:
    """What ``read_criteo`` read: ``lines`` seen, ``samples`` kept, ``malformed`` skipped (in
    total and per file), the first few malformed-line messages, and the files in order."""

    files: list[str] = field(default_factory=list)
    lines: int = 0
    samples: int = 0
    malformed: int = 0
    malformed_per_file: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    def skipped_note(self) -> str | None:
        """One line saying how many malformed lines were skipped, where, and the first; None if none."""
        if not self.malformed:
            return None
        per_file = ", ".join(f"{os.path.basename(p)}: {c}" for p, c in self.malformed_per_file.items())
        return (
            f"data=criteo: skipped {self.malformed} malformed of {self.lines} lines ({per_file}); "
            f"first: {self.examples[0]}"
        )


class _Malformed(Exception):
    pass


def criteo_row(value: bytes | str, size: int) -> int:
    """The row of categorical ``value`` (hex, or empty) in a table of ``size >= 2`` rows."""
    if isinstance(value, str):
        value = value.encode("ascii")
    if value == b"":
        return EMPTY_ROW
    if value.translate(None, _HEX_DIGITS):
        raise ValueError(f"{value!r} is not a hex string")
    return 1 + int(value, 16) % (size - 1)


def _show(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="backslashreplace")
    return repr(text if len(text) <= 40 else text[:37] + "...")


# A whole well-formed line in one match, at C speed; only lines it rejects go through the
# field-by-field parser, which says what is wrong.
_LINE = re.compile(rb"([01])" + rb"\t(-?[0-9]+|)" * NUM_INT_FEATURES + rb"\t([0-9a-fA-F]*)" * NUM_CAT_FEATURES)


def _parse(line: bytes, mods: list[int]) -> tuple[float, list[float], list[int]]:
    """``(label, 13 integer values clamped to >= 0 as floats, 26 rows)`` of one line without
    its line ending; raises ``_Malformed``."""
    m = _LINE.fullmatch(line)
    if m is not None:
        g = m.groups()
        try:
            ints = [float(max(int(f), 0)) if f else 0.0 for f in g[1 : 1 + NUM_INT_FEATURES]]
        except OverflowError:
            return _parse_fields(line, mods)
        rows = [
            1 + int(f, 16) % mod if f else EMPTY_ROW for f, mod in zip(g[1 + NUM_INT_FEATURES :], mods, strict=True)
        ]
        return (1.0 if g[0] == b"1" else 0.0), ints, rows
    return _parse_fields(line, mods)


def _parse_fields(line: bytes, mods: list[int]) -> tuple[float, list[float], list[int]]:
    """``_parse``, one field at a time, with a precise message for the first bad field."""
    fields = line.split(b"\t")
    if len(fields) != _NUM_FIELDS:
        hint = ""
        if len(fields) == _NUM_FIELDS - 1:
            hint = " (39 fields is the layout of the unlabelled Kaggle test.txt, which cannot be trained on)"
        elif len(fields) == 1:
            hint = " (an empty line, or not tab-separated)"
        raise _Malformed(f"{len(fields)} tab-separated fields instead of 40{hint}")
    label = fields[0]
    if label != b"0" and label != b"1":
        raise _Malformed(f"the label is {_show(label)}, not 0 or 1")
    ints: list[float] = []
    for j in range(1, 1 + NUM_INT_FEATURES):
        f = fields[j]
        if not f:
            ints.append(0.0)
            continue
        digits = f[1:] if f[:1] == b"-" else f
        # isdigit on bytes is ASCII-only; int() alone would also take "+5", " 5" and "5_0".
        if not digits.isdigit():
            raise _Malformed(f"integer feature I{j} (field {j + 1}) is {_show(f)}, not an integer")
        try:
            ints.append(float(max(int(f), 0)))
        except OverflowError:  # beyond float64 (over 300 digits)
            raise _Malformed(f"integer feature I{j} (field {j + 1}) is too large") from None
    rows: list[int] = []
    for k, j in enumerate(range(1 + NUM_INT_FEATURES, _NUM_FIELDS)):
        f = fields[j]
        if not f:
            rows.append(EMPTY_ROW)
        elif f.translate(None, _HEX_DIGITS):
            raise _Malformed(f"categorical feature C{k + 1} (field {j + 1}) is {_show(f)}, not a hex string")
        else:
            rows.append(1 + int(f, 16) % mods[k])
    return (1.0 if label == b"1" else 0.0), ints, rows


def _open(path: str) -> BinaryIO:
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
    """``(1-based line number, line without its line ending)``; a damaged gzip stream is a
    ``CriteoFormatError`` at the line where it broke."""
    n = 0
    with _open(path) as f:
        it = iter(f)
        while True:
            try:
                raw = next(it)
            except StopIteration:
                return
            except (EOFError, gzip.BadGzipFile, zlib.error) as e:
                raise CriteoFormatError(
                    path, n + 1, f"the gzip stream is damaged or truncated ({e})", "re-download or re-compress the file"
                ) from e
            n += 1
            if raw.endswith(b"\n"):
                raw = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1]
            yield n, raw


def _table_sizes(table_sizes: int | Sequence[int]) -> list[int]:
    sizes = [int(table_sizes)] * NUM_CAT_FEATURES if isinstance(table_sizes, int) else [int(s) for s in table_sizes]
    if len(sizes) != NUM_CAT_FEATURES:
        raise ValueError(
            f"table_sizes: Criteo has {NUM_CAT_FEATURES} categorical features, got {len(sizes)} "
            "sizes; give 26 sizes or one size for all tables"
        )
    if min(sizes) < 2:
        raise ValueError(
            f"table_sizes: {min(sizes)} rows is too few; a table needs row {EMPTY_ROW} for "
            "empty values plus at least one row for the hashed ones"
        )
    return sizes


_DAY_FILE = re.compile(r"^(?:day_(\d+)|train)(?:\.txt)?(?:\.gz)?$")


def find_criteo_files(folder: PathLike) -> list[str]:
    """The Criteo files in ``folder`` in time order: ``day_0``, ``day_1``, ... ``day_23`` (by
    number; optional ``.txt``/``.gz``) or the Kaggle ``train.txt`` (optionally ``.gz``)."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"data=criteo: {folder} is not a folder")
    days: dict[int, list[str]] = {}
    for name in sorted(os.listdir(folder)):
        m = _DAY_FILE.match(name)
        if m and os.path.isfile(os.path.join(folder, name)):
            days.setdefault(int(m.group(1)) if m.group(1) is not None else -1, []).append(name)
    if not days:
        raise FileNotFoundError(
            f"data=criteo: no Criteo files in {folder}; expected day_0 .. day_23 "
            "(Terabyte, optionally .gz) or train.txt (Kaggle, optionally .gz)"
        )
    dupes = [names for names in days.values() if len(names) > 1]
    if dupes:
        raise ValueError(f"data=criteo: {folder} holds the same data twice: {', '.join(dupes[0])}; keep one")
    if -1 in days and len(days) > 1:
        raise ValueError(
            f"data=criteo: {folder} mixes Kaggle's {days[-1][0]} with Terabyte day files, "
            "whose features differ; keep one dataset per folder"
        )
    return [os.path.join(folder, days[d][0]) for d in sorted(days)]


def _resolve(paths: PathLike | Sequence[PathLike]) -> list[str]:
    """The files ``paths`` names (a file, a folder of day files, or a list), each checked to exist."""
    if isinstance(paths, (str, os.PathLike)):
        p = os.fspath(paths)
        files = find_criteo_files(p) if os.path.isdir(p) else [p]
    else:
        files = [os.fspath(p) for p in paths]
    if not files:
        raise ValueError("read_criteo: no files given")
    for p in files:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"data=criteo: file not found: {p}")
    return files


def check_criteo_files(
    paths: PathLike | Sequence[PathLike],
    table_sizes: int | Sequence[int],
    *,
    head: int = CHECKED_LINES,
    skip_malformed: bool = False,
) -> list[str]:
    """Before a run reads them: the files ``read_criteo(paths, ...)`` would read exist and open,
    and the first ``head`` lines of each parse (with ``skip_malformed``, only that they can
    be read). Returns the files. Raises what ``read_criteo`` would for those lines
    (``CriteoFormatError`` naming the file and line, ``FileNotFoundError``); a problem
    further into a file is found only by reading it all."""
    files = _resolve(paths)
    mods = [s - 1 for s in _table_sizes(table_sizes)]
    for path in files:
        for n, line in _lines(path):
            if n > head:
                break
            if skip_malformed:
                continue
            try:
                _parse(line, mods)
            except _Malformed as e:
                raise CriteoFormatError(path, n, str(e)) from None
    return files


def read_criteo(
    paths: PathLike | Sequence[PathLike], table_sizes: int | Sequence[int], *, skip_malformed: bool = False
) -> tuple[CtrSplit, CriteoStats]:
    """Read Criteo files into one ``CtrSplit`` (dense [N, 13], ids [N, 26], labels [N]).

    ``paths``: a file, a folder (see ``find_criteo_files``) or a list of files, read and
    concatenated in the given order. ``table_sizes``: rows per categorical table, 26 of them
    or one for all, each >= 2 (see the module docstring for the hashing).
    """
    files = _resolve(paths)
    sizes = _table_sizes(table_sizes)
    mods = [s - 1 for s in sizes]
    # Compact typed buffers: a Python list would cost ~8x the memory per value.
    labels, dense, ids = array.array("f"), array.array("d"), array.array("q")
    stats = CriteoStats(files=list(files))
    for path in files:
        for n, line in _lines(path):
            stats.lines += 1
            try:
                y, x, r = _parse(line, mods)
            except _Malformed as e:
                err = CriteoFormatError(path, n, str(e))
                if not skip_malformed:
                    raise err from None
                stats.malformed += 1
                stats.malformed_per_file[path] = stats.malformed_per_file.get(path, 0) + 1
                if len(stats.examples) < _MAX_EXAMPLES:
                    stats.examples.append(f"{path}, line {n}: {e}")
                continue
            labels.append(y)
            dense.extend(x)
            ids.extend(r)
    stats.samples = len(labels)
    note = stats.skipped_note()
    if note:
        log.warning("%s", note)
    if stats.samples == 0:
        raise ValueError(
            f"data=criteo: no valid samples in {', '.join(files)} ({stats.lines} lines, {stats.malformed} malformed)"
        )
    # torch is imported here, not with the module: the converter (python -m ps_train.prepare)
    # uses this module's format and must start without it.
    import torch

    from ps_train.workloads.ctr.data.split import CtrSplit

    dense_np = np.log1p(np.frombuffer(dense, dtype=np.float64)).astype(np.float32)
    split = CtrSplit(
        torch.from_numpy(dense_np.reshape(-1, NUM_INT_FEATURES)),
        torch.from_numpy(np.frombuffer(ids, dtype=np.int64).reshape(-1, NUM_CAT_FEATURES).copy()),
        torch.from_numpy(np.frombuffer(labels, dtype=np.float32).copy()),
        sizes,
    )
    return split, stats


def load_criteo(
    paths: PathLike | Sequence[PathLike],
    table_sizes: int | Sequence[int],
    test_fraction: float,
    *,
    skip_malformed: bool = False,
) -> tuple[CtrSplit, CtrSplit, CriteoStats]:
    """``(train, test, stats)``: ``read_criteo`` then ``time_split`` -- the last
    ``test_fraction`` of the lines (of the last file(s), in the given order) are the test
    split, because Criteo's lines are in time order and a CTR model is judged on the future."""
    from ps_train.workloads.ctr.data.split import time_split

    split, stats = read_criteo(paths, table_sizes, skip_malformed=skip_malformed)
    train, test = time_split(split, test_fraction)
    return train, test, stats
