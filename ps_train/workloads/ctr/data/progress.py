"""A progress line for a long conversion: lines, lines/s, percent of the input bytes and ETA.

On a terminal the line is redrawn in place (``\\r``) a few times a second; otherwise (a log
file, CI) a full line is written every ``every`` seconds, so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress", "format_duration"]


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _count(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


class Progress:
    """``update(lines, done_bytes, note)`` as work is done, ``close()`` at the end.
    ``total_bytes``: the input's size, for the percentage and the ETA."""

    def __init__(
        self, total_bytes: int, stream: TextIO | None = None, every: float | None = None, label: str = "prepare"
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every if every is not None else (0.25 if self.tty else 10.0)
        self.total, self.label = max(total_bytes, 1), label
        self.t0 = time.perf_counter()
        self.last = self.t0
        self.lines, self.done, self.note = 0, 0, ""
        self._width = 0

    def update(self, lines: int, done_bytes: int, note: str = "", force: bool = False) -> None:
        self.lines, self.done, self.note = lines, done_bytes, note
        now = time.perf_counter()
        if force or now - self.last >= self.every:
            self.last = now
            self._show(self.text(now))

    def text(self, now: float | None = None) -> str:
        elapsed = max((now if now is not None else time.perf_counter()) - self.t0, 1e-9)
        frac = min(self.done / self.total, 1.0)
        eta = elapsed * (1 - frac) / frac if frac > 0 else float("nan")
        parts = [
            f"{self.label}: {_count(self.lines)} lines",
            f"{frac:6.1%}",
            f"{_count(self.lines / elapsed)} lines/s",
            f"elapsed {format_duration(elapsed)}",
        ]
        if frac < 1:
            parts.append(f"ETA {format_duration(eta)}" if eta == eta else "ETA ?")
        return "  ".join(parts) + (f"  ({self.note})" if self.note else "")

    def _show(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r" + text.ljust(self._width))
            self._width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """The final line (always written), ending the redrawn one on a terminal."""
        self._show(self.text())
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
