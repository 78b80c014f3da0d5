"""The per-test comparison: outcomes on each library, the reason where rpc_core's differs,
and the markdown table ``python -m tests.torch_suite`` writes (docs/torch_suite.md)."""

from __future__ import annotations

import datetime
import json
import pathlib
import platform
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from tests.torch_suite import exclusions
from tests.torch_suite.suites import NOT_SELECTED, TestId

# How a failure caused by TorchScript RPC reads: a TorchScript function that cannot compile
# against rpc_core's types (routing), or rpc_core's own refusal (a scriptable RemoteModule).
TORCHSCRIPT_SIGNS = ("NeedsTorchScript", "rpc_core has no TorchScript RPC")


@dataclass(frozen=True)
class Row:
    test: TestId
    torch: str  # passed | failed | skipped | not run
    rpc_core: str
    why: str  # why rpc_core's outcome differs from torch's, or why the test is excluded
    kind: str  # same | rpc_core only | skipped | excluded | torch-private | differs | fails on torch | gap


def read(path: pathlib.Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rows(tests: list[TestId], results: pathlib.Path) -> list[Row]:
    got = {lib: {r["test"]: r for r in read(results / f"{lib}.jsonl")} for lib in ("torch", "rpc_core")}
    out = []
    for test in [*tests, *(TestId.parse(t) for t in exclusions.EXCLUDED)]:
        key = str(test)
        if key in exclusions.EXCLUDED:
            out.append(Row(test, "not run", "not run", exclusions.EXCLUDED[key], "excluded"))
            continue
        theirs = got["torch"].get(key, {"outcome": "not run", "detail": ""})
        ours = got["rpc_core"].get(key, {"outcome": "not run", "detail": ""})
        out.append(Row(test, theirs["outcome"], ours["outcome"], *_why(key, theirs, ours)))
    return out


def _why(key: str, theirs: dict[str, Any], ours: dict[str, Any]) -> tuple[str, str]:
    if ours["outcome"] == "passed":
        if theirs["outcome"] == "passed":
            return "", "same"
        return f"torch: {theirs['outcome']} ({theirs['detail']})", "rpc_core only"
    if ours["outcome"] == "skipped" and theirs["outcome"] == "skipped":
        return f"skipped by the test itself: {theirs['detail']}", "skipped"
    if any(sign in ours["detail"] for sign in TORCHSCRIPT_SIGNS):
        return f"needs TorchScript RPC: {ours['detail']}", "excluded"
    if key in exclusions.TORCH_PRIVATE:
        return exclusions.TORCH_PRIVATE[key], "torch-private"
    if key in exclusions.DIFFERS:
        return exclusions.DIFFERS[key], "differs"
    if theirs["outcome"] != "passed":
        return f"torch: {theirs['outcome']} ({theirs['detail']}); rpc_core: {ours['detail']}", "fails on torch"
    return ours["detail"] or ours["outcome"], "gap"


def unexplained(table: list[Row]) -> list[Row]:
    """Tests torch passes that rpc_core does not, with no listed reason."""
    return [r for r in table if r.kind == "gap"]


def summary(table: list[Row]) -> str:
    ran = [r for r in table if r.kind != "excluded"]
    torch_pass = sum(r.torch == "passed" for r in ran)
    both = sum(r.torch == "passed" and r.rpc_core == "passed" for r in ran)
    ours = sum(r.rpc_core == "passed" for r in ran)
    kinds = Counter(r.kind for r in table)
    return (
        f"{len(table)} tests: {len(ran)} run, {kinds['excluded']} excluded (CUDA/TorchScript); "
        f"torch passes {torch_pass}, rpc_core passes {ours} ({both} of torch's); "
        f"listed differences: {kinds['torch-private']} torch-private, {kinds['differs']} on purpose; "
        f"skipped by the tests themselves: {kinds['skipped']}; "
        f"unexplained gaps: {kinds['gap']}"
    )


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(table: list[Row], command: str) -> str:
    lines = [
        "# torch's RPC test suites on rpc_core",
        "",
        "Written by `python -m tests.torch_suite` (tests/torch_suite/): torch's own test modules "
        "(`torch.testing._internal.distributed.rpc.rpc_test`, `dist_autograd_test`, `dist_optimizer_test`, "
        "`examples.parameter_server_test`, `examples.reinforcement_learning_rpc_test`, "
        "`nn.api.remote_module_test`), run unchanged on torch (TensorPipe) and with their "
        "`torch.distributed.rpc` / `.autograd` / `.optim` / `.nn` imports routed to rpc_core "
        "(`tests/torch_suite/routing.py`). Excluded: what needs CUDA or TorchScript RPC. "
        "The target: every other test torch passes passes on rpc_core, or is listed with the torch-private "
        "object it touches or the difference rpc_core keeps on purpose (docs/torch_compatibility.md); a "
        "test that misses it is marked `gap`.",
        "",
        f"Command: `{command}`; torch {torch.__version__}, {platform.python_implementation()} "
        f"{platform.python_version()}, {datetime.date.today().isoformat()}.",
        "",
        summary(table),
        "",
        "## Suites not in the selection",
        "",
        "| suite | why |",
        "|---|---|",
        *(f"| `{name}` | {why} |" for name, why in NOT_SELECTED.items()),
        "",
        "## Per test",
        "",
        "| test | torch | rpc_core | kind | why |",
        "|---|---|---|---|---|",
    ]
    for r in table:
        lines.append(f"| `{r.test}` | {r.torch} | {r.rpc_core} | {r.kind} | {_cell(r.why)} |")
    return "\n".join(lines) + "\n"
