"""Metrics: a small writer protocol (TensorBoard or no-op), throughput and latency meters,
and the run's final ``metrics.json``.

Roles log through ``MetricsWriter`` so code never checks whether TensorBoard is on: with
``logging.tensorboard=false`` it gets a ``NullWriter``.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from ps_train.files import atomic_write_text

__all__ = [
    "MetricsWriter",
    "TensorBoardWriter",
    "NullWriter",
    "make_writer",
    "flatten_hparams",
    "ThroughputMeter",
    "LatencyStats",
    "write_metrics_json",
    "peak_rss_bytes",
    "mark_session_start",
    "mark_attempt",
]

HParamValue = bool | int | float | str


@runtime_checkable
class MetricsWriter(Protocol):
    def add_scalar(self, tag: str, value: float, step: int) -> None: ...

    def add_scalars(self, values: Mapping[str, float], step: int) -> None: ...

    def add_histogram(self, tag: str, values: Sequence[float], step: int) -> None: ...

    def add_hparams(self, hparams: Mapping[str, Any], metrics: Mapping[str, float]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class NullWriter:
    """Accepts everything, writes nothing."""

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        pass

    def add_scalars(self, values: Mapping[str, float], step: int) -> None:
        pass

    def add_histogram(self, tag: str, values: Sequence[float], step: int) -> None:
        pass

    def add_hparams(self, hparams: Mapping[str, Any], metrics: Mapping[str, float]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> NullWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TensorBoardWriter:
    """Event files in ``log_dir`` via ``torch.utils.tensorboard.SummaryWriter``.

    ``filename_suffix`` keeps files apart when several roles write into one run folder
    (e.g. ``.trainer0``); TensorBoard merges them into one run.
    """

    def __init__(self, log_dir: str | os.PathLike[str], filename_suffix: str = "", flush_secs: int = 10) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard; only when used

        self.log_dir = os.fspath(log_dir)
        _wait_past_event_files(self.log_dir)
        self._writer = SummaryWriter(log_dir=self.log_dir, filename_suffix=filename_suffix, flush_secs=flush_secs)
        self._closed = False

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._writer.add_scalar(tag, float(value), global_step=int(step))

    def add_scalars(self, values: Mapping[str, float], step: int) -> None:
        # Separate tags (not SummaryWriter.add_scalars, which makes one sub-run per key).
        for tag, value in values.items():
            self.add_scalar(tag, value, step)

    def add_histogram(self, tag: str, values: Sequence[float], step: int) -> None:
        import numpy as np

        self._writer.add_histogram(tag, np.asarray(values, dtype=np.float64), global_step=int(step), bins="auto")

    def add_hparams(self, hparams: Mapping[str, Any], metrics: Mapping[str, float]) -> None:
        """Record hyper-parameters with the final metrics for TensorBoard's HPARAMS tab.

        Written into this run's own folder (SummaryWriter.add_hparams would make a timestamped
        sub-run instead), so each run under runs/ is one row. Metric tags are also logged as
        scalars, which is where the HPARAMS tab reads their values.
        """
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        flat = flatten_hparams(hparams)
        exp, ssi, sei = hparams_summary(flat, dict(metrics))
        file_writer = self._writer._get_file_writer()
        for summary in (exp, ssi, sei):
            file_writer.add_summary(summary)
        for tag, value in metrics.items():
            self.add_scalar(tag, value, 0)

    def add_custom_scalars(self, layout: Mapping[str, Mapping[str, list[Any]]]) -> None:
        """A custom-scalars layout: ``{category: {chart title: ["Multiline", [tag regexes]]}}``."""
        self._writer.add_custom_scalars({c: dict(charts) for c, charts in layout.items()})

    def add_summary(self, summary: Any) -> None:
        """A ready ``Summary`` protocol buffer (e.g. the HParams plugin's records)."""
        self._writer._get_file_writer().add_summary(summary)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        if not self._closed:
            self._writer.close()
            self._closed = True

    def __enter__(self) -> TensorBoardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wait_past_event_files(log_dir: str) -> None:
    """Wait (at most about a second) until the clock has passed every event file in ``log_dir``.

    Event files are named ``events.out.tfevents.<seconds>.<host>.<pid>...`` and TensorBoard
    reads a folder's files in name order. A restarted attempt that opens its file within the
    same second as the failed one would sort by pid, i.e. at random, and TensorBoard could
    read the attempts backwards, letting the old attempt's points supersede the new ones.
    """
    newest = -1
    try:
        names = os.listdir(log_dir)
    except FileNotFoundError:
        return
    for name in names:
        parts = name.split(".")
        if name.startswith("events.out.tfevents.") and len(parts) > 3 and parts[3].isdigit():
            newest = max(newest, int(parts[3]))
    remaining = newest + 1 - time.time()
    if 0 < remaining <= 1.0:  # a file from the future (clock skew) is not worth waiting for
        time.sleep(remaining)


def make_writer(enabled: bool, log_dir: str | os.PathLike[str], filename_suffix: str = "") -> MetricsWriter:
    """TensorBoard writer if ``enabled`` (``logging.tensorboard``), else a no-op one."""
    return TensorBoardWriter(log_dir, filename_suffix) if enabled else NullWriter()


def mark_session_start(writer: MetricsWriter, purge_step: int) -> None:
    """Tell TensorBoard that a (re)started attempt writes from ``purge_step`` on.

    A restarted run resumes from a checkpoint at step k and writes steps k+1.. again, next to
    the failed attempt's events for those steps. This writes a ``SessionLog.START`` event at
    ``purge_step = k + 1`` (what ``SummaryWriter(purge_step=...)`` does): TensorBoard's event
    reader then drops the points earlier event files hold at steps >= k+1, so every curve
    shows each step once. TensorBoard ignores a run's first START, which is why every
    attempt, the first included, writes one. A no-op for writers other than TensorBoard's.
    """
    if not isinstance(writer, TensorBoardWriter):
        return
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog

    file_writer = writer._writer._get_file_writer()
    file_writer.add_event(Event(step=int(purge_step), session_log=SessionLog(status=SessionLog.START)))


def mark_attempt(writer: MetricsWriter, start_step: int, restarts: int | None) -> None:
    """A trainer's writer at the start of an attempt that resumes after ``start_step``: what
    a failed attempt wrote after that step is superseded (``mark_session_start``), and
    trainer0 (``restarts`` not None) plots ``train/restarts``, the restarts so far."""
    mark_session_start(writer, start_step + 1)
    if restarts is not None:
        writer.add_scalar("train/restarts", restarts, start_step)


def flatten_hparams(values: Mapping[str, Any], prefix: str = "") -> dict[str, HParamValue]:
    """Nested config -> ``{"optim.lr": 0.05, ...}`` with values TensorBoard accepts.

    Lists become strings (``"[128, 64]"``), ``None`` becomes ``"None"``.
    """
    flat: dict[str, HParamValue] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_hparams(value, prefix=f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat


class ThroughputMeter:
    """Samples per second, overall and over a recent window.

    ``update(n)`` after each batch; ``rate()`` is the windowed rate (what a progress line
    shows), ``overall()`` the rate since ``start()`` (what metrics.json reports).
    """

    def __init__(self, window_s: float = 5.0, clock: Any = time.perf_counter) -> None:
        self._clock = clock
        self.window_s = window_s
        self.start()

    def start(self) -> None:
        now = self._clock()
        self._t0 = now
        self.total = 0
        self._marks: list[tuple[float, int]] = [(now, 0)]  # (time, cumulative samples)

    def update(self, n_samples: int) -> None:
        now = self._clock()
        self.total += int(n_samples)
        self._marks.append((now, self.total))
        # Keep one mark at or before the window start, so rate() spans the full window.
        while len(self._marks) > 2 and self._marks[1][0] <= now - self.window_s:
            self._marks.pop(0)

    def rate(self) -> float:
        (t0, n0), (t1, n1) = self._marks[0], self._marks[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def overall(self) -> float:
        elapsed = self._clock() - self._t0
        return self.total / elapsed if elapsed > 0 else 0.0


class LatencyStats:
    """Running count / mean / max of durations (e.g. RPC latency) and bytes moved."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.count = 0
        self.total_s = 0.0
        self.max_s = 0.0
        self.bytes = 0

    def record(self, seconds: float, nbytes: int = 0) -> None:
        self.count += 1
        self.total_s += seconds
        self.max_s = max(self.max_s, seconds)
        self.bytes += int(nbytes)

    @property
    def mean_s(self) -> float:
        return self.total_s / self.count if self.count else 0.0

    def summary(self, prefix: str = "") -> dict[str, float]:
        """E.g. ``{"<prefix>latency_ms": ..., "<prefix>max_latency_ms": ..., ...}`` for add_scalars."""
        return {
            f"{prefix}latency_ms": self.mean_s * 1e3,
            f"{prefix}max_latency_ms": self.max_s * 1e3,
            f"{prefix}calls": float(self.count),
            f"{prefix}bytes": float(self.bytes),
        }


def write_metrics_json(path: str | os.PathLike[str], metrics: Mapping[str, Any]) -> None:
    """Write the run's final metrics atomically (readers never see a partial file).

    Non-finite floats are written as null, so the file stays strict JSON.
    """

    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, Mapping):
            return {str(k): clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    atomic_write_text(path, json.dumps(clean(dict(metrics)), indent=2, sort_keys=True, allow_nan=False) + "\n")


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far, in bytes (what metrics.json reports per role)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB, macOS bytes
