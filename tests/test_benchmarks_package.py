"""benchmarks/ is a package run as ``python -m benchmarks.<name>``: no benchmark edits
``sys.path``, each one's module docstring (its ``--help``) says what it runs in at most 20
lines, and no test imports anything from it (tests run its commands as subprocesses)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def _modules(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "results" not in p.parts)


def test_no_benchmark_edits_sys_path() -> None:
    offenders = []
    for path in _modules(BENCHMARKS):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "path":
                if isinstance(node.value, ast.Name) and node.value.id == "sys":
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"sys.path edits (run benchmarks as python -m benchmarks.<name>): {offenders}"


def test_each_benchmark_says_what_it_runs_in_at_most_20_lines() -> None:
    bad = {}
    for path in sorted(BENCHMARKS.glob("[!_]*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        lines = len(doc.splitlines()) if doc else 0
        if not 1 <= lines <= 20:
            bad[path.name] = lines
    assert not bad, f"module docstrings must have 1-20 lines (name: lines): {bad}"


def test_no_test_imports_benchmarks() -> None:
    offenders = []
    for path in _modules(ROOT / "tests"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            if any(n == "benchmarks" or n.startswith("benchmarks.") for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"tests import from benchmarks/ (run its command as a subprocess instead): {offenders}"
