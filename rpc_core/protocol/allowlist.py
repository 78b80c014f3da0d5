"""What a message may name under ``serializer="safe"``: functions and classes, by module and
qualified name, resolved against an allowlist and nothing else.

A name from the wire is never imported or looked up freely. It resolves only to

- an object registered by its owner: ``allow(obj)`` (the user's, also a decorator) or
  ``internal(...)`` (rpc_core's own request handlers and record types);
- an object *defined* in a module the user listed (``allow_module("pkg")``: ``pkg`` and its
  submodules): the module is imported, the qualified name walked one attribute at a time
  (no dunder or ``<locals>`` part), and the object found must be a function or class whose
  own ``__module__`` and name are the ones asked for, so an import inside the module
  (``pkg.os.system``) or an attribute of an object never resolves.

Anything else raises ``NotAllowedError`` naming it, before anything of the message runs.
"""

from __future__ import annotations

import builtins
import importlib
import sys
import threading
import types
from typing import Any, TypeVar

from ..errors import NotAllowedError

Name = tuple[str, str]  # (module, qualified name)
T = TypeVar("T")

_lock = threading.Lock()
_user: dict[Name, Any] = {}
_internal: dict[Name, Any] = {}
_modules: set[str] = set()
# Names resolved so far (a message names the same functions over and over); cleared when
# the allowlist grows, since a name may then resolve to a wrapper registered later.
_resolved: dict[Name, Any] = {}

FUNCTION_TYPES = (types.FunctionType, types.BuiltinFunctionType)
_NAMEABLE = (*FUNCTION_TYPES, type)


def name_of(obj: Any) -> Name:
    """The (module, qualified name) a function or class travels under."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if isinstance(obj, types.BuiltinFunctionType):
        # torch.add's __qualname__ is "_VariableFunctionsClass.add": a builtin is named by
        # the attribute of its module that holds it, as pickle names it.
        name = getattr(obj, "__name__", None)
        if module and name and getattr(sys.modules.get(module), name, None) is obj:
            qualname = name
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        raise NotAllowedError(
            f"{obj!r} has no importable name (module and qualified name): under serializer='safe' "
            "only functions and classes defined at the top level of a module (or in a class) travel"
        )
    return module, qualname


def allow(obj: T) -> T:
    """Let messages name ``obj`` (a function or class) under ``serializer="safe"``: calls of
    it, and records (dataclasses, NamedTuples, plain objects) of it as a class. Usable as a
    decorator; returns ``obj``."""
    if isinstance(obj, types.ModuleType):
        raise TypeError(f"allow() takes a function or class; for module {obj.__name__!r} use allow_module()")
    if not callable(obj):
        raise TypeError(f"allow() takes a function or class, got {type(obj).__name__} {obj!r}")
    key = name_of(obj)
    with _lock:
        _user[key] = obj
        _resolved.clear()
    return obj


def allow_module(module: str) -> None:
    """Let messages name any function or class defined in ``module`` or its submodules."""
    if not isinstance(module, str) or not module or module.startswith(".") or "<" in module:
        raise ValueError(f"allow_module() takes a dotted module name such as 'mypkg.calls', got {module!r}")
    with _lock:
        _modules.add(module)
        _resolved.clear()


def allowed_modules() -> frozenset[str]:
    return frozenset(_modules)


def internal(*objs: Any) -> None:
    """rpc_core's own functions and record types that its messages name."""
    with _lock:
        for obj in objs:
            _internal[name_of(obj)] = obj
        _resolved.clear()


def resolve(module: str, qualname: str) -> Any:
    """The allowed function or class named so; ``NotAllowedError`` if there is none."""
    key = (module, qualname)
    obj = _resolved.get(key)
    if obj is not None:
        return obj
    obj = _internal.get(key)
    if obj is None:
        registered = _user.get(key)
        found = _defined_in(module, qualname) if registered is not None or _module_listed(module) else None
        # A registered function under a decorator (allow innermost, e.g. below
        # @async_execution) stands for the decorated object its module holds.
        if registered is not None and found is not registered and not _wraps(found, registered):
            found = registered
        obj = found
    if obj is None:
        raise NotAllowedError(
            f"{module}.{qualname} is not allowed here: under serializer='safe' a message may name only "
            "functions and classes in this worker's allowlist. Register it on this worker with "
            f"@rpc_core.safe.allow (or rpc_core.safe.allow({qualname.rsplit('.', 1)[-1]})), or, if everything "
            f"defined in its module may be called, RpcBackendOptions(allow_modules=[{module!r}])"
        )
    _resolved[key] = obj
    return obj


def exception_type(module: str, qualname: str) -> type[BaseException] | None:
    """The exception class named so, if this worker may rebuild it: a builtin exception, or an
    allowed class that derives from BaseException; None otherwise."""
    cls: Any
    if module == "builtins":
        cls = getattr(builtins, qualname, None) if "." not in qualname and not qualname.startswith("_") else None
    else:
        try:
            cls = resolve(module, qualname)
        except NotAllowedError:
            return None
    if isinstance(cls, type) and issubclass(cls, BaseException):
        return cls
    return None


def _module_listed(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in _modules)


def _defined_in(module: str, qualname: str) -> Any:
    """The function or class defined in ``module`` under ``qualname``, or None."""
    mod = sys.modules.get(module)
    if mod is None:
        if not _module_listed(module):
            return None  # never import a module only a registration named
        try:
            mod = importlib.import_module(module)
        except ImportError:
            return None
    obj: Any = mod
    for part in qualname.split("."):
        if not part or part.startswith("__") or "<" in part:
            return None
        if obj is not mod and not isinstance(obj, type):
            return None  # only a class holds what a qualified name reaches further
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    if not isinstance(obj, _NAMEABLE) or getattr(obj, "__module__", None) != module:
        return None
    name = getattr(obj, "__qualname__", None)
    if name != qualname and not (isinstance(obj, types.BuiltinFunctionType) and obj.__name__ == qualname):
        return None
    return obj


def _wraps(outer: Any, inner: Any) -> bool:
    seen = 0
    while outer is not None and seen < 16:
        outer = getattr(outer, "__wrapped__", None)
        if outer is inner:
            return True
        seen += 1
    return False


# Values of these types travel as classes (an RRef's value type, ``type(x)`` as a result).
internal(int, float, complex, bool, str, bytes, bytearray, tuple, list, dict, set, frozenset, slice, range)
