"""The end of a worker's part of a distributed backward, for contexts with hooks.

A context whose caller attached hook payloads (``hooks.set_backward_info``) runs each
worker's hooks once its part of the backward is done there (``hooks``' docstring says when
that is). This module carries that out: ``end_call`` as a gradient call is served (the last
one to come runs the hooks before it is answered), ``finish`` on the caller once its own
backward is done (it also tells the workers it called whose last call was not flagged so,
through ``_on_finish``). It only decides when and answers; the passes and the gradient calls
are ``engine``'s, the hooks and their bookkeeping ``hooks``'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..agent import agent as _agent_mod
from ..agent import calls
from ..agent.early_exit import torch_collect_all
from ..agent.futures import set_error
from ..errors import RpcError
from ..functions import async_execution
from ..protocol import allowlist
from . import context as _context
from . import hooks
from .node_errors import hook_error, on_node, one_error, settle_named

# A gradient call's answer: the (message id, gradients) of the caller's own sends that its
# pass reached, for the caller to continue from; None when there are none.
Returned = list[tuple[int, list[Any]]] | None


def end_call(ctx: _context.DistAutogradContext, returned: Returned, done: torch.futures.Future[Any]) -> None:
    """A gradient call of a context with hooks is served: if it was the last one to come,
    run the hooks (``finish``) before answering; the answer carries the results gathered here."""
    with ctx.lock:
        ctx.grad_calls -= 1
        go = ctx.final_seen and ctx.grad_calls == 0 and not ctx.hooks_ran
        if go:
            ctx.hooks_ran = True
    if go:
        ctx.drop_graph()  # this worker's part of the pass is over (hooks' docstring)

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
        _when_done(finish(ctx), answer)
    else:
        answer(None)


def finish(ctx: _context.DistAutogradContext) -> torch.futures.Future[None]:
    """This worker's part of the backward is done: tell the workers it called whose last call
    was not flagged so (``_on_finish``), then run its own hooks; their results go into
    ``ctx.results``. Never blocks. The finish calls are not ``waited``: their answers
    complete the returned future through callbacks, which a background reader runs."""
    me = _agent_mod.current_agent().me
    out: torch.futures.Future[None] = torch.futures.Future()
    futs = [calls.invoke_async(w, _on_finish, (ctx.context_id,), None, 0, "async") for w in hooks.unfinished(ctx)]

    def own_done(f: torch.futures.Future[dict[str, Any]]) -> None:
        try:
            values = f.wait()
        except BaseException as e:  # noqa: BLE001 - named after this worker, for the backward's caller
            set_error(out, hook_error(me, e))
            return
        if values:
            hooks.merge_results(ctx, {me.id: values})
        out.set_result(None)

    def run_own(_: Any = None) -> None:
        if futs:
            values, errors = settle_named(futs)  # all done: this does not block
            if errors:
                set_error(out, one_error(errors))
                return
            for v in values:
                hooks.merge_results(ctx, v)
        _when_done(hooks.run_hooks(ctx), own_done)

    if futs:
        torch_collect_all(futs).add_done_callback(run_own)
    else:
        run_own()
    return out


@async_execution
def _on_finish(context_id: int) -> torch.futures.Future[Any]:
    """The caller's backward is done and its calls here were not flagged last: run this
    worker's part of the finish now (or the call still served here will); answers the
    hooks' results gathered here."""
    me = _agent_mod.current_agent().me
    try:
        ctx = _context.retrieve(context_id)
    except RpcError as e:
        raise RpcError(on_node(me, e)) from e
    with ctx.lock:
        ctx.final_seen = True
        go = ctx.grad_calls == 0 and not ctx.hooks_ran
        if go:
            ctx.hooks_ran = True
    done: torch.futures.Future[Any] = torch.futures.Future()
    if not go:
        done.set_result(None)
        return done
    ctx.drop_graph()

    def answer(f: torch.futures.Future[None]) -> None:
        try:
            f.wait()
        except BaseException as e:  # noqa: BLE001 - the backward's waiter gets it
            done.set_exception(e)
            return
        done.set_result(hooks.take_results(ctx) or None)

    _when_done(finish(ctx), answer)
    return done


def _when_done(fut: torch.futures.Future[Any], callback: Callable[[torch.futures.Future[Any]], None]) -> None:
    """``fut.add_done_callback(callback)``, but a future that is done already (the hooks
    usually are, on every step) is handed to ``callback`` here, without torch's callback machinery."""
    if fut.done():
        callback(fut)
    else:
        fut.add_done_callback(callback)


# A context's hooks, run where it ends: called by name under serializer='safe'.
allowlist.internal(_on_finish, hooks.Answer)
