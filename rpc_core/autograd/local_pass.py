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
from collections import Counter
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
_running = [0]  # passes in run() now, for the debug counters
_running_lock = threading.Lock()
_accumulating = threading.Lock()  # root passes that run AccumulateGrad take turns with .grad

# What torch.autograd.grad and .backward call once they have checked their arguments (None
# in a torch without it: then the public functions).
_engine_run_backward: Callable[..., tuple[torch.Tensor | None, ...]] | None = getattr(
    torch.autograd.graph, "_engine_run_backward", None
)


def is_anchor(t: torch.Tensor) -> bool:
    return t is ANCHOR


def _discover(starts: Sequence[torch.Tensor], accumulators: dict[int, Any] | None = None) -> list[torch.Tensor]:
    """Leaves (including recv anchors) reachable from ``starts``: the inputs of the pass.
    ``accumulators``, when given, gets each leaf's AccumulateGrad node by ``id(leaf)``."""
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
            if accumulators is not None:
                accumulators[id(var)] = node
            if id(var) not in seen:
                seen.add(id(var))
                leaves.append(var)
            continue
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                stack.append(nxt)
    return leaves


def _accumulate_pass(
    starts: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    inputs: list[torch.Tensor],
    accumulators: dict[int, Any],
) -> tuple[list[torch.Tensor | None], list[bool]]:
    """The leaves' gradients, through their AccumulateGrad nodes (so the hooks after those
    run: DDP's), read back from ``.grad``, which is then restored; and for each, whether it
    is a tensor the pass handed to another leaf too. torch's AccumulateGrad keeps the last
    of such a shared tensor as the leaf's ``.grad`` (the others let go of it first), where
    distributed autograd, which holds every gradient of the pass until the end, copies it:
    what each node received tells which ``.grad`` is such a tensor."""
    received: dict[int, int] = {}  # id(leaf) -> storage of the gradient its AccumulateGrad received

    def note(key: int) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            if grad_outputs and grad_outputs[0] is not None:
                received[key] = _storage(grad_outputs[0])

        return hook

    with _accumulating:
        saved = [t.grad for t in inputs]
        handles = [accumulators[id(t)].register_prehook(note(id(t))) for t in inputs if id(t) in accumulators]
        for t in inputs:
            t.grad = None
        try:
            _run_pass(starts, grads, inputs, accumulate=True)
            # A DDP gradient may be a view of its bucket (gradient_as_bucket_view=True),
            # which the next backward overwrites: the context keeps its own copy.
            out = [None if t.grad is None else t.grad.clone() if t.grad._base is not None else t.grad for t in inputs]
        finally:
            for handle in handles:
                handle.remove()
            for t, g in zip(inputs, saved, strict=True):
                t.grad = g
    counts = Counter(received.values())
    shared = [
        g is not None and counts[received.get(id(t), -1)] > 1 and _storage(g) == received[id(t)]
        for t, g in zip(inputs, out, strict=True)
    ]
    return out, shared


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


def _shared(results: Sequence[torch.Tensor | None]) -> list[bool]:
    """For each gradient, whether the pass handed its storage to another leaf too."""
    ptrs = [None if g is None else _storage(g) for g in results]
    found = [p for p in ptrs if p is not None]
    if len(set(found)) == len(found):  # the usual case: no gradient is shared, no Counter needed
        return [False] * len(ptrs)
    counts = Counter(found)
    return [p is not None and counts[p] > 1 for p in ptrs]


def _storage(grad: torch.Tensor) -> int:
    return int(grad._values().data_ptr() if grad.is_sparse else grad.data_ptr())


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
    accumulators: dict[int, Any] = {}
    inputs = _discover(starts, accumulators)
    if not inputs:
        return []
    with _running_lock:
        _running[0] += 1
    try:
        return _run(ctx, starts, grads, inputs, accumulators, root, reply)
    finally:
        with _running_lock:
            _running[0] -= 1


def running() -> int:
    """Backward passes running on this worker now (torch's ``num_current_backward_passes``)."""
    return _running[0]


def _run(
    ctx: _context.DistAutogradContext,
    starts: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    inputs: list[torch.Tensor],
    accumulators: dict[int, Any],
    root: bool,
    reply: tuple[int, list[tuple[int, list[Any]]]] | None,
) -> Outgoing:
    prev = (getattr(pass_tls, "outgoing", None), getattr(pass_tls, "reply", None))
    outgoing: Outgoing = []
    pass_tls.outgoing, pass_tls.reply = outgoing, reply
    prev_ctx = _context.set_current(ctx.context_id)
    try:
        if root and any(not is_anchor(t) for t in inputs):
            results, shared = _accumulate_pass(starts, grads, inputs, accumulators)
        else:
            results = list(_run_pass(starts, grads, inputs, accumulate=False))
            # A tensor the pass handed to two leaves (a backward that returned one grad for
            # both) is copied for each, so neither's later accumulation writes into the other's.
            shared = _shared(results)
    finally:
        pass_tls.outgoing, pass_tls.reply = prev
        _context.set_current(prev_ctx)
    for leaf, g, g_shared in zip(inputs, results, shared, strict=True):
        if g is not None and not is_anchor(leaf):
            ctx.accumulate(leaf, g, shared=g_shared)
    ctx.backward_passes += 1
    return outgoing
