"""Route the RPC imports of torch's own test modules to rpc_core, inside one process.

torch's RPC test modules (``torch.testing._internal.distributed.rpc.rpc_test`` and friends)
are written against ``torch.distributed.rpc`` / ``.autograd`` / ``.optim`` /
``.nn.api.remote_module``. ``install()`` puts a module finder first on ``sys.meta_path``
that loads those modules (and the helpers they share, ``dist_utils`` and the agent fixture)
from torch's own files, unchanged, but with an ``__import__`` of their own: there,

- ``torch.distributed.rpc`` (and ``.api``, ``.constants``, ``.functions``, ``.options``)
  is ``rpc_core`` (and ``rpc_core.api``, ...);
- ``torch.distributed.autograd`` is ``rpc_core.autograd``, ``torch.distributed.optim``'s
  ``DistributedOptimizer`` is ``rpc_core.optim``'s, ``torch.distributed.nn``'s
  ``RemoteModule`` and ``torch.distributed.nn.api.remote_module`` are ``rpc_core.nn``'s;
- the profilers the tests open around RPCs (``torch.autograd.profiler.profile`` and
  ``torch.autograd.profiler_legacy.profile``) are ``rpc_core.profiler.profile``.

Everything else (``torch.ones``, ``torch.distributed.init_process_group`` for the gloo
barriers some tests use, ``torch.futures``) stays torch's. A torch-private name that
rpc_core has no equivalent for (``torch.distributed.rpc.internal._internal_rpc_pickler``)
resolves to a stand-in that raises ``NotEmulated`` naming it when a test uses it, so the
module imports and only the tests that touch it fail, saying why.

torch's own code elsewhere in the process keeps its real modules: only the test modules
see the routes, so the same process can never mix the two libraries by accident.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

# The modules whose imports are routed: torch's RPC test modules and the helpers they share.
ROUTED_PACKAGES = (
    "torch.testing._internal.distributed.rpc.",
    "torch.testing._internal.distributed.nn.api.",
)
ROUTED_MODULES = ("torch.testing._internal.dist_utils",)


class NotEmulated(RuntimeError):
    """A test used a torch-private object that rpc_core does not emulate."""


class NeedsTorchScript(NotEmulated):
    """A test used a TorchScript function that cannot be compiled against rpc_core's types
    (an ``RRef[T]`` argument, an RPC inside TorchScript)."""


def _tolerant_script(obj: Any = None, *args: Any, **kwargs: Any) -> Any:
    """``torch.jit.script`` for the routed modules: a function that TorchScript cannot
    compile against rpc_core (an ``RRef[T]`` argument) becomes a stand-in raising
    ``NeedsTorchScript`` when called, so the module still imports."""
    import torch

    try:
        return torch.jit.script(obj, *args, **kwargs)
    except Exception as e:  # noqa: BLE001 - what TorchScript raised is the reason shown
        name = getattr(obj, "__qualname__", repr(obj))
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__

        def stand_in(*a: Any, **k: Any) -> Any:
            raise NeedsTorchScript(f"TorchScript: torch.jit.script({name}) fails on rpc_core's types: {first}")

        stand_in.__name__ = stand_in.__qualname__ = getattr(obj, "__name__", "scripted")
        return stand_in


class _Missing:
    """Stands for a torch-private name in a routed module: any use raises ``NotEmulated``."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def _fail(self, *args: Any, **kwargs: Any) -> Any:
        raise NotEmulated(f"{self._qualname} is torch-private and has no rpc_core equivalent (see docs/torch_suite.md)")

    __call__ = _fail
    __iter__ = _fail
    __enter__ = _fail
    __bool__ = _fail

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._qualname}.{name}")

    def __repr__(self) -> str:
        return f"<not emulated: {self._qualname}>"


class View(types.ModuleType):
    """A module as the routed test modules see it: names from ``sources`` in order (a dict of
    overrides or a module), then, when ``missing`` is set, a ``_Missing`` stand-in."""

    def __init__(self, name: str, sources: Sequence[Any], missing: bool = True) -> None:
        super().__init__(name)
        object.__setattr__(self, "_sources", list(sources))
        object.__setattr__(self, "_missing", missing)

    def __getattr__(self, attr: str) -> Any:
        for source in object.__getattribute__(self, "_sources"):
            if isinstance(source, dict):
                if attr in source:
                    value = source[attr]
                    return value() if isinstance(value, _Lazy) else value
            elif hasattr(source, attr):
                return getattr(source, attr)
        if attr.startswith("__") or not object.__getattribute__(self, "_missing"):
            raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")
        return _Missing(f"{self.__name__}.{attr}")


class _Lazy:
    """A view entry resolved when first read (the rpc_core/torch module it names)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn

    def __call__(self) -> Any:
        return self.fn()


_VIEWS: dict[str, View] = {}


def views() -> dict[str, View]:
    """The routed modules by torch name (built once: the test modules import them again and again)."""
    if _VIEWS:
        return _VIEWS
    import torch
    import torch.autograd.profiler
    import torch.autograd.profiler_legacy
    import torch.distributed.nn
    import torch.distributed.optim

    import rpc_core
    import rpc_core.api
    import rpc_core.autograd
    import rpc_core.constants
    import rpc_core.functions
    import rpc_core.nn
    import rpc_core.optim
    import rpc_core.options
    import rpc_core.profiler
    from tests.torch_suite import torch_private

    def lazy(name: str) -> _Lazy:
        return _Lazy(lambda: _VIEWS[name])

    v = _VIEWS
    v["torch.distributed.rpc.api"] = View("torch.distributed.rpc.api", [torch_private.API, rpc_core.api, rpc_core])
    v["torch.distributed.rpc.internal"] = View("torch.distributed.rpc.internal", [torch_private.INTERNAL])
    v["torch.distributed.rpc.backend_registry"] = View(
        "torch.distributed.rpc.backend_registry", [torch_private.BACKEND_REGISTRY]
    )
    v["torch.distributed.rpc.constants"] = View("torch.distributed.rpc.constants", [rpc_core.constants])
    v["torch.distributed.rpc.functions"] = View("torch.distributed.rpc.functions", [rpc_core.functions])
    v["torch.distributed.rpc.options"] = View("torch.distributed.rpc.options", [rpc_core.options])
    v["torch.distributed.rpc"] = View(
        "torch.distributed.rpc",
        [
            {
                "api": lazy("torch.distributed.rpc.api"),
                "internal": lazy("torch.distributed.rpc.internal"),
                "backend_registry": lazy("torch.distributed.rpc.backend_registry"),
                "constants": lazy("torch.distributed.rpc.constants"),
                "functions": lazy("torch.distributed.rpc.functions"),
                "options": lazy("torch.distributed.rpc.options"),
            },
            torch_private.RPC,
            rpc_core,
        ],
    )
    v["torch.distributed.autograd"] = View("torch.distributed.autograd", [rpc_core.autograd])
    v["torch.distributed.optim"] = View(
        "torch.distributed.optim", [rpc_core.optim, torch.distributed.optim], missing=False
    )
    v["torch.distributed.nn.api.remote_module"] = View(
        "torch.distributed.nn.api.remote_module", [torch_private.REMOTE_MODULE, rpc_core.nn.remote_module]
    )
    v["torch.distributed.nn.api"] = View(
        "torch.distributed.nn.api", [{"remote_module": lazy("torch.distributed.nn.api.remote_module")}]
    )
    v["torch.distributed.nn"] = View(
        "torch.distributed.nn",
        [{"api": lazy("torch.distributed.nn.api")}, rpc_core.nn, torch.distributed.nn],
        missing=False,
    )
    profile = {"profile": rpc_core.profiler.profile}
    v["torch.autograd.profiler_legacy"] = View(
        "torch.autograd.profiler_legacy", [profile, torch.autograd.profiler_legacy], missing=False
    )
    v["torch.autograd.profiler"] = View("torch.autograd.profiler", [profile, torch.autograd.profiler], missing=False)
    v["torch.autograd"] = View(
        "torch.autograd",
        [
            {
                "profiler": lazy("torch.autograd.profiler"),
                "profiler_legacy": lazy("torch.autograd.profiler_legacy"),
            },
            torch.autograd,
        ],
        missing=False,
    )
    v["torch.distributed"] = View(
        "torch.distributed",
        [
            {name: lazy(f"torch.distributed.{name}") for name in ("rpc", "autograd", "optim", "nn")},
            torch.distributed,
        ],
        missing=False,
    )
    v["torch.jit"] = View("torch.jit", [{"script": _tolerant_script}, torch.jit], missing=False)
    v["torch"] = View(
        "torch",
        [
            {"distributed": lazy("torch.distributed"), "autograd": lazy("torch.autograd"), "jit": lazy("torch.jit")},
            torch,
        ],
        missing=False,
    )
    return v


def _routed_import(
    name: str,
    globals: dict[str, Any] | None = None,
    locals: dict[str, Any] | None = None,
    fromlist: Sequence[str] | None = (),
    level: int = 0,
) -> Any:
    module = _real_import(name, globals, locals, fromlist, level)
    if level != 0 or not (name == "torch" or name.startswith("torch.")):
        return module
    routes = views()
    if not fromlist:
        # `import torch.x.y [as z]` binds `torch` (or reads .x.y from it): the routed torch.
        return routes["torch"]
    return routes.get(name, module)


_real_import = builtins.__import__


class _Loader(importlib.machinery.SourceFileLoader):
    """torch's own file, executed with the routed ``__import__``."""

    def exec_module(self, module: types.ModuleType) -> None:
        routed_builtins = dict(vars(builtins))
        routed_builtins["__import__"] = _routed_import
        module.__dict__["__builtins__"] = routed_builtins
        super().exec_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not (fullname in ROUTED_MODULES or fullname.startswith(ROUTED_PACKAGES)):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            if spec.origin is None or not spec.origin.endswith(".py"):
                return spec  # a package without __init__ code of interest
            loader = _Loader(fullname, spec.origin)
            return importlib.util.spec_from_file_location(
                fullname, spec.origin, loader=loader, submodule_search_locations=spec.submodule_search_locations
            )
        return None


def install() -> None:
    """Route the RPC imports of torch's test modules imported from now on to rpc_core."""
    already = [m for m in sys.modules if m in ROUTED_MODULES or m.startswith(ROUTED_PACKAGES)]
    if already:
        raise RuntimeError(
            f"install() must run before torch's RPC test modules are imported; already imported: {already[:3]}"
        )
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    importlib.invalidate_caches()
