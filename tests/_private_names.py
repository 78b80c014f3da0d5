"""Finds private names (a leading underscore) used across package lines, from the source (``ast``).

A package is each directory with an ``__init__.py``; a module belongs to the directory it lies
in (``rpc_core/api.py`` to ``rpc_core``, ``rpc_core/agent/agent.py`` and
``rpc_core/agent/__init__.py`` to ``rpc_core.agent``). A name is private when it starts with an
underscore and is not a dunder (``__init__``, ``__version__``). Only names of the scanned code
count (rpc_core's and ps_train's): what torch or the standard library keep private is theirs.

A use crosses a package line when a module of one package

1. imports a private name from a module of another package (``from ..rref import _on_invoke``,
   ``from rpc_core.agent import _helpers``, ``import rpc_core._x``);
2. reads, writes or deletes a private attribute of a name its imports bound to a module or object
   of another package, followed through dotted chains (``agent_mod._agent``,
   ``rref.state._ctx``, ``Agent._install``, ``getattr(agent_mod, "_agent")``);
3. reads a private attribute, on any other expression, that only classes of the packages it
   imports from define (``self._x = ...`` in a method, ``_x`` in a class body or its
   ``__slots__``, a ``def _x`` method) and no class of its own package does: ``opt._owner_id``
   where ``opt`` is an RRef held in a local, ``self._start()`` of a base class imported from
   another package.

Limits: case 3 is a guess from names, as the static type of an expression is unknown: an
attribute that classes of the reader's own package define too is not flagged, nor one of a
package the module does not import (an object handed over by a caller), nor a private
attribute of another library (``tensor._indices()``) that no class of ours defines. Names bound
inside functions count as if bound at module level; an object imported from a package that
re-exports it is taken as the re-exporter's.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass(frozen=True)
class Violation:
    module: str  # the module that uses the name
    line: int
    what: str  # e.g. "reads rpc_core.agent.agent._agent"

    def __str__(self) -> str:
        return f"{self.module} (line {self.line}) {self.what}"


@dataclass(frozen=True)
class Bound:
    """What a name bound by an import refers to: a module of ours, or an object one of ours holds."""

    module: str  # the module itself, or the module the object was imported from
    is_module: bool


class Code:
    """The modules under some top-level package directories, by dotted name."""

    def __init__(self, roots: Collection[Path]) -> None:
        self.paths: dict[str, Path] = {}
        for root in roots:
            for path in sorted(root.rglob("*.py")):
                parts = list(path.relative_to(root.parent).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                self.paths[".".join(parts)] = path

    def is_package(self, module: str) -> bool:
        return self.paths[module].name == "__init__.py"

    def package_of(self, module: str) -> str:
        return module if self.is_package(module) else module.rpartition(".")[0]

    def ours(self, module: str) -> bool:
        return module in self.paths

    def resolve_from(self, importer: str, node: ast.ImportFrom) -> str:
        """The absolute module name ``from X import ...`` reads from."""
        if not node.level:
            return node.module or ""
        base = self.package_of(importer).split(".")
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))


def _class_attributes(tree: ast.Module) -> set[str]:
    """The private attribute names the classes of one module define."""
    found: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.add(item.name)
                if item.args.args:
                    found |= _assigned_on(item, item.args.args[0].arg)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                found.add(item.target.id)
            elif isinstance(item, ast.Assign):
                for target in item.targets:
                    if isinstance(target, ast.Name):
                        found.add(target.id)
                        if target.id == "__slots__":
                            found |= {
                                c.value
                                for c in ast.walk(item.value)
                                if isinstance(c, ast.Constant) and isinstance(c.value, str)
                            }
    return {n for n in found if is_private(n)}


def _assigned_on(method: ast.AST, self_name: str) -> set[str]:
    """Attributes ``self.x = ...`` (also annotated, augmented and in tuples) sets inside ``method``."""
    return {
        n.attr
        for n in ast.walk(method)
        if isinstance(n, ast.Attribute)
        and isinstance(n.ctx, ast.Store)
        and isinstance(n.value, ast.Name)
        and n.value.id == self_name
    }


def _chain(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None if it does not start with a plain name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _attribute_uses(tree: ast.Module) -> Iterator[tuple[ast.expr, str, str, int]]:
    """(object expression, attribute, "reads"/"writes"/"deletes", line) for every attribute use,
    ``getattr``/``setattr``/``hasattr``/``delattr`` with a constant name included."""
    verbs = {ast.Load: "reads", ast.Store: "writes", ast.Del: "deletes"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node.value, node.attr, verbs[type(node.ctx)], node.lineno
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            verb = {"setattr": "writes", "delattr": "deletes"}.get(node.func.id, "reads")
            yield node.args[0], node.args[1].value, verb, node.lineno


class Checker:
    """Every private name used across package lines in ``roots``, except the names in ``allowed``."""

    def __init__(self, roots: Collection[Path], allowed: Collection[str] = ()) -> None:
        self.code = Code(roots)
        self.allowed = frozenset(allowed)
        self.trees = {m: ast.parse(p.read_text(), str(p)) for m, p in self.code.paths.items()}
        self.defined_by: dict[str, set[str]] = {}  # package -> private attributes its classes define
        for module, tree in self.trees.items():
            self.defined_by.setdefault(self.code.package_of(module), set()).update(_class_attributes(tree))

    def _private(self, name: str) -> bool:
        return is_private(name) and name not in self.allowed

    def _crosses(self, user: str, owner_module: str) -> bool:
        return self.code.package_of(user) != self.code.package_of(owner_module)

    def violations(self) -> list[Violation]:
        found: list[Violation] = []
        for module, tree in self.trees.items():
            bound, external = self._bindings(module, tree, found)
            imported = {self.code.package_of(b.module) for b in bound.values()}
            for obj, attr, verb, line in _attribute_uses(tree):
                if not self._private(attr):
                    continue
                chain = _chain(obj)
                if chain is not None and chain[0] in external:
                    continue  # torch._C and the like: not ours
                if chain is not None and chain[0] in bound:
                    owner = self._follow(bound[chain[0]], chain[1:])
                    if self._crosses(module, owner.module):
                        path = ".".join([owner.module, *([] if owner.is_module else ["<object>"]), attr])
                        found.append(Violation(module, line, f"{verb} {path}"))
                    continue
                package = self.code.package_of(module)
                if verb == "reads" and attr not in self.defined_by.get(package, set()):
                    owners = sorted(p for p in imported if attr in self.defined_by.get(p, set()))
                    if owners:
                        found.append(Violation(module, line, f"reads .{attr} (defined by {', '.join(owners)})"))
        return sorted(set(found), key=lambda v: (v.module, v.line, v.what))

    def _follow(self, start: Bound, attrs: list[str]) -> Bound:
        """Where ``name.a.b`` leads: submodules while they are modules, then an object of the last one."""
        current = start
        for attr in attrs:
            if not current.is_module or not self.code.ours(f"{current.module}.{attr}"):
                break
            current = Bound(f"{current.module}.{attr}", True)
        return current

    def _bindings(self, module: str, tree: ast.Module, found: list[Violation]) -> tuple[dict[str, Bound], set[str]]:
        """(names bound to our modules or objects, names bound to other libraries); records the
        imports of private names across package lines in ``found``."""
        bound: dict[str, Bound] = {}
        external: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    self._check_module_path(module, alias.name, node.lineno, found)
                    if alias.asname is not None:
                        if self.code.ours(alias.name):
                            bound[alias.asname] = Bound(alias.name, True)
                        else:
                            external.add(alias.asname)
                    else:
                        top = alias.name.partition(".")[0]
                        if self.code.ours(top):
                            bound[top] = Bound(top, True)
                        else:
                            external.add(top)
            elif isinstance(node, ast.ImportFrom):
                source = self.code.resolve_from(module, node)
                if not self.code.ours(source):
                    external |= {a.asname or a.name for a in node.names}
                    continue
                self._check_module_path(module, source, node.lineno, found)
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if self._private(alias.name) and self._crosses(module, source):
                        found.append(Violation(module, node.lineno, f"imports {sub}"))
                    is_module = self.code.ours(sub)
                    bound[alias.asname or alias.name] = Bound(sub if is_module else source, is_module)
        return bound, external

    def _check_module_path(self, module: str, path: str, line: int, found: list[Violation]) -> None:
        """``import a._b.c`` reaches into the private module ``a._b`` of package ``a``."""
        parts = path.split(".")
        for i in range(1, len(parts)):
            prefix = ".".join(parts[:i])
            if self._private(parts[i]) and self.code.ours(prefix) and self._crosses(module, prefix):
                found.append(Violation(module, line, f"imports {'.'.join(parts[: i + 1])}"))
                return
