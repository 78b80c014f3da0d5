"""The checkpoint protocol between roles: saving a running job, and resuming from it.

``ps_train.checkpoint.files`` defines what a checkpoint is on disk; this module decides who
writes which part, and when. trainer0 coordinates (``Checkpointer``): after step k (every
``checkpoint.every`` steps, and at the end) it asks each server, through the server's RRef,
to fix its state and write it (``ParameterServer.begin_save``): its shards' weights and
optimizer state at once, its embedding tables (model=dlrm) by a thread while training goes on,
all rows or only those changed since the previous checkpoint (``checkpoint.differential``).
Once every server's files are written (``finish_save``), a thread of trainer0 writes the
manifest tying them to step k, every trainer's data position and the RNG states. In sync mode
the servers cannot move while trainer0 is busy asking (step k+1 needs trainer0's gradients),
so the checkpoint is exactly the state after step k, and every trainer's position is the one
after step k. In async/ssp modes the other trainers move on meanwhile: each server holds the
updates that come between its ``begin_save`` and its ``finish_save`` (sent once every server's
state is taken), and answers ``begin_save`` with its record of where each trainer stands
(``ps_train.checkpoint.positions``); each trainer then resumes after its own last step that
every saved server holds. So no sample a trainer had not trained in the saved state is
skipped, and a trainer retrains at most its one step in flight at the snapshot.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ps_train.checkpoint.checksums import Checksum, file_matches
from ps_train.checkpoint.files import (
    CheckpointError,
    Manifest,
    SaveStarted,
    begin_checkpoint,
    capture_rng_state,
    checkpoint_chain,
    load_shard_state,
    prune_checkpoints,
    read_manifest,
    resolve_resume,
    resume_hint,
    write_manifest,
)
from ps_train.checkpoint.positions import TrainerPositions, earliest, trainer_name
from ps_train.config import CheckpointConfig, ConfigError
from ps_train.faults import die, fault_at
from ps_train.partition import TrainerSplit

log = logging.getLogger("ps_train.checkpoint")


class RestoredServer(Protocol):
    """What resuming uses of a server (``ps_train.roles.server.ParameterServer``)."""

    @property
    def rank(self) -> int: ...

    @property
    def positions(self) -> TrainerPositions: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class CheckpointingTrainer(Protocol):
    """What the coordinator uses of trainer0 (``ps_train.roles.trainer.Trainer``)."""

    @property
    def index(self) -> int: ...

    @property
    def steps(self) -> int:
        """The step it trains to."""

    @property
    def run_dir(self) -> str: ...

    @property
    def servers(self) -> Sequence[Any]:
        """RRefs to the ParameterServers: ``servers[r]`` is ps<r>'s."""

    @property
    def train_set(self) -> Sized:
        """Its training split (its length places every trainer's data after a step)."""

    def settle(self) -> dict[str, float]:
        """Wait until the servers applied its last step's update."""

    def waited_for_checkpoint(self, seconds: float) -> None:
        """After its last step it waited ``seconds`` for the last checkpoint to be complete
        (reported apart from the training's samples/s)."""


def load_server_state(ps: RestoredServer, resume_state: dict[str, Any]) -> None:
    """Before the job starts: give server ``ps`` its saved state, and where each trainer
    starts (what its next checkpoint keeps for a trainer with no update yet)."""
    ps.load_state_dict(resume_state["servers"][f"ps{ps.rank}"])
    ps.positions.start = {name: dict(p) for name, p in resume_state["trainer_positions"].items()}


def trainer_positions(
    split: TrainerSplit, n_items: int, step: int, started: Sequence[SaveStarted]
) -> dict[str, dict[str, int]]:
    """The manifest's positions: by trainer name, its data position in ``split`` (of
    ``n_items`` training samples) and completed ``step``.

    sync (the servers keep no positions): every trainer after ``step``, trainer0's. async/ssp:
    each trainer's own, after its last update every server's saved state holds (the fewest
    steps among the servers' records); a trainer none of whose updates every server holds
    starts from the beginning."""
    T, seed = split.world, split.seed
    records = [s.positions for s in started if s.positions is not None]
    if not records:
        pos = split.position(n_items, step)
        return {trainer_name(k): dict(pos, rank=k, world=T, seed=seed, step=step) for k in range(T)}
    out = earliest(records)
    for k in range(T):
        out.setdefault(trainer_name(k), dict(split.position(n_items, 0), rank=k, world=T, seed=seed, step=0))
    return out


class Checkpointer:
    """trainer0's checkpoints of one run: when to write a full one or a differential one, and
    the one being completed in the background.

    ``save`` fixes the job's state after a step (each server's ``begin_save``: in sync mode
    nothing can move meanwhile, see the module docstring) and returns; the servers write
    their files while training goes on, and a thread here writes the manifest once they
    are all written. One checkpoint is in flight at a time: ``checkpoint_hook`` starts the
    next only once the previous one is complete (``busy``), and ``save`` raises the previous
    one's error if it failed.

    ``settings``: the ``checkpoint`` group; ``split``: how the trainers' data is dealt out
    (their positions); ``config``: the run's whole config as a plain dict
    (``ps_train.config.config_to_dict``), which every manifest keeps for resume's checks."""

    def __init__(self, settings: CheckpointConfig, split: TrainerSplit, config: dict[str, Any]) -> None:
        self.settings = settings
        self.split = split
        self.config = config
        self.last: Path | None = None  # the newest checkpoint this process completed
        self.differential_since_full = 0  # differential checkpoints written after it
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def busy(self) -> bool:
        """A checkpoint is still being completed."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Until the checkpoint in flight (if any) is complete; raises if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"writing a checkpoint failed: {error}") from error

    def save(self, trainer: CheckpointingTrainer, step: int, wait: bool = False) -> Path:
        """Checkpoint the job after ``step``; ``wait``: return once it is complete."""
        trainer.settle()  # the servers have applied step ``step``'s update
        self.wait()
        ckpt = begin_checkpoint(trainer.run_dir, step)
        c = self.settings
        base = None
        if c.differential and self.last is not None and self.differential_since_full + 1 < c.full_every:
            base = self.last.name
        # trainer.servers[r] is ps<r>'s RRef; every server fixes its state now, at once.
        begun = [server.rpc_async().begin_save(str(ckpt), base) for server in trainer.servers]
        started: list[SaveStarted] = [f.wait() for f in begun]
        # No RPC timeout: writing gigabytes of rows may take longer than any call should.
        written = [server.rpc_async(timeout=0).finish_save(str(ckpt)) for server in trainer.servers]
        positions = trainer_positions(self.split, len(trainer.train_set), step, started)
        manifest = Manifest(
            step=step,
            shards=[],
            trainer_positions=positions,
            rng_states={"trainer0": capture_rng_state()},
            extra={"mode": self.config["mode"]["name"], "backend": self.config["backend"], "config": self.config},
            bases={s.shard: s.base for s in started if s.base is not None},
        )

        def complete() -> None:
            try:
                files = [file for f in written for file in f.wait()]
                if fault_at(f"trainer{trainer.index}", step, "checkpoint"):  # test-only, see ps_train.faults
                    die(f"trainer{trainer.index}", step)
                manifest.shards = [f for f in files if f.file.endswith(".pt")]
                manifest.row_files = [f for f in files if not f.file.endswith(".pt")]
                write_manifest(ckpt, manifest)
                prune_checkpoints(trainer.run_dir, c.keep)
            except Exception as e:
                self.last = None  # the next one is full
                self._error = e
                log.exception("checkpoint after step %d (%s) failed", step, ckpt)
                return
            self.last = ckpt
            self.differential_since_full = self.differential_since_full + 1 if manifest.bases else 0
            kind = f"differential on {base}" if manifest.bases else "full"
            log.info("checkpoint after step %d: %s (%s)", step, ckpt, kind)

        self._thread = threading.Thread(target=complete, name=f"checkpoint-{step}", daemon=True)
        self._thread.start()
        if wait or not any(s.background for s in started):  # nothing left to wait for: complete it now
            self.wait()
        return ckpt


class Action(enum.Enum):
    """What trainer0 does after a step (``CheckpointSchedule.after``)."""

    NOTHING = "nothing"
    SAVE = "save"  # start a checkpoint; training goes on while it is written
    SAVE_AND_WAIT = "save and wait"  # the last step: a checkpoint, complete before the run ends
    WAIT = "wait"  # the last step: the checkpoint in flight completes before the run ends


@dataclass
class CheckpointSchedule:
    """When checkpoints are taken: every ``every`` steps and after the last step (``final``).
    A checkpoint due while the previous one is still being written is taken after the first
    step that finds the previous one complete: a slow disk delays checkpoints, never steps
    (``wait_when_busy``: the step waits for the previous one instead)."""

    every: int
    final: bool
    wait_when_busy: bool = False
    deferred: int | None = None  # the step a due checkpoint found the previous one unfinished

    def after(self, step: int, last: bool, busy: bool) -> Action:
        """After ``step`` (``last``: the run's last), with a checkpoint still being written (``busy``)."""
        due = bool(self.every) and step % self.every == 0
        if last:
            return Action.SAVE_AND_WAIT if due or self.final else Action.WAIT
        if not (due or self.deferred is not None):
            return Action.NOTHING
        if busy and not self.wait_when_busy:
            if self.deferred is None:
                self.deferred = step
            return Action.NOTHING
        if self.deferred is not None:
            log.info(
                "checkpoint due after step %d taken after step %d: the previous one was still being written",
                self.deferred,
                step,
            )
            self.deferred = None
        return Action.SAVE


def checkpoint_hook(
    settings: CheckpointConfig, split: TrainerSplit, config: dict[str, Any]
) -> Callable[[CheckpointingTrainer, int], None]:
    """The per-step callback trainer0 runs: checkpoint as ``CheckpointSchedule`` says (every
    ``checkpoint.every`` steps and after the last step unless ``checkpoint.final`` is false;
    ``checkpoint.when_busy``),
    full or differential (``checkpoint.differential``, ``checkpoint.full_every``); the last
    step waits until the checkpoint in flight is complete, and tells the trainer how long.
    ``split`` and ``config``: as ``Checkpointer`` takes them."""
    checkpointer = Checkpointer(settings, split, config)
    schedule = CheckpointSchedule(settings.every, settings.final, settings.when_busy == "wait")

    def hook(trainer: CheckpointingTrainer, step: int) -> None:
        if trainer.index != 0:
            return
        action = schedule.after(step, step == trainer.steps, checkpointer.busy())
        if action is Action.SAVE:
            checkpointer.save(trainer, step)
        elif action is Action.WAIT and not checkpointer.busy():
            checkpointer.wait()  # nothing to wait for; raises the last one's error if it failed
        elif action in (Action.SAVE_AND_WAIT, Action.WAIT):
            t0 = time.perf_counter()
            if action is Action.SAVE_AND_WAIT:
                checkpointer.save(trainer, step, wait=True)
            else:
                checkpointer.wait()
            trainer.waited_for_checkpoint(time.perf_counter() - t0)

    return hook


def load_resume_state(path: str, server: str | None = None) -> dict[str, Any]:
    """Read the latest complete checkpoint under ``path`` (a run dir or checkpoint dir) and
    check that every server's chain of rows files is there (``checkpoint_chain``).

    ``server``: also load that server's state file (``ps0``, ...), checksum-verified, and name
    its rows files (checksum-verified too) in its ``tables`` entry; trainers need only the
    manifest.
    """
    ckpt = resolve_resume(path)
    manifest = read_manifest(ckpt)
    chains = {
        f.name.removesuffix(".rows"): checkpoint_chain(ckpt, f.name.removesuffix(".rows")) for f in manifest.row_files
    }
    servers = {}
    if server is not None:
        entry = {s.name: s for s in manifest.shards}.get(server)
        if entry is None:
            raise CheckpointError(
                f"resume={path}: checkpoint {ckpt} has no state for {server} (it has "
                f"{sorted(s.name for s in manifest.shards)}); resume with the same "
                "cluster.num_servers"
            )
        state = load_shard_state(ckpt, entry)
        if server in chains:
            for folder, rows in chains[server]:
                if not file_matches(folder / rows.file, rows.checksum):
                    raise CheckpointError(
                        f"{folder / rows.file} does not match its manifest's checksum "
                        f"({Checksum.algorithm(rows.checksum)}; corrupt or overwritten); {resume_hint(folder)}"
                    )
            state["tables"]["rows_files"] = [str(folder / rows.file) for folder, rows in chains[server]]
        servers[server] = state
    return {
        "checkpoint": str(ckpt),
        "step": manifest.step,
        "servers": servers,
        # Older checkpoints (and sync runs') hold every trainer at the manifest's step.
        "trainer_positions": {name: {"step": manifest.step, **pos} for name, pos in manifest.trainer_positions.items()},
        "extra": manifest.extra,
    }


def check_resumable(now: dict[str, Any], path: str) -> dict[str, Any]:
    """In the launcher, before any role starts: the checkpoint to resume from exists and was
    written by a run whose config can continue as ``now`` (the run's whole config as a plain
    dict, ``ps_train.config.config_to_dict``): same model, cluster shape, seed and data."""
    state = load_resume_state(path)
    saved = state["extra"].get("config")
    if saved:
        problems = [
            f"{key}: the checkpoint has {saved.get(key)!r}, this run {now.get(key)!r}"
            for key in _RESUME_MUST_MATCH
            if key in saved and saved.get(key) != now.get(key)
        ]
        for group, key in (
            ("cluster", "num_servers"),
            ("cluster", "num_trainers"),
            ("cluster", "placement"),
            ("optim", "name"),
            ("data", "name"),
        ):
            old, new = saved.get(group, {}).get(key), now[group][key]
            if old is not None and old != new:
                problems.append(f"{group}.{key}: the checkpoint has {old!r}, this run {new!r}")
        for key in _TABLE_KEYS:  # model=dlrm: the servers' saved table shards have these shapes
            old, new = saved.get("data", {}).get(key), now["data"].get(key)
            if old is not None and new is not None and old != new:
                problems.append(f"data.{key}: the checkpoint has {old!r}, this run {new!r}")
        if problems:
            raise ConfigError(
                f"resume={path}: {state['checkpoint']} was written by a different setup; pass the "
                "original run's overrides again:\n  - " + "\n  - ".join(problems)
            )
    return state


# Config sections a resumed run must share with the checkpoint's run (optim.lr etc. may change).
_RESUME_MUST_MATCH = ("model", "seed")
_TABLE_KEYS = ("num_tables", "table_rows", "table_sizes")
