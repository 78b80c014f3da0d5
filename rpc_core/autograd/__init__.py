"""Distributed autograd (``torch.distributed.autograd`` API).

    import rpc_core.autograd as dist_autograd
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("ps", forward, args=(x,)).sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)   # {tensor: grad} on this worker

An rpc_core extension beyond torch (``rpc_core.autograd.hooks``): an owner's hook run as soon
as a context's backward is done on it, answered with the backward itself --
``on_backward_done(key, fn)`` on the owner, ``set_backward_info(context_id, key, payload)``
before ``backward`` and ``backward_results(context_id)`` after it on the caller; and
``take_gradients(context_id)``, ``get_gradients`` that hands them over (the context keeps none).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..agent import agent as _agent_mod
from ..group import lifecycle
from . import context as _context
from . import local_pass as _local_pass
from . import release as _release
from .context import DistAutogradContext
from .engine import backward
from .hooks import backward_results, on_backward_done, set_backward_info
from .recording import AutogradMiddleware
from .release import release_context as _release_context

__all__ = [
    "backward",
    "context",
    "get_gradients",
    "take_gradients",
    "is_available",
    "DistAutogradContext",
    "on_backward_done",
    "set_backward_info",
    "backward_results",
]

_wait_cleanups = _release.wait_cleanups  # private API: tests wait with it


def is_available() -> bool:
    return True


def _install(agent: _agent_mod.Agent) -> None:
    _context.init(agent.me.id, agent.roster.id_base)
    _release.reset()
    agent.middleware.append(AutogradMiddleware())


lifecycle.init_hooks.append(_install)
lifecycle.pre_shutdown_hooks.append(_release.flush)

# torch's words when distributed autograd is not initialized; init_rpc does it here.
_NOT_INITIALIZED = (
    "Need to initialize distributed autograd using rpc_core.init_rpc (rpc_core.autograd has no "
    "init() of its own: init_rpc initializes it)."
)


@contextlib.contextmanager
def context() -> Iterator[int]:
    """A distributed autograd context; yields its id. Leaving it releases the context here
    and on every worker it touched."""
    _agent_mod.current_agent(_NOT_INITIALIZED)
    ctx = _context.new_context()
    try:
        yield ctx.context_id
    finally:
        _context.set_current(None)
        _release_context(ctx.context_id, defer=True)


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    ctx = _context.retrieve(context_id)
    with ctx.lock:
        return dict(ctx.grads)


def take_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """``get_gradients``, and the context forgets them (an rpc_core extension): the caller
    owns the tensors and may change them in place, and they are freed once it drops them
    instead of living until the context is released. Gradients accumulated later start anew."""
    return _context.retrieve(context_id).take_gradients()


# -- private API, as torch.distributed.autograd has it (its tests and ours use these) --------------
def _current_context() -> DistAutogradContext:
    cid = _context.current_id()
    if cid is None:
        raise RuntimeError(
            "Current thread doesn't have a valid autograd context. Please wrap your code using "
            "`with rpc_core.autograd.context() as context_id` to generate a valid context"
        )
    return _context.retrieve(cid)


def _new_context() -> DistAutogradContext:
    """A new context, current on this thread (``context()`` also releases it at the end)."""
    _agent_mod.current_agent(_NOT_INITIALIZED)
    return _context.new_context()


def _retrieve_context(context_id: int) -> DistAutogradContext:
    return _context.retrieve(context_id)


def _is_valid_context(context_id: int) -> None:
    _context.retrieve(context_id)


def _get_max_id() -> int:
    return _context.max_id()


def _get_debug_info() -> dict[str, Any]:
    """torch's counters: backward passes running on this worker, contexts it holds."""
    return {"num_current_backward_passes": _local_pass.running(), "num_autograd_contexts": _context.count()}
