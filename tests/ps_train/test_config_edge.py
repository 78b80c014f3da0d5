"""The whole config stays at the edge: only the modules listed here take the root ``Config``
(``ps_train.config.root``); every other component takes the typed groups it reads
(``cfg.model``, ``cfg.cluster``, ...), plain arguments, or a small record of them built at
the edge (``ServerSettings``, ``TableSettings``, ``TrainerSplit``).

A module "takes" the root config when its source names it (``ast``): imports it, annotates a
parameter, field or return with it (in a string annotation too), or reads it off a module
(``config.Config``). The config package itself, which defines it, is not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ps_train

PACKAGE_DIR = Path(ps_train.__file__).resolve().parent
CONFIG_PACKAGE = "ps_train.config"
ROOT_CONFIG = "Config"
MOST_EDGE_MODULES = 6

# The edge: module -> why it holds the whole config.
EDGE = {
    "ps_train.app": "trains one experiment from its config (what python -m ps_train calls)",
    "ps_train.launch.local": "the local launcher: starts every role with the run's config",
    "ps_train.launch.rank": "one process's role: builds each part's settings from the config",
    "ps_train.launch.role_processes": "a role's launch record: builds the Config once per process (the fork server)",
    "ps_train.plan.cli": "python -m ps_train.plan: composes and checks a config to plan",
    "ps_train.roles.step": "the trainer: its workload's subclass may read any group",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _names_in_annotation(text: str) -> set[str]:
    """The names a string annotation (``"Config | None"``) uses; none if it is no expression."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return set()
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def mentions_of_root_config(source: str, filename: str = "<source>") -> list[int]:
    """The lines where ``source`` names the root ``Config``."""
    lines = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(CONFIG_PACKAGE):
            if any(alias.name == ROOT_CONFIG for alias in node.names):
                lines.append(node.lineno)
        elif isinstance(node, ast.Name) and node.id == ROOT_CONFIG:
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == ROOT_CONFIG:
            lines.append(node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and ROOT_CONFIG in node.value:
            if ROOT_CONFIG in _names_in_annotation(node.value):
                lines.append(node.lineno)
    return sorted(set(lines))


def takers_of_root_config() -> dict[str, list[int]]:
    """ps_train module (outside the config package) -> the lines where it names the root ``Config``."""
    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        module = _module_name(path)
        if module == CONFIG_PACKAGE or module.startswith(CONFIG_PACKAGE + "."):
            continue
        lines = mentions_of_root_config(path.read_text(), str(path))
        if lines:
            found[module] = lines
    return found


def test_the_scan_sees_each_way_of_naming_the_root_config():
    assert mentions_of_root_config("from ps_train.config import Config\n") == [1]
    assert mentions_of_root_config("from ps_train.config.root import Config as C\n") == [1]
    assert mentions_of_root_config("def f(cfg: 'Config | None') -> None: ...\n") == [1]
    assert mentions_of_root_config("from ps_train import config\nx = config.Config()\n") == [2]
    assert mentions_of_root_config("from ps_train.config import ModelConfig\ndef f(m: ModelConfig): ...\n") == []
    assert mentions_of_root_config("s = 'the Config we read'\n") == []


def test_the_edge_is_small():
    assert len(EDGE) <= MOST_EDGE_MODULES, (
        f"{len(EDGE)} modules take the whole config; at most {MOST_EDGE_MODULES} may: pass the "
        "others the config groups they read"
    )


def test_only_the_edge_takes_the_whole_config():
    found = takers_of_root_config()
    outside = {m: lines for m, lines in found.items() if m not in EDGE}
    assert not outside, (
        "these modules take the root Config (ps_train.config.Config), which only the edge may "
        f"({sorted(EDGE)}): {outside} (module: lines). Pass them the typed config groups they "
        "read (cfg.model, cfg.cluster, cfg.train, ...), plain arguments, or a small frozen "
        "record of what they need built at the edge (as launch/rank.py builds ServerSettings)"
    )


def test_every_edge_module_still_takes_it():
    # A module that no longer needs the whole config leaves the list, so the edge stays as small as it is.
    found = takers_of_root_config()
    stale = sorted(set(EDGE) - set(found))
    assert not stale, f"{stale} no longer name the root Config: remove them from EDGE in {__file__}"
