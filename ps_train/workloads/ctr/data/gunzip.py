"""The text of a gzip file, ``read(size)`` at a time, through the fastest inflater installed.

Two implementations of the same stream interface (``decompressobj(31)``: a gzip member,
header and trailer checked):

- ``isal``: python-isal's bindings to Intel's ISA-L (igzip), a core dependency wherever its
  wheels exist (``pyproject.toml``): about 3.5x the standard library's speed, and it decodes
  without the GIL, so the parsing threads run meanwhile;
- ``zlib``: the standard library's, the fallback where isal is not installed.

Both check each member's CRC-32 and length; a damaged or truncated stream raises
``DamagedGzip`` whichever is used.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO, Protocol, cast

__all__ = ["DamagedGzip", "Inflater", "INFLATERS", "AUTO", "inflater", "Gunzip", "open_text", "GZIP_MAGIC"]

GZIP_MAGIC = b"\x1f\x8b"
AUTO = "auto"  # the fastest installed
_RAW_READ = 1 << 20  # compressed bytes read from the file at a time


class DamagedGzip(Exception):
    """The compressed stream is damaged (bad data, CRC or length) or ends inside a member."""


class _Decompressor(Protocol):
    """What both libraries' ``decompressobj`` return (the standard library's interface)."""

    @property
    def unconsumed_tail(self) -> bytes: ...

    @property
    def unused_data(self) -> bytes: ...

    @property
    def eof(self) -> bool: ...

    def decompress(self, data: bytes, max_length: int = ..., /) -> bytes: ...


@dataclass(frozen=True)
class Inflater:
    """One deflate implementation: ``member()`` decodes one gzip member; ``errors`` are the
    exceptions it raises for damaged data."""

    name: str
    member: Callable[[], _Decompressor]
    errors: tuple[type[Exception], ...]


def _installed() -> dict[str, Inflater]:
    found = {"zlib": Inflater("zlib", lambda: zlib.decompressobj(31), (zlib.error,))}
    try:
        from isal import isal_zlib
    except ImportError:  # no wheel for this platform: the standard library's
        return found
    isal_error = cast(type[Exception], isal_zlib.error)  # a class; isal's stub calls it an instance
    return {"isal": Inflater("isal", lambda: isal_zlib.decompressobj(31), (isal_error, zlib.error)), **found}


INFLATERS: dict[str, Inflater] = _installed()  # fastest first


def inflater(name: str = AUTO) -> Inflater:
    """The inflater ``name`` (``auto``: the fastest installed); a clear error if it is unknown
    or not installed."""
    if name == AUTO:
        return next(iter(INFLATERS.values()))
    if name in INFLATERS:
        return INFLATERS[name]
    if name == "isal":
        raise ValueError("--gunzip isal: python-isal is not installed here (pip install isal), or use --gunzip zlib")
    raise ValueError(f"--gunzip {name}: unknown; choose one of {[AUTO, 'isal', 'zlib']}")


class Gunzip:
    """The text of a gzip file, ``read(size)`` at a time: members one after another, never
    more than ``size`` bytes out whatever the compression ratio."""

    def __init__(self, raw: BinaryIO, inflate: Inflater) -> None:
        self.raw, self.inflate = raw, inflate
        self.z = inflate.member()
        self.input = b""  # compressed bytes not given to self.z yet
        self.fresh = True  # self.z has decompressed nothing: the file may end here

    def read(self, size: int) -> bytes:
        parts, n = [], 0
        while n < size:
            if not self.input:
                self.input = self.raw.read(_RAW_READ)
                if not self.input:
                    if not self.fresh:
                        raise DamagedGzip("the file ends inside a compressed member")
                    break
            try:
                out = self.z.decompress(self.input, size - n)
            except self.inflate.errors as e:
                raise DamagedGzip(str(e)) from e
            self.fresh = False
            if self.z.eof:  # a member ended; another may follow
                self.input, self.z, self.fresh = self.z.unused_data, self.inflate.member(), True
            else:
                self.input = self.z.unconsumed_tail
            parts.append(out)
            n += len(out)
        return parts[0] if len(parts) == 1 else b"".join(parts)


def open_text(path: str, inflate: Inflater | None = None) -> tuple[Gunzip | BinaryIO, BinaryIO]:
    """``(text stream, raw file)``: gzip recognised by its magic bytes, as ``read_criteo`` does."""
    raw = open(path, "rb")
    gz = raw.read(2) == GZIP_MAGIC
    raw.seek(0)
    return (Gunzip(raw, inflate or inflater()) if gz else raw), raw
