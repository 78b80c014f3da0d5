"""Recording sends and recvs while RPCs run inside a distributed autograd context.

On the sending side, the tensors of a message that require grad are remembered in the
context under a fresh autograd message id (a "send"). On the receiving side, those tensors
come out of ``_Recv``, a custom autograd Function: when the local backward pass reaches it,
its backward ships the gradients to the sender under that message id. Requests and
responses are recorded alike, and the context id travels with every call made inside a
context, so nested calls join the same context.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C._autograd import _profiler_enabled

from ..agent import agent as _agent_mod
from ..agent import calls
from ..protocol import wire
from . import context as _context
from .context import RecvInfo as _RecvInfo
from .engine import _on_backward
from .local_pass import ANCHOR, pass_tls
from .release import release_on_arrival, released_after_requests


class _Recv(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, info: _RecvInfo, anchor: torch.Tensor, *tensors: torch.Tensor) -> Any:
        ctx.set_materialize_grads(False)
        ctx.info = info
        outs = tuple(t.detach() for t in tensors)
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        if _profiler_enabled():  # torch's name for this node, in a profile
            with torch.autograd.profiler.record_function("torch::distributed::autograd::RecvRpcBackward"):
                return _Recv._send_back(ctx, grads)
        return _Recv._send_back(ctx, grads)

    @staticmethod
    def _send_back(ctx: Any, grads: tuple[torch.Tensor | None, ...]) -> Any:
        info: _RecvInfo = ctx.info
        if any(g is not None for g in grads):
            reply = getattr(pass_tls, "reply", None)
            if reply is not None and reply[0] == info.sender:
                # The sender is the caller whose gradient call this pass serves: the
                # gradients ride on that call's answer (see engine).
                reply[1].append((info.msg_id, list(grads)))
                return (None, None) + (None,) * len(grads)
            outgoing = getattr(pass_tls, "outgoing", None)
            if outgoing is not None:  # sent once the pass is done, one call per worker (engine)
                outgoing.append((info.sender, info.msg_id, list(grads)))
                return (None, None) + (None,) * len(grads)
            # A local .backward() through received tensors: nobody waits for this call.
            # Through the user-call path, so the profiler sees this RPC (no cost otherwise).
            me = _agent_mod.current_agent().me.id
            calls.invoke_async(
                info.sender, _on_backward, (info.context_id, [(info.msg_id, list(grads))], me), None, 0, "async"
            )
        return (None, None) + (None,) * len(grads)


def _context_of_graph(tensors: list[torch.Tensor]) -> int | None:
    """The live context whose received tensors these tensors were computed from, if any.

    A request sent by a thread without a current context (typically a callback of an
    ``@async_execution`` function's future, which runs on whichever thread completes that
    future) still belongs to the context its tensors came from: without this, their
    gradients would silently stop at this worker. Only searched when this worker holds
    contexts and a tensor requires grad, so it costs nothing outside distributed autograd.
    """
    stack = [t.grad_fn for t in tensors if t.requires_grad and t.grad_fn is not None]
    if not stack or not _context.count():
        return None
    seen = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if isinstance(node, _RecvBackward):
            cid: int = node.info.context_id  # type: ignore[attr-defined]  # _Recv.forward set it on its ctx, this node
            if _context.is_valid(cid):
                return cid
            continue  # a released context: its inputs are detached anyway
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                stack.append(nxt)
    return None


_RecvBackward = _Recv._backward_cls


class AutogradMiddleware(_agent_mod.Middleware):
    """Plugged into the agent: records sends on the way out, recvs on the way in, and
    makes the request's context current while the callee runs the function. A request's
    context is looked up once, when it arrives (``admit``), and held until it is answered."""

    def admit(self, src: int, extras: dict[str, Any]) -> None:
        released = extras.get(wire.EXTRA_RELEASED_CONTEXTS)
        if released:  # contexts ``src`` left, after every request it sent before this one
            gone = release_on_arrival(released, src)
            if gone:
                # Released now, freed once this request is answered (exit_call): a trainer's
                # release rides on its next step's forward, which should not wait while the
                # last step's graph and gradients are freed.
                extras[wire.LOCAL_RELEASED_CONTEXTS] = gone
        ag = extras.get(wire.EXTRA_AUTOGRAD)
        if ag:
            context_id, _ = ag
            ctx = _context.admit(context_id)
            if ctx is not None:
                ctx.known_workers.add(src)
                # held until the request is answered (see context.admit)
                extras[wire.LOCAL_AUTOGRAD_CONTEXT] = ctx

    def finish(self, extras: dict[str, Any]) -> None:
        ctx = extras.pop(wire.LOCAL_AUTOGRAD_CONTEXT, None)
        if ctx is not None and _context.leave(ctx):
            released_after_requests(ctx)

    def outgoing(
        self, dst: int, tensors: list[torch.Tensor], extras: dict[str, Any], request_extras: dict[str, Any] | None
    ) -> None:
        ctx: _context.DistAutogradContext | None
        if request_extras is None:
            if _context.deferred:
                released = _context.take_deferred(dst)
                if released:
                    extras[wire.EXTRA_RELEASED_CONTEXTS] = released  # contexts we left: dst can drop them too
            context_id = _context.current_id()
            if context_id is None:
                if not tensors:
                    return
                context_id = _context_of_graph(tensors)
            if context_id is None or _context.is_released(context_id):
                return
            ctx = _context.get_or_create(context_id)
        else:  # an answer: in the context its request was admitted into, if any
            ctx = request_extras.get(wire.LOCAL_AUTOGRAD_CONTEXT)
            if ctx is None:
                return
            context_id = ctx.context_id
        ctx.known_workers.add(dst)
        needs_grad = [t for t in tensors if t.requires_grad]
        if needs_grad:
            msg_id = _context.new_message_id()
            ctx.sends[msg_id] = needs_grad
            ctx.send_dst[msg_id] = dst
            extras[wire.EXTRA_AUTOGRAD] = (context_id, msg_id)
        else:
            extras[wire.EXTRA_AUTOGRAD] = (context_id, -1)

    def incoming(
        self, src: int, tensors: list[torch.Tensor], extras: dict[str, Any], is_response: bool
    ) -> list[torch.Tensor]:
        ag = extras.get(wire.EXTRA_AUTOGRAD)
        if not ag:
            return tensors
        context_id, msg_id = ag
        if msg_id < 0:  # no tensor of this message needed grad
            return tensors
        ctx: _context.DistAutogradContext | None
        if is_response:
            if _context.is_released(context_id):
                return tensors  # a late answer in a released context
            ctx = _context.get_or_create(context_id)
            ctx.known_workers.add(src)
        else:
            ctx = extras.get(wire.LOCAL_AUTOGRAD_CONTEXT)
            if ctx is None:
                return tensors  # a request that arrived after its context was released here
        idx = [i for i, t in enumerate(tensors) if t.requires_grad]
        if not idx:
            return tensors
        received = [tensors[i].detach() for i in idx]
        if torch.is_grad_enabled():  # the usual case: skip the context manager
            outs = _Recv.apply(_RecvInfo(context_id, src, msg_id), ANCHOR, *received)
        else:
            with torch.enable_grad():
                outs = _Recv.apply(_RecvInfo(context_id, src, msg_id), ANCHOR, *received)
        if not isinstance(outs, tuple):
            outs = (outs,)
        ctx.recvs[msg_id] = outs[0].grad_fn
        tensors = list(tensors)
        for i, o in zip(idx, outs, strict=True):
            tensors[i] = o
        return tensors

    def enter_call(self, src: int, extras: dict[str, Any]) -> Any:
        ctx = extras.get(wire.LOCAL_AUTOGRAD_CONTEXT)
        if ctx is None:
            return _NO_TOKEN
        return _context.set_current(ctx.context_id)

    def exit_call(self, token: Any, extras: dict[str, Any], result_future: torch.futures.Future[Any] | None) -> None:
        if token is not _NO_TOKEN:
            _context.set_current(token)
        # After the answer of a function that returned (or whose future was done): the
        # contexts this request's arrival released are freed here, off the caller's wait.
        extras.pop(wire.LOCAL_RELEASED_CONTEXTS, None)


_NO_TOKEN = object()
