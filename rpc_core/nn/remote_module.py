"""``RemoteModule`` (``torch.distributed.nn.RemoteModule``): an ``nn.Module`` built on another worker.

    emb = RemoteModule("ps/cpu", torch.nn.EmbeddingBag, args=(100, 16), kwargs={"mode": "sum"})
    out = emb(indices, offsets)                 # forward runs on "ps"; autograd records the RPC
    opt = DistributedOptimizer(torch.optim.SGD, emb.remote_parameters(), lr=0.05)

The module lives on its owner (``remote_device``'s worker) and is referenced by an RRef;
``forward`` / ``forward_async`` call its ``forward`` there (not ``__call__``: as in torch, the
remote module's own hooks do not run). The methods of ``nn.Module`` that would need the
module here raise ``ValueError`` as torch's do; ``train()`` / ``eval()`` switch the remote
module's mode. A RemoteModule passed inside an RPC arrives as a RemoteModule sharing the
same remote module (its RRef is forked); plain pickling is refused, as in torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch import nn

from ..agent import calls
from ..agent.agent import current_agent
from ..protocol import allowlist
from ..protocol.serialization import register_reducer
from ..rref import RRef, invoke_on_owner, remote

__all__ = ["RemoteModule"]

# nn.Module methods that need the module itself: torch's RemoteModule raises ValueError for
# each (``parameters`` has its own message), and so do we.
_UNSUPPORTED = (
    "register_buffer",
    "register_parameter",
    "add_module",
    "apply",
    "cuda",
    "ipu",
    "xpu",
    "cpu",
    "type",
    "float",
    "double",
    "half",
    "bfloat16",
    "to",
    "register_backward_hook",
    "register_forward_pre_hook",
    "register_forward_hook",
    "state_dict",
    "load_state_dict",
    "named_parameters",
    "buffers",
    "named_buffers",
    "children",
    "named_children",
    "modules",
    "named_modules",
    "requires_grad_",
    "zero_grad",
    "share_memory",
    "extra_repr",
)


def _parse_error(remote_device: object) -> ValueError:
    return ValueError(
        f"Could not parse remote_device: {remote_device}. The valid format is "
        "'<workername>/<device>' or 'rank:<rank>/<device>' or '<device>'"
    )


def _is_device(text: str) -> bool:
    try:
        torch.device(text)
        return True
    except (RuntimeError, ValueError):
        return False


def parse_remote_device(remote_device: str) -> tuple[str | int, str]:
    """``"worker1/cpu"`` -> ("worker1", "cpu"); ``"rank:1"`` -> (1, "cpu"): the worker (name or
    rank) and the device there, by torch's ``_remote_device`` rules. rpc_core places modules
    on CPU only, and a string without a worker names none to place it on: both are errors."""
    if not isinstance(remote_device, str):
        raise TypeError(f"Invalid type for remote_device: {type(remote_device)}")
    fields = remote_device.split("/")
    if len(fields) > 2:
        raise _parse_error(remote_device)
    if len(fields) == 1 and _is_device(fields[0]):
        raise ValueError(
            f"remote_device {remote_device!r} names a device but no worker: write "
            f"'<workername>/{fields[0]}' or 'rank:<rank>/{fields[0]}'"
        )
    worker, device_text = (fields[0], "cpu") if len(fields) == 1 else (fields[0], fields[1])
    if not worker or not _is_device(device_text):
        raise _parse_error(remote_device)
    device = torch.device(device_text)
    if device.type != "cpu":
        raise ValueError(
            f"remote_device {remote_device!r}: rpc_core sends CPU tensors only, so remote modules "
            f"live on CPU; use '{worker}/cpu' (torch RPC needs a device map for {device.type})"
        )
    parts = worker.split(":")
    if len(parts) == 1:
        return worker, str(device)
    if len(parts) == 2 and parts[0] == "rank" and parts[1].isdigit():
        return int(parts[1]), str(device)
    raise _parse_error(remote_device)


# -- on the owner ----------------------------------------------------------------------------------------
def _create_module(
    module_cls: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], device: str
) -> nn.Module:
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise ValueError(
            "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, "
            f"but it returns an instance of {type(module)}."
        )
    return module.to(device)


def _param_rrefs(module_rref: RRef[nn.Module], recurse: bool) -> list[RRef[nn.Parameter]]:
    return [RRef(p) for p in module_rref.local_value().parameters(recurse)]


def _set_training(module_rref: RRef[nn.Module], mode: bool) -> None:
    module_rref.local_value().train(mode)


def _remote_forward(*args: Any, **kwargs: Any) -> Any:
    """Only a name: what the profiler calls a RemoteModule's forward RPC (``rpc_async#_remote_forward(...)``,
    as in torch). The call itself runs the module's ``forward`` through the RRef proxy path."""
    raise AssertionError("never called")


# -- the handle --------------------------------------------------------------------------------------------
class RemoteModule(nn.Module):
    """``RemoteModule(remote_device, module_cls, args=None, kwargs=None)``.

    Args:
        remote_device: ``"<workername>/<device>"`` or ``"rank:<rank>/<device>"``; the device
            may be left out (``"ps0"``: CPU), and must be CPU.
        module_cls: called on the owner as ``module_cls(*args, **kwargs)``; must return an
            ``nn.Module``. Travels by reference, so the owner must be able to import it.
        args, kwargs: its arguments (sent to the owner).
    """

    on: str | int
    device: str
    module_rref: RRef[nn.Module]

    def __init__(
        self,
        remote_device: str,
        module_cls: Callable[..., nn.Module],
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        _module_interface_cls: Any = None,
    ) -> None:
        super().__init__()
        self._prepare(remote_device, _module_interface_cls)
        args = tuple(args) if args is not None else ()
        kwargs = dict(kwargs) if kwargs is not None else {}
        # Not awaited: an error in module_cls surfaces at the first use of the module.
        self.module_rref = remote(self.on, _create_module, (module_cls, args, kwargs, self.device))

    def _prepare(self, remote_device: str, module_interface_cls: Any) -> None:
        if module_interface_cls is not None:
            raise NotImplementedError(
                "rpc_core has no TorchScript RPC: a scriptable RemoteModule "
                "(_module_interface_cls) is not supported; leave it out"
            )
        self.on, self.device = parse_remote_device(remote_device)
        current_agent().worker_info(self.on)  # a worker outside the group fails here, by name
        self.is_device_map_set = False
        self.is_scriptable = False

    @staticmethod
    def init_from_module_rref(
        remote_device: str, module_rref: RRef[nn.Module], _module_interface_cls: Any = None
    ) -> RemoteModule:
        """A RemoteModule over an existing module RRef (several handles, one module)."""
        m = RemoteModule.__new__(RemoteModule)
        nn.Module.__init__(m)
        m._prepare(remote_device, _module_interface_cls)
        m.module_rref = module_rref
        return m

    # -- what runs remotely ----------------------------------------------------------------------------
    def forward_async(self, *args: Any, **kwargs: Any) -> torch.futures.Future[Any]:
        """Run the module's ``forward(*args, **kwargs)`` on its owner; a Future of the result."""
        # Named by RRef id, as RRef proxies do: no fork (and no delete) per forward.
        return invoke_on_owner(self.module_rref, "forward", args, kwargs, user_func=_remote_forward)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's ``forward(*args, **kwargs)`` on its owner and return the result."""
        return self.forward_async(*args, **kwargs).wait()

    def remote_parameters(self, recurse: bool = True) -> list[RRef[nn.Parameter]]:
        """RRefs to the remote module's parameters (for ``DistributedOptimizer``)."""
        rrefs: list[RRef[nn.Parameter]] = calls.rpc_sync(self.on, _param_rrefs, args=(self.module_rref, recurse))
        return rrefs

    def get_module_rref(self) -> RRef[nn.Module]:
        return self.module_rref

    def train(self, mode: bool = True) -> RemoteModule:
        """Set the remote module's training mode; returns this handle. (torch returns a copy
        of the remote module, fetched over RPC.)"""
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        calls.rpc_sync(self.on, _set_training, args=(self.module_rref, mode))
        self.training = mode
        return self

    def eval(self) -> RemoteModule:
        return self.train(False)

    def parameters(self, recurse: bool = True) -> NoReturn:
        raise ValueError(
            "Method ``parameters`` not supported for RemoteModule. Please use ``remote_parameters`` instead."
        )

    def __repr__(self) -> str:
        return f"RemoteModule(on={self.on!r}, device={self.device!r}, module_rref={self.module_rref!r})"

    def __getstate__(self) -> NoReturn:
        raise RuntimeError(
            "Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled when using RPC"
        )

    def __setstate__(self, state: Any) -> NoReturn:
        raise RuntimeError(
            "Cannot unpickle RemoteModule in python pickler. RemoteModule can only be unpickled when using RPC"
        )


def _unsupported(name: str) -> Callable[..., NoReturn]:
    def method(self: RemoteModule, *args: Any, **kwargs: Any) -> NoReturn:
        raise ValueError(f"Method ``{name}`` not supported for RemoteModule")

    method.__name__ = method.__qualname__ = name
    return method


for _name in _UNSUPPORTED:
    setattr(RemoteModule, _name, _unsupported(_name))


# -- inside RPC messages -----------------------------------------------------------------------------------
def _rebuild(on: str | int, device: str, training: bool, module_rref: RRef[nn.Module]) -> RemoteModule:
    m = RemoteModule.__new__(RemoteModule)
    nn.Module.__init__(m)
    m.on, m.device, m.training, m.module_rref = on, device, training, module_rref
    m.is_device_map_set = m.is_scriptable = False
    return m


def _reduce(m: RemoteModule) -> tuple[Callable[..., RemoteModule], tuple[Any, ...]]:
    return _rebuild, (m.on, m.device, m.training, m.module_rref)  # the RRef forks as it pickles


register_reducer(RemoteModule, _reduce)


# RemoteModule's calls and its rebuilding: called by name under serializer='safe'.
allowlist.internal(_create_module, _param_rrefs, _set_training, _remote_forward, _rebuild)
