"""A ported program's error handling sees on rpc_core what it sees on torch.distributed.rpc.

``torch_compat_program.py`` meets the errors a program meets (failed calls and their futures,
exception classes, the messages programs match, RRef proxies, the callee's log) and reports
what its ``except``/regex handlers saw. The test runs it on torch (the oracle) and with its
RPC imports swapped for rpc_core's (nothing else changed), and expects the same reports,
except where docs/torch_compatibility.md lists a difference, which the test then asserts.
"""

from __future__ import annotations

import importlib
import logging
import pathlib
import secrets
import sys
from typing import Any

import pytest
import torch

from tests._world import free_port, run_world

PROGRAM = pathlib.Path(__file__).with_name("torch_compat_program.py")
SWAPS = {
    "import torch.distributed.autograd as dist_autograd": "import rpc_core.autograd as dist_autograd",
    "import torch.distributed.rpc as rpc": "import rpc_core as rpc",
    "from torch.distributed.rpc import RRef": "from rpc_core import RRef",
}
pytestmark = pytest.mark.skipif(
    not torch.distributed.rpc.is_available(), reason="this torch build has no torch.distributed.rpc to compare with"
)


def source(lib: str) -> str:
    src = PROGRAM.read_text()
    if lib == "rpc_core":
        for old, new in SWAPS.items():
            assert src.count(old) == 1, f"{PROGRAM.name} should contain {old!r} once"
            src = src.replace(old, new)
        left = [
            line for line in src.splitlines() if line.startswith(("import torch.distributed", "from torch.distributed"))
        ]
        assert not left, f"imports not swapped: {left}"
    return src


def _body(ctx: Any, module_dir: str, module_name: str, call: str, args: tuple[Any, ...]) -> Any:
    sys.path.insert(0, module_dir)
    program = importlib.import_module(module_name)
    return (
        getattr(program, call)(*args) if call != "run_worker" else program.run_worker(ctx.rank, ctx.world_size, *args)
    )


def run(tmp_path: pathlib.Path, lib: str, call: str, *args: Any, world_size: int = 2) -> Any:
    name = f"compat_on_{lib}"
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / f"{name}.py").write_text(source(lib))
    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RPC_CORE_AUTH_SECRET": secrets.token_hex(16)}
    return run_world(
        _body, world_size, args=(str(tmp_path), name, call, args), init=False, env=env, port=port, timeout=150
    )[0]


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The scenarios' reports on each library (one world each: they take a few seconds)."""
    import tests.rpc_core.torch_compat_program as program

    names = [f.__name__ for f in program.SCENARIOS]
    return {lib: run(tmp_path_factory.mktemp(lib), lib, "run_worker", names) for lib in ("torch", "rpc_core")}


def same(reports: dict[str, dict[str, Any]], scenario: str) -> dict[str, Any]:
    ours, theirs = reports["rpc_core"][scenario], reports["torch"][scenario]
    assert ours == theirs, f"{scenario}: rpc_core saw {ours}, torch saw {theirs}"
    return ours


@pytest.mark.timeout(400)
def test_failed_calls_reach_handlers_as_on_torch(reports: dict[str, dict[str, Any]]) -> None:
    """A failed call's error keeps its class and message through wait(), then() and an RRef
    whose creation failed (its proxies included); after shutdown, calls fail as on torch."""
    got = same(reports, "failed_futures")
    assert got["wait"] == got["wait again"] == "caught ValueError"
    assert got["then, callback waits"] == "caught RuntimeError"
    assert got["then, callback catches"] == "callback caught ValueError"
    assert got["remote: to_here"] == got["remote: proxy"] == got["remote: proxy async"] == "caught ValueError"
    assert got["remote: _get_type"] == "caught ValueError"
    assert same(reports, "after_shutdown") == {"rpc_sync": "caught RuntimeError"}


@pytest.mark.timeout(400)
def test_wait_all_and_collect_all_raise_a_failed_call_without_waiting_for_the_others(
    reports: dict[str, dict[str, Any]],
) -> None:
    """torch's wait_all and collect_all exit at the first failed RPC; so do rpc_core's (which
    replace torch's: docs/torch_compatibility.md), raising the same class. The other call
    is released only after both raised, so it was not done when they did."""
    got = same(reports, "wait_all_with_a_failed_call")
    assert got == {
        "wait_all": "caught ValueError",
        "slow done when wait_all raised": False,
        "collect_all": "caught ValueError",
        "slow done when collect_all raised": False,
        "collect_all, both ended": "caught ValueError",
        "slow": "released",
    }


@pytest.mark.timeout(400)
def test_errors_torch_raises_as_runtime_error(reports: dict[str, dict[str, Any]], tmp_path: pathlib.Path) -> None:
    """An @async_execution function that returns no Future, invalid worker names and options
    raise RuntimeError with torch's message (rpc_core's classes also derive from
    TypeError/ValueError)."""
    got = same(reports, "async_execution_wrong_type")
    assert set(got.values()) == {"caught RuntimeError"}, got
    bad = {
        lib: run(tmp_path / lib, lib, "invalid_arguments", free_port(), world_size=1) for lib in ("torch", "rpc_core")
    }
    assert bad["rpc_core"] == bad["torch"]
    assert set(bad["rpc_core"].values()) == {"caught RuntimeError"}, bad
    import rpc_core

    with pytest.raises(ValueError, match="Worker name must match"):  # what rpc_core raised before
        rpc_core.WorkerInfo("abc*", 0)


@pytest.mark.timeout(300)
def test_constants_module(tmp_path: pathlib.Path) -> None:
    import tests.rpc_core.torch_compat_program as program

    public = sorted(n for n in dir(torch.distributed.rpc.constants) if not n.startswith("_") and n.isupper())
    assert program.CONSTANTS == public, "the program reads every public constant of torch's module"
    got = {lib: run(tmp_path / lib, lib, "constants", world_size=1) for lib in ("torch", "rpc_core")}
    assert got["rpc_core"] == got["torch"]
    import rpc_core.constants  # the module path, as torch.distributed.rpc.constants

    assert rpc_core.constants.DEFAULT_RPC_TIMEOUT_SEC == got["torch"]["DEFAULT_RPC_TIMEOUT_SEC"]


@pytest.mark.timeout(400)
def test_messages_programs_match(reports: dict[str, dict[str, Any]], tmp_path: pathlib.Path) -> None:
    """Distributed backward's remote error, use before init_rpc, local_value() on a user:
    torch's words, which programs match (rpc_core's detail follows them)."""
    got = same(reports, "distributed_backward_errors")
    assert set(got.values()) == {"caught RuntimeError"}, got
    assert same(reports, "local_value_on_a_user") == {"local_value": "caught RuntimeError"}
    before = {lib: run(tmp_path / lib, lib, "before_init", world_size=1) for lib in ("torch", "rpc_core")}
    assert before["rpc_core"] == before["torch"]
    assert set(before["rpc_core"].values()) == {"caught RuntimeError"}, before


@pytest.mark.timeout(400)
def test_rref_proxies_check_the_method_first(reports: dict[str, dict[str, Any]]) -> None:
    got = same(reports, "rref_proxies")
    assert got["rpc_async: future done at once"] is True
    assert {got[k] for k in ("first rpc_async", "rpc_sync", "rpc_async", "remote")} == {"caught AttributeError"}
    assert got["method raises"] == "caught ValueError"
    assert got["calls"] == [1, 3, 6, "Counter"]
    assert got["_get_type"] == ["Counter", "Counter"]
    assert got["scripted"] == [[2.0, 2.0], [3.0, 3.0]]


@pytest.mark.timeout(400)
def test_callee_logs_a_called_functions_error(reports: dict[str, dict[str, Any]]) -> None:
    got = same(reports, "callee_logs_the_error")
    assert got == {"function named": True, "error": True, "traceback": True}


# -- rpc_core only ----------------------------------------------------------------------------------
def _quiet_callee(ctx: Any) -> Any:
    import rpc_core
    import tests.rpc_core.torch_compat_program as program

    if ctx.rank == 1:
        sys.stderr = program._Tee(sys.stderr)
        logging.getLogger("rpc_core.user_errors").setLevel(logging.ERROR)  # as docs/torch_compatibility.md says
    rpc_core._barrier(["worker0", "worker1"])
    out = None
    if ctx.rank == 0:
        with pytest.raises(ValueError, match=program.EXPECTED):
            rpc_core.rpc_sync(1, program.raise_now)
        out = rpc_core.rpc_sync(1, program.captured_stderr)
    rpc_core._barrier(["worker0", "worker1"])
    return out


@pytest.mark.timeout(120)
def test_the_callee_log_can_be_turned_off() -> None:
    assert run_world(_quiet_callee, 2)[0] == ""


@pytest.mark.timeout(120)
def test_backward_past_an_unused_send_finishes(tmp_path: pathlib.Path) -> None:
    """torch's test_backward_unused_send_function asserts that this backward never ends
    (its FAST mode waits for the unused send's gradient); on rpc_core it ends, with the
    local gradients. Kept so (docs/torch_compatibility.md, `backward`); not run on torch,
    where it would hang."""
    got = run(tmp_path, "rpc_core", "run_worker", ["backward_past_an_unused_send"])
    assert got["backward_past_an_unused_send"] == {"finished": True}
