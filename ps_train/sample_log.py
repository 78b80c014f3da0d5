"""A debug record of the samples each trainer step trained on; off unless asked for.

With ``PS_TRAIN_SAMPLE_LOG=1`` in the launcher's environment (every role inherits it), each
trainer appends one JSON line per step it ran to ``<run_dir>/logs/<trainer>.samples.jsonl``:
``{"attempt": 0, "step": 5, "epoch": 0, "ids": [...]}`` -- the step (the run's count, from 1),
the epoch its batch came from and the training-split indices of the batch's samples, in
batch order. A line is written as the step's update goes out to the servers, before they
answer: a step whose update some server applied is on record even if its trainer was held
(ssp's clock, a checkpoint) or killed before the answers came. A restarted run appends its
attempts' lines to the same file; with ``restarts.json`` (the step each attempt resumed after;
async/ssp: each trainer's own step in that checkpoint's manifest) they say which samples the
final model was trained on. ``tests/ps_train/test_failure_matrix.py`` checks with it that a sync
run restarted after a failure trains every sample of an epoch exactly once,
``tests/ps_train/test_async_restarts.py`` that an async or ssp one trains each at least once.

Off, it costs one attribute test per step: the batch iterators note their last batch
(``PartitionCursor.last_batch``) anyway.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ps_train.faults import current_attempt

__all__ = ["SAMPLE_LOG_ENV", "SampleLog", "read_sample_log"]

SAMPLE_LOG_ENV = "PS_TRAIN_SAMPLE_LOG"


class SampleLog:
    """One trainer's record; ``fetched`` after each batch is drawn, ``trained`` as each step's
    update goes out."""

    def __init__(self, run_dir: str, name: str) -> None:
        on = os.environ.get(SAMPLE_LOG_ENV, "") not in ("", "0")
        self.path = Path(run_dir) / "logs" / f"{name}.samples.jsonl" if on else None
        self._next: tuple[int, list[int]] | None = None  # (epoch, ids) of the batch drawn for the next step

    def fetched(self, batches: Any) -> None:
        """``batches`` just gave the next step's batch (its ``last_batch``: ``(epoch, ids [B])``)."""
        if self.path is None:
            return
        last = getattr(batches, "last_batch", None)
        self._next = None if last is None else (int(last[0]), [int(i) for i in last[1]])

    def trained(self, step: int) -> None:
        """Step ``step`` ran its forward on the batch drawn last; its backward, which sends its
        update, comes next."""
        if self.path is None or self._next is None:
            return
        epoch, ids = self._next
        self._next = None
        line = json.dumps({"attempt": current_attempt(), "step": step, "epoch": epoch, "ids": ids}) + "\n"
        with open(self.path, "a") as f:
            f.write(line)


def read_sample_log(run_dir: str | Path, name: str) -> list[dict[str, Any]]:
    """The lines trainer ``name`` wrote, oldest first."""
    path = Path(run_dir) / "logs" / f"{name}.samples.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
