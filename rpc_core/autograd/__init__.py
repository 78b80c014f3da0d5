"""Distributed autograd (``torch.distributed.autograd`` API).

    import rpc_core.autograd as dist_autograd
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("ps", forward, args=(x,)).sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)   # {tensor: grad} on this worker
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Optional, Any, Dict, Iterator, List

import torch

from .. import agent as _agent_mod
from .. import api as _api
from ..futures import settle
from ..functions import async_execution
from . import context as _context
from .context import DistAutogradContext
from .engine import backward
from .recording import AutogradMiddleware

__all__ = ["backward", "context", "get_gradients", "is_available", "DistAutogradContext"]

_cleanups: List[torch.futures.Future] = []  # cleanup RPCs this worker sent, not yet known done
_cleanups_lock = threading.Lock()
_MAX_DEFERRED = 16  # deferred releases per worker before they go out as a cleanup RPC
# How long a deferred release waits for a request to ride on before it goes out as a
# cleanup RPC of its own: a training loop's next request comes within milliseconds, and an
# idle worker should hold no context for long (torch's cleanup goes out at once).
_FLUSH_AFTER = 0.1
_flush_armed = False  # a check of stale deferred releases is scheduled (guarded by deferred_lock)


def is_available() -> bool:
    return True


def _install(agent: _agent_mod.Agent) -> None:
    global _flush_armed
    _context.init(agent.me.id)
    _flush_armed = False
    agent.middleware.append(AutogradMiddleware())


_api.init_hooks.append(_install)
_api.pre_shutdown_hooks.append(lambda: _flush())


@contextlib.contextmanager
def context() -> Iterator[int]:
    """A distributed autograd context; yields its id. Leaving it releases the context here
    and on every worker it touched."""
    _agent_mod.current_agent()
    ctx = _context.new_context()
    try:
        yield ctx.context_id
    finally:
        _context.set_current(None)
        _release_context(ctx.context_id, defer=True)


def get_gradients(context_id: int) -> Dict[torch.Tensor, torch.Tensor]:
    ctx = _context.retrieve(context_id)
    with ctx.lock:
        return dict(ctx.grads)


def _release_context(context_id: int, skip: int = -1, defer: bool = False) -> List[torch.futures.Future]:
    """Release the context here and tell the workers it touched (except ``skip``, who told
    us); returns the futures of those cleanup calls. Each receiver does the same with the
    workers *it* touched and answers only when they have answered, so waiting for these
    futures waits for the whole cleanup. With ``defer`` the news waits for the next request
    to each worker (see ``context.deferred``). A context with requests still running here
    goes when the last of them is answered (see ``context.release``); its news then too."""
    ctx = _context.release(context_id, skip)
    if ctx is None:
        return []
    return _announce(ctx, skip, defer)


def _announce(ctx: DistAutogradContext, skip: int, defer: bool) -> List[torch.futures.Future]:
    """Tell the workers ``ctx`` touched (except ``skip``) that it was released here."""
    agent = _agent_mod._agent
    if agent is None or agent._closing:
        return []
    context_id = ctx.context_id
    targets = ctx.known_workers - {agent.me.id, skip}
    if defer:
        full = []
        now = time.monotonic()
        arm = False
        global _flush_armed
        with _context.deferred_lock:
            for w in targets:
                ids = _context.deferred.setdefault(w, [])
                if not ids:
                    _context.deferred_since[w] = now
                ids.append(context_id)
                if len(ids) >= _MAX_DEFERRED:
                    full.append(w)
            if targets and not _flush_armed:
                _flush_armed = arm = True
        for w in full:
            _flush(w)
        if arm:
            agent.call_later(now + _FLUSH_AFTER, _flush_stale)
        return []
    return _send_cleanup({w: [context_id] for w in targets})


def _flush_stale() -> None:
    """On the agent's timer: send the deferred releases that no request carried within
    ``_FLUSH_AFTER``, and check again for the younger ones."""
    global _flush_armed
    agent = _agent_mod._agent
    now = time.monotonic()
    with _context.deferred_lock:
        stale = {w: _context.deferred.pop(w) for w, since in list(_context.deferred_since.items())
                 if now - since >= _FLUSH_AFTER and w in _context.deferred}
        for w in stale:
            del _context.deferred_since[w]
        nxt = min(_context.deferred_since.values(), default=None)
        _flush_armed = nxt is not None and agent is not None
    if agent is None:
        return
    if stale:
        agent.pool.submit(_send_cleanup, stale)  # the timer thread never sends
    if nxt is not None:
        agent.call_later(nxt + _FLUSH_AFTER, _flush_stale)


def _send_cleanup(per_worker: Dict[int, List[int]]) -> List[torch.futures.Future]:
    agent = _agent_mod._agent
    if agent is None or agent._closing:
        return []
    futs = []
    for w, ids in per_worker.items():
        try:
            futs.append(agent.send_request(w, _on_cleanup, (ids, agent.me.id), {}, timeout=0))
        except Exception:
            pass  # a dead worker has nothing left to clean
    if futs:
        with _cleanups_lock:
            _cleanups[:] = [f for f in _cleanups if not f.done()] + futs
    return futs


def _flush(worker: Optional[int] = None) -> None:
    with _context.deferred_lock:
        if worker is None:
            pending = dict(_context.deferred)
            _context.deferred.clear()
            _context.deferred_since.clear()
        else:
            pending = {worker: _context.deferred.pop(worker, [])}
            _context.deferred_since.pop(worker, None)
    _send_cleanup({w: ids for w, ids in pending.items() if ids})


def _release_many(context_ids: List[int], sender: int) -> List[torch.futures.Future]:
    futs: List[torch.futures.Future] = []
    for cid in context_ids:
        futs += _release_context(cid, skip=sender)
    return futs


def _release_on_arrival(context_ids: List[int], sender: int) -> None:
    """Releases that rode on a request from ``sender``, on the thread that read it: the
    contexts go here at once (or once their running requests are answered), and the news
    goes on to the workers they touched from a pool thread, so the reading loop never
    waits on a send or a dial."""
    ctxs = [c for c in (_context.release(cid, sender) for cid in context_ids) if c is not None]
    agent = _agent_mod._agent
    if ctxs and agent is not None and any(c.known_workers - {agent.me.id, sender} for c in ctxs):
        agent.pool.submit(lambda: [_announce(c, sender, False) for c in ctxs])


def _released_after_requests(ctx: DistAutogradContext) -> None:
    """The last request of a context whose release waited for it was answered."""
    agent = _agent_mod._agent
    skip = ctx.release_from if ctx.release_from is not None else -1
    if agent is not None and ctx.known_workers - {agent.me.id, skip}:
        agent.pool.submit(_announce, ctx, skip, False)


@async_execution
def _on_cleanup(context_ids: List[int], sender: int) -> torch.futures.Future:
    futs = _release_many(context_ids, sender)
    done: torch.futures.Future = torch.futures.Future()
    if not futs:
        done.set_result(None)
        return done
    # Errors (a dead worker) do not matter: there is nothing left to clean there.
    torch.futures.collect_all(futs).add_done_callback(lambda _: done.set_result(None))
    return done


def _wait_cleanups() -> None:
    """Wait until the cleanup messages this worker sent were handled, including the ones
    their receivers passed on to the workers they touched (for tests)."""
    _flush()
    with _cleanups_lock:
        futs = list(_cleanups)
    settle(futs)  # a dead worker has nothing left to clean


def _current_context() -> DistAutogradContext:
    cid = _context.current_id()
    if cid is None:
        raise RuntimeError("Current thread doesn't have a valid autograd context. Please wrap your code using "
                           "`with rpc_core.autograd.context() as context_id` to generate a valid context")
    return _context.retrieve(cid)


def _retrieve_context(context_id: int) -> DistAutogradContext:
    return _context.retrieve(context_id)


def _is_valid_context(context_id: int) -> None:
    _context.retrieve(context_id)


def _get_max_id() -> int:
    return _context.max_id()


def _get_debug_info() -> Dict[str, Any]:
    return {"num_autograd_contexts": _context.count()}


def _rref_backward(rref: Any, context_id: int, retain_graph: bool) -> None:
    """RRef.backward: run backward from the RRef's value (on its owner)."""
    if context_id == -1:
        if not rref.is_owner():
            raise RuntimeError("User RRefs require 'dist_autograd_ctx_id' to be specified")
        value = rref.local_value()
        if not isinstance(value, torch.Tensor):
            raise RuntimeError("RRef should contain a tensor for .backward()")
        value.backward(retain_graph=retain_graph)
        return
    if rref.is_owner():
        value = rref.local_value()
        if not isinstance(value, torch.Tensor):
            raise RuntimeError("RRef should contain a tensor for .backward()")
        backward(context_id, [value], retain_graph)
        return
    _api.rpc_sync(rref.owner(), _rref_backward_on_owner, args=(rref, context_id, retain_graph))


def _rref_backward_on_owner(rref: Any, context_id: int, retain_graph: bool) -> None:
    _rref_backward(rref, context_id, retain_graph)
