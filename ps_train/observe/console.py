"""What reaches the console from the roles: the warnings a user must see, and the run's summary.

A role logs to its own file only (``logs/<role>.log``, at ``logging.level``). A log call
marked with ``extra=CONSOLE`` -- lines skipped in the data, a trainer replaced, a trainer
that joined or left -- also goes to the console, one line (``[role] warning: ...``), at any
``logging.level`` that keeps it (``logging=quiet`` keeps warnings): ``ConsoleHandler``.
The summary is a few lines trainer0 prints at the end: per role, its steps or updates,
samples/s, bytes moved and peak RSS (``summary_lines``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

__all__ = ["CONSOLE", "ConsoleHandler", "summary_lines"]

CONSOLE = {"console": True}  # log.warning(..., extra=CONSOLE): also on the console


class ConsoleHandler(logging.Handler):
    """Writes the records marked ``CONSOLE`` to ``stream`` (stderr), the first line of each."""

    def __init__(self, role: str, stream: TextIO | None = None) -> None:
        super().__init__()
        self.role, self.stream = role, stream

    def emit(self, record: logging.LogRecord) -> None:
        if not getattr(record, "console", False):
            return
        try:
            first = record.getMessage().splitlines()[0] if record.getMessage() else ""
            stream = self.stream or sys.stderr
            stream.write(f"[{self.role}] {record.levelname.lower()}: {first}\n")
            stream.flush()
        except (OSError, ValueError):  # a console that went away must not fail the role
            self.handleError(record)


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _moved(s: Mapping[str, Any]) -> str:
    if "bytes_received" not in s:
        return ""
    return f", {_mb(s['bytes_received'])} in / {_mb(s['bytes_sent'])} out"


def summary_lines(trainers: Sequence[Mapping[str, Any]], servers: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per role: servers (``ParameterServer.stats()``, in rank order) then trainers
    (their final totals)."""
    lines = []
    for r, s in enumerate(servers):
        upd = s.get("update_seconds", 0.0)
        per = f" ({upd / s['version'] * 1e3:.2f} ms each)" if s.get("version") else ""
        lines.append(f"  ps{r}: {s['version']} updates{per}{_moved(s)}, peak RSS {_mb(s['peak_rss_bytes'])}")
    for t in trainers:
        lines.append(
            f"  {t['trainer']}: {t['steps']} steps, {t['samples_per_s']:,.0f} samples/s{_moved(t)}, "
            f"peak RSS {_mb(t['peak_rss_bytes'])}"
        )
    return lines
