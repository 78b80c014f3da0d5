"""Each config field's documentation, read from the comments beside it in the source.

A field's doc is the block of comment lines right above its declaration, then the comment
at the end of its line::

    # Seconds the ranks wait for each other to start (the rendezvous).
    init_timeout: float = 300.0
    rpc_timeout: float = 60.0  # seconds; 0 = no timeout

The declarations are found with ``ast`` (annotated assignments in the class body) and the
comments with ``tokenize``, so a comment is only ever a comment (never text inside a string)
and a declaration may span several lines. A class that redeclares a field without a comment
(``name: str = "digits"`` in a subclass) keeps the doc of the class it inherits it from.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import tokenize
from dataclasses import dataclass

__all__ = ["FieldDoc", "field_docs", "undocumented_fields"]


@dataclass(frozen=True)
class FieldDoc:
    """Where a field is declared (the class that says most about it) and what it says."""

    owner: type
    text: str  # "" when no class of its line declares a comment for it


@functools.cache
def _comments(path: str) -> dict[int, str]:
    """Line number -> the text of the comment on it (without ``#`` and surrounding spaces)."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    found: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found[token.start[0]] = token.string.lstrip("#").strip()
    return found


@functools.cache
def _source_lines(path: str) -> tuple[str, ...]:
    with open(path, encoding="utf-8") as f:
        return tuple(f.read().splitlines())


@functools.cache
def _class_nodes(path: str) -> dict[str, ast.ClassDef]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def _declared_docs(cls: type) -> dict[str, str]:
    """The docs of the fields ``cls`` itself declares (not inherited ones), by name."""
    path = inspect.getsourcefile(cls)
    node = _class_nodes(path).get(cls.__name__) if path else None
    if path is None or node is None:
        return {}
    comments, lines = _comments(path), _source_lines(path)
    docs: dict[str, str] = {}
    previous_end = node.lineno  # the class line: comments above the first field start after it
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            above: list[str] = []
            line = stmt.lineno - 1
            # Only comment lines directly above, up to a blank line or the statement before.
            while line > previous_end and lines[line - 1].strip().startswith("#"):
                above.insert(0, comments.get(line, ""))
                line -= 1
            end = stmt.end_lineno or stmt.lineno
            trailing = [comments[n] for n in range(stmt.lineno, end + 1) if n in comments]
            docs[stmt.target.id] = " ".join(part for part in above + trailing if part)
        previous_end = stmt.end_lineno or stmt.lineno
    return docs


def field_docs(cls: type) -> dict[str, FieldDoc]:
    """Every dataclass field of ``cls`` (inherited ones too), in declaration order, with its doc."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass")
    result: dict[str, FieldDoc] = {}
    for f in dataclasses.fields(cls):
        doc = FieldDoc(cls, "")
        for klass in cls.__mro__:
            if not dataclasses.is_dataclass(klass) or f.name not in getattr(klass, "__annotations__", {}):
                continue
            text = _declared_docs(klass).get(f.name, "")
            if text:
                doc = FieldDoc(klass, text)
                break
        result[f.name] = doc
    return result


def undocumented_fields(classes: list[type]) -> list[str]:
    """``Class.field`` for every field of these classes that has no doc (to be added in its source)."""
    missing = []
    for cls in classes:
        for name, doc in field_docs(cls).items():
            if not doc.text:
                missing.append(f"{cls.__name__}.{name}")
    return missing
