"""``cluster.serializer=safe`` covers everything ps_train sends over RPC.

Two guards, so that a new RPC call cannot slip past the allowlist: every function ps_train's
source hands to ``rpc_sync`` / ``rpc_async`` / ``remote`` (directly, or through a method
that forwards its argument there) resolves in the allowlist ``ps_train.rpc_allowlist``
registers; and real runs under the safe serializer, each combining several features (every
mode, the CTR workload's row cache, dynamic, lazy and tiered tables, update in the backward,
elastic trainers, a fault hold, the profiler window, checkpoints), train, and where the run
is deterministic (one trainer in hybrid mode) exactly what pickle trains. (Plain sync mode:
test_app.py's ``test_the_safe_serializer_trains_exactly_what_pickle_trains``.)
"""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

import ps_train
from ps_train import rpc_allowlist
from ps_train.faults import FAULT_ENV
from ps_train.workload import Workload, registered_workloads
from rpc_core.protocol.allowlist import name_of
from tests.ps_train._app import final_weights, make_cfg, run_app
from tests.ps_train.test_dlrm import SMALL

PACKAGE_DIR = Path(ps_train.__file__).resolve().parent
RPC_CALLS = {"rpc_sync", "rpc_async", "remote"}  # each takes (to, func, ...)

# Sites whose function is a parameter of a lambda, so no caller can be read from the source:
# where the lambda goes, and which run below sends what it forwards.
INDIRECT = {
    # _step_hooks' ``call`` of the profiler window (ps_train.observe.traces.deposit):
    # test_elastic_profiled_async_run_with_a_fault_hold_completes_under_safe.
    ("ps_train.launch.rank", "<lambda>"),
}


class CallSite(NamedTuple):
    module: str
    line: int
    func: Any  # the function or class named, None when unresolved
    expr: str  # how the source names it


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _callee_name(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _value(module: Any, expr: ast.expr) -> Any:
    """The module-level object ``expr`` (a name, or a dotted attribute of one) refers to, or None."""
    if isinstance(expr, ast.Name):
        return getattr(module, expr.id, None)
    if isinstance(expr, ast.Attribute):
        base = _value(module, expr.value)
        return None if base is None else getattr(base, expr.attr, None)
    return None


class _Scopes(ast.NodeVisitor):
    """RPC call sites of one module, with the function or lambda each sits in."""

    def __init__(self) -> None:
        self.stack: list[ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda] = []
        self.sites: list[tuple[ast.Call, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | None]] = []
        self.calls: list[ast.Call] = []

    def _scoped(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        self.stack.append(node)
        self.generic_visit(node)
        self.stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _scoped

    def visit_Call(self, node: ast.Call) -> None:
        self.calls.append(node)
        if _callee_name(node) in RPC_CALLS and len(node.args) >= 2:
            self.sites.append((node, self.stack[-1] if self.stack else None))
        self.generic_visit(node)


def rpc_call_sites() -> Iterator[CallSite]:
    """Every function ps_train's source sends to be run by another worker.

    A site whose function is a parameter of the method it sits in (``ElasticRole._ps0(func,
    *args)``) stands for the arguments every call of that method in the module passes there."""
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        name = _module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        scopes = _Scopes()
        scopes.visit(tree)
        if not scopes.sites:
            continue
        module = importlib.import_module(name)
        for call, scope in scopes.sites:
            arg = call.args[1]
            params = [a.arg for a in scope.args.args] if scope is not None else []
            if isinstance(arg, ast.Name) and arg.id in params and isinstance(scope, ast.Lambda):
                yield CallSite(name, call.lineno, None, "<lambda>")
            elif isinstance(arg, ast.Name) and arg.id in params and scope is not None:
                assert not isinstance(scope, ast.Lambda)
                # A method: its own parameters after ``self``; a plain function: all of them.
                index = params.index(arg.id) - (1 if params and params[0] == "self" else 0)
                forwarded = [c for c in scopes.calls if _callee_name(c) == scope.name and len(c.args) > index]
                assert forwarded, f"{name}:{call.lineno}: nothing in {name} calls {scope.name}() with its {arg.id!r}"
                for c in forwarded:
                    yield CallSite(name, c.lineno, _value(module, c.args[index]), ast.unparse(c.args[index]))
            else:
                yield CallSite(name, call.lineno, _value(module, arg), ast.unparse(arg))


# Run in a fresh interpreter: what ``register`` imports is all a role is sure to know (this
# test's process imported every module it scanned).
RESOLVE = """
import json, sys
from ps_train import rpc_allowlist
from rpc_core import NotAllowedError
from rpc_core.protocol.allowlist import resolve
from tests.ps_train._app import make_cfg

overrides, names = json.loads(sys.argv[1])
rpc_allowlist.register(make_cfg(*overrides).model)
refused = []
for module, qualname in names:
    try:
        resolve(module, qualname)
    except NotAllowedError as e:
        refused.append(str(e))
print(json.dumps(refused))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workload", registered_workloads(), ids=lambda w: w.name)
def test_every_function_ps_train_sends_over_rpc_is_allowed(workload: Workload) -> None:
    model = {"vision": ["model=mlp"], "ctr": ["model=dlrm", "data=synthetic_ctr"]}.get(workload.name)
    if model is None:
        pytest.skip(f"a workload of another test ({workload.name}): its own tests register it")
    sites = list(rpc_call_sites())
    unresolved = {(s.module, s.expr) for s in sites if s.func is None}
    assert unresolved == INDIRECT, "RPC call sites whose function this test cannot name: list them in INDIRECT"
    named = [s for s in sites if s.func is not None]
    # The calls known today, so that a reader of a failure sees what is looked at.
    assert {s.func.__name__ for s in named} >= {
        "_lookup",
        "_prefetch",
        "_push_gradients",
        "_ps0_view",
        "request_stop",
        "assignment",
        "final_reports",
        "deposit_stats",
        "collect_stats",
        "_get_server_rref",
    }
    # ps_train's own calls, and this workload's (those of another workload run in its runs only).
    package = workload.module.rpartition(".")[0]
    mine = [s for s in named if not s.module.startswith("ps_train.workloads.") or s.module.startswith(package + ".")]
    names = sorted({name_of(s.func) for s in mine})
    out = subprocess.run(
        [sys.executable, "-c", RESOLVE, json.dumps([model, names])],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr
    refused = json.loads(out.stdout.strip().splitlines()[-1])
    where = {name_of(s.func): f"{s.module}:{s.line}" for s in mine}
    assert not refused, (
        "mark these @ps_train.backend.called_by_name, in a module ps_train.rpc_allowlist.MODULES "
        "or the workload's rpc_modules imports:\n" + "\n".join(refused) + f"\n(call sites: {where})"
    )


def test_a_workload_rpc_module_that_does_not_import_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = make_cfg()
    broken = Workload(
        name="broken",
        models=("mlp",),
        stages=lambda model, data, seed: None,  # type: ignore[arg-type,return-value]  # never built here
        trainer=lambda: object,
        check_data=lambda d: None,
        module="tests.ps_train.broken_workload",
        rpc_modules=("no_such_package.calls",),
    )
    monkeypatch.setattr(rpc_allowlist, "workload_for", lambda c: broken)
    with pytest.raises(
        ImportError, match=r"workload 'broken' .*'no_such_package.calls', named in its Workload.rpc_modules"
    ):
        rpc_allowlist.register(cfg.model)


# -- real runs ---------------------------------------------------------------------------------------
SAFE = "cluster.serializer=safe"
CTR = (*(o for o in SMALL if not o.startswith("checkpoint.every")), "cluster.num_servers=2")
DYNAMIC_TABLES = (
    "model.tables=[{name: a, num_embeddings: 40},"
    " {name: b, num_embeddings: 300, kind: dynamic, max_rows: 400}, {name: c, num_embeddings: 7}]"
)


def _same_checkpoint(a: Path, b: Path) -> None:
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.timeout(150)
@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_a_hybrid_ctr_run_with_a_row_cache_trains_exactly_what_pickle_trains(tmp_path: Path) -> None:
    # One trainer: hybrid mode is deterministic. The cache pushes its rows' gradients by
    # function (_push_gradients); lookups are functions too (_lookup); checkpoints carry tables.
    # A refresh every 2 steps: steps 3 and 4 read cached rows (step 0's refresh had no scores).
    cache = ("model.cache_rows=40", "model.cache_staleness=2")
    run = (*CTR, "train.steps=5", "mode=hybrid", "cluster.num_trainers=1", *cache, "checkpoint.every=2")
    pickled = run_app(tmp_path / "pickle", *run, timeout=60)
    safe = run_app(tmp_path / "safe", *run, SAFE, timeout=60)
    assert safe["losses"] == pickled["losses"] and safe["test_auc"] == pickled["test_auc"]
    assert safe["cache_hits_per_step"] == pickled["cache_hits_per_step"] > 0
    _same_checkpoint(tmp_path / "pickle", tmp_path / "safe")


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_an_ssp_ctr_run_with_dynamic_and_tiered_tables_completes_under_safe(tmp_path: Path) -> None:
    # ssp with the update on the backward: ps0 answers with a ClockedUpdate record; a memory
    # budget puts rows on disk and makes the trainers prefetch (_prefetch); table b is dynamic.
    metrics = run_app(
        tmp_path,
        *(o for o in CTR if not o.startswith(("data.table_sizes", "data.num_tables", "data.table_rows"))),
        DYNAMIC_TABLES,
        "model.table_memory_budget=26000",
        "train.steps=4",
        "mode=ssp",
        "cluster.num_trainers=2",
        "cluster.update_in_backward=true",
        "checkpoint.every=2",
        SAFE,
        timeout=90,
    )
    assert {t: len(v) for t, v in metrics["losses"].items()} == {"trainer0": 4, "trainer1": 4}
    assert all(rows > 0 for rows in metrics["dynamic_rows_live"].values())
    assert set(metrics["tier"]) == {"ps0", "ps1"}


@pytest.mark.timeout(120)
def test_elastic_profiled_async_run_with_a_fault_hold_completes_under_safe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Elastic: the trainers ask ps0 for their resume point and epochs (membership calls,
    # Assignment records); the hold asks ps0 for its view (faults._ps0_view); the profiler
    # window deposits each trainer's events on the servers (traces.deposit).
    monkeypatch.setenv(FAULT_ENV, "trainer0@2:hold_steps=trainer1*2")
    run_dir = tmp_path / "run"
    metrics = run_app(
        run_dir,
        "mode=async",
        "cluster.elastic=true",
        "cluster.num_trainers=2",
        "train.steps=5",
        "train.batch_size=32",
        "checkpoint.every=0",
        "profile.enabled=true",
        "profile.warmup=1",
        "profile.steps=2",
        SAFE,
        timeout=90,
    )
    assert {t: len(v) for t, v in metrics["losses"].items()} == {"trainer0": 5, "trainer1": 5}
    assert [e["event"] for e in metrics["membership"]][:2] == ["joined", "joined"]
    assert sorted(p.name for p in (run_dir / "traces").glob("ps*.json")) == ["ps0.json", "ps1.json"]
