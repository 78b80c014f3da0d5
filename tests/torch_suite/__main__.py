"""Run torch's own RPC test suites on torch and on rpc_core, and write the comparison table.

    python -m tests.torch_suite                     # the whole selection, both libraries: docs/torch_suite.md
    python -m tests.torch_suite --quick             # the representative subset (a minute or two)
    python -m tests.torch_suite --suite rpc -k profiler --lib rpc_core   # a part, one library
    python -m tests.torch_suite --from-results DIR  # rewrite the table from an earlier run's results

Each library runs in a process of its own (``driver``), which forks every test's ranks; the
outcomes go to ``--results`` (one JSON line per test) as they come. The table is written
when the whole selection ran (or with ``--table PATH``); a partial run prints its summary.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from tests.torch_suite import exclusions, report
from tests.torch_suite.suites import LIBS, SUITES, TestId

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_TABLE = ROOT / "docs" / "torch_suite.md"


def selection(suites: list[str], pattern: str | None, quick: bool) -> list[TestId]:
    """The tests to run, from the test names torch's modules define (listed without
    importing them into this process: a driver does)."""
    listed = [t for t in list_tests(suites) if str(t) not in exclusions.EXCLUDED]
    if quick:
        listed = [t for t in listed if str(t) in exclusions.QUICK]
    if pattern:
        listed = [t for t in listed if pattern in str(t)]
    return listed


def list_tests(suites: list[str]) -> list[TestId]:
    code = (
        "import json, sys\n"
        "from tests.torch_suite.suites import prepare_environment, test_classes, test_names\n"
        "prepare_environment(60)\n"
        f"classes = test_classes('torch', {suites!r})\n"
        "print(json.dumps([[s, c, n] for s, d in classes.items() for c, k in d.items() for n in test_names(k)]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT, env=_env(), timeout=300
    )
    return [TestId(*row) for row in json.loads(out.stdout.strip().splitlines()[-1])]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def run_lib(
    lib: str, tests: list[TestId], results: pathlib.Path, timeout: float, budget: float, rerun: bool = False
) -> None:
    """Run ``tests`` on ``lib`` in a driver process, bounded by ``budget`` seconds in all.
    Tests with an outcome in ``results`` are not run again, unless ``rerun`` and it was not a pass."""
    out = results / f"{lib}.jsonl"
    kept = [r for r in report.read(out) if not (rerun and r["outcome"] != "passed")]
    if rerun:
        out.write_text("".join(json.dumps(r) + "\n" for r in kept))
    done = {r["test"] for r in kept}
    todo = [str(t) for t in tests if str(t) not in done]
    if not todo:
        return
    cmd = [sys.executable, "-m", "tests.torch_suite.driver", "--lib", lib, "--out", str(out)]
    cmd += ["--timeout", str(timeout), *todo]
    try:
        subprocess.run(cmd, cwd=ROOT, env=_env(), timeout=budget, check=False)
    except subprocess.TimeoutExpired:
        print(f"[torch_suite] {lib}: stopped after the {budget:.0f} s budget", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lib", choices=(*LIBS, "both"), default="both")
    parser.add_argument("--suite", action="append", choices=sorted(SUITES), help="a suite to run (repeatable)")
    parser.add_argument("-k", dest="pattern", help="only tests whose SUITE.CLASS.test_name contains this")
    parser.add_argument("--quick", action="store_true", help="only the representative subset (exclusions.QUICK)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one test may take (default 120)")
    parser.add_argument("--budget", type=float, default=4 * 3600.0, help="seconds one library's run may take")
    parser.add_argument("--results", type=pathlib.Path, help="folder for the outcomes (default: a new temp folder)")
    parser.add_argument("--rerun", action="store_true", help="run again the tests --results has as not passed")
    parser.add_argument("--from-results", type=pathlib.Path, help="skip running: write the table from this folder")
    parser.add_argument(
        "--table", type=pathlib.Path, help=f"write the table here (default {DEFAULT_TABLE} on a full run)"
    )
    args = parser.parse_args(argv)

    suites = args.suite or list(SUITES)
    tests = selection(suites, args.pattern, args.quick)
    full = not (args.suite or args.pattern or args.quick)
    results = args.from_results or args.results or pathlib.Path(tempfile.mkdtemp(prefix="torch_suite_"))
    results.mkdir(parents=True, exist_ok=True)
    if args.from_results is None:
        start = time.monotonic()
        for lib in LIBS if args.lib == "both" else (args.lib,):
            run_lib(lib, tests, results, args.timeout, args.budget, args.rerun)
        print(f"[torch_suite] {len(tests)} tests in {time.monotonic() - start:.0f} s; results in {results}")
    rows = report.rows(tests, results)
    print(report.summary(rows))
    table = args.table or (DEFAULT_TABLE if full or args.from_results else None)
    if table is not None:
        given = sys.argv[1:] if argv is None else argv
        # A table rewritten from results names the run that made them (into one --results folder).
        command = (
            "python -m tests.torch_suite" if args.from_results else " ".join(["python -m tests.torch_suite", *given])
        )
        table.write_text(report.markdown(rows, command=command))
        print(f"[torch_suite] wrote {table}")
    return 1 if report.unexplained(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
