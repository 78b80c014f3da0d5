"""The update modes: one object per mode, found by name, and nothing else of ps_train naming one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import ps_train
from ps_train.config import Config, ConfigError, ModeConfig, validate
from ps_train.modes import MODE_NAMES, MODES, make_mode
from ps_train.modes.asynchronous import AsyncMode
from ps_train.modes.base import UpdateRequest
from ps_train.modes.hybrid import HybridMode
from ps_train.modes.ssp import SspMode
from ps_train.modes.sync import SyncMode
from tests.ps_train._app import make_cfg
from tests.ps_train._mode_server import StandInServer

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


# What models the modes from outside a run, by name: the planner's cost model and simulator,
# and the chaos harness's expectations of each mode. Nothing a run executes is among them.
MODELS_OF_THE_MODES = ("plan", "scaling", "chaos.py")


def test_no_module_outside_the_modes_branches_on_a_mode_name():
    # A mode's behaviour is its object's: the server, the trainer and the config ask it.
    found = [
        hit
        for path in sorted(PACKAGE_DIR.rglob("*.py"))
        if PACKAGE_DIR / "modes" not in path.parents
        and path.relative_to(PACKAGE_DIR).parts[0] not in MODELS_OF_THE_MODES
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


class _Server(StandInServer):
    """A server whose updates carry no gradients: each one only moves the version on."""

    def gradients(self, context_id):
        return {}

    def step(self, grads, lr_factor=1.0):
        self.version += 1


def _rows():
    return torch.zeros(1, 1)


def test_the_server_reads_an_update_s_staleness_from_the_mode_s_answer():
    # async: both trainers read version 0; trainer 1's update applies first, so trainer 0's
    # update is one update stale.
    mode = make_mode(make_cfg("mode=async"))
    server = _Server()
    for trainer in (0, 1):
        mode.lookup(server, _rows, trainer, 0)
    assert mode.answer_staleness(mode.update(server, 1, 1, 0, None).wait()) == 0
    assert mode.answers_with_staleness and mode.answer_staleness(mode.update(server, 2, 0, 0, None).wait()) == 1

    # ssp: ps0's update in the backward answers with the clock's answer too (ClockedUpdate).
    ssp = make_mode(make_cfg("mode=ssp", "mode.staleness=2"))
    server = _Server()
    for trainer in (0, 1):
        ssp.lookup(server, _rows, trainer, 0)
    first = ssp.in_backward(server, 1, UpdateRequest(1, 0, None)).wait()
    second = ssp.in_backward(server, 2, UpdateRequest(0, 0, None)).wait()
    assert (ssp.answer_staleness(first), ssp.answer_staleness(second)) == (0, 1)
    assert ssp.answer_staleness(ssp.update(server, 3, 1, 1, None).wait()) == 0  # a plain update's answer

    # sync and hybrid: the server counts no staleness of theirs.
    for name in ("sync", "hybrid"):
        model = ("model=dlrm", "data=synthetic_ctr") if name == "hybrid" else ()
        other = make_mode(make_cfg(*model, f"mode={name}"))
        assert not other.answers_with_staleness
        with pytest.raises(RuntimeError, match=f"mode={name}'s update answers carry no staleness"):
            other.answer_staleness(0)


# The modules that use a mode through ps_train.modes (the registry), modes.base (the
# protocol) and modes.aggregation (the arithmetic) only; a mode's own module is its business.
MODE_MODULES = {f"ps_train.modes.{m}" for m in ("sync", "asynchronous", "ssp", "hybrid")}


def _mode_module_imports(path: Path, root: Path = PACKAGE_DIR.parent) -> set[str]:
    """Each name one source file imports from a mode's own module (``root``: where paths start)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        rel = path.relative_to(root)
        if isinstance(node, ast.ImportFrom) and node.module in MODE_MODULES:
            found |= {f"{rel} imports {node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {f"{rel} imports {a.name}" for a in node.names if a.name in MODE_MODULES}
    return found


def test_no_module_outside_the_modes_tests_a_mode_s_class():
    # Testing ``isinstance(mode, AsyncMode)`` or a mode's answer type needs the class, from
    # the mode's own module: the roles ask the mode object instead.
    found = {
        hit
        for path in sorted(PACKAGE_DIR.rglob("*.py"))
        if PACKAGE_DIR / "modes" not in path.parents
        for hit in _mode_module_imports(path)
    }
    assert not found, f"ask the mode object (ps_train.modes.base.Mode) instead: {sorted(found)}"


def test_the_scan_sees_imports_from_a_mode_s_module(tmp_path):
    src = tmp_path / "x.py"
    src.write_text(
        "import ps_train.modes.ssp\n"
        "from ps_train.modes.sync import SyncMode as S\n"
        "from ps_train.modes import make_mode\n"
        "from ps_train.modes.base import Mode\n"
    )
    assert _mode_module_imports(src, tmp_path) == {
        "x.py imports ps_train.modes.ssp",
        "x.py imports ps_train.modes.sync.SyncMode",
    }
