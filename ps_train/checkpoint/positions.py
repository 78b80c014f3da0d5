"""Where each trainer's data stands in a server's parameters (async and ssp modes).

With every update a trainer sends every server its data position after that step
(``Trainer.train_step``); a server notes it as it applies the update, under the lock its
parameters change under (``ps_train.modes.asynchronous``), so its parameters and this record
always agree: the record names, per trainer, the step after its last update the server
holds, and where that trainer's next batch comes from. Two readers:

- a checkpoint (``ps_train.checkpoint.protocol``): each server's record is taken with its
  saved state, and each trainer resumes after the last of its steps that *every* saved
  server holds (``earliest``), so no sample it trained is skipped, and a step that some
  servers held and others did not (in flight at the snapshot) is trained again;
- ps0 of an elastic run (``ps_train.elastic.membership``): a replacement for a dead trainer
  continues after its predecessor's last step that ps0 applied.

A position is JSON-safe: the batch iterator's ``state_dict`` (``epoch``, ``offset``, ``rank``,
``world``, ``seed``), or an elastic trainer's (``epoch``, ``slot``, ``world``, ``offset``); a
checkpoint stores it with ``step``, the steps that trainer had completed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import NamedTuple

__all__ = ["DataPoint", "TrainerPositions", "earliest", "trainer_name"]


class DataPoint(NamedTuple):
    """A trainer after ``step`` completed steps; ``position``: where its next batch comes from."""

    step: int
    position: dict[str, int]

    def saved(self) -> dict[str, int]:
        """As a checkpoint's manifest keeps it: the position with its ``step``."""
        return {**self.position, "step": self.step}


def trainer_name(index: int) -> str:
    return f"trainer{index}"


class TrainerPositions:
    """One server's record: per trainer index, the ``DataPoint`` after its last update here.

    ``start``: where the attempt started (a resumed checkpoint's positions, by trainer name),
    kept apart from what this attempt's updates say (a replacement asks for the latter only)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[int, DataPoint] = {}
        self.start: dict[str, dict[str, int]] = {}

    def completed(self, trainer: int, step: int, position: Mapping[str, int]) -> None:
        """The server applied ``trainer``'s step ``step`` (0-based); ``position``: its data
        position after it. An older step (a late answer) never moves the record back."""
        with self._lock:
            last = self._last.get(trainer)
            if last is None or step + 1 > last.step:
                self._last[trainer] = DataPoint(step + 1, dict(position))

    def last(self, trainer: int) -> DataPoint | None:
        """``trainer``'s point after its last update applied in this attempt, if any."""
        with self._lock:
            return self._last.get(trainer)

    def steps(self) -> dict[int, int]:
        """Completed steps per trainer that has an update applied in this attempt."""
        with self._lock:
            return {t: p.step for t, p in self._last.items()}

    def snapshot(self) -> dict[str, dict[str, int]]:
        """By trainer name, what a checkpoint keeps: this attempt's last point of each trainer,
        else where it started (a trainer with no update here yet)."""
        with self._lock:
            out = {name: dict(saved) for name, saved in self.start.items()}
            out.update({trainer_name(t): p.saved() for t, p in self._last.items()})
        return out


def earliest(snapshots: Iterable[Mapping[str, Mapping[str, int]]]) -> dict[str, dict[str, int]]:
    """Per trainer name, the saved point with the fewest steps among the servers' snapshots:
    the step after the last update of that trainer that every server holds. A trainer that
    some snapshot lacks had no update there (nor a start): it is left out, its caller places
    it at the beginning."""
    snapshots = list(snapshots)
    names: set[str] = set(snapshots[0]) if snapshots else set()
    for s in snapshots[1:]:
        names &= set(s)
    return {name: dict(min((s[name] for s in snapshots), key=lambda p: p["step"])) for name in sorted(names)}
