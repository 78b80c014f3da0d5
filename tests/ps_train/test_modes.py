"""The update modes: one object per mode, found by name, and nothing else of ps_train naming one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ps_train
from ps_train.config import Config, ConfigError, ModeConfig, validate
from ps_train.modes import MODE_NAMES, MODES, make_mode
from ps_train.modes.asynchronous import AsyncMode
from ps_train.modes.hybrid import HybridMode
from ps_train.modes.ssp import SspMode
from ps_train.modes.sync import SyncMode
from tests.ps_train._app import make_cfg

PACKAGE_DIR = Path(ps_train.__file__).resolve().parent


def test_every_mode_has_its_config_file_and_every_config_file_a_mode():
    files = {p.stem for p in (PACKAGE_DIR / "conf" / "mode").glob("*.yaml")}
    assert files == set(MODE_NAMES) == {"sync", "async", "ssp", "hybrid"}
    assert all(MODES[name].name == name for name in MODE_NAMES)


@pytest.mark.parametrize(
    ("name", "cls"), [("sync", SyncMode), ("async", AsyncMode), ("ssp", SspMode), ("hybrid", HybridMode)]
)
def test_a_run_gets_the_object_of_its_mode(name, cls):
    staleness = 2 if name == "ssp" else 0
    model = ("model=dlrm", "data=synthetic_ctr") if name == "hybrid" else ()  # hybrid needs tables
    mode = make_mode(make_cfg(*model, f"mode={name}", f"mode.staleness={staleness}"))
    assert type(mode) is cls
    # Only sync and hybrid (its dense rounds) on rpc_core send the next forward before
    # their update is answered.
    assert mode.pipelined == (name in ("sync", "hybrid"))
    on_torch = make_cfg(*model, f"mode={name}", f"mode.staleness={staleness}", "backend=torch")
    assert make_mode(on_torch).pipelined is False


def test_an_unknown_mode_is_named_with_the_choices():
    with pytest.raises(
        ConfigError, match=r"mode.name: unknown mode 'bsp'; choose one of \['sync', 'async', 'ssp', 'hybrid'\]"
    ):
        validate(Config(mode=ModeConfig(name="bsp")))
    with pytest.raises(ValueError, match="unknown mode 'bsp'"):
        make_mode(Config(mode=ModeConfig(name="bsp")))


def test_an_option_a_mode_does_not_read_names_the_modes_that_do():
    with pytest.raises(
        ConfigError, match=r"mode.staleness: only used by mode=ssp and mode=hybrid \(got 3 with mode=async\)"
    ):
        validate(Config(mode=ModeConfig(name="async", staleness=3)))
    with pytest.raises(
        ConfigError,
        match=r"mode.staleness_rule: only used by mode=async and mode=ssp and mode=hybrid \(got none "
        r"with mode=sync, whose gradients are never stale",
    ):
        validate(Config(mode=ModeConfig(name="sync", staleness_rule="none")))


def _mode_name_comparisons(path: Path, root: Path = PACKAGE_DIR.parent) -> list[str]:
    """``x == "sync"``, ``name in ("async", "ssp")``, ``cfg.mode.name != ...``: comparisons
    with a mode's name or with ``mode.name`` in one source file (``root``: where paths start)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        names = {c.value for o in operands for c in ast.walk(o) if isinstance(c, ast.Constant)} & set(MODE_NAMES)
        reads_mode = any(
            isinstance(o, ast.Attribute)
            and o.attr == "name"
            and isinstance(o.value, ast.Attribute)
            and o.value.attr == "mode"
            for o in operands
        )
        if names or reads_mode:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_outside_the_modes_branches_on_a_mode_name():
    # A mode's behaviour is its object's: the server, the trainer and the config ask it.
    found = [
        hit
        for path in sorted(PACKAGE_DIR.rglob("*.py"))
        if PACKAGE_DIR / "modes" not in path.parents
        for hit in _mode_name_comparisons(path)
    ]
    assert not found, "mode names compared outside ps_train.modes:\n  " + "\n  ".join(found)


def test_the_scan_sees_comparisons_with_a_mode_name(tmp_path):
    src = tmp_path / "x.py"
    src.write_text(
        "def f(cfg, rule):\n"
        "    return cfg.mode.name == x or rule in ('ssp',) or rule == 'scale' or cfg.backend == 'torch'\n"
    )
    assert [hit.split(": ")[1] for hit in _mode_name_comparisons(src, tmp_path)] == [
        "cfg.mode.name == x",
        "rule in ('ssp',)",
    ]
