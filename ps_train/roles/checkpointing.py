"""A parameter server's part of a checkpoint: its state fixed at once, its files written after.

The checkpoint coordinator (``ps_train.checkpoint.protocol``) asks every server to
``begin_save``, and once every server's state is taken, to ``finish_save``; the server hands
both to its ``CheckpointWriter``. In between the mode holds the updates (async/ssp:
``ps_train.modes.asynchronous``; sync: nothing can move anyway), so the servers' saved states
belong together. A server without tables writes its few MB of dense shards at once; one with
tables copies its small state under its lock and freezes the rows, which are written while
updates go on. ``checkpoint.writer=fork`` (the default): under the locks the server forks a
child that writes the rows' copy-on-write image (``TablePart.freeze_rows``,
``ps_train.checkpoint.forked_writer``), so the server's threads share neither its GIL nor its
page-cache copies; ``thread``: a thread of the lowest CPU priority copies the rows block by
block before updates change them (``TablePart.begin_snapshot``). Either way a thread here
writes the small ``.pt`` file and resolves ``finish_save`` once every file is durable. Kept
apart from the server (``ps_train.roles.server``), whose other methods serve the trainers' steps.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, Protocol

import torch

from ps_train.checkpoint.files import SaveStarted, ShardFile, save_shard_state
from ps_train.checkpoint.forked_writer import ForkedWrite, FrozenRows, fork_rows_writer
from ps_train.checkpoint.positions import TrainerPositions
from ps_train.modes.base import Mode, ModeServer
from ps_train.table_service import TablePart

log = logging.getLogger("ps_train.server")


class SavingServer(ModeServer, Protocol):
    """What the writer uses of a server (``ps_train.roles.server.ParameterServer``)."""

    @property
    def mode(self) -> Mode: ...

    @property
    def positions(self) -> TrainerPositions: ...

    @property
    def tables(self) -> TablePart | None: ...

    def state_dict(self) -> dict[str, Any]:
        """Its whole state, the tables' rows copied."""

    def take_state(self, copy_tables: bool | None) -> dict[str, Any]:
        """Its state (``copy_tables`` None: without the tables); the caller holds ``lock``."""


class CheckpointWriter:
    """The checkpoint ``server`` is writing, if any, and whether it holds the updates for it."""

    def __init__(self, server: SavingServer, writer: str = "fork") -> None:
        self.server = server
        self.writer = writer  # checkpoint.writer: fork | thread
        self._saving: tuple[str, torch.futures.Future[list[ShardFile]]] | None = None  # (folder, files written)
        self._holding = False  # updates are held for a checkpoint (begin .. finish)

    def begin(self, ckpt_dir: str, base: str | None) -> SaveStarted:
        """``ParameterServer.begin_save``: returns once the state is fixed."""
        server = self.server
        name = f"ps{server.rank}"
        done: torch.futures.Future[list[ShardFile]] = torch.futures.Future()
        if self.saving():
            raise RuntimeError(f"{name}: asked for checkpoint {ckpt_dir} while {self._saving} is being written")
        # async/ssp: no update applies here until finish_save, when every server's state is
        # taken (ps_train.modes.asynchronous); sync: nothing can move anyway.
        server.mode.hold_updates(server)
        self._holding = True
        positions = None
        if server.mode.per_trainer_positions:  # the positions the parameters hold (nothing moves now)
            positions = server.positions.snapshot()
        if server.tables is None:  # a few MB of dense shards: written now
            done.set_result([save_shard_state(ckpt_dir, name, server.state_dict())])
            self._saving = (ckpt_dir, done)
            return SaveStarted(name, None, background=False, positions=positions)
        tables = server.tables
        if self.writer == "fork" and tables.forks_writer:  # a disk tier's rows: its own snapshot, by a thread
            return self._begin_forked(ckpt_dir, base, tables, done, positions)
        with server.lock:  # only the small state is copied while updates wait
            state = server.take_state(copy_tables=None)
            snapshot = tables.begin_snapshot(os.path.basename(os.path.normpath(ckpt_dir)), base)
        state["tables"] = snapshot.state
        self._saving = (ckpt_dir, done)

        def write() -> None:
            _lowest_priority()
            try:
                rows = snapshot.write(ckpt_dir, name)
                files = [save_shard_state(ckpt_dir, name, state), rows]
            except BaseException as e:
                tables.end_snapshot(written=False)
                log.exception("%s: writing its checkpoint into %s failed", name, ckpt_dir)
                done.set_exception(e)  # type: ignore[arg-type]  # torch's stub names the result type
                return
            tables.end_snapshot(written=True)
            log.info(
                "%s: wrote %d rows of its tables into %s (%d copied aside by updates meanwhile)",
                name,
                snapshot.row_count,
                ckpt_dir,
                snapshot.rows_copied_aside,
            )
            done.set_result(files)

        threading.Thread(target=write, name=f"{name}-checkpoint", daemon=True).start()
        return SaveStarted(name, snapshot.base, background=True, positions=positions)

    def _begin_forked(
        self,
        ckpt_dir: str,
        base: str | None,
        tables: TablePart,
        done: torch.futures.Future[list[ShardFile]],
        positions: dict[str, dict[str, int]] | None,
    ) -> SaveStarted:
        server = self.server
        name = f"ps{server.rank}"
        folder = os.path.basename(os.path.normpath(ckpt_dir))
        rows_path = Path(ckpt_dir) / f"{name}.rows"
        frozen: list[FrozenRows] = []

        def fork(rows: FrozenRows) -> ForkedWrite:
            frozen.append(rows)
            return fork_rows_writer(rows, rows_path, f"{name}.rows")

        try:
            with server.lock:  # the fork happens while no update runs: the child's image is this moment's
                state = server.take_state(copy_tables=None)
                child = tables.freeze_rows(folder, base, fork)
        except BaseException:  # e.g. no memory to fork: this checkpoint fails, the next one is full
            if frozen:
                tables.end_snapshot(written=False)
            self._release_held()
            raise
        state["tables"] = frozen[0].state
        self._saving = (ckpt_dir, done)

        def wait() -> None:
            try:
                files = [save_shard_state(ckpt_dir, name, state)]
                report = child.wait()
                files.append(report.file)
            except BaseException as e:
                tables.end_snapshot(written=False)
                log.exception("%s: writing its checkpoint into %s failed", name, ckpt_dir)
                done.set_exception(e)  # type: ignore[arg-type]  # torch's stub names the result type
                return
            tables.end_snapshot(written=True)
            log.info(
                "%s: a forked writer (fork %.0f ms) wrote %d rows, %.2f GB, of its tables into %s in %.1f s (%s)",
                name,
                report.fork_s * 1e3,
                frozen[0].row_count,
                report.file.bytes / 1e9,
                ckpt_dir,
                report.write_s,
                "direct I/O" if report.direct_io else "through the page cache",
            )
            done.set_result(files)

        threading.Thread(target=wait, name=f"{name}-checkpoint", daemon=True).start()
        return SaveStarted(name, frozen[0].base, background=True, positions=positions)

    def saving(self) -> bool:
        """A checkpoint's files are still being written."""
        return self._saving is not None and not self._saving[1].done()

    def finish(self, ckpt_dir: str) -> torch.futures.Future[list[ShardFile]]:
        """``ParameterServer.finish_save``: the updates held since ``begin`` go on; resolves
        to the files ``begin(ckpt_dir)`` wrote, once they are written."""
        self._release_held()
        if self._saving is None or self._saving[0] != ckpt_dir:
            raise RuntimeError(f"ps{self.server.rank}: no checkpoint {ckpt_dir} begun (begin_save first)")
        return self._saving[1]

    def _release_held(self) -> None:
        if self._holding:
            self._holding = False
            self.server.mode.release_updates(self.server)

    def member_left(self, name: str) -> None:
        """``ParameterServer.member_left``: if trainer0 left while its checkpoint held the
        updates, they go on."""
        if name == "trainer0" and self._holding:
            log.warning("ps%d: trainer0 left while a checkpoint held the updates; they go on", self.server.rank)
            self._release_held()


def _lowest_priority() -> None:
    """Give the calling thread the lowest CPU priority (nice 19), so a checkpoint's writer
    takes the CPU time training leaves (it then takes longer on a saturated machine). Linux
    only: there a thread has its own nice value, set through its thread id."""
    if sys.platform != "linux":
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except OSError:  # e.g. a sandbox without setpriority: the writer keeps normal priority
        log.debug("could not lower the checkpoint writer's priority", exc_info=True)
