"""The distributed backward pass.

``backward(context_id, roots)`` runs a local pass from the roots (module ``local_pass``: the
walk of this worker's graph). Each ``_Recv`` node the pass reaches ships its gradients to the
worker that sent those tensors (``_on_backward``), which runs a local pass from the tensors
it sent, and so on. A worker answers a gradient RPC only when every gradient RPC its own
pass started has been answered, so when the root's calls return, the whole distributed pass
is done.

Unlike torch's FAST mode, nothing waits for gradients that never come: a send whose
output the loss did not use is simply never visited, so it cannot make backward hang.
Passes add up by linearity, so a tensor that gets gradients from several places (used
locally and sent, or sent twice) receives their sum. Graphs are kept (retain_graph)
because several passes may cross the same nodes; they are freed with their tensors and
the context, so ``retain_graph=False`` neither frees them early nor forbids a second
backward. One consequence of passes: a gradient hook (``register_hook``) on a tensor
reached by several passes sees each pass's part, not their sum, as torch's engine would
give it; linear hooks (scaling) give the same result, non-linear ones (clamping) do not.

Gradients for the worker that made a gradient call ride on its answer. When the pass that
``_on_backward`` runs for worker A reaches a ``_Recv`` of tensors A sent, it does not call A
back (a request A's reader would have to wake up for, while A's caller thread waits for
this very answer, and an answer this worker's reader would have to wake up for): it puts
(message id, gradients) in the answer, and A continues from those sends itself, on the
thread that waited (``_continue``). The gradient of an input that flows back to the caller
(``rpc_sync(owner, f, args=(rref, x))`` with ``x.requires_grad``) then costs no message
beyond the gradient call's own round trip.

The root pass runs the leaves' ``AccumulateGrad`` nodes, so DistributedDataParallel's hooks
fire (module ``local_pass``). A context with hook payloads ends each worker's part with its hooks
(``finish``); errors name the worker they happened on (``node_errors``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch._C._autograd import _profiler_enabled

from ..agent import agent as _agent_mod
from ..agent import calls
from ..agent.early_exit import torch_collect_all
from ..errors import RpcError
from ..functions import async_execution
from ..protocol import allowlist
from . import context as _context
from . import hooks
from . import local_pass as _local
from .finish import end_call, finish
from .node_errors import on_node, raise_all, settle_named


def local_pass(
    ctx: _context.DistAutogradContext,
    starts: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    waited: bool = False,
    root: bool = False,
    reply: tuple[int, list[tuple[int, list[Any]]]] | None = None,
) -> list[torch.futures.Future[Any]]:
    """Backward from ``starts`` with ``grads`` on this worker (``local_pass.run``); returns
    the futures of the gradient RPCs it started. ``waited``: this thread waits on them
    itself afterwards (so it reads their answers; see outbound). ``root``: the pass
    ``backward()`` started here, which runs the leaves' AccumulateGrad nodes. ``reply``:
    (rank, list) of a pass serving that rank's gradient call: gradients for its sends go
    into the list, for the answer, instead of into a call."""
    return _send_gradients(ctx, _local.run(ctx, starts, grads, root, reply), waited)


def _send_gradients(
    ctx: _context.DistAutogradContext, outgoing: _local.Outgoing, waited: bool
) -> list[torch.futures.Future[Any]]:
    """One gradient call per worker for what a pass reached of the tensors received from it.
    Through the user-call path, so the profiler sees these RPCs (no cost otherwise).
    ``waited``: this thread waits on them itself (so it reads their answers; see outbound).
    A context with hook payloads sends them along, and whether the call is the last to that
    worker (``hooks``)."""
    if not outgoing:
        return []
    per_worker: dict[int, list[tuple[int, list[Any]]]] = {}
    for rank, msg_id, grads in outgoing:
        per_worker.setdefault(rank, []).append((msg_id, grads))
    me = _agent_mod.current_agent().me.id
    info = ctx.info
    last = hooks.call_flags(ctx, per_worker) if info is not None else {}
    return [
        calls.invoke_async(
            rank,
            _on_backward,
            (ctx.context_id, entries, me) if info is None else (ctx.context_id, entries, me, info, last[rank]),
            None,
            0,
            "async",
            waited=waited,
        )
        for rank, entries in per_worker.items()
    ]


def _check_roots(roots: Any) -> list[torch.Tensor]:
    if not isinstance(roots, (list, tuple)):
        raise TypeError(f"incompatible function arguments: roots must be a list of tensors, got {type(roots).__name__}")
    if len(roots) == 0:
        raise RpcError("No tensors provided for gradient computation.")
    for i, r in enumerate(roots):
        if not isinstance(r, torch.Tensor):
            raise TypeError(f"incompatible function arguments: roots[{i}] is a {type(r).__name__}, not a Tensor")
        if not r.requires_grad:
            raise RpcError(f"requires_grad not set on root tensor {i}: it is not part of any autograd graph")
        if r.numel() != 1:
            raise RpcError(f"roots[{i}] of shape {tuple(r.shape)} is not a scalar, all roots need to be scalar")
        if r.grad_fn is None:
            # As in torch: a leaf root has nothing to differentiate through.
            raise RpcError(
                f"roots[{i}] does not have a valid gradient function: it is a leaf tensor, "
                "not the result of a computation"
            )
    return list(roots)


def backward(context_id: int, roots: list[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the distributed backward pass from scalar ``roots`` (local tensors) in context
    ``context_id``; returns when every worker's part is done. Gradients accumulate in the
    context of each worker (``get_gradients``), never in ``.grad``."""
    if not isinstance(context_id, int) or isinstance(context_id, bool):
        raise TypeError(f"incompatible function arguments: context_id must be an int, got {type(context_id).__name__}")
    roots = _check_roots(roots)
    if _profiler_enabled():  # a profile shows the pass under torch's name
        with torch.autograd.profiler.record_function(PROFILED_BACKWARD):
            _backward(context_id, roots)
    else:
        _backward(context_id, roots)


# The names torch's profiles give distributed autograd's work, which rpc_core's keep: the
# whole backward, the part that continues from this worker's sends once their gradients
# came back, and a received tensor's gradient leaving for its sender (recording's _Recv).
PROFILED_BACKWARD = "torch::distributed::autograd::backward"
PROFILED_SEND = "torch::distributed::autograd::SendRpcBackward"


def _backward(context_id: int, roots: list[torch.Tensor]) -> None:
    ctx = _context.retrieve(context_id)
    me = _agent_mod.current_agent().me
    if ctx.info is not None:  # hooks run once per backward (rpc_core.autograd.hooks)
        with ctx.lock:
            ctx.called.clear()
            ctx.results.clear()
            ctx.hooks_ran = True
    try:
        futures = local_pass(ctx, roots, [torch.ones_like(r) for r in roots], waited=True, root=True)
    except Exception as e:
        raise RuntimeError(on_node(me, e)) from e
    while futures:  # the answers may carry gradients for our sends: continue from them here
        values, errors = settle_named(futures)
        raise_all(errors)
        futures = _continue(ctx, values, True, None)
    if ctx.info is not None:  # the workers not told their last call came, and this one's hooks
        finish(ctx).wait()


def _continue(
    ctx: _context.DistAutogradContext,
    answers: list[Any],
    waited: bool,
    reply: tuple[int, list[tuple[int, list[Any]]]] | None,
) -> list[torch.futures.Future[Any]]:
    """Continue backward from this worker's sends whose gradients came back in gradient
    calls' ``answers`` (see the module docstring); the futures of the calls that started."""
    entries: list[tuple[int, list[Any]]] = []
    for answer in answers:
        if isinstance(answer, hooks.Answer):  # hooks' results ride on it
            hooks.merge_results(ctx, answer.results)
            answer = answer.returned
        entries += answer or ()
    return _pass_from_sends(ctx, _merge(entries), waited, reply) if entries else []


def _merge(entries: list[tuple[int, list[Any]]]) -> list[tuple[int, list[Any]]]:
    """Gradients for the same send added up (passes add by linearity): one pass per send,
    so what it reaches is called once, not once per part."""
    merged: dict[int, list[Any]] = {}
    for msg_id, grads in entries:
        have = merged.get(msg_id)
        if have is None:
            merged[msg_id] = list(grads)
            continue
        for i, g in enumerate(grads):
            if g is not None:
                have[i] = g if have[i] is None else have[i] + g
    return list(merged.items())


def _pass_from_sends(
    ctx: _context.DistAutogradContext,
    entries: list[tuple[int, list[Any]]],
    waited: bool,
    reply: tuple[int, list[tuple[int, list[Any]]]] | None,
) -> list[torch.futures.Future[Any]]:
    """One pass backward from the tensors of our sends, (message id, their gradients (None:
    no gradient)) each."""
    me = _agent_mod.current_agent().me
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for msg_id, grads in entries:
        sent = ctx.sends.get(msg_id)
        if sent is None:
            why = ": this worker's part of its graph was freed when its backward hooks ran" if ctx.graph_dropped else ""
            raise RpcError(on_node(me, f"no send with autograd message id {msg_id} in context {ctx.context_id}{why}"))
        pairs += [(t, g) for t, g in zip(sent, grads, strict=False) if g is not None]
    try:
        if _profiler_enabled():
            with torch.autograd.profiler.record_function(PROFILED_SEND):
                return local_pass(ctx, [t for t, _ in pairs], [g for _, g in pairs], waited=waited, reply=reply)
        return local_pass(ctx, [t for t, _ in pairs], [g for _, g in pairs], waited=waited, reply=reply)
    except Exception as e:
        raise RuntimeError(on_node(me, e)) from e


@async_execution
def _on_backward(
    context_id: int,
    entries: list[tuple[int, list[Any]]],
    reply_to: int = -1,
    info: dict[str, Any] | None = None,
    last: bool = False,
) -> torch.futures.Future[Any]:
    """On the worker that sent the tensors of ``entries`` ((message id, gradients) each):
    continue backward from them. The answer carries the gradients for ``reply_to``'s (the
    caller's) sends that the pass reached (``finish.Returned``); the caller continues from them.
    ``info``: the context's hook payloads; ``last``: the caller's last call here (``hooks``)."""
    me = _agent_mod.current_agent().me
    try:
        ctx = _context.retrieve(context_id)
    except RpcError as e:  # released here meanwhile: named like every error this handler raises
        raise RpcError(on_node(me, e)) from e
    if info is not None:
        with ctx.lock:
            if ctx.hooks_ran:
                raise RpcError(
                    on_node(
                        me,
                        f"gradients of context {context_id} arrived after this worker's "
                        "backward hooks ran (a worker it got no gradient call from before "
                        "sent them); hooks need the backward's gradients to come through the "
                        "workers that called this one",
                    )
                )
            ctx.info = info
            ctx.grad_calls += 1
            ctx.final_seen = ctx.final_seen or last
    returned: list[tuple[int, list[Any]]] = []
    reply = (reply_to, returned) if reply_to >= 0 else None
    try:
        futures = _pass_from_sends(ctx, entries, False, reply)
    except BaseException:
        if info is not None:
            with ctx.lock:
                ctx.grad_calls -= 1
        raise
    done: torch.futures.Future[Any] = torch.futures.Future()
    _finish_when_answered(ctx, futures, reply, done, info is not None)
    return done


def _finish_when_answered(
    ctx: _context.DistAutogradContext,
    futures: list[torch.futures.Future[Any]],
    reply: tuple[int, list[tuple[int, list[Any]]]] | None,
    done: torch.futures.Future[Any],
    hooked: bool,
) -> None:
    """Complete ``done`` with the gradients for the caller once every gradient call of this
    pass was answered, continuing from the gradients those answers brought back (which
    may start more calls); never blocks (it runs in the callbacks of those calls).
    ``hooked``: the context has hook payloads; the last call served here runs the hooks."""
    if not futures:
        returned = _merge(reply[1]) or None if reply is not None else None
        if hooked:
            end_call(ctx, returned, done)
        else:
            done.set_result(returned)
        return

    def answered(_: Any) -> None:
        try:
            values, errors = settle_named(futures)  # all done: this does not block
            raise_all(errors)
            more = _continue(ctx, values, False, reply)
        except BaseException as e:  # noqa: BLE001 - the backward's waiter gets it
            if hooked:
                with ctx.lock:
                    ctx.grad_calls -= 1
            done.set_exception(e)
            return
        _finish_when_answered(ctx, more, reply, done, hooked)

    torch_collect_all(futures).add_done_callback(answered)


# Gradients sent back along a backward: called by name under serializer='safe'.
allowlist.internal(_on_backward)
