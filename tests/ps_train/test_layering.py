"""Imports point down only: ps_train's modules, and its sub-packages, import each other
without cycles, only the entry points import the launcher, and the config imports nothing
else of ps_train but the update modes, which import nothing else.

The import graph is read from the source (``ast``), counting imports inside functions too:
a deferred import is still a dependency, and deferring one is how cycles used to hide.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ps_train
from tests._graphs import cycles

PACKAGE_DIR = Path(ps_train.__file__).resolve().parent
# The entry points: what starts a run may import the launcher (the package ps_train.launch);
# nothing the launcher starts may.
LAUNCHER = "ps_train.launch"
ENTRY_POINTS = {"ps_train.app", "ps_train.__main__"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _within(package: str, module: str) -> bool:
    return module == package or module.startswith(package + ".")


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The ps_train module ``name`` refers to (its longest prefix that is one), or None."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """ps_train module -> the ps_train modules it imports (anywhere in its body)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    # `from ps_train import backend` imports the module ps_train.backend,
                    # `from ps_train.config import Config` the module ps_train.config.
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in modules else base)
        resolved = {_resolve(t, modules) for t in targets if t == "ps_train" or t.startswith("ps_train.")}
        graph[name] = {t for t in resolved if t is not None and t != name}
    return graph


# Each workload (a sub-package of ps_train.workloads) is a unit of its own, as a sub-package
# of ps_train is: the workloads sit on one floor, above the roles, and never import each other.
WORKLOADS = "ps_train.workloads"
# Above the workloads: a run's entry points, `python -m ps_train.prepare` (converts a
# workload's raw data before any run), and the planner with its cost model (`python -m
# ps_train.plan` prices each built-in workload's shapes). Nothing a run starts imports them.
ABOVE_WORKLOADS = ("ps_train.app", "ps_train.__main__", "ps_train.prepare", "ps_train.plan", "ps_train.scaling")


def package_of(module: str, modules: dict[str, Path]) -> str:
    """The unit of the package graph: a sub-package of ps_train (``ps_train.roles``), or a
    workload (``ps_train.workloads.ctr``), for every module inside it; a top-level module
    (``ps_train.stage_sharding``) for itself."""
    parts = module.split(".")
    depth = 3 if _within(WORKLOADS, module) and len(parts) > 2 else 2
    if len(parts) >= depth and modules.get(".".join(parts[:depth]), Path()).name == "__init__.py":
        return ".".join(parts[:depth])
    return module


def package_graph() -> dict[str, set[str]]:
    """ps_train's sub-packages and top-level modules -> those they import."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        unit = package_of(module, modules)
        graph.setdefault(unit, set()).update(package_of(t, modules) for t in targets)
    return {unit: targets - {unit, "ps_train"} for unit, targets in graph.items() if unit != "ps_train"}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, each sorted."""
    return cycles(graph)


def _describe(graph: dict[str, set[str]], component: list[str]) -> str:
    members = set(component)
    edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return "{" + ", ".join(edges) + "}"


def test_the_graph_sees_ps_train_and_its_imports():
    graph = import_graph()
    assert {"ps_train.launch.local", "ps_train.roles.server", "ps_train.roles.trainer", "ps_train.app"} <= set(graph)
    assert "ps_train.launch.restarts" in graph["ps_train.app"]  # a sanity check of the parser itself


def test_no_import_cycles():
    graph = import_graph()
    cycles = _cycles(graph)
    assert not cycles, "ps_train modules import each other in cycles: " + "; ".join(_describe(graph, c) for c in cycles)


def test_no_import_cycles_between_packages():
    # A package is one concept (modes, checkpoint, elastic, roles, launch, a workload): it sits on
    # one floor, so no two of them (or a top-level module and a package) import each other.
    graph = package_graph()
    assert {"ps_train.roles", "ps_train.workloads.ctr", "ps_train.workloads.vision", "ps_train.launch"} <= set(graph)
    cycles = _cycles(graph)
    assert not cycles, "ps_train's packages import each other in cycles: " + "; ".join(
        _describe(graph, c) for c in cycles
    )


def test_only_the_entry_points_import_the_launcher():
    graph = import_graph()
    importers = sorted(
        m
        for m, targets in graph.items()
        if not _within(LAUNCHER, m) and m not in ENTRY_POINTS and any(_within(LAUNCHER, t) for t in targets)
    )
    assert not importers, (
        f"{importers} import {LAUNCHER}; only {sorted(ENTRY_POINTS)} may (what the "
        "launcher starts must not depend on it)"
    )


def test_the_config_imports_nothing_else_of_ps_train_but_the_modes():
    # Validation needs shapes and stage counts; the config answers them itself, so data,
    # models and the rest can import the config and never the other way round. A mode checks
    # its own options (so a new mode is one module), hence the config imports the modes,
    # which import nothing else of ps_train.
    graph = import_graph()
    below = ("ps_train.config", "ps_train.modes")
    outside = {
        f"{m} -> {t}"
        for m, targets in graph.items()
        if _within("ps_train.config", m)
        for t in targets
        if not any(_within(p, t) for p in below)
    }
    assert not outside, f"the config imports other ps_train modules: {sorted(outside)}"
    outside = {
        f"{m} -> {t}"
        for m, targets in graph.items()
        if _within("ps_train.modes", m)
        for t in targets
        if not _within("ps_train.modes", t)
    }
    assert not outside, f"the modes import other ps_train modules: {sorted(outside)}"
    assert "ps_train.modes" in graph["ps_train.config.run"]  # the rule above is not empty


def test_the_machinery_imports_no_workload():
    # The launcher, the roles and the modes (and everything below them) reach a workload
    # only through the registry (ps_train.workload); only the entry points import the
    # built-in workloads, to register them. A new workload is then a new package and nothing else.
    graph = import_graph()
    importers = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if not _within(WORKLOADS, m) and not any(_within(t, m) for t in ABOVE_WORKLOADS)
        for t in targets
        if _within(WORKLOADS, t) and t != WORKLOADS
    )
    assert not importers, f"these import a workload by name; ask ps_train.workload.workload_for instead: {importers}"
    assert any(_within(WORKLOADS + ".ctr", t) for t in graph["ps_train.workloads.ctr"] | {"ps_train.workloads.ctr"})


def test_workloads_do_not_import_each_other():
    graph = package_graph()
    workloads = [u for u in graph if _within(WORKLOADS, u) and u != WORKLOADS]
    assert {"ps_train.workloads.ctr", "ps_train.workloads.vision"} <= set(workloads)
    crossing = sorted(f"{a} -> {b}" for a in workloads for b in graph[a] if b in workloads and b != a)
    assert not crossing, f"workloads import each other (share code below them instead): {crossing}"


def test_nothing_a_run_starts_imports_the_planner():
    graph = import_graph()
    tools = ("ps_train.plan", "ps_train.scaling")
    importers = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if not any(_within(p, m) for p in tools)
        for t in targets
        if any(_within(p, t) for p in tools)
    )
    assert not importers, f"the planner sits above the workloads; these import it: {importers}"
