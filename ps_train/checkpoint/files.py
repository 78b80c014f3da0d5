"""Checkpoints on disk: per-shard state files tied together by a manifest.

Layout::

    <run_dir>/checkpoints/step_000000200/
        shard0.pt  shard1.pt ...     one per shard, written by the server hosting it
        ps0.rows  ps1.rows ...       embedding tables (model=dlrm): rows, full or differential
        manifest.json                written last, by the coordinator

A rows file (``ps_train.checkpoint.rows_file``) is *full* (every row of the server's tables)
or *differential*: only the rows changed since an earlier checkpoint, its *base*, named in
the manifest's ``bases`` (shard -> base folder). Restoring a differential one reads its
*chain* (``checkpoint_chain``): the latest full rows file, then each differential one after
it, in order; pruning keeps every checkpoint a kept one builds on.

A checkpoint exists only once its manifest does. Every file is written to a temporary name
and moved into place with ``os.replace`` (atomic on POSIX, ``ps_train.files``), and the manifest records each
shard file's size and checksum (``ps_train.checkpoint.checksums``: XXH3-128; SHA-256 in
manifests of format 2 and before), so a crash at any point leaves either the previous complete
checkpoint or a new complete one -- never a half-written one that ``latest_checkpoint``
would pick up.

Steps of a distributed save (``ps_train.checkpoint.protocol`` runs them between the
roles): the coordinator calls ``begin_checkpoint`` (creates the
folder, invalidates any stale manifest), each server calls ``save_shard_state`` and returns
the ``ShardFile`` it gets, then the coordinator calls ``write_manifest`` and
``prune_checkpoints``. ``save_checkpoint`` does all of it in one process.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import random
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ps_train import backend
from ps_train.checkpoint.checksums import ALGORITHM, Checksum, file_matches, hasher
from ps_train.files import atomic_write, atomic_write_text

__all__ = [
    "CheckpointError",
    "ShardFile",
    "Manifest",
    "MANIFEST_NAME",
    "CHECKPOINTS_DIRNAME",
    "checkpoint_dir",
    "begin_checkpoint",
    "save_shard_state",
    "load_shard_state",
    "write_manifest",
    "read_manifest",
    "is_complete",
    "list_checkpoints",
    "latest_checkpoint",
    "resolve_resume",
    "SaveStarted",
    "checkpoint_chain",
    "resume_hint",
    "prune_checkpoints",
    "save_checkpoint",
    "load_checkpoint",
    "capture_rng_state",
    "restore_rng_state",
]

MANIFEST_NAME = "manifest.json"
CHECKPOINTS_DIRNAME = "checkpoints"
# 2: rows files and bases (a version-1 checkpoint has none and still loads); 3: each file's
# ``checksum`` ("<algorithm>:<hex>") instead of its ``sha256``
FORMAT_VERSION = 3
_READABLE_VERSIONS = (1, 2, 3)
_STEP_DIR = re.compile(r"step_(\d+)")
_SHARD_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@backend.called_by_name
class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the path."""


@backend.called_by_name
@dataclass
class ShardFile:
    """One shard's state file, as listed in the manifest (``file`` is relative to the checkpoint)."""

    name: str
    file: str
    bytes: int
    checksum: str  # "<algorithm>:<hex digest>" (ps_train.checkpoint.checksums)

    @staticmethod
    def from_dict(raw: Mapping[str, Any]) -> ShardFile:
        """A manifest's entry; one of format 2 or before has a ``sha256`` field instead."""
        fields = dict(raw)
        if "sha256" in fields and "checksum" not in fields:
            fields["checksum"] = Checksum.of("sha256", fields.pop("sha256"))
        return ShardFile(**fields)


@backend.called_by_name
@dataclass(frozen=True)
class SaveStarted:
    """A server's answer to the coordinator's "save now": its shard, the checkpoint its rows
    file builds on (None: a full one or none), and whether it is still writing."""

    shard: str
    base: str | None
    background: bool  # its files are still being written (tables); False: already written
    # async/ssp: by trainer name, the point after its last update the saved state holds
    # (``ps_train.checkpoint.positions``, with ``step``); None: the mode keeps no such record (sync)
    positions: dict[str, dict[str, int]] | None = None


@dataclass
class Manifest:
    step: int  # global step the checkpoint was taken after
    shards: list[ShardFile]
    # trainer name -> BatchIterator.state_dict() ({"epoch", "offset", ...}) and "step", the steps
    # it completed (async/ssp: its own; older checkpoints have no "step": the manifest's)
    trainer_positions: dict[str, dict[str, int]] = field(default_factory=dict)
    # role name -> capture_rng_state()
    rng_states: dict[str, dict[str, Any]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. mode, per-shard update counts
    row_files: list[ShardFile] = field(default_factory=list)  # embedding rows, one per server with tables
    bases: dict[str, str] = field(default_factory=dict)  # shard -> the folder its differential rows build on
    format_version: int = FORMAT_VERSION
    created_unix: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        raw = json.loads(text)
        raw["shards"] = [ShardFile.from_dict(s) for s in raw["shards"]]
        raw["row_files"] = [ShardFile.from_dict(s) for s in raw.get("row_files", [])]
        return cls(**raw)


def checkpoint_dir(run_dir: str | os.PathLike[str], step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIRNAME / f"step_{step:09d}"


def begin_checkpoint(run_dir: str | os.PathLike[str], step: int) -> Path:
    """Create the folder for ``step`` and invalidate a manifest left there from before,
    so that overwriting shard files can never pair them with an old manifest."""
    ckpt = checkpoint_dir(run_dir, step)
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / MANIFEST_NAME).unlink(missing_ok=True)
    return ckpt


def save_shard_state(ckpt_dir: str | os.PathLike[str], shard_name: str, state: Mapping[str, Any]) -> ShardFile:
    """Save one shard's state (e.g. ``{"model": sd, "optimizer": sd, "rng": ...}``) atomically.

    Streamed to a temporary file and hashed from there: a server holding gigabytes of
    embedding rows never holds a serialised copy of them in memory as well."""
    if not _SHARD_NAME.fullmatch(shard_name):
        raise ValueError(f"shard name {shard_name!r} must match [A-Za-z0-9_.-]+ (it becomes a file name)")
    file = f"{shard_name}.pt"
    size, digest = atomic_write(Path(ckpt_dir) / file, lambda f: torch.save(dict(state), f), hasher=hasher(ALGORITHM))
    return ShardFile(shard_name, file, size, Checksum.of(ALGORITHM, digest))


def load_shard_state(ckpt_dir: str | os.PathLike[str], entry: ShardFile, verify: bool = True) -> dict[str, Any]:
    """Load a shard file listed in a manifest, checking its checksum unless ``verify=False``."""
    path = Path(ckpt_dir) / entry.file
    if not path.is_file():
        raise CheckpointError(f"checkpoint {ckpt_dir}: shard file {entry.file} is missing")
    if verify and not file_matches(path, entry.checksum):
        raise CheckpointError(
            f"checkpoint {ckpt_dir}: {entry.file} does not match the manifest's checksum "
            f"({Checksum.algorithm(entry.checksum)}; corrupt or overwritten); resume from an earlier checkpoint"
        )
    # weights_only: a checkpoint is data; loading it must not run code from the file.
    return torch.load(path, map_location="cpu", weights_only=True)


def write_manifest(ckpt_dir: str | os.PathLike[str], manifest: Manifest) -> Path:
    """Publish the checkpoint: call only after every shard file is saved."""
    ckpt = Path(ckpt_dir)
    names = [s.name for s in manifest.shards + manifest.row_files]
    if len(set(names)) != len(names):
        raise ValueError(f"manifest lists a shard twice: {names}")
    for s in manifest.shards + manifest.row_files:
        if not (ckpt / s.file).is_file():
            raise CheckpointError(f"cannot write manifest in {ckpt}: shard file {s.file} was not saved")
    path = ckpt / MANIFEST_NAME
    atomic_write_text(path, manifest.to_json())
    return path


def read_manifest(ckpt_dir: str | os.PathLike[str]) -> Manifest:
    path = Path(ckpt_dir) / MANIFEST_NAME
    try:
        manifest = Manifest.from_json(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt_dir} is not a complete checkpoint: no {MANIFEST_NAME}") from None
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{path} is not a valid manifest: {e}") from e
    if manifest.format_version not in _READABLE_VERSIONS:
        raise CheckpointError(
            f"{path}: format version {manifest.format_version}, this ps_train reads {list(_READABLE_VERSIONS)}"
        )
    return manifest


def is_complete(ckpt_dir: str | os.PathLike[str]) -> bool:
    """Manifest readable and every shard file present with its recorded size (cheap check;
    ``load_shard_state`` verifies the checksums)."""
    try:
        manifest = read_manifest(ckpt_dir)
    except CheckpointError:
        return False
    for s in manifest.shards + manifest.row_files:
        path = Path(ckpt_dir) / s.file
        if not path.is_file() or path.stat().st_size != s.bytes:
            return False
    return True


def _step_dirs(run_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    root = Path(run_dir) / CHECKPOINTS_DIRNAME
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))]
    return sorted(found)


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    return [p for _, p in _step_dirs(run_dir) if is_complete(p)]


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint of ``run_dir``, or None if it has none."""
    complete = list_checkpoints(run_dir)
    return complete[-1] if complete else None


def resolve_resume(path: str | os.PathLike[str]) -> Path:
    """``resume=`` accepts a checkpoint dir or a run dir (its latest complete checkpoint)."""
    p = Path(path)
    if (p / MANIFEST_NAME).exists():
        if not is_complete(p):
            raise CheckpointError(f"resume={path}: checkpoint is incomplete (shard files missing or truncated)")
        return p
    if not p.is_dir():
        raise CheckpointError(f"resume={path}: no such directory; pass a run dir or a checkpoint dir")
    latest = latest_checkpoint(p)
    if latest is None:
        raise CheckpointError(
            f"resume={path}: no complete checkpoint under {p / CHECKPOINTS_DIRNAME}; "
            "the run stopped before its first checkpoint (see checkpoint.every)"
        )
    return latest


def prune_checkpoints(run_dir: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints (``keep=0``: delete none),
    plus incomplete leftovers older than the newest complete one. Returns what was deleted."""
    if keep < 0:
        raise ValueError(f"checkpoint.keep={keep} must be >= 0")
    dirs = _step_dirs(run_dir)
    complete = [(s, p) for s, p in dirs if is_complete(p)]
    if not complete:
        return []
    newest = complete[-1][0]
    keep_set = {p for _, p in complete[-keep:]} if keep else {p for _, p in complete}
    for p in list(keep_set):  # and what they build on
        keep_set.update(_bases_of(p))
    removed = []
    for step, p in dirs:
        if p in keep_set or step >= newest:
            continue  # an incomplete newer dir may be a save in progress
        # Manifest first: if we crash mid-delete, what is left is incomplete and ignored.
        (p / MANIFEST_NAME).unlink(missing_ok=True)
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def save_checkpoint(
    run_dir: str | os.PathLike[str],
    step: int,
    shard_states: Mapping[str, Mapping[str, Any]],
    trainer_positions: Mapping[str, Mapping[str, int]] | None = None,
    rng_states: Mapping[str, Mapping[str, Any]] | None = None,
    extra: Mapping[str, Any] | None = None,
    keep: int = 0,
) -> Path:
    """Single-process save: every shard file, then the manifest, then pruning."""
    ckpt = begin_checkpoint(run_dir, step)
    files = [save_shard_state(ckpt, name, state) for name, state in shard_states.items()]
    write_manifest(
        ckpt,
        Manifest(
            step=step,
            shards=files,
            trainer_positions={k: dict(v) for k, v in (trainer_positions or {}).items()},
            rng_states={k: dict(v) for k, v in (rng_states or {}).items()},
            extra=dict(extra or {}),
        ),
    )
    prune_checkpoints(run_dir, keep)
    return ckpt


def load_checkpoint(ckpt_dir: str | os.PathLike[str]) -> tuple[Manifest, dict[str, dict[str, Any]]]:
    """The manifest and every shard's state (checksum-verified), keyed by shard name."""
    manifest = read_manifest(ckpt_dir)
    return manifest, {s.name: load_shard_state(ckpt_dir, s) for s in manifest.shards}


def _bases_of(ckpt: Path) -> set[Path]:
    """Every checkpoint ``ckpt``'s differential rows build on, directly or not (best effort:
    a broken link is reported when restoring, ``checkpoint_chain``)."""
    found: set[Path] = set()
    todo = [ckpt]
    while todo:
        try:
            manifest = read_manifest(todo.pop())
        except CheckpointError:
            continue
        for base in manifest.bases.values():
            p = ckpt.parent / base
            if p not in found:
                found.add(p)
                todo.append(p)
    return found


def checkpoint_chain(ckpt_dir: str | os.PathLike[str], shard: str) -> list[tuple[Path, ShardFile]]:
    """The rows files that restore ``shard``'s tables as of checkpoint ``ckpt_dir``: its
    latest full one, then every differential one up to ``ckpt_dir``'s, each with the
    checkpoint folder it is in. Raises ``CheckpointError`` naming the first broken link
    (a base folder missing or incomplete, a rows file missing, truncated or not listed)
    and what to resume from instead."""
    chain: list[tuple[Path, ShardFile]] = []
    ckpt = Path(ckpt_dir)
    seen: set[Path] = set()
    while True:
        manifest = read_manifest(ckpt)
        entry = {s.name: s for s in manifest.row_files}.get(f"{shard}.rows")
        if entry is None:
            raise CheckpointError(f"checkpoint {ckpt} has no rows file for {shard} (its manifest lists none)")
        path = ckpt / entry.file
        if not path.is_file() or path.stat().st_size != entry.bytes:
            raise CheckpointError(f"{path} is missing or truncated ({entry.bytes} bytes expected); {resume_hint(ckpt)}")
        chain.append((ckpt, entry))
        seen.add(ckpt)
        base = manifest.bases.get(shard)
        if base is None:
            return chain[::-1]
        previous = ckpt.parent / base
        if previous in seen or not _STEP_DIR.fullmatch(base):
            raise CheckpointError(f"{ckpt / MANIFEST_NAME}: {shard}'s base {base!r} is not an earlier checkpoint")
        if not is_complete(previous):
            raise CheckpointError(
                f"checkpoint {ckpt} holds only the rows {shard} changed since {previous}, which is "
                f"{'incomplete' if previous.is_dir() else 'missing'} (its {MANIFEST_NAME} or a file it lists); "
                f"{resume_hint(previous)}"
            )
        ckpt = previous


def resume_hint(broken: Path) -> str:
    """Where to resume from when a chain through ``broken`` cannot be restored."""
    older = [p for _, p in _step_dirs(broken.parent.parent) if p < broken and is_complete(p)]
    full = [p for p in older if not read_manifest(p).bases]
    if full:
        return f"resume from an earlier checkpoint, e.g. resume={full[-1]} (a full one)"
    return "no earlier full checkpoint is left: train from the start"


def capture_rng_state() -> dict[str, Any]:
    """This process's torch (CPU), Python and NumPy RNG states, JSON-safe."""
    np_state = np.random.get_state()
    if isinstance(np_state, dict):  # numpy's legacy state is the tuple; its stubs allow either
        raise TypeError("numpy returned its RNG state as a dict; capture_rng_state needs the legacy tuple")
    version, internal, gauss = random.getstate()
    return {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of ``capture_rng_state``: the next random draws repeat those after the capture."""
    raw = np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()
    torch.set_rng_state(torch.from_numpy(raw))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
