"""A benchmark's result as a JSON file in ``benchmarks/results/``: what docs/benchmarks.md is
generated from (``python -m benchmarks.report``; the schema is in docs/benchmarking.md).

A benchmark records its run with ``--result [PATH]`` (``add_result_option``): its printed report
is kept as it was printed, its Markdown tables as tables and its other lines as notes, with the
date, the commit, the machine and the command. ``load`` reads a result back and rejects a
malformed one with a ``ResultError`` naming the file and the field.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

SCHEMA = 1
ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}( \d{2}:\d{2})?")
_COMMIT = re.compile(r"[0-9a-f]{7,40}\+?")  # "+": run with uncommitted changes


class ResultError(ValueError):
    """A result file that does not follow the schema (the message names the file and field)."""


@dataclass(frozen=True)
class Machine:
    cores: int
    load_start: float | None  # 1-minute load average when the run started
    load_end: float | None = None
    cpu: str | None = None  # e.g. "AMD EPYC", from /proc/cpuinfo's model name
    note: str | None = None  # what else was known: "quiet", "shared with other jobs", ...


@dataclass(frozen=True)
class Table:
    columns: list[str]
    rows: list[list[str]]  # each as long as ``columns``; figures already formatted as printed
    caption: str | None = None


@dataclass(frozen=True)
class Result:
    benchmark: str  # the module: python -m benchmarks.<benchmark>
    title: str  # the report's heading for it
    date: str  # UTC, "YYYY-MM-DD HH:MM" (or "YYYY-MM-DD")
    commit: str
    machine: Machine
    command: str
    tables: list[Table]
    notes: list[str] = field(default_factory=list)  # printed lines that are not tables
    summary: str = ""  # Markdown: how to read the figures, written by whoever recorded them
    schema: int = SCHEMA

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, ensure_ascii=False) + "\n"


def _need(doc: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str, optional: bool = False) -> Any:
    value = doc.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ResultError(f"{where}: field {key!r} must be of type {names}, got {value!r}")
    return value


def parse(doc: Any, where: str) -> Result:
    """A result from its decoded JSON; ``where`` (the file) is named in every error."""
    if not isinstance(doc, dict):
        raise ResultError(f"{where}: a result is a JSON object, got {type(doc).__name__}")
    if doc.get("schema") != SCHEMA:
        raise ResultError(f"{where}: field 'schema' must be {SCHEMA}, got {doc.get('schema')!r}")
    unknown = set(doc) - {f for f in Result.__dataclass_fields__}
    if unknown:
        raise ResultError(f"{where}: unknown field(s) {sorted(unknown)} (see docs/benchmarking.md for the schema)")
    date, commit = _need(doc, "date", str, where), _need(doc, "commit", str, where)
    if not _DATE.fullmatch(date):
        raise ResultError(f"{where}: field 'date' must be 'YYYY-MM-DD HH:MM' (UTC), got {date!r}")
    if not _COMMIT.fullmatch(commit):
        raise ResultError(f"{where}: field 'commit' must be a git hash (7-40 hex digits), got {commit!r}")
    m = _need(doc, "machine", dict, where)
    mw = f"{where}: machine"
    machine = Machine(
        cores=_need(m, "cores", int, mw),
        load_start=_need(m, "load_start", (int, float), mw, optional=True),
        load_end=_need(m, "load_end", (int, float), mw, optional=True),
        cpu=_need(m, "cpu", str, mw, optional=True),
        note=_need(m, "note", str, mw, optional=True),
    )
    tables = []
    for i, t in enumerate(_need(doc, "tables", list, where)):
        tw = f"{where}: tables[{i}]"
        if not isinstance(t, dict):
            raise ResultError(f"{tw} must be an object with 'columns' and 'rows'")
        columns = [str(c) for c in _need(t, "columns", list, tw)]
        rows = _need(t, "rows", list, tw)
        for j, row in enumerate(rows):
            if not isinstance(row, list) or len(row) != len(columns):
                raise ResultError(f"{tw}: rows[{j}] must be a list of {len(columns)} cells (one per column)")
        tables.append(Table(columns, [[str(c) for c in r] for r in rows], _need(t, "caption", str, tw, optional=True)))
    if not tables:
        raise ResultError(f"{where}: field 'tables' is empty: a result holds at least one table")
    notes = _need(doc, "notes", list, where, optional=True) or []
    if not all(isinstance(n, str) for n in notes):
        raise ResultError(f"{where}: field 'notes' must be a list of strings (lines)")
    return Result(
        benchmark=_need(doc, "benchmark", str, where),
        title=_need(doc, "title", str, where),
        date=date,
        commit=commit,
        machine=machine,
        command=_need(doc, "command", str, where),
        tables=tables,
        notes=notes,
        summary=_need(doc, "summary", str, where, optional=True) or "",
    )


def load(path: Path) -> Result:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ResultError(f"{path}: not valid JSON ({e})") from e
    return parse(doc, str(path))


def load_all(directory: Path) -> list[Result]:
    results = [load(p) for p in sorted(directory.glob("*.json"))]
    if not results:
        raise ResultError(f"{directory}: no result files (*.json); record one with a benchmark's --result")
    return results


def split_report(text: str) -> tuple[list[Table], list[str]]:
    """A printed report's Markdown tables (a header line, a ``|---|`` line, rows) and the
    other lines, in order; a table's caption is the note line just before it, if any."""
    tables: list[Table] = []
    notes: list[str] = []
    lines = text.rstrip("\n").splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\s*\|[\s:|-]+\|\s*", lines[i + 1]):
            columns = [c.strip() for c in line.strip().strip("|").split("|")]
            rows = []
            i += 2
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
                rows.append((cells + [""] * len(columns))[: len(columns)])
                i += 1
            tables.append(Table(columns, rows))
            continue
        if line.strip() or (notes and notes[-1]):  # no leading or repeated blank lines
            notes.append(line.rstrip())
        i += 1
    while notes and not notes[-1]:
        notes.pop()
    return tables, notes


def _git_commit() -> str:
    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return run.stdout.strip() if run.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "0000000"
    return commit + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None


def _load() -> float | None:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def add_result_option(parser: argparse.ArgumentParser, benchmark: str) -> None:
    """``--result [PATH]``: also record the run for docs/benchmarks.md (see ``run_recorded``)."""
    parser.add_argument(
        "--result",
        nargs="?",
        const=str(RESULTS_DIR / f"{benchmark}.json"),
        metavar="PATH",
        help=f"also record the printed report as a result file (default: benchmarks/results/{benchmark}.json), "
        "the input of python -m benchmarks.report",
    )


class _Tee(io.TextIOBase):
    def __init__(self, out: TextIO) -> None:
        self.out, self.kept = out, io.StringIO()

    def write(self, s: str) -> int:
        self.kept.write(s)
        return self.out.write(s)

    def flush(self) -> None:
        self.out.flush()


@contextlib.contextmanager
def _teed() -> Iterator[_Tee]:
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield tee


def run_recorded(benchmark: str, main: Callable[[], int | None]) -> int:
    """Run a benchmark's ``main``; with ``--result`` on the command line, write what it printed
    to stdout as a ``Result`` once it succeeded (its tables, notes, date, commit, machine)."""
    pre = argparse.ArgumentParser(add_help=False)
    add_result_option(pre, benchmark)
    path = pre.parse_known_args()[0].result
    started, load_start, commit = time.gmtime(), _load(), _git_commit()  # the code as it starts
    with _teed() as tee:
        code = main() or 0
    if path is None or code != 0 or "-h" in sys.argv[1:] or "--help" in sys.argv[1:]:
        return code
    tables, notes = split_report(tee.kept.getvalue())
    if not tables:  # a report printed as plain lines: one table of them keeps the schema whole
        tables, notes = [Table(["output"], [[n] for n in notes if n])], []
    argv = [a for a in sys.argv[1:] if not a.startswith("--result") and a != path]
    result = Result(
        benchmark=benchmark,
        title=benchmark,
        date=time.strftime("%Y-%m-%d %H:%M", started),
        commit=commit,
        machine=Machine(cores=os.cpu_count() or 1, load_start=load_start, load_end=_load(), cpu=_cpu_model()),
        command=" ".join(["python -m", f"benchmarks.{benchmark}", *argv]),
        tables=tables,
        notes=notes,
    )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(result.to_json(), encoding="utf-8")
    print(f"recorded {path}; python -m benchmarks.report regenerates docs/benchmarks.md", file=sys.stderr)
    return code
