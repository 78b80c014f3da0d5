"""TorchScript values inside RPC messages.

rpc_core has no TorchScript RPC (RPCs made from inside scripted code, ``_module_interface_cls``
remote modules), but scripted functions and modules still travel in messages:

- a ``torch.jit.script`` function defined at module level travels by reference, like any
  function (its qualified name is ``__torch__.<module>.<name>``), so ``rpc_sync(to, scripted_fn,
  args)`` runs it on the callee, which must be able to import that module;
- a scripted module (``RecursiveScriptModule``) travels as its ``torch.jit.save`` bytes and is
  rebuilt with ``torch.jit.load``, as torch RPC sends it.
"""

from __future__ import annotations

import importlib
import io
import sys
from typing import Any

import torch

from .serialization import register_reducer

_PREFIX = "__torch__."


def _function_by_name(module: str, name: str) -> torch.jit.ScriptFunction[Any, Any]:
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise RuntimeError(f"TorchScript function {module}.{name} is not importable on this worker: {e}") from e
    if not isinstance(fn, torch.jit.ScriptFunction):
        raise TypeError(f"{module}.{name} is a {type(fn).__name__} here, not a TorchScript function")
    return fn


def _reduce_function(fn: torch.jit.ScriptFunction[Any, Any]) -> tuple[Any, tuple[str, str]]:
    qualified = fn.qualified_name
    module, _, name = qualified[len(_PREFIX) :].rpartition(".")
    # The qualified name leaves out enclosing functions: check that it finds this very function.
    if not qualified.startswith(_PREFIX) or getattr(sys.modules.get(module), name, None) is not fn:
        raise TypeError(
            f"cannot send TorchScript function {qualified}: only functions defined at the top level "
            "of a module travel (by reference); send a Python function that calls it"
        )
    return _function_by_name, (module, name)


def _module_from_bytes(data: bytes) -> torch.jit.ScriptModule:
    module: torch.jit.ScriptModule = torch.jit.load(io.BytesIO(data))
    return module


def _reduce_module(module: torch.jit.ScriptModule) -> tuple[Any, tuple[bytes]]:
    buf = io.BytesIO()
    torch.jit.save(module, buf)
    return _module_from_bytes, (buf.getvalue(),)


register_reducer(torch.jit.ScriptFunction, _reduce_function)
register_reducer(torch.jit.RecursiveScriptModule, _reduce_module)  # type: ignore[attr-defined]  # torch's stub omits it
