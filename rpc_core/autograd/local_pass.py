"""One local pass of a distributed backward: the walk of this worker's graph, run in torch's engine.

A pass starts from some tensors with their gradients (the roots, with ones; or the tensors
this worker sent, with the gradients that came back for them), finds the leaves and recv
nodes its graph reaches, runs ``torch.autograd.grad`` to them (so nothing lands in
``.grad``) and adds the leaves' gradients to the context. The ``_Recv`` nodes it reaches
(``recording``) note what to ship to the workers that sent those tensors in the pass's
thread-local state (``pass_tls``); the engine sends it once the pass is done. This module
knows nothing of calls: it is the part of ``engine`` that runs on one worker alone.

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

from . import context as _context

# The backward pass running on this thread (the CPU autograd engine runs a pass on the
# thread that started it): ``outgoing``, the (rank, message id, gradients) its _Recv nodes
# reached (recording's _Recv appends to it; sent once the pass is done, one call per rank);
# ``reply``, for a pass serving a gradient call, (the caller's rank, the list of (message
# id, gradients) its answer carries back) or None.
pass_tls = threading.local()

# What a pass reached of the tensors received from other workers: (rank, message id, gradients).
Outgoing = list[tuple[int, int, list[Any]]]

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
    ``engine._pass_from_sends``), and the engine checks each one's shape against its start; the
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


def run(
    ctx: _context.DistAutogradContext,
    starts: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    root: bool = False,
    reply: tuple[int, list[tuple[int, list[Any]]]] | None = None,
) -> Outgoing:
    """Backward from ``starts`` with ``grads`` on this worker, the leaves' gradients added to
    ``ctx``; returns what it reached of the tensors received from other workers, for the
    engine to send. ``root``: the pass ``backward()`` started here, which runs the leaves'
    AccumulateGrad nodes (see the module docstring). ``reply``: (rank, list) of a pass
    serving that rank's gradient call: gradients for its sends go into the list, for the
    answer, instead of into the returned list."""
    inputs = _discover(starts)
    if not inputs:
        return []
    prev = (getattr(pass_tls, "outgoing", None), getattr(pass_tls, "reply", None))
    outgoing: Outgoing = []
    pass_tls.outgoing, pass_tls.reply = outgoing, reply
    prev_ctx = _context.set_current(ctx.context_id)
    try:
        if root and any(not is_anchor(t) for t in inputs):
            results = _accumulate_pass(starts, grads, inputs)
        else:
            results = list(_run_pass(starts, grads, inputs, accumulate=False))
    finally:
        pass_tls.outgoing, pass_tls.reply = prev
        _context.set_current(prev_ctx)
    for leaf, g in zip(inputs, results, strict=True):
        if g is not None and not is_anchor(leaf):
            ctx.accumulate(leaf, g)
    ctx.backward_passes += 1
    return outgoing
