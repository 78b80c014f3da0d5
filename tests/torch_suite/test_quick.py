"""torch's own RPC tests, the representative subset (``exclusions.QUICK``), pass on rpc_core.

The tests are torch's, unchanged (torch is the oracle: each asserts results against plain
torch or known values); their RPC imports are routed to rpc_core. One driver process runs
them all (its start costs what a torch import costs), each test bounded by the driver's
per-test timeout, the whole by ``BUDGET``. ``python -m tests.torch_suite`` runs the whole
selection on both libraries.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from tests.torch_suite import exclusions, report
from tests.torch_suite.suites import SUITES, TestId

ROOT = pathlib.Path(__file__).resolve().parents[2]
PER_TEST = 30.0  # s one torch test may take, all its ranks
BUDGET = 150.0  # s for the driver: its start, and every test

pytest.importorskip("expecttest", reason="torch's test modules import expecttest (the `test` extra)")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    out = tmp_path_factory.mktemp("torch_suite") / "rpc_core.jsonl"
    cmd = [sys.executable, "-m", "tests.torch_suite.driver", "--lib", "rpc_core", "--out", str(out)]
    subprocess.run([*cmd, "--timeout", str(PER_TEST), *exclusions.QUICK], cwd=ROOT, timeout=BUDGET, check=False)
    return {r["test"]: r for r in report.read(out)}


def test_the_quick_subset_is_in_the_selection() -> None:
    for name in exclusions.QUICK:
        test = TestId.parse(name)
        assert test.cls in SUITES[test.suite][1], f"{name}: {test.cls} is not a class of suite {test.suite}"


@pytest.mark.timeout(BUDGET + 30)
@pytest.mark.parametrize("name", exclusions.QUICK)
def test_torch_test_passes_on_rpc_core(outcomes: dict[str, dict[str, str]], name: str) -> None:
    got = outcomes.get(name)
    assert got is not None, f"{name} did not finish within the driver's {BUDGET:.0f} s"
    assert got["outcome"] == "passed", f"{name} {got['outcome']} on rpc_core: {got['detail']}"
