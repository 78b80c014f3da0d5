"""Criteo files read as blocks of whole lines, for ``ps_train.workloads.ctr.data.criteo_prepare``.

``read_pieces(path, block_bytes, inflate)`` yields ``LinePiece``s in order: blocks of about
``block_bytes`` of complete lines, then the file's end (with its last line if that has no
line ending), or a problem that ends the file (a damaged gzip stream, no line ending in
``MAX_LINE_BYTES``); gzip goes through ``inflate`` (``ps_train.workloads.ctr.data.gunzip``). ``PieceReader``
runs it for a list of files in a thread, handing the pieces on through a bounded queue, so
reading and decompressing overlap the parsing.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from ps_train.workloads.ctr.data.gunzip import DamagedGzip, Inflater, open_text

__all__ = ["LinePiece", "read_pieces", "PieceReader", "MAX_LINE_BYTES", "BLOCK_BYTES"]

BLOCK_BYTES = 4 << 20  # ~17k Criteo lines per block, parsed as one batch (criteo_columns._TOKENIZE_BYTES)
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


def read_pieces(path: str, block_bytes: int, inflate: Inflater) -> Iterator[LinePiece]:
    stream, raw = open_text(path, inflate)
    with raw:
        rest = b""  # the start of a line whose end is in the next read
        while True:
            try:
                data = stream.read(block_bytes)
            except DamagedGzip as e:
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

    def __init__(self, files: list[str], block_bytes: int, depth: int, inflate: Inflater) -> None:
        super().__init__(name="prepare-reader", daemon=True)
        self.files, self.block_bytes, self.inflate = files, block_bytes, inflate
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
                for piece in read_pieces(path, self.block_bytes, self.inflate):
                    if not self._put(piece):
                        return
            self._put(None)
        except BaseException as e:  # noqa: BLE001 - handed to the consuming thread, which raises it
            self._put(e)
