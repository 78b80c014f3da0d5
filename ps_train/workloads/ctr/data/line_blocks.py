"""Criteo files read as blocks of whole lines, for ``ps_train.workloads.ctr.data.criteo_prepare``.

``read_pieces(path, block_bytes)`` yields ``LinePiece``s in order: blocks of about
``block_bytes`` of complete lines, then the file's end (with its last line if that has no
line ending), or a problem that ends the file (a damaged gzip stream, no line ending in
``MAX_LINE_BYTES``). ``PieceReader`` runs it for a list of files in a thread, handing the
pieces on through a bounded queue, so reading and decompressing overlap the parsing.
"""

from __future__ import annotations

import queue
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

__all__ = ["LinePiece", "Gunzip", "open_text", "read_pieces", "PieceReader", "MAX_LINE_BYTES"]

MAX_LINE_BYTES = 16 << 20  # a Criteo line is a few hundred bytes; no line ending for this long: not Criteo


@dataclass
class LinePiece:
    """What the reader thread hands on, in order: a ``block`` of complete lines, or the end
    of a file (``last``: its last line if it has no line ending), or a ``problem`` that ends
    the file (damaged gzip, a line too long)."""

    path: str
    pos: int  # input bytes of this file consumed so far (compressed bytes for gzip)
    block: bytes = b""
    end: bool = False
    last: bytes = b""
    problem: str = ""
    remedy: str = ""


class Gunzip:
    """The text of a gzip file, ``read(size)`` at a time: zlib directly (it checks every
    member's CRC and length itself; the gzip module would compute the CRC a second time),
    members one after another, never more than ``size`` bytes out whatever the ratio."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.z = zlib.decompressobj(31)  # 31: a gzip header and trailer
        self.input = b""  # compressed bytes not given to self.z yet
        self.fresh = True  # self.z has decompressed nothing: the file may end here

    def read(self, size: int) -> bytes:
        parts, n = [], 0
        while n < size:
            if not self.input:
                self.input = self.raw.read(1 << 20)
                if not self.input:
                    if not self.fresh:
                        raise EOFError("the file ends inside a compressed member")
                    break
            out = self.z.decompress(self.input, size - n)
            self.fresh = False
            if self.z.eof:  # a member ended; another may follow
                self.input, self.z, self.fresh = self.z.unused_data, zlib.decompressobj(31), True
            else:
                self.input = self.z.unconsumed_tail
            parts.append(out)
            n += len(out)
        return b"".join(parts)


def open_text(path: str) -> tuple[Gunzip | BinaryIO, BinaryIO]:
    """``(text stream, raw file)``: gzip recognised by its magic bytes, as ``read_criteo`` does."""
    raw = open(path, "rb")
    gz = raw.read(2) == b"\x1f\x8b"
    raw.seek(0)
    return (Gunzip(raw) if gz else raw), raw


def read_pieces(path: str, block_bytes: int) -> Iterator[LinePiece]:
    stream, raw = open_text(path)
    with raw:
        rest = b""  # the start of a line whose end is in the next read
        while True:
            try:
                data = stream.read(block_bytes)
            except (EOFError, zlib.error) as e:
                yield LinePiece(
                    path,
                    raw.tell(),
                    problem=f"the gzip stream is damaged or truncated ({e})",
                    remedy="re-download or re-compress the file",
                )
                return
            if not data:
                break
            cut = data.rfind(b"\n") + 1
            if cut:
                block = b"".join((rest, memoryview(data)[:cut])) if rest or cut < len(data) else data
                rest = data[cut:]
            else:
                block, rest = b"", rest + data
            if len(rest) > MAX_LINE_BYTES:
                yield LinePiece(path, raw.tell(), block=block)
                yield LinePiece(
                    path,
                    raw.tell(),
                    problem=f"no line ending in {MAX_LINE_BYTES >> 20} MiB (a Criteo line is a few hundred bytes)",
                    remedy="check that this is a Criteo TSV file",
                )
                return
            if block:
                yield LinePiece(path, raw.tell(), block=block)
        yield LinePiece(path, raw.tell(), end=True, last=rest)


class PieceReader(threading.Thread):
    """Reads the files' pieces into ``out`` (bounded), then None; an exception is handed on."""

    def __init__(self, files: list[str], block_bytes: int, depth: int) -> None:
        super().__init__(name="prepare-reader", daemon=True)
        self.files, self.block_bytes = files, block_bytes
        self.out: queue.Queue[LinePiece | BaseException | None] = queue.Queue(maxsize=depth)
        self.stop = threading.Event()

    def _put(self, item: LinePiece | BaseException | None) -> bool:
        while not self.stop.is_set():
            try:
                self.out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run(self) -> None:
        try:
            for path in self.files:
                for piece in read_pieces(path, self.block_bytes):
                    if not self._put(piece):
                        return
            self._put(None)
        except BaseException as e:  # noqa: BLE001 - handed to the consuming thread, which raises it
            self._put(e)
