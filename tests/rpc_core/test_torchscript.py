"""TorchScript values in rpc_core messages: a module-level scripted function as the called
function (by reference) and scripted modules as arguments and results, as torch RPC allows."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from tests._world import run_world

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torch.jit.script is deprecated in torch 2.14; still supported

    @torch.jit.script
    def scripted_affine(x: torch.Tensor, scale: float) -> torch.Tensor:
        return x * scale + 1


def run_scripted(m: torch.jit.ScriptModule, x: torch.Tensor) -> tuple[torch.Tensor, str]:
    return m(x), type(m).__name__


def make_scripted(d: int) -> torch.jit.ScriptModule:
    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.jit.script(torch.nn.Linear(d, 2))


def _body(ctx: Any) -> dict[str, Any]:
    import rpc_core

    if ctx.rank != 0:
        return {}
    x = torch.arange(4.0)
    out: dict[str, Any] = {
        "function": torch.equal(rpc_core.rpc_sync("worker1", scripted_affine, args=(x, 2.0)), scripted_affine(x, 2.0))
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        local = torch.jit.script(torch.nn.Linear(4, 3))
    y, kind = rpc_core.rpc_sync("worker1", run_scripted, args=(local, x))
    out["module_arg"] = torch.equal(y, local(x)) and kind == "RecursiveScriptModule"
    returned = rpc_core.rpc_sync("worker1", make_scripted, args=(4,))
    out["module_result"] = isinstance(returned, torch.jit.ScriptModule) and torch.equal(
        returned(x), make_scripted(4)(x)
    )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")

        @torch.jit.script
        def nested(t: torch.Tensor) -> torch.Tensor:
            return t + 1

    try:
        rpc_core.rpc_sync("worker1", nested, args=(x,))
        out["nested"] = "no error"
    except TypeError as e:
        out["nested"] = str(e)
    return out


@pytest.mark.timeout(120)
def test_scripted_functions_and_modules_travel() -> None:
    out = run_world(_body, 2, timeout=100)[0]
    assert out["function"] and out["module_arg"] and out["module_result"]
    assert "only functions defined at the top level of a module travel" in out["nested"], out["nested"]
