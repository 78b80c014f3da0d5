"""Distributed autograd contexts: ids, per-worker state, the thread's current context.

A context id is 64 bits: the creating worker's id in the high 16, a counter in the low 48,
so ids are unique across the world without coordination. Every worker a context touches
holds a ``DistAutogradContext`` with the same id; it records the sends (tensors this worker
sent that need gradients back), the recvs, the workers it talked to (for cleanup), and the
gradients accumulated here in this context.

A release never pulls a context from under a request that uses it. Requests of a context
are counted from the moment they arrive (``admit``, in arrival order) until they are
answered (``leave``); a release that finds requests counted marks the context and takes
effect when the last of them is answered. A caller that leaves a context while a request
of it still runs (sent with ``rpc_async`` and not waited for) and then sends another
request to the same worker relies on that: its release rides on the second request,
which may be read while the first still runs or before its thread has even started.

Released ids are remembered (a bounded FIFO of tombstones): a message of a context that
arrives after the context was released here (the late answer of an RPC nobody waited
for, or a request overtaken by the cleanup) must not bring it back, or it would never be
released again. Such messages are treated as outside any context (``is_released``), so
they do not pass the dead id on to workers that never heard of it either.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from typing import Any, NamedTuple

import torch

from ..errors import RpcError

_ID_BITS = 48
_tls = threading.local()
_lock = threading.Lock()
_contexts: dict[int, DistAutogradContext] = {}
_counter = itertools.count(0)
_msg_counter = itertools.count(0)
_worker_id = 0
# Releases not yet told to a worker: they ride on the next request to it ("rel" extras),
# which saves a cleanup RPC per worker per training step. Flushed as an explicit cleanup
# when too many pile up, when no request came for them within a short time, by
# _wait_cleanups, and before shutdown. ``deferred_since``: when each worker's list began.
deferred: dict[int, list[int]] = {}
deferred_since: dict[int, float] = {}
deferred_lock = threading.Lock()


def take_deferred(worker: int) -> list[int]:
    """The releases waiting for the next request to ``worker`` (the caller attaches them)."""
    with deferred_lock:
        deferred_since.pop(worker, None)
        return deferred.pop(worker, [])


_released: OrderedDict[int, None] = OrderedDict()  # tombstones of released ids
_MAX_TOMBSTONES = 1 << 16


class RecvInfo(NamedTuple):
    """What a received tensors' ``_Recv`` node needs to ship their gradients back (local, never sent)."""

    context_id: int
    sender: int  # rank that sent the tensors
    msg_id: int  # autograd message id of the send


class DistAutogradContext:
    def __init__(self, context_id: int) -> None:
        self.context_id = context_id
        self.lock = threading.Lock()
        self.grads: dict[torch.Tensor, torch.Tensor] = {}
        self.sends: dict[int, list[torch.Tensor]] = {}  # autograd message id -> tensors sent
        self.recvs: dict[int, Any] = {}  # autograd message id -> recv node
        self.known_workers: set[int] = set()
        self.backward_passes = 0
        # Requests of this context admitted here and not yet answered (guarded by _lock).
        self.active = 0
        # Released while requests were active: the worker that asked (or -1), to skip when
        # the release is passed on once the last of them is answered.
        self.release_from: int | None = None
        self.send_dst: dict[int, int] = {}  # autograd message id -> the rank it was sent to
        # Hooks in the backward (``rpc_core.autograd.hooks``, an rpc_core extension): the
        # payloads by hook key (None: the context runs no hooks); gradient calls of the context
        # being served here; whether a caller said its last call came; whether the hooks ran
        # here; the workers this worker called -> whether its last call there was its last;
        # the hooks' results gathered here, by worker rank (they go up with the next answer).
        self.info: dict[str, Any] | None = None
        self.grad_calls = 0
        self.final_seen = False
        self.hooks_ran = False
        self.called: dict[int, bool] = {}
        self.results: dict[int, dict[str, Any]] = {}
        self.graph_dropped = False  # drop_graph ran: the sends and recvs are gone

    # Names used by torch's tests.
    def _context_id(self) -> int:
        return self.context_id

    def _send_functions(self) -> dict[int, list[torch.Tensor]]:
        return dict(self.sends)

    def _recv_functions(self) -> dict[int, Any]:
        return dict(self.recvs)

    def _known_worker_ids(self) -> set[int]:
        return set(self.known_workers)

    def drop_graph(self) -> None:
        """Forget this worker's part of the context's graph (the tensors it sent, with the
        activations their graph saved, and the recv nodes), keeping the gradients and the
        bookkeeping of its release. For a worker whose backward hooks ran: no later gradient
        call of the context may reach it (``engine._on_backward`` refuses them), so the graph
        is dead here and its saved tensors need not wait for the release."""
        with self.lock:
            self.sends = {}
            self.recvs = {}
            self.graph_dropped = True

    def take_gradients(self) -> dict[torch.Tensor, torch.Tensor]:
        """The gradients accumulated here, which the context forgets: the caller owns them."""
        with self.lock:
            out, self.grads = self.grads, {}
        return out

    def accumulate(self, leaf: torch.Tensor, grad: torch.Tensor, shared: bool = False) -> None:
        """Add ``grad`` to ``leaf``'s gradient here. The first one is kept as it is (no copy)
        when nothing else holds it (``shared``: the pass gave the same tensor to another
        leaf) and its layout is the one ``leaf.grad`` would have; else a copy is kept, so
        a later in-place accumulation never writes into a tensor someone else sees, as
        torch's AccumulateGrad decides."""
        with self.lock:
            old = self.grads.get(leaf)
            if old is not None:
                self.grads[leaf] = old + grad
            elif not shared and _obeys_layout(leaf, grad):
                self.grads[leaf] = grad.detach()
            else:
                self.grads[leaf] = _copy_like(leaf, grad)


def _obeys_layout(leaf: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether ``grad`` may be kept as ``leaf``'s gradient without a copy: dense with the
    leaf's strides (or contiguous, for a leaf that overlaps or has gaps), or sparse with
    contiguous indices and values."""
    if grad.is_sparse:
        return bool(grad._indices().is_contiguous() and grad._values().is_contiguous())
    if grad.layout != torch.strided or leaf.layout != torch.strided:
        return True
    stride = grad.stride()
    if stride == leaf.stride() and leaf.is_contiguous():
        # The common case (a parameter's gradient), decided without _dense's sort: a
        # contiguous leaf is dense, or empty (then a gradient with its strides is contiguous).
        return True
    if _dense(leaf):
        return bool(stride == leaf.stride())
    return bool(grad.is_contiguous())


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: its elements fill its storage span exactly, in some order of dims."""
    expected = 1
    for size, stride in sorted(
        ((s, st) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1), key=lambda p: p[1]
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def _copy_like(leaf: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    if grad.is_sparse:
        return grad.detach().clone()
    if grad.layout == torch.strided and leaf.layout == torch.strided and _dense(leaf):
        return torch.empty_strided(leaf.size(), leaf.stride(), dtype=grad.dtype, device=grad.device).copy_(grad)
    return grad.detach().clone(memory_format=torch.contiguous_format)


def init(worker_id: int, base: int = 0) -> None:
    """At init_rpc: ids from now on are this worker's, counted from ``base`` (a rank reused in
    a dynamic group never makes the ids of the member that held it before)."""
    global _worker_id, _counter, _msg_counter
    _worker_id = worker_id
    _counter = itertools.count(base)
    _msg_counter = itertools.count(base)
    with _lock:
        _contexts.clear()
        _released.clear()
    with deferred_lock:
        deferred.clear()
        deferred_since.clear()


def new_message_id() -> int:
    return (_worker_id << _ID_BITS) | next(_msg_counter)


def new_context() -> DistAutogradContext:
    if getattr(_tls, "context_id", None) is not None:
        raise RpcError(
            "Already have an autograd context id for this thread: distributed autograd contexts cannot "
            "be nested on one thread; leave the current `with context()` block first"
        )
    ctx = DistAutogradContext((_worker_id << _ID_BITS) | next(_counter))
    with _lock:
        _contexts[ctx.context_id] = ctx
    _tls.context_id = ctx.context_id
    return ctx


def get_or_create(context_id: int) -> DistAutogradContext:
    """The context with this id, created if new here; for an id already released here, a
    throwaway context that is not registered (so late messages cannot resurrect it)."""
    with _lock:
        ctx = _contexts.get(context_id)
        if ctx is None:
            ctx = DistAutogradContext(context_id)
            if context_id not in _released:
                _contexts[context_id] = ctx
        return ctx


def retrieve(context_id: int) -> DistAutogradContext:
    with _lock:
        ctx = _contexts.get(context_id)
    if ctx is None:
        raise RpcError(
            f"Could not find autograd context with id: {context_id}. It was released (its `with "
            "context()` block ended) or never existed on this worker."
        )
    return ctx


def is_valid(context_id: int) -> bool:
    with _lock:
        return context_id in _contexts


def is_released(context_id: int) -> bool:
    """Whether this id was released here and is gone (messages of it are then treated as
    context-free). A context whose release waits for its active requests is not."""
    return context_id in _released and context_id not in _contexts


def admit(context_id: int) -> DistAutogradContext | None:
    """The context of a request that just arrived (created if new here), counted as in use
    until ``leave``; None if the id was released here already."""
    with _lock:
        ctx = _contexts.get(context_id)
        if ctx is None:
            if context_id in _released:
                return None
            ctx = _contexts[context_id] = DistAutogradContext(context_id)
        ctx.active += 1
        return ctx


def leave(ctx: DistAutogradContext) -> bool:
    """A request admitted into ``ctx`` was answered. True if that completes a release that
    waited for it: the context is gone here, and the caller passes the release on (to the
    workers it touched but ``ctx.release_from``)."""
    with _lock:
        ctx.active -= 1
        if ctx.active or ctx.release_from is None:
            return False
        _contexts.pop(ctx.context_id, None)
        return True


def release(context_id: int, sender: int = -1) -> DistAutogradContext | None:
    """Tombstone the id and forget the context; returns it, for the caller to pass the
    release on. None if it is not here, or if requests of it are still active: then it goes
    when the last of them is answered (``leave``), and ``sender`` is remembered for that."""
    with _lock:
        _released[context_id] = None
        if len(_released) > _MAX_TOMBSTONES:
            _released.popitem(last=False)
        ctx = _contexts.get(context_id)
        if ctx is None or ctx.release_from is not None:
            return None
        if ctx.active:
            ctx.release_from = sender
            return None
        del _contexts[context_id]
        return ctx


def current_id() -> int | None:
    return getattr(_tls, "context_id", None)


def set_current(context_id: int | None) -> int | None:
    prev = getattr(_tls, "context_id", None)
    _tls.context_id = context_id
    return prev


def count() -> int:
    with _lock:
        return len(_contexts)


def max_id() -> int:
    return ((1 << _ID_BITS) - 1) + (_worker_id << _ID_BITS)
