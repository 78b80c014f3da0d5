"""docs/benchmarks.md is what ``python -m benchmarks.report`` makes of the committed result files
in benchmarks/results/ (a drift check), and the generator rejects a malformed result file with
an error naming the file and the field. The generator runs as its command does (a subprocess:
the tests import nothing from benchmarks/); no benchmark runs here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _report(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "benchmarks.report", *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def _a_result() -> dict[str, object]:
    return json.loads((RESULTS / "e2e_bench.json").read_text(encoding="utf-8"))


@pytest.mark.timeout(120)
def test_the_committed_page_is_what_the_committed_results_give(tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    run = _report("--out", out)
    assert run.returncode == 0, run.stderr
    page = out.read_text(encoding="utf-8")
    assert page == (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8"), (
        "docs/benchmarks.md drifted from benchmarks/results/: run python -m benchmarks.report"
    )
    assert len(page.splitlines()) <= 450
    for path in sorted(RESULTS.glob("*.json")):  # every result is on the page with its provenance
        doc = json.loads(path.read_text(encoding="utf-8"))
        assert f"## {doc['title']}\n" in page
        assert f"{doc['date']}, commit {doc['commit']}, " in page
        assert f"`{doc['command']}`" in page
        for table in doc["tables"]:
            assert "| " + " | ".join(table["columns"]) + " |" in page
    assert _report("--check").returncode == 0


@pytest.mark.timeout(120)
def test_a_stale_page_fails_the_check(tmp_path: Path) -> None:
    stale = tmp_path / "benchmarks.md"
    stale.write_text("# Benchmarks\n", encoding="utf-8")
    run = _report("--check", "--out", stale)
    assert run.returncode == 1
    assert "out of date" in run.stderr and "python -m benchmarks.report" in run.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"commit": "not-a-hash"}, "field 'commit'"),
        ({"date": "yesterday"}, "field 'date'"),
        ({"tables": []}, "field 'tables' is empty"),
        ({"machine": {"cores": "two"}}, "machine: field 'cores'"),
        ({"tables": [{"columns": ["a", "b"], "rows": [["1"]]}]}, "tables[0]: rows[0]"),
        ({"colour": "blue"}, "unknown field(s) ['colour']"),
    ],
)
def test_a_malformed_result_file_is_rejected_naming_the_file_and_field(
    tmp_path: Path, change: dict[str, object], named: str
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**_a_result(), **change}), encoding="utf-8")
    run = _report("--results", tmp_path, "--out", tmp_path / "page.md")
    assert run.returncode == 2, run.stdout + run.stderr
    assert str(bad) in run.stderr and named in run.stderr, run.stderr
    assert not (tmp_path / "page.md").exists()


@pytest.mark.timeout(120)
def test_a_result_file_that_is_not_json_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "broken.json").write_text("{", encoding="utf-8")
    run = _report("--results", tmp_path, "--out", tmp_path / "page.md")
    assert run.returncode == 2
    assert "broken.json: not valid JSON" in run.stderr
