"""The distributed backward pass.

``backward(context_id, roots)`` runs a local pass from the roots. A local pass finds the
leaves and recv nodes its graph reaches, runs ``torch.autograd.grad`` to them (so nothing
lands in ``.grad``), and adds the leaves' gradients to the context. Each ``_Recv`` node
the pass reaches ships its gradients to the worker that sent those tensors
(``_on_backward``), which runs a local pass from the tensors it sent, and so on. A worker
answers a gradient RPC only when every gradient RPC its own pass started has been
answered, so when the root's calls return, the whole distributed pass is done.

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

The pass that ``backward()`` starts on the caller's own worker (the root pass) runs the
leaves' ``AccumulateGrad`` nodes, as torch's distributed engine does, instead of only
capturing their gradients: hooks that other torch machinery puts after them then fire. That
is how DistributedDataParallel learns that a gradient is ready; it averages the gradients
across its process group and writes the result to ``.grad``, which the pass moves into the
context (``.grad`` is left as it was). Root passes on one worker take turns for this (a
lock; only their local autograd part), and a plain ``.backward()`` on the same leaves in
another thread at the same time would mix with it. Passes started by gradients arriving
from other workers only capture (their leaves, often a parameter server's, are shared by
many concurrent passes), so DDP modules belong on the worker that calls ``backward``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..agent import agent as _agent_mod
from ..agent import calls
from ..agent.early_exit import torch_collect_all
from ..agent.futures import raised_on, set_error, settle
from ..agent.worlds import WorkerInfo
from ..errors import RpcError, format_many
from ..functions import async_execution
from . import context as _context
from . import hooks

# The backward pass running on this thread (the CPU autograd engine runs a pass on the
# thread that started it): ``outgoing``, the (rank, message id, gradients) its _Recv nodes
# reached (recording's _Recv appends to it; sent once the pass is done, one call per rank);
# ``reply``, for a pass serving a gradient call, (the caller's rank, the list of (message
# id, gradients) its answer carries back) or None.
_pass_tls = threading.local()

# A gradient call's answer: the (message id, gradients) of the caller's own sends that its
# pass reached, for the caller to continue from; None when there are none.
Returned = list[tuple[int, list[Any]]] | None

# A 0-element leaf that makes every received tensor's _Recv node part of the graph (its
# received inputs are detached); its "gradient" is always None, so one leaf serves all of
# them: autograd.grad never accumulates into its inputs, and a local .backward() only ever
# hands it None. A pass finds it among its leaves and skips it.
ANCHOR = torch.empty(0, requires_grad=True)
_accumulating = threading.Lock()  # root passes that run AccumulateGrad take turns with .grad

# What torch.autograd.grad and .backward call once they have checked their arguments (None
# in a torch without it: then the public functions).
_engine_run_backward: Callable[..., tuple[torch.Tensor | None, ...]] | None = getattr(
    torch.autograd.graph, "_engine_run_backward", None
)


def is_anchor(t: torch.Tensor) -> bool:
    return t is ANCHOR


def _on_node(me: WorkerInfo, detail: object) -> str:
    """How an error of distributed backward names the worker it happened on: torch's
    "Error on Node 1: <what>" (programs match it), then the worker's name after the first
    line of ``detail`` (a remote traceback may follow it)."""
    first, nl, rest = str(detail).partition("\n")
    return f"Error on Node {me.id}: {first} (on {me.name}){nl}{rest}"


def _discover(starts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Leaves (including recv anchors) reachable from ``starts``: the inputs of the pass."""
    leaves: list[torch.Tensor] = []
    seen: set[object] = set()  # nodes, and ids of leaf tensors (a tensor's __eq__ is elementwise)
    stack = []
    for t in starts:
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad and id(t) not in seen:
            seen.add(id(t))
            leaves.append(t)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if var is not None:  # AccumulateGrad: a leaf
            if id(var) not in seen:
                seen.add(id(var))
                leaves.append(var)
            continue
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                stack.append(nxt)
    return leaves


def _accumulate_pass(
    starts: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], inputs: list[torch.Tensor]
) -> list[torch.Tensor | None]:
    """The leaves' gradients, through their AccumulateGrad nodes (so the hooks after those
    run: DDP's), read back from ``.grad``, which is then restored."""
    with _accumulating:
        saved = [t.grad for t in inputs]
        for t in inputs:
            t.grad = None
        try:
            _run_pass(starts, grads, inputs, accumulate=True)
            # A DDP gradient may be a view of its bucket (gradient_as_bucket_view=True),
            # which the next backward overwrites: the context keeps its own copy.
            return [None if t.grad is None else t.grad.clone() if t.grad._base is not None else t.grad for t in inputs]
        finally:
            for t, g in zip(inputs, saved, strict=True):
                t.grad = g


def _run_pass(
    starts: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], inputs: list[torch.Tensor], accumulate: bool
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad`` (``accumulate``: ``.backward``, into the inputs' ``.grad``)
    from ``starts`` with ``grads``, keeping the graph. Straight into torch's engine: every
    gradient here is a tensor, one per start (roots' are ones, the others come from
    ``_pass_from_send``), and the engine checks each one's shape against its start; the
    public functions' own checks in Python cost more than a small layer's backward (and
    the first one imports sympy). Tensor subclasses that override torch functions take the
    public path, which dispatches to them."""
    if _engine_run_backward is None or torch.overrides.has_torch_function((*starts, *inputs)):
        if accumulate:
            torch.autograd.backward(list(starts), list(grads), retain_graph=True, inputs=inputs)
            return ()
        return torch.autograd.grad(list(starts), inputs, list(grads), retain_graph=True, allow_unused=True)
    out: tuple[torch.Tensor | None, ...] = _engine_run_backward(
        tuple(starts), tuple(grads), True, False, tuple(inputs), True, accumulate
    )
    return out


def local_pass(
    ctx: _context.DistAutogradContext,
    starts: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    waited: bool = False,
    root: bool = False,
    reply: tuple[int, list[tuple[int, list[Any]]]] | None = None,
) -> list[torch.futures.Future[Any]]:
    """Backward from ``starts`` with ``grads`` on this worker; returns the futures of the
    gradient RPCs it started. ``waited``: this thread waits on them itself afterwards (so
    it reads their answers; see outbound). ``root``: the pass ``backward()`` started here,
    which runs the leaves' AccumulateGrad nodes (see the module docstring). ``reply``:
    (rank, list) of a pass serving that rank's gradient call: gradients for its sends go
    into the list, for the answer, instead of into a call."""
    inputs = _discover(starts)
    if not inputs:
        return []
    prev = (getattr(_pass_tls, "outgoing", None), getattr(_pass_tls, "reply", None))
    outgoing: list[tuple[int, int, list[Any]]] = []
    _pass_tls.outgoing, _pass_tls.reply = outgoing, reply
    prev_ctx = _context.set_current(ctx.context_id)
    try:
        if root and any(not is_anchor(t) for t in inputs):
            results = _accumulate_pass(starts, grads, inputs)
        else:
            results = list(_run_pass(starts, grads, inputs, accumulate=False))
    finally:
        _pass_tls.outgoing, _pass_tls.reply = prev
        _context.set_current(prev_ctx)
    for leaf, g in zip(inputs, results, strict=True):
        if g is not None and not is_anchor(leaf):
            ctx.accumulate(leaf, g)
    ctx.backward_passes += 1
    return _send_gradients(ctx, outgoing, waited)


def _send_gradients(
    ctx: _context.DistAutogradContext, outgoing: list[tuple[int, int, list[Any]]], waited: bool
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
        raise RuntimeError(_on_node(me, e)) from e
    while futures:  # the answers may carry gradients for our sends: continue from them here
        values, errors = _wait(futures)
        _raise_all(errors)
        futures = _continue(ctx, values, True, None)
    if ctx.info is not None:  # the workers not told their last call came, and this one's hooks
        _finish(ctx, waited=True).wait()


def _wait(futures: list[torch.futures.Future[Any]]) -> tuple[list[Any], list[BaseException]]:
    """Wait for every gradient RPC; their answers, and their errors, each naming the node it happened on."""
    values, errors = settle(futures)
    return values, [_on_this_node(e) for e in errors]


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
            raise RpcError(_on_node(me, f"no send with autograd message id {msg_id} in context {ctx.context_id}"))
        pairs += [(t, g) for t, g in zip(sent, grads, strict=False) if g is not None]
    try:
        return local_pass(ctx, [t for t, _ in pairs], [g for _, g in pairs], waited=waited, reply=reply)
    except Exception as e:
        raise RuntimeError(_on_node(me, e)) from e


def _on_this_node(e: BaseException) -> BaseException:
    """An error raised on the worker that ran the gradient call is kept as it is: that
    worker's ``_on_backward`` named itself in every error it raises (and the agent's remote
    traceback names it otherwise). An error that arose here (a peer that died, a timeout)
    is named after this node, which saw it."""
    if raised_on(e) is not None:
        return e
    me = _agent_mod.current_agent().me
    msg = _on_node(me, f"in distributed backward: {e}")
    try:
        wrapped = type(e)(msg)  # keep the type (WorkerUnavailableError, RpcTimeoutError, ...)
    except Exception:  # noqa: BLE001 - a type's constructor may refuse a lone message
        wrapped = RuntimeError(_on_node(me, f"in distributed backward: {type(e).__name__}: {e}"))
    wrapped.__cause__ = e
    return wrapped


def _raise_all(errors: list[BaseException]) -> None:
    if errors:
        raise _one_error(errors)


def _one_error(errors: list[BaseException]) -> BaseException:
    if len(errors) == 1:
        return errors[0]
    return RuntimeError(format_many(errors, "distributed backward's gradient calls"))


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
    caller's) sends that the pass reached (``Returned``); the caller continues from them.
    ``info``: the context's hook payloads; ``last``: the caller's last call here (``hooks``)."""
    me = _agent_mod.current_agent().me
    try:
        ctx = _context.retrieve(context_id)
    except RpcError as e:  # released here meanwhile: named like every error this handler raises
        raise RpcError(_on_node(me, e)) from e
    if info is not None:
        with ctx.lock:
            if ctx.hooks_ran:
                raise RpcError(
                    _on_node(
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
            _end_call(ctx, returned, done)
        else:
            done.set_result(returned)
        return

    def finish(_: Any) -> None:
        try:
            values, errors = _wait(futures)  # all done: this does not block
            _raise_all(errors)
            more = _continue(ctx, values, False, reply)
        except BaseException as e:  # noqa: BLE001 - the backward's waiter gets it
            if hooked:
                with ctx.lock:
                    ctx.grad_calls -= 1
            done.set_exception(e)
            return
        _finish_when_answered(ctx, more, reply, done, hooked)

    torch_collect_all(futures).add_done_callback(finish)


def _end_call(ctx: _context.DistAutogradContext, returned: Returned, done: torch.futures.Future[Any]) -> None:
    """A gradient call of a context with hooks is served: if it was the last one to come,
    run the hooks (``_finish``) before answering; the answer carries the results gathered here."""
    with ctx.lock:
        ctx.grad_calls -= 1
        go = ctx.final_seen and ctx.grad_calls == 0 and not ctx.hooks_ran
        if go:
            ctx.hooks_ran = True

    def answer(f: torch.futures.Future[Any] | None) -> None:
        try:
            if f is not None:
                f.wait()
        except BaseException as e:  # noqa: BLE001 - the backward's waiter gets it
            done.set_exception(e)
            return
        results = hooks.take_results(ctx)
        done.set_result(hooks.Answer(returned, results) if results else returned)

    if go:
        _finish(ctx, waited=False).add_done_callback(answer)
    else:
        answer(None)


def _finish(ctx: _context.DistAutogradContext, waited: bool) -> torch.futures.Future[None]:
    """This worker's part of the backward is done: tell the workers it called whose last call
    was not flagged so (``_on_finish``), then run its own hooks; their results go into
    ``ctx.results``. Never blocks."""
    me = _agent_mod.current_agent().me
    out: torch.futures.Future[None] = torch.futures.Future()
    futs = [
        calls.invoke_async(w, _on_finish, (ctx.context_id,), None, 0, "async", waited=waited)
        for w in hooks.unfinished(ctx)
    ]

    def own_done(f: torch.futures.Future[dict[str, Any]]) -> None:
        try:
            values = f.wait()
        except BaseException as e:  # noqa: BLE001 - named after this worker, for the backward's caller
            set_error(out, _hook_error(me, e))
            return
        if values:
            hooks.merge_results(ctx, {me.id: values})
        out.set_result(None)

    def run_own(_: Any = None) -> None:
        if futs:
            values, errors = _wait(futs)  # all done: this does not block
            if errors:
                set_error(out, _one_error(errors))
                return
            for v in values:
                hooks.merge_results(ctx, v)
        hooks.run_hooks(ctx).add_done_callback(own_done)

    if futs:
        torch_collect_all(futs).add_done_callback(run_own)
    else:
        run_own()
    return out


def _hook_error(me: WorkerInfo, e: BaseException) -> BaseException:
    """A hook's error, named after this worker (its type kept when it takes a message)."""
    msg = _on_node(me, f"in a backward hook: {type(e).__name__}: {e}")
    try:
        wrapped = type(e)(msg)
    except Exception:  # noqa: BLE001 - a type's constructor may refuse a lone message
        wrapped = RuntimeError(msg)
    wrapped.__cause__ = e
    return wrapped


@async_execution
def _on_finish(context_id: int) -> torch.futures.Future[Any]:
    """The caller's backward is done and its calls here were not flagged last: run this
    worker's part of the finish now (or the call still served here will); answers the
    hooks' results gathered here."""
    me = _agent_mod.current_agent().me
    try:
        ctx = _context.retrieve(context_id)
    except RpcError as e:
        raise RpcError(_on_node(me, e)) from e
    with ctx.lock:
        ctx.final_seen = True
        go = ctx.grad_calls == 0 and not ctx.hooks_ran
        if go:
            ctx.hooks_ran = True
    done: torch.futures.Future[Any] = torch.futures.Future()
    if not go:
        done.set_result(None)
        return done

    def answer(f: torch.futures.Future[None]) -> None:
        try:
            f.wait()
        except BaseException as e:  # noqa: BLE001 - the backward's waiter gets it
            done.set_exception(e)
            return
        done.set_result(hooks.take_results(ctx) or None)

    _finish(ctx, waited=False).add_done_callback(answer)
    return done
