"""docs/torch_compatibility.md against both libraries: every public name of torch's RPC
modules has a row, and each row's verdict holds (a name marked same/differs exists in
rpc_core, one marked not supported or torch's does not)."""

from __future__ import annotations

import importlib
import pathlib
import re
import warnings
from types import ModuleType

import pytest

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "torch_compatibility.md"
# Imports that torch's modules happen to hold: not API.
NOT_API = {
    "Any",
    "Generator",
    "TYPE_CHECKING",
    "annotations",
    "dist",
    "dist_autograd",
    "functools",
    "logger",
    "logging",
    "numbers",
    "optim",
    "os",
    "threading",
    "timedelta",
    "torch",
    "urlparse",
    "warnings",
}
VERDICTS = {"same", "differs", "not supported", "torch's"}


def _import(name: str) -> ModuleType:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(name)


def doc_rows() -> dict[tuple[str, str], dict[str, str]]:
    """{(torch module, rpc_core module): {name: verdict}} from the doc's tables."""
    out: dict[tuple[str, str], dict[str, str]] = {}
    section = None
    for line in DOC.read_text().splitlines():
        m = re.match(r"## `([\w.]+)` → `([\w.]+)`", line)
        if m:
            section = out.setdefault((m[1], m[2]), {})
            continue
        if line.startswith("## "):
            section = None
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if section is not None and len(cells) == 3 and cells[0].startswith("`"):
            assert cells[1] in VERDICTS, f"unknown verdict {cells[1]!r} in: {line}"
            for name in re.findall(r"`(\w+)`", cells[0]):
                section[name] = cells[1]
    return out


SECTIONS = doc_rows()


def test_the_doc_covers_torchs_modules() -> None:
    assert [t for t, _ in SECTIONS] == [
        "torch.distributed.rpc",
        "torch.distributed.rpc.constants",
        "torch.distributed.rpc.functions",
        "torch.distributed.autograd",
        "torch.distributed.optim",
        "torch.distributed.nn",
    ]


@pytest.mark.parametrize("theirs,ours", list(SECTIONS))
def test_every_public_torch_name_has_a_row(theirs: str, ours: str) -> None:
    public = {n for n in dir(_import(theirs)) if not n.startswith("_")} - NOT_API
    missing = sorted(public - set(SECTIONS[(theirs, ours)]))
    assert not missing, f"{theirs}: no row in {DOC.name} for {missing}"


@pytest.mark.parametrize("theirs,ours", list(SECTIONS))
def test_each_row_holds(theirs: str, ours: str) -> None:
    torch_mod, our_mod = _import(theirs), _import(ours)
    for name, verdict in SECTIONS[(theirs, ours)].items():
        assert hasattr(torch_mod, name), f"{theirs}.{name} is not in torch"
        if verdict in ("same", "differs"):
            assert hasattr(our_mod, name), f"{ours}.{name} is marked {verdict} but missing"
        else:
            assert not hasattr(our_mod, name), f"{ours}.{name} exists but is marked {verdict}"


def test_private_names_torch_programs_use() -> None:
    import torch.distributed.rpc as trpc

    import rpc_core

    for name in (
        "_DEFAULT_INIT_METHOD",
        "_DEFAULT_NUM_WORKER_THREADS",
        "_DEFAULT_RPC_TIMEOUT_SEC",
        "_UNSET_RPC_TIMEOUT",
    ):
        assert getattr(rpc_core, name) == getattr(trpc, name), name
    assert rpc_core.PyRRef is rpc_core.RRef
    assert rpc_core._is_current_rpc_agent_set() is False
    with pytest.raises(rpc_core.RpcNotInitializedError):
        rpc_core._get_current_rpc_agent()
