"""Writing a server's table rows from a forked child, while the server goes on training.

``fork`` gives the child the server's memory as it is at that instant, shared copy-on-write:
the kernel copies a 4 KB page only when the server next writes to it. So the child holds a
frozen image of every row and optimizer state at the checkpoint's moment for the cost of
copying the server's page tables (tens of ms for a few GB) and, afterwards, of the pages
the server's updates touch first (a copy at memory speed each) -- as Redis's background
save does. The server keeps its own threads, locks and GIL to itself; the child's CPU
(filling an aligned buffer, XXH3, ``O_DIRECT`` writes: ``ps_train.checkpoint.direct_io``)
runs at the lowest priority, in another process.

The child of a multi-threaded process has only the forking thread; any lock another thread
held at the fork stays held forever in the child. So the child runs a short, fixed path that
takes no lock the server's threads use: it writes the rows file from NumPy views of the
tensors it inherited (no torch op, whose thread pool did not survive the fork; no logging,
no RPC), reports its result through a pipe and leaves with ``os._exit`` (no atexit
handlers, no finalizers of the parent's objects). Everything it needs is made before the
fork. It stops as soon as it finds its parent gone (checked between pieces of the file): a
killed server leaves no writer behind. (Not ``PR_SET_PDEATHSIG``: that fires when the
forking *thread* ends, and RPC pool threads come and go.)

What a table storage must give (``TablePart.freeze_rows``): its rows as CPU tensors in the
process's private memory (anonymous or ``MAP_PRIVATE``; a ``MAP_SHARED`` file would change
under the child) and, while the fork happens, no thread changing them.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from ps_train.checkpoint.checksums import ALGORITHM, Checksum, hasher
from ps_train.checkpoint.direct_io import write_file_direct
from ps_train.checkpoint.files import CheckpointError, ShardFile
from ps_train.checkpoint.rows_file import RowsHeader, rows_file_pieces

__all__ = ["FrozenRows", "ForkedWrite", "WriteReport", "fork_rows_writer", "fork_supported"]

CHUNK_ROWS = 65536  # rows a chunk of the file: 16 MiB of dim-64 float32 values per column


def fork_supported() -> bool:
    return hasattr(os, "fork")


@dataclass(frozen=True)
class FrozenRows:
    """A server's table rows as a checkpoint holds them, valid while nothing changes them
    (``TablePart.freeze_rows`` hands it over under the storage's locks, for the fork)."""

    columns: Mapping[str, Tensor]  # the live per-row tensors, each [R, ...], contiguous, CPU
    wanted: Tensor | None  # bool [R]: the rows a differential file holds; None: every row
    base: str | None  # the checkpoint a differential file builds on
    state: dict[str, Any]  # what goes into the server's .pt file for the tables (a copy)

    @property
    def header(self) -> RowsHeader:
        return RowsHeader.of(self.columns, full=self.wanted is None)

    @property
    def row_count(self) -> int:
        """Rows the file holds."""
        return int(next(iter(self.columns.values())).shape[0]) if self.wanted is None else int(self.wanted.sum())


@dataclass(frozen=True)
class WriteReport:
    """What a forked writer did: its file, how long the fork and the write took, and
    whether the bytes went around the page cache."""

    file: ShardFile
    fork_s: float
    write_s: float
    direct_io: bool


class ForkedWrite:
    """A child process writing one rows file; ``wait`` for its result."""

    def __init__(self, pid: int, result_fd: int, path: Path, name: str, fork_s: float) -> None:
        self.pid, self._fd, self.path, self.name, self.fork_s = pid, result_fd, path, name, fork_s

    def wait(self) -> WriteReport:
        """Until the child exits (blocks, without the GIL); its report, or ``CheckpointError``."""
        chunks = []
        try:
            while data := os.read(self._fd, 65536):
                chunks.append(data)
        finally:
            os.close(self._fd)
        _, status = os.waitpid(self.pid, 0)
        try:
            result = json.loads(b"".join(chunks)) if chunks else {}
        except ValueError:
            result = {}
        if os.waitstatus_to_exitcode(status) != 0 or "error" in result or "bytes" not in result:
            why = result.get("error") or f"it ended with status {os.waitstatus_to_exitcode(status)}"
            raise CheckpointError(f"the process writing {self.path} failed: {why}")
        file = ShardFile(self.name, self.path.name, int(result["bytes"]), str(result["checksum"]))
        return WriteReport(file, self.fork_s, float(result["seconds"]), bool(result["direct"]))


def fork_rows_writer(frozen: FrozenRows, path: Path, name: str) -> ForkedWrite:
    """Fork a child that writes ``frozen``'s rows into rows file ``path`` (listed as ``name``)
    and exits. Call while nothing changes the rows (the child's image is taken at the fork);
    they may change as soon as this returns."""
    header = frozen.header
    arrays = [t.detach().numpy() for t in frozen.columns.values()]  # views: the child reads these pages
    wanted = frozen.wanted.numpy() if frozen.wanted is not None else None
    make_hash = hasher(ALGORITHM)
    parent = os.getpid()
    read_fd, write_fd = os.pipe()
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        # Python 3.12+ warns on fork in a process with threads; the child here never touches
        # what those threads own (see the module docstring).
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: write, report, leave; never return into the server's code
        status = 1
        try:
            # Only the result pipe stays open: the server's sockets close when the server closes them.
            os.closerange(3, write_fd)
            os.closerange(write_fd + 1, _max_fd())
            os.nice(19)
            start = time.perf_counter()
            pieces = _while_alive(parent, rows_file_pieces(header, arrays, wanted, CHUNK_ROWS))
            size, digest, direct = write_file_direct(path, pieces, make_hash)
            report = {
                "bytes": size,
                "checksum": Checksum.of(ALGORITHM, digest),
                "seconds": time.perf_counter() - start,
                "direct": direct,
            }
            _write_all(write_fd, json.dumps(report).encode())
            status = 0
        except BaseException as e:  # noqa: BLE001 -- reported to the parent, whatever it is
            try:
                _write_all(write_fd, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
            except BaseException:  # noqa: BLE001 -- the exit status still says it failed
                pass
        finally:
            os._exit(status)
    fork_s = time.perf_counter() - t0
    os.close(write_fd)
    return ForkedWrite(pid, read_fd, path, name, fork_s)


def _while_alive(parent: int, pieces: Iterable[bytes | memoryview]) -> Iterator[bytes | memoryview]:
    """In the child: ``pieces``, leaving (no file, exit status 1) once ``parent`` is gone."""
    for piece in pieces:
        if os.getppid() != parent:
            os._exit(1)
        yield piece


def _max_fd() -> int:
    try:
        return int(os.sysconf("SC_OPEN_MAX"))
    except (ValueError, OSError):
        return 1 << 16


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while len(view):
        view = view[os.write(fd, view) :]
