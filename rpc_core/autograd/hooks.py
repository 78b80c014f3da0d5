"""Hooks in the distributed backward: an owner's code run as soon as a context's backward pass
is done on it, answered with the backward itself (an rpc_core extension beyond torch).

torch applies an optimizer in the backward locally (``_apply_optimizer_in_backward``, FBGEMM's
fused backward); across workers it needs a further round trip, ``DistributedOptimizer.step``.
Here the worker that calls ``backward`` attaches small payloads to the context, by hook key
(``set_backward_info``); they travel with the backward's gradient calls. A worker that
registered a hook under that key (``on_backward_done``) runs it once the context's gradients
are all accumulated there, before it answers the gradient call that completed them; the
hook's value (or the value of the future it returns) rides back on that answer, and
``backward`` returns only once every such hook ran: ``backward_results`` then gives the
values by worker name and key. A hook that raises makes ``backward`` raise, naming the worker
("Error on Node <rank>: ... (on <name>)"). Contexts without payloads run no hooks and send
nothing more: everything else of distributed autograd is torch's.

When the pass is done on a worker. A worker may get several gradient calls of one context:
the caller's later passes may reach tensors received from it again. A caller therefore flags
each call as its last to that worker or not (``call_flags``): a call is the last unless the
gradients that answers may still bring (for the caller's sends to workers it has not made
its last call to) could reach tensors received from that worker (``reach``, a walk of the
caller's own graph). The worker runs its hooks when it serves no call of the context and a
last call came. A worker whose calls were never flagged last gets an explicit ``finish``
call once the caller's backward is done (an extra message only in graphs where tensors go
back and forth between the same two workers). Calls that arrive after a worker's hooks ran
(a third worker calling it, which the caller could not see) fail the backward.

What the pass leaves behind. Once a worker (not the caller) runs its hooks, no gradient call
of the context can reach it any more, so it frees its part of the graph then (the tensors
it sent and the activations their graph saved) instead of at the context's release, which
comes with the caller's next request: a parameter server's step no longer holds the
previous step's activations of every trainer. The gradients stay (``get_gradients``) until
the release, or until a hook takes them (``take_gradients``, which leaves the context none:
the hook may then change them in place).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, cast

import torch

from ..agent import agent as _agent_mod
from ..agent.early_exit import torch_collect_all
from ..agent.futures import set_error
from . import context as _context

__all__ = ["on_backward_done", "set_backward_info", "backward_results"]

Hook = Callable[[int, Any], Any]
_hooks: dict[str, Hook] = {}
_hooks_lock = threading.Lock()


class Answer(NamedTuple):
    """A gradient call's answer when hooks' results ride on it."""

    returned: list[tuple[int, list[Any]]] | None  # gradients for the caller's sends (finish.Returned)
    results: dict[int, dict[str, Any]]  # worker rank -> {hook key: its value}


def on_backward_done(key: str, fn: Hook) -> Callable[[], None]:
    """On a worker that owns parameters: run ``fn(context_id, payload)`` once the backward of
    a context whose caller set a ``key`` payload (``set_backward_info``) is done here (every
    gradient of the context accumulated: ``get_gradients(context_id)`` is complete). ``fn``
    returns a value or a future of one (``torch.futures.Future``, or what its ``then``
    returns); it comes back to the caller of ``backward``. Returns a function that removes the hook."""
    if not callable(fn):
        raise TypeError(f"on_backward_done({key!r}, fn): fn must be callable, got {type(fn).__name__}")
    with _hooks_lock:
        if key in _hooks:
            raise ValueError(
                f"a backward hook is already registered under {key!r} on this worker; "
                "remove it first (call the function on_backward_done returned)"
            )
        _hooks[key] = fn

    def remove() -> None:
        with _hooks_lock:
            if _hooks.get(key) is fn:
                del _hooks[key]

    return remove


def set_backward_info(context_id: int, key: str, payload: Any) -> None:
    """On the worker that will call ``backward(context_id, ...)``: every worker the backward
    reaches runs its ``key`` hook with ``payload`` (sent along with the gradients; keep it
    small) once its part of the pass is done. Set before ``backward``."""
    ctx = _context.retrieve(context_id)
    with ctx.lock:
        info = dict(ctx.info or {})
        info[key] = payload
        ctx.info = info


def backward_results(context_id: int) -> dict[str, dict[str, Any]]:
    """After ``backward``: the values of the hooks that ran, by worker name and hook key."""
    ctx = _context.retrieve(context_id)
    agent = _agent_mod.current_agent()
    with ctx.lock:
        return {agent.worker_info(rank).name: dict(values) for rank, values in sorted(ctx.results.items())}


def merge_results(ctx: _context.DistAutogradContext, results: dict[int, dict[str, Any]] | None) -> None:
    if results:
        with ctx.lock:
            for rank, values in results.items():
                ctx.results.setdefault(rank, {}).update(values)


def take_results(ctx: _context.DistAutogradContext) -> dict[int, dict[str, Any]]:
    """The results gathered here so far (a server passes them up with its answer)."""
    with ctx.lock:
        out, ctx.results = ctx.results, {}
    return out


def reach(ctx: _context.DistAutogradContext, dsts: set[int]) -> set[int]:
    """The workers whose received tensors a pass from this worker's sends to ``dsts`` may
    reach (in this worker's graph): those it may call again."""
    stack = [
        t.grad_fn
        for mid, sent in list(ctx.sends.items())
        if ctx.send_dst.get(mid) in dsts
        for t in sent
        if t.grad_fn is not None
    ]
    found: set[int] = set()
    seen: set[Any] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        info = getattr(node, "info", None)
        if isinstance(info, _context.RecvInfo):  # a _Recv node: past it is only the anchor
            found.add(info.sender)
            continue
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return found


def call_flags(ctx: _context.DistAutogradContext, dsts: Iterable[int]) -> dict[int, bool]:
    """Whether the gradient calls this worker is about to make to ``dsts`` are its last to
    them (see the module docstring); remembered for ``unfinished``."""
    dsts = set(dsts)
    with ctx.lock:
        still_open = dsts | {mid_dst for mid_dst in ctx.send_dst.values() if not ctx.called.get(mid_dst, False)}
    again = reach(ctx, still_open)
    flags = {d: d not in again for d in dsts}
    with ctx.lock:
        ctx.called.update(flags)
    return flags


def unfinished(ctx: _context.DistAutogradContext) -> list[int]:
    """The workers this worker called whose last call was not flagged so: they get a finish."""
    with ctx.lock:
        return [w for w, last in ctx.called.items() if not last]


def run_hooks(ctx: _context.DistAutogradContext) -> torch.futures.Future[dict[str, Any]]:
    """Run this worker's hooks for ``ctx``'s payloads; a future of their values by key."""
    info = ctx.info or {}
    with _hooks_lock:
        todo = [(key, _hooks[key], payload) for key, payload in info.items() if key in _hooks]
    out: torch.futures.Future[dict[str, Any]] = torch.futures.Future()
    values: dict[str, Any] = {}
    pending: list[tuple[str, torch.futures.Future[Any]]] = []
    try:
        for key, fn, payload in todo:
            value = fn(ctx.context_id, payload)
            if isinstance(value, torch._C.Future):  # a torch.futures.Future, or a chained one (then())
                pending.append((key, cast("torch.futures.Future[Any]", value)))  # waited on alike
            else:
                values[key] = value
    except BaseException as e:  # noqa: BLE001 - the backward's caller gets it, naming this worker
        set_error(out, e)
        return out
    if not pending:
        out.set_result(values)
        return out

    def done(_: Any = None) -> None:
        try:
            for key, fut in pending:
                values[key] = fut.wait()
        except BaseException as e:  # noqa: BLE001 - as above
            set_error(out, e)
            return
        out.set_result(values)

    if all(f.done() for _, f in pending):
        done()  # values that were ready (an update answered at once): no collect_all, no callback
    else:
        torch_collect_all([f for _, f in pending]).add_done_callback(done)
    return out
