"""DistributedOptimizer (``torch.distributed.optim`` API).

One local optimizer per owner of the parameters, built on that owner over RPC; ``step``
applies one context's gradients on every owner at once. Any ``torch.optim`` class works,
with its arguments; results equal the same optimizer run locally.

An rpc_core extension beyond torch: ``step_in_backward(context_id)``, called before
``dist_autograd.backward``, has each owner step its local optimizer as soon as its part of
that backward is done (``rpc_core.autograd.hooks``), so ``backward`` returns with the step
applied everywhere and no ``step`` round trip follows. The same local optimizers step with
the same gradients: the results are ``step``'s.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import torch

from . import autograd as dist_autograd
from .agent import agent as _agent_mod
from .agent import calls
from .agent.futures import settle
from .autograd import hooks
from .errors import format_many
from .protocol import allowlist
from .rref import RRef, invoke_on_owner, owned_value, owner_id_of, rref_id_of

__all__ = ["DistributedOptimizer"]


class _LocalOptimizer:
    # Concurrent steps on one worker (several trainers, several DistributedOptimizers over
    # the same parameters) are serialized, as in torch.
    global_lock = threading.Lock()

    def __init__(
        self, optim_cls: type[torch.optim.Optimizer], local_params_rref: list[RRef[Any]], *args: Any, **kwargs: Any
    ) -> None:
        self._params = [rref.local_value() for rref in local_params_rref]
        self.optim = optim_cls(self._params, *args, **kwargs)

    def step(self, context_id: int) -> None:
        grads = dist_autograd.get_gradients(context_id)
        with _LocalOptimizer.global_lock:
            saved = [p.grad for p in self._params]
            for p in self._params:
                # Parameters without a gradient in this context must not be moved by a stale .grad.
                p.grad = grads.get(p)
            try:
                self.optim.step()
            finally:
                for p, g in zip(self._params, saved, strict=True):
                    p.grad = g  # .grad is the owner's business: leave it as it was


_IN_BACKWARD = "rpc_core.optim"  # the hook key of step_in_backward


def _step_in_backward(context_id: int, per_owner: dict[int, list[Any]]) -> None:
    """On an owner, once its part of a backward is done: step its local optimizers that
    ``per_owner`` (rank -> their RRef ids) names here."""
    for rref_id in per_owner.get(_agent_mod.current_agent().me.id, ()):
        owned_value(tuple(rref_id)).step(context_id)


hooks.on_backward_done(_IN_BACKWARD, _step_in_backward)


def _new_local_optimizer(
    optim_cls: type[torch.optim.Optimizer], local_params_rref: list[RRef[Any]], *args: Any, **kwargs: Any
) -> RRef[Any]:
    return RRef(_LocalOptimizer(optim_cls, local_params_rref, *args, **kwargs))


def _wait_all(futures: list[torch.futures.Future[Any]], what: str) -> list[Any]:
    """Wait for every owner; then raise the first owner's exception with its own type (as
    torch does, so ``except ValueError`` around a step keeps working), noting ``what`` was
    being done and the other owners' failures."""
    results, errors = settle(futures)
    if errors:
        first = errors[0]
        note = f"{what} ({len(errors)} of {len(futures)} owners failed)"
        if len(errors) > 1:
            note += "\n" + format_many(errors[1:], "other owners")
        if hasattr(first, "add_note"):  # Python >= 3.11
            first.add_note(note)
        raise first
    return results


class DistributedOptimizer:
    """``DistributedOptimizer(optimizer_class, params_rref, *args, **kwargs)``.

    Args:
        optimizer_class: any ``torch.optim.Optimizer`` subclass.
        params_rref: RRefs of the parameters, on any workers.
        args, kwargs: passed to ``optimizer_class`` on each owner.
    """

    def __init__(
        self, optimizer_class: type[torch.optim.Optimizer], params_rref: list[RRef[Any]], *args: Any, **kwargs: Any
    ) -> None:
        per_owner: dict[Any, list[RRef[Any]]] = defaultdict(list)
        for p in params_rref:
            per_owner[p.owner()].append(p)
        futures = [
            calls.rpc_async(owner, _new_local_optimizer, args=(optimizer_class, rrefs) + tuple(args), kwargs=kwargs)
            for owner, rrefs in per_owner.items()
        ]
        self.remote_optimizers: list[RRef[Any]] = _wait_all(futures, "Error creating optimizer.")

    def step(self, context_id: int) -> None:
        """Apply the gradients of ``context_id`` on every owner, concurrently."""
        dist_autograd._is_valid_context(context_id)
        # Each call names its owner's optimizer by RRef id, as RRef proxies do (sending the
        # RRef itself would fork it: a confirmation and a delete per owner per step), and
        # is ``waited``: this thread waits for every answer right away and reads them
        # itself, so no background reader needs waking for them.
        futures = [invoke_on_owner(opt, "step", (context_id,), {}, waited=True) for opt in self.remote_optimizers]
        _wait_all(futures, "Error running optimizer.")

    def step_in_backward(self, context_id: int) -> None:
        """Have every owner apply the gradients of ``context_id`` as soon as its part of the
        distributed backward is done (an rpc_core extension; call it before
        ``dist_autograd.backward``, which then returns with the step applied and raises an
        owner's optimizer error, naming the owner). Results equal ``step``'s."""
        per_owner: dict[int, list[Any]] = defaultdict(list)
        for opt in self.remote_optimizers:
            per_owner[owner_id_of(opt)].append(rref_id_of(opt))
        hooks.set_backward_info(context_id, _IN_BACKWARD, dict(per_owner))


# DistributedOptimizer's per-owner optimizers: called by name under serializer='safe'.
allowlist.internal(_new_local_optimizer)
