"""docs/configuration.md is what ``python -m ps_train.config.reference`` generates from the
typed config and the Hydra files, and it lists every key Hydra composes, with a doc each."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from ps_train.config.field_docs import field_docs, undocumented_fields
from ps_train.config.reference import CONF_DIR, DOC_PATH, REGENERATE, render, undocumented_keys

ROOT = Path(__file__).resolve().parents[2]
CHOICES = [(g.name, f.stem) for g in sorted(CONF_DIR.iterdir()) if g.is_dir() for f in sorted(g.glob("*.yaml"))]
# Choices that compose only with a partner (model=dlrm trains on CTR data).
PARTNERS = {("model", "dlrm"): ["data=synthetic_ctr"], ("data", "synthetic_ctr"): ["model=dlrm"]}
PARTNERS[("data", "criteo")] = ["model=dlrm"]


def test_configuration_md_is_current() -> None:
    assert DOC_PATH == ROOT / "docs" / "configuration.md"
    current = DOC_PATH.read_text(encoding="utf-8") if DOC_PATH.exists() else ""
    assert current == render(), f"docs/configuration.md is stale; regenerate it from the repository root: {REGENERATE}"


def test_every_listed_key_has_a_doc() -> None:
    assert undocumented_keys() == [], "add a comment above or beside each of these fields in ps_train/config/"


def _keys(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [k for key, value in node.items() for k in _keys(value, f"{prefix}{key}.")]
    return [prefix[:-1]]


@pytest.mark.parametrize(("group", "choice"), CHOICES)
def test_every_composed_key_is_listed(group: str, choice: str) -> None:
    # The oracle is Hydra itself: every key of the composed config, with this choice made,
    # appears in the reference (a table row `key`, or a model.tables entry's field).
    overrides = [f"{group}={choice}", *PARTNERS.get((group, choice), [])]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    text = render()
    missing = [key for key in _keys(OmegaConf.to_container(cfg, resolve=False)) if f"| `{key}` |" not in text]
    assert missing == []
    assert f"`{choice}`" in text


@pytest.mark.timeout(300)
def test_generator_runs_as_a_module(tmp_path: Path) -> None:
    out = tmp_path / "configuration.md"
    cmd = [sys.executable, "-m", "ps_train.config.reference", "--output", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=120)
    assert out.read_text(encoding="utf-8") == render()
    check = subprocess.run([*cmd, "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0
    out.write_text("stale\n", encoding="utf-8")
    check = subprocess.run([*cmd, "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert check.returncode == 1 and REGENERATE in check.stderr


@dataclasses.dataclass
class Sample:
    """A docstring is not a field's doc."""

    # Above, first line
    # and second line.
    above: int = 1
    trailing: str = "#not a comment"  # beside it
    both: list[int] = dataclasses.field(  # opening line
        default_factory=list
    )  # closing line

    # A block that a blank line separates from the next field is nobody's doc.

    bare: float = 0.0

    def method(self) -> None:  # not a field
        pass


@dataclasses.dataclass
class SampleChild(Sample):
    bare: float = 1.0  # the child's own
    above: int = 2
    extra: bool = False


def test_field_docs_read_the_comments_beside_each_field() -> None:
    docs = {name: doc.text for name, doc in field_docs(Sample).items()}
    assert docs == {
        "above": "Above, first line and second line.",
        "trailing": "beside it",
        "both": "opening line closing line",
        "bare": "",
    }
    child = field_docs(SampleChild)
    assert {name: doc.text for name, doc in child.items()} == {
        "above": "Above, first line and second line.",  # redeclared without a comment: the base's
        "trailing": "beside it",
        "both": "opening line closing line",
        "bare": "the child's own",
        "extra": "",
    }
    assert child["above"].owner is Sample and child["bare"].owner is SampleChild
    assert undocumented_fields([SampleChild]) == ["SampleChild.extra"]
    with pytest.raises(TypeError, match="not a dataclass"):
        field_docs(int)
