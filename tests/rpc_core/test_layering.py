"""rpc_core's imports point down only (docs/design.md, "Layout"; the order is ``rpc_core._LAYERS``).

Reads every module of rpc_core with ``ast`` (no import runs) and collects every import of
an rpc_core module: module-level and function-level, relative and absolute. Checks that
there is no import cycle, that every import points to a lower layer of
``rpc_core._LAYERS``, that a package's modules never import the package's ``__init__``,
and that rpc_core depends on none of the application's libraries.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path

import rpc_core
from tests._graphs import cycles

PACKAGE = "rpc_core"
# The application's dependencies: rpc_core needs torch and the standard library only.
FORBIDDEN = ("hydra", "omegaconf", "tensorboard", "torch.utils.tensorboard", "ps_train")

Edge = tuple[str, str, int]  # (importing module, imported module, line)


def module_names(root: Path) -> dict[str, Path]:
    """Dotted names relative to the package ("" is its __init__, "autograd.engine", ...)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _resolve(importer: str, node: ast.ImportFrom, modules: dict[str, Path]) -> str | None:
    """The rpc_core-relative name an ``from X import ...`` reads from, or None if X is outside rpc_core."""
    if node.level:
        base = importer.split(".") if importer else []
        if not _is_package(importer, modules):
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
        target = ".".join(base + ([node.module] if node.module else []))
        return target
    if node.module is not None and (node.module == PACKAGE or node.module.startswith(PACKAGE + ".")):
        return node.module[len(PACKAGE) + 1 :]
    return None


def _ancestors(name: str) -> list[str]:
    """Packages whose __init__ runs before ``name`` is imported ("a.b.c" -> ["a", "a.b"]); not rpc_core's own."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def imports(root: Path) -> tuple[list[Edge], list[tuple[str, str, int]]]:
    """(edges between rpc_core modules, (module, external module, line) for every other import)."""
    modules = module_names(root)
    edges: list[Edge] = []
    external: list[tuple[str, str, int]] = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                        targets.append(alias.name[len(PACKAGE) + 1 :])
                    else:
                        external.append((name, alias.name, node.lineno))
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, node, modules)
                if base is None:
                    # ``from torch.utils import tensorboard`` imports torch.utils.tensorboard
                    external.append((name, node.module or "", node.lineno))
                    external += [(name, f"{node.module}.{a.name}", node.lineno) for a in node.names]
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}" if base else alias.name
                    # ``from pkg import x`` imports module pkg.x if there is one, else a name of pkg.
                    targets.append(sub if sub in modules else base)
            for target in targets:
                # Importing a.b.c first runs the __init__ of each package on the way that
                # the importer is not itself inside (those are already running).
                for pkg in _ancestors(target):
                    if pkg not in _ancestors(name) and pkg != name:
                        edges.append((name, pkg, node.lineno))
                edges.append((name, target, node.lineno))
    return [e for e in edges if e[0] != e[1]], external


def find_cycles(edges: Sequence[Edge]) -> list[list[str]]:
    """Each strongly connected component of more than one module, as a sorted list."""
    graph: dict[str, set[str]] = {}
    for a, b, _ in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    return cycles(graph)


def _label(name: str) -> str:
    return f"{PACKAGE}.{name}" if name else PACKAGE


def upward_imports(edges: Sequence[Edge], layers: Sequence[Sequence[str]]) -> list[str]:
    """Imports that do not point to a strictly lower layer."""
    level = {m: i for i, layer in enumerate(layers) for m in layer}
    problems = []
    for a, b, line in sorted(set(edges)):
        if a in level and b in level and level[b] >= level[a]:
            where = "its own layer" if level[b] == level[a] else f"layer {level[b]}, above its {level[a]}"
            problems.append(f"{_label(a)} (line {line}) imports {_label(b)}: {where}")
    return problems


def own_package_imports(edges: Sequence[Edge]) -> list[str]:
    """Explicit imports of a module's own package __init__ (``from . import x`` where x is not a module)."""
    return [
        f"{_label(a)} (line {line}) imports its own package {_label(b)}"
        for a, b, line in sorted(set(edges))
        if a and (b == "" or b in _ancestors(a))
    ]


def problems(root: Path, layers: Sequence[Sequence[str]]) -> dict[str, list[str]]:
    """Everything wrong with the imports of the package at ``root``; empty lists when none."""
    edges, external = imports(root)
    modules = set(module_names(root))
    declared = [m for layer in layers for m in layer]
    return {
        "cycles": [" <-> ".join(_label(m) for m in c) for c in find_cycles(edges)],
        "undeclared": sorted(_label(m) for m in modules - set(declared)),
        "declared but missing": sorted(_label(m) for m in set(declared) - modules),
        "declared twice": sorted({_label(m) for m in declared if declared.count(m) > 1}),
        "upward": upward_imports(edges, layers),
        "own package": own_package_imports(edges),
        "forbidden": sorted(
            {
                f"{_label(a)} (line {line}) imports {ext}"
                for a, ext, line in external
                if any(ext == f or ext.startswith(f + ".") for f in FORBIDDEN)
            }
        ),
    }


ROOT = Path(rpc_core.__file__).parent


def _check(kind: str) -> None:
    found = problems(ROOT, rpc_core._LAYERS)[kind]
    assert not found, f"{kind}:\n  " + "\n  ".join(found)


def test_rpc_core_has_no_import_cycle() -> None:
    _check("cycles")


def test_every_module_has_one_place_in_the_layer_order() -> None:
    _check("undeclared")
    _check("declared but missing")
    _check("declared twice")


def test_every_import_points_to_a_lower_layer() -> None:
    _check("upward")


def test_no_module_imports_its_own_package_init() -> None:
    _check("own package")


def test_rpc_core_does_not_depend_on_the_application_or_its_libraries() -> None:
    _check("forbidden")


TESTS = Path(__file__).resolve().parents[1]
# rpc_core's tests and the harness their worker processes run (tests/_world.py and the
# emulated network's helpers): they test rpc_core alone, so they load nothing of the application.
HARNESS = ("__init__.py", "_graphs.py", "_world.py", "netns.py", "netns_relay.py", "netns_world.py")


def _imported_modules(path: Path) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.append((node.module, node.lineno))
    return out


def test_rpc_core_tests_and_their_harness_do_not_load_the_application() -> None:
    files = [TESTS / name for name in HARNESS] + sorted((TESTS / "rpc_core").glob("*.py"))
    found = [
        f"{path.relative_to(TESTS.parent)} (line {line}) imports {name}"
        for path in files
        for name, line in _imported_modules(path)
        if name == "ps_train" or name.startswith("ps_train.")
    ]
    assert not found, "\n  ".join(["rpc_core's tests import the application:", *found])


# -- the checker itself, on small made-up packages ------------------------------------------------------
def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / PACKAGE
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checker_sees_function_level_relative_and_absolute_imports(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "from . import low, high\n",
            "low.py": "def f():\n    from .high import g  # upward, inside a function\n",
            "high.py": "import rpc_core.low\nfrom rpc_core import low as _low\nimport hydra\n",
            "sub/__init__.py": "from .a import x\n",
            "sub/a.py": "from . import x\nfrom .. import low\n",
        },
    )
    found = problems(root, (("low",), ("high",), ("sub.a",), ("sub",), ("",)))
    assert found["cycles"] == ["rpc_core.high <-> rpc_core.low", "rpc_core.sub <-> rpc_core.sub.a"]
    assert found["upward"] == [
        "rpc_core.low (line 2) imports rpc_core.high: layer 1, above its 0",
        "rpc_core.sub.a (line 1) imports rpc_core.sub: layer 3, above its 2",
    ]
    assert found["own package"] == ["rpc_core.sub.a (line 1) imports its own package rpc_core.sub"]
    assert found["forbidden"] == ["rpc_core.high (line 3) imports hydra"]
    assert found["undeclared"] == [] and found["declared twice"] == []


def test_importing_a_submodule_counts_as_importing_its_package(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "sub/__init__.py": "from .. import top\n",
            "sub/a.py": "",
            "top.py": "from .sub import a\n",  # runs sub/__init__, which imports top
        },
    )
    assert problems(root, (("sub.a",), ("sub",), ("top",), ("",)))["cycles"] == ["rpc_core.sub <-> rpc_core.top"]
