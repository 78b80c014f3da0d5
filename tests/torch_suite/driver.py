"""Runs selected tests of torch's RPC suites on one library, in this process, and records each.

    python -m tests.torch_suite.driver --lib rpc_core --out results.jsonl rpc.RpcTest.test_self_add ...

One process per library: on ``rpc_core`` it installs the import routes before torch's test
modules load, so nothing in it can reach torch's RPC by accident. Each test forks its ranks
(``suites``); its outcome is appended to ``--out`` as one JSON line as soon as it ends, so
a run cut short keeps what it measured. Used by ``python -m tests.torch_suite``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import unittest
from dataclasses import asdict, dataclass
from typing import Any

from tests.torch_suite.suites import LIBS, TestId, prepare_environment, test_classes


@dataclass(frozen=True)
class Outcome:
    test: str  # TestId text
    lib: str
    outcome: str  # passed | failed | skipped
    detail: str  # the error's last line, or the skip reason
    seconds: float


_FRAME = re.compile(r'^  File "[^"]*/(\w+_test\.py)", line (\d+), in (\w+)')
_ERROR = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|NotEmulated|NeedsTorchScript))(: .*)?$")


def summarize(text: str) -> str:
    """What failed, in one line, from a test's error text: the first rank's exception and
    the line of torch's test file it came through (``rpc_test.py:1234 ValueError: ...``).
    The parent's own "Process 1 exited with error code 10" wraps the ranks' tracebacks."""
    where = ""
    for line in text.splitlines():
        frame = _FRAME.match(line)
        if frame:
            where = f"{frame[1]}:{frame[2]} "
            continue
        error = _ERROR.match(line)
        if error and not line.startswith("RuntimeError: Process "):
            return (where + line)[:400]
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:400]


class _Result(unittest.TestResult):
    def __init__(self) -> None:
        super().__init__()
        self.outcome = ("passed", "")

    def addError(self, test: Any, err: Any) -> None:
        super().addError(test, err)
        self.outcome = ("failed", summarize(self.errors[-1][1]))

    def addFailure(self, test: Any, err: Any) -> None:
        super().addFailure(test, err)
        self.outcome = ("failed", summarize(self.failures[-1][1]))

    def addSkip(self, test: Any, reason: str) -> None:
        super().addSkip(test, reason)
        self.outcome = ("skipped", reason)


def run(lib: str, tests: list[TestId], out: str, timeout: float) -> None:
    prepare_environment(timeout)
    if lib == "rpc_core":
        from tests.torch_suite import routing

        routing.install()
    classes = test_classes(lib, sorted({t.suite for t in tests}))
    for test in tests:
        cls = classes[test.suite][test.cls]
        start = time.monotonic()
        result = _Result()
        cls(test.method).run(result)
        outcome = Outcome(str(test), lib, *result.outcome, seconds=round(time.monotonic() - start, 2))
        with open(out, "a") as f:
            f.write(json.dumps(asdict(outcome)) + "\n")
        print(f"[{lib}] {outcome.outcome:7s} {outcome.seconds:6.1f}s {test}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lib", choices=LIBS, required=True)
    parser.add_argument("--out", required=True, help="JSON-lines file the outcomes are appended to")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one test may take (all its ranks)")
    parser.add_argument("tests", nargs="+", help="SUITE.CLASS.test_name")
    args = parser.parse_args(argv)
    run(args.lib, [TestId.parse(t) for t in args.tests], args.out, args.timeout)


if __name__ == "__main__":
    main()
