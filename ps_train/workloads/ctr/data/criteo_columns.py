"""Vectorised parsing of Criteo lines into raw columns (``python -m ps_train.prepare``).

A block of complete lines (each ending in ``\\n``) goes through pyarrow's CSV tokenizer (tab
delimiter, no quoting: a field is exactly the bytes between two tabs) into 40 string
columns; numpy then turns those into the columns prepared data keeps:

- ``labels`` float32 [n]; ``dense`` float32 [n, 13]: ``log(max(x, 0) + 1)``, empty -> 0;
- ``hashes`` uint32 [n, 26]: each categorical's hex value, 0 where empty -- not yet reduced
  to a table row, so ``data.table_rows`` can change without preparing again;
- ``missing`` uint32 [n]: bit k set when C(k+1) is empty (row 0 of its table).

Semantics are ``read_criteo``'s, line for line. The vectorised checks pass only lines whose
every field is plainly well formed (label 0/1, an integer of at most 18 digits after an
optional minus, hex of at most 8 digits); any other line goes to the reader's own
field-by-field parser, which accepts it (a 30-digit integer is fine) or names the problem.
One difference: a categorical above 32 bits (more than 8 significant hex digits) is malformed
here, because prepared data stores Criteo's 32-bit hashes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from ps_train.workloads.ctr.data.criteo import NUM_CAT_FEATURES, NUM_INT_FEATURES, _Malformed, _parse_fields, _show

__all__ = ["CriteoColumns", "parse_block", "parse_lines"]

_NUM_FIELDS = 1 + NUM_INT_FEATURES + NUM_CAT_FEATURES
_NAMES = [f"f{j}" for j in range(_NUM_FIELDS)]
_ONES = [1] * NUM_CAT_FEATURES  # table "sizes" for the reader's checks: rows are not wanted here
# pyarrow tokenizes in pieces of about this size, each a batch of columns for numpy: small
# enough for the CPU caches (32 MiB pieces take ~1.5x the time per line), large enough that
# the ~500 numpy calls per batch cost little per line.
_TOKENIZE_BYTES = 4 << 20
_MAX_DIGITS = 18  # at most 18 decimal digits fit int64 whatever they are
_MINUS = (ord("-") - ord("0")) & 0xFF  # '-' after subtracting '0' from every byte

# Hex digit -> value, 255 for any other byte; and the same for a pair of bytes read as one
# little-endian uint16 (first character in the low byte): value 0..255, 0xFFFF if either is bad.
_HEX_DIGIT = np.full(256, 255, np.uint8)
for _v, _c in enumerate(b"0123456789abcdef"):
    _HEX_DIGIT[_c] = _v
for _v, _c in enumerate(b"ABCDEF"):
    _HEX_DIGIT[_c] = 10 + _v
_pair = np.arange(1 << 16)
_hi, _lo = _HEX_DIGIT[_pair & 0xFF].astype(np.uint16), _HEX_DIGIT[_pair >> 8].astype(np.uint16)
_HEX_PAIR = np.where((_hi == 255) | (_lo == 255), 0xFFFF, (_hi << 4) | _lo).astype(np.uint16)
del _pair, _hi, _lo

# log1p of 0 .. 65535 as read_criteo computes it: most counts are small, and a lookup is
# ~10x cheaper than the log.
_LOG1P_TABLE_SIZE = 1 << 16
_LOG1P_TABLE = np.log1p(np.arange(_LOG1P_TABLE_SIZE, dtype=np.float64)).astype(np.float32)

_CONVERT = pacsv.ConvertOptions(
    column_types=dict.fromkeys(_NAMES, pa.string()), strings_can_be_null=False, check_utf8=False
)


@dataclass
class CriteoColumns:
    """The rows a block of lines gave (malformed lines left out), in line order."""

    labels: np.ndarray  # float32 [n]
    dense: np.ndarray  # float32 [n, 13]
    hashes: np.ndarray  # uint32 [n, 26]
    missing: np.ndarray  # uint32 [n], bit k: C(k+1) empty
    lines: int  # lines read, malformed ones included
    malformed: list[tuple[int, str]] = field(default_factory=list)  # (0-based line in the block, problem)

    def __len__(self) -> int:
        return len(self.labels)


class _Rows:
    """Per-line values being filled in, before the log and the dropping of malformed lines.
    Feature-major ([13, lines], [26, lines]): the vectorised path fills one feature at a time."""

    def __init__(self, n: int) -> None:
        self.labels = np.zeros(n, np.float32)
        self.ints = np.zeros((NUM_INT_FEATURES, n), np.float64)  # clamped to >= 0
        self.hashes = np.zeros((NUM_CAT_FEATURES, n), np.uint32)
        self.missing = np.zeros(n, np.uint32)
        self.keep = np.ones(n, bool)
        self.malformed: list[tuple[int, str]] = []

    def put(self, i: int, line: bytes) -> None:
        """Line ``i`` through the reader's parser: its values, or malformed."""
        try:
            self.labels[i], self.ints[:, i], self.hashes[:, i], self.missing[i] = _parse_line(line)
        except _Malformed as e:
            self.keep[i] = False
            self.malformed.append((i, str(e)))

    def take(self, at: np.ndarray, other: _Rows) -> None:
        """Lines ``at`` are ``other``'s lines, in order."""
        self.labels[at], self.ints[:, at], self.hashes[:, at], self.missing[at] = (
            other.labels,
            other.ints,
            other.hashes,
            other.missing,
        )
        self.keep[at] = other.keep
        self.malformed += [(int(at[i]), problem) for i, problem in other.malformed]

    def columns(self) -> CriteoColumns:
        labels, ints, hashes, missing = self.labels, self.ints, self.hashes, self.missing
        if not self.keep.all():
            keep = self.keep
            labels, ints, hashes, missing = labels[keep], ints[:, keep], hashes[:, keep], missing[keep]
        dense = _log1p(ints)
        self.malformed.sort()
        return CriteoColumns(
            labels,
            np.ascontiguousarray(dense.T),
            np.ascontiguousarray(hashes.T),
            missing,
            len(self.labels),
            self.malformed,
        )


def _log1p(ints: np.ndarray) -> np.ndarray:
    """float32 ``log(x + 1)`` of float64 counts, as ``read_criteo`` computes it (float64 log,
    then float32): from a table for the small counts most values are, computed for the rest."""
    small = np.minimum(ints, _LOG1P_TABLE_SIZE - 1).astype(np.int64)
    out = np.take(_LOG1P_TABLE, small)
    large = ints >= _LOG1P_TABLE_SIZE
    if large.any():
        out[large] = np.log1p(ints[large]).astype(np.float32)
    return out


def _parse_line(line: bytes) -> tuple[float, list[float], list[int], int]:
    """``(label, 13 integers clamped to >= 0, 26 hashes, missing bits)`` of one line without
    its line ending, with ``read_criteo``'s checks and messages; raises ``_Malformed``."""
    label, ints, _ = _parse_fields(line, _ONES)
    fields = line.split(b"\t")
    hashes, missing = [], 0
    for k in range(NUM_CAT_FEATURES):
        f = fields[1 + NUM_INT_FEATURES + k]
        value = int(f, 16) if f else 0
        if value >> 32:
            raise _Malformed(
                f"categorical feature C{k + 1} (field {k + 15}) is {_show(f)}, above 32 bits; "
                "prepared data keeps Criteo's 32-bit hashes (read_criteo accepts it)"
            )
        hashes.append(value)
        missing |= (not f) << k
    return label, ints, hashes, missing


def parse_lines(lines: list[bytes]) -> CriteoColumns:
    """Lines without their line endings, one at a time (the reader's speed): for the few
    lines a block cannot take, e.g. a last line with no ``\\n``."""
    rows = _Rows(len(lines))
    for i, line in enumerate(lines):
        rows.put(i, line)
    return rows.columns()


def parse_block(block: bytes, threads: bool = False) -> CriteoColumns:
    """The rows of ``block``: complete lines, each ending in ``\\n`` (``\\r\\n`` too).
    ``threads``: let pyarrow tokenize with its thread pool."""
    if not block:
        return parse_lines([])
    if not block.endswith(b"\n"):
        raise ValueError("parse_block: a block must end with a line ending")
    # pyarrow also ends a line at a lone \r, which the reader keeps as a byte of the field.
    if b"\r" not in block or block.count(b"\r") == block.count(b"\r\n"):
        rows = _tokenized(block, threads)
        if rows is not None:
            return rows.columns()
    # Some line does not have 40 fields or holds a stray \r: split the lines here; those go
    # through the reader's parser, the rest through the vectorised path again.
    lines = block.split(b"\n")[:-1]
    lines = [ln[:-1] if ln.endswith(b"\r") else ln for ln in lines]
    clean = [i for i, ln in enumerate(lines) if ln.count(b"\t") == _NUM_FIELDS - 1 and b"\r" not in ln]
    rows = _Rows(len(lines))
    if clean:
        sub = _tokenized(b"\n".join(lines[i] for i in clean) + b"\n", threads)
        if sub is None:
            raise AssertionError("parse_block: lines of 40 fields without \\r did not tokenize one row each")
        rows.take(np.array(clean), sub)
    for i in sorted(set(range(len(lines))) - set(clean)):
        rows.put(i, lines[i])
    return rows.columns()


def _tokenized(block: bytes, threads: bool) -> _Rows | None:
    """The lines of ``block`` through pyarrow; None if some line did not give exactly one row
    of 40 fields. ``block`` holds no lone \\r."""
    odd: list[int] = []

    def on_odd_row(row: object) -> str:
        odd.append(1)
        return "skip"

    parse = pacsv.ParseOptions(
        delimiter="\t",
        quote_char=False,
        escape_char=False,
        double_quote=False,
        newlines_in_values=False,
        ignore_empty_lines=False,
        invalid_row_handler=on_odd_row,
    )
    read = pacsv.ReadOptions(column_names=_NAMES, use_threads=threads, block_size=_TOKENIZE_BYTES + (64 << 10))
    table = pacsv.read_csv(pa.py_buffer(block), read, parse, _CONVERT)
    if odd:
        return None
    rows = _Rows(table.num_rows)
    suspect = np.zeros(table.num_rows, bool)
    start = 0
    for batch in table.to_batches():
        stop = start + batch.num_rows
        _convert(batch, rows, start, stop, suspect[start:stop])
        start = stop
    bad = np.flatnonzero(suspect)
    if len(bad):
        # Lines the vectorised checks did not pass: through the reader's parser, from the text.
        ends = np.flatnonzero(np.frombuffer(block, np.uint8) == ord("\n"))
        if len(ends) != table.num_rows:
            return None
        for i in bad.tolist():
            line = block[(ends[i - 1] + 1 if i else 0) : ends[i]]
            rows.put(i, line[:-1] if line.endswith(b"\r") else line)
    return rows


def _strings(column: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(offsets int32 [n + 1], bytes uint8, lengths int32 [n])`` of a string column (views,
    no copies). A null (only a line without 40 fields gives one) has length 0."""
    _, offsets, data = column.buffers()
    off = np.frombuffer(offsets, np.int32, len(column) + 1, column.offset * 4)
    chars = np.frombuffer(data, np.uint8) if data is not None and data.size else np.zeros(0, np.uint8)
    return off, chars, np.diff(off)


def _convert(batch: pa.RecordBatch, rows: _Rows, start: int, stop: int, suspect: np.ndarray) -> None:
    """Rows ``start:stop`` from one batch of tokenized lines; ``suspect[i]``: line ``start + i``
    needs the reader's parser."""
    if any(column.null_count for column in batch.columns):
        suspect |= np.logical_or.reduce([column.is_null().to_numpy(zero_copy_only=False) for column in batch.columns])
    off, chars, lens = _strings(batch.column(0))
    one = lens == 1
    label = np.zeros(len(one), np.uint8)
    label[one] = chars[off[:-1][one]]
    rows.labels[start:stop] = label == ord("1")
    suspect |= (label != ord("0")) & (label != ord("1"))
    for j in range(NUM_INT_FEATURES):
        rows.ints[j, start:stop] = _integers(batch.column(1 + j), suspect)
    missing = rows.missing[start:stop]
    for k in range(NUM_CAT_FEATURES):
        rows.hashes[k, start:stop], empty = _hex(batch.column(1 + NUM_INT_FEATURES + k), suspect)
        missing |= empty.astype(np.uint32) << k


def _value_of(byte: np.ndarray, off: np.ndarray) -> np.ndarray:
    """The value each byte (an index into the column's bytes) belongs to."""
    return np.searchsorted(off, byte, side="right") - 1


def _integers(column: pa.Array, suspect: np.ndarray) -> np.ndarray:
    """An integer column as float64 [n], clamped to >= 0, empty -> 0; marks in ``suspect``
    the values that are not ``-?[0-9]{1,18}`` (and leaves them 0)."""
    off, chars, lens = _strings(column)
    digits = chars[off[0] : off[-1]] - np.uint8(ord("0"))  # other bytes wrap to > 9
    bad = lens > _MAX_DIGITS
    other = np.flatnonzero(digits > 9)
    if len(other):
        byte = other + off[0]
        at = _value_of(byte, off)
        sign = (digits[other] == _MINUS) & (off[at] == byte) & (lens[at] >= 2)  # a leading minus
        bad[at[~sign]] = True
    suspect |= bad
    # pyarrow parses the checked strings; empty and bad ones are marked null for it.
    _, offsets, data = column.buffers()
    ok = (lens != 0) & ~bad
    checked = pa.StringArray.from_buffers(
        len(column), offsets.slice(column.offset * 4), data, pa.py_buffer(np.packbits(ok, bitorder="little"))
    )
    parsed = pc.cast(checked, pa.int64())
    values = np.frombuffer(parsed.buffers()[1], np.int64, len(parsed), parsed.offset)  # any value where null
    # read_criteo clamps negative counts to 0; empty and bad values are 0 here.
    return np.where(ok, np.maximum(values, 0), 0).astype(np.float64)


def _hex(column: pa.Array, suspect: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A categorical column as ``(values uint32 [n], empty bool [n])`` (an empty value is 0);
    marks in ``suspect`` the values that are not hex of at most 8 digits."""
    off, chars, lens = _strings(column)
    text = chars[off[0] : off[-1]]
    empty = lens == 0
    out = np.zeros(len(lens), np.uint32)
    if len(lens) and lens.max() <= 8 and len(text) == 8 * (len(lens) - np.count_nonzero(empty)):
        # Criteo's own layout, 8 hex digits or none: two digits at a time through the pair table.
        pairs = np.take(_HEX_PAIR, text.view(np.uint16)).reshape(-1, 4)
        if pairs.max(initial=0) == 0xFFFF:
            bad = np.flatnonzero((pairs == 0xFFFF).any(axis=1))
            suspect[np.flatnonzero(~empty)[bad]] = True
            pairs[bad] = 0
        np.place(out, ~empty, pairs.astype(np.uint8).view(">u4"))
        return out, empty
    # Any other lengths: digit by digit, each shifted by its place from the end.
    nibbles = np.take(_HEX_DIGIT, text)
    suspect |= lens > 8
    bad = np.flatnonzero(nibbles == 255)
    if len(bad):
        suspect[_value_of(bad + off[0], off)] = True
        nibbles[bad] = 0
    place = np.repeat(off[1:], lens) - 1 - np.arange(off[0], off[-1])
    parts = nibbles.astype(np.uint64) << (4 * np.minimum(place, 7)).astype(np.uint64)
    nonempty = np.flatnonzero(lens)
    if len(nonempty):
        out[nonempty] = np.add.reduceat(parts, off[nonempty] - off[0]) & 0xFFFFFFFF
    return out, empty
