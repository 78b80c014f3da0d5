"""Releasing distributed autograd contexts on every worker they touched.

Leaving a ``with context()`` block releases the context here and tells the workers it
touched. That news waits for the next request to each worker (``context.deferred``, sent as
``wire.EXTRA_RELEASED_CONTEXTS`` by the recording middleware), which saves a cleanup RPC per
worker per training step; it goes as a cleanup RPC of its own (``_on_cleanup``) when too
many pile up, when no request came for it within ``_FLUSH_AFTER``, from ``wait_cleanups``,
and before shutdown. A receiver passes the release on to the workers *it* touched, and
answers a cleanup only once they have answered.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from ..agent import agent as _agent_mod
from ..agent.early_exit import torch_collect_all
from ..agent.futures import settle
from ..functions import async_execution
from ..protocol import allowlist
from . import context as _context
from .context import DistAutogradContext

_cleanups: list[torch.futures.Future[Any]] = []  # cleanup RPCs this worker sent, not yet known done
_cleanups_lock = threading.Lock()
_MAX_DEFERRED = 16  # deferred releases per worker before they go out as a cleanup RPC
# How long a deferred release waits for a request to ride on before it goes out as a
# cleanup RPC of its own: a training loop's next request comes within milliseconds, and an
# idle worker should hold no context for long (torch's cleanup goes out at once).
_FLUSH_AFTER = 0.1
_flush_armed = False  # a check of stale deferred releases is scheduled (guarded by deferred_lock)


def reset() -> None:
    """At init_rpc: no check of stale releases is scheduled on the new agent."""
    global _flush_armed
    _flush_armed = False


def release_context(context_id: int, skip: int = -1, defer: bool = False) -> list[torch.futures.Future[Any]]:
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


def _announce(ctx: DistAutogradContext, skip: int, defer: bool) -> list[torch.futures.Future[Any]]:
    """Tell the workers ``ctx`` touched (except ``skip``) that it was released here."""
    agent = _agent_mod.current_agent_or_none()
    if agent is None or agent.closing:
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
            flush(w)
        if arm:
            agent.call_later(now + _FLUSH_AFTER, _flush_stale)
        return []
    return _send_cleanup({w: [context_id] for w in targets})


def _flush_stale() -> None:
    """On the agent's timer: send the deferred releases that no request carried within
    ``_FLUSH_AFTER``, and check again for the younger ones."""
    global _flush_armed
    agent = _agent_mod.current_agent_or_none()
    now = time.monotonic()
    with _context.deferred_lock:
        stale = {
            w: _context.deferred.pop(w)
            for w, since in list(_context.deferred_since.items())
            if now - since >= _FLUSH_AFTER and w in _context.deferred
        }
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


def _send_cleanup(per_worker: dict[int, list[int]]) -> list[torch.futures.Future[Any]]:
    agent = _agent_mod.current_agent_or_none()
    if agent is None or agent.closing:
        return []
    futs: list[torch.futures.Future[Any]] = []
    for w, ids in per_worker.items():
        try:
            futs.append(agent.send_request(w, _on_cleanup, (ids, agent.me.id), {}, timeout=0))
        except Exception:  # noqa: BLE001 - best effort: one worker not told must not stop the rest
            pass  # a dead worker has nothing left to clean
    if futs:
        with _cleanups_lock:
            _cleanups[:] = [f for f in _cleanups if not f.done()] + futs
    return futs


def flush(worker: int | None = None) -> None:
    """Send the deferred releases (for ``worker``, or for all) as cleanup RPCs now."""
    with _context.deferred_lock:
        if worker is None:
            pending = dict(_context.deferred)
            _context.deferred.clear()
            _context.deferred_since.clear()
        else:
            pending = {worker: _context.deferred.pop(worker, [])}
            _context.deferred_since.pop(worker, None)
    _send_cleanup({w: ids for w, ids in pending.items() if ids})


def _release_many(context_ids: list[int], sender: int) -> list[torch.futures.Future[Any]]:
    futs: list[torch.futures.Future[Any]] = []
    for cid in context_ids:
        futs += release_context(cid, skip=sender)
    return futs


def release_on_arrival(context_ids: list[int], sender: int) -> list[DistAutogradContext]:
    """Releases that rode on a request from ``sender``, on the thread that read it: the
    contexts go here at once (or once their running requests are answered), and the news
    goes on to the workers they touched from a pool thread, so the reading loop never
    waits on a send or a dial. Returns the contexts released: the caller decides when their
    memory goes (freeing a step's graph and gradients takes tens of µs)."""
    ctxs = [c for c in (_context.release(cid, sender) for cid in context_ids) if c is not None]
    _announce_later(ctxs, sender)
    return ctxs


def released_after_requests(ctx: DistAutogradContext) -> None:
    """The last request of a context whose release waited for it was answered (called just
    before that answer is sent)."""
    _announce_later([ctx], ctx.release_from if ctx.release_from is not None else -1)


def _announce_later(ctxs: list[DistAutogradContext], skip: int) -> None:
    """Pass the releases of ``ctxs`` on from a pool thread. They count as this worker's
    cleanups from now on, so a ``wait_cleanups`` here that comes after (e.g. once the answer
    this runs before was read) waits for them too."""
    agent = _agent_mod.current_agent_or_none()
    if agent is None or not any(c.known_workers - {agent.me.id, skip} for c in ctxs):
        return
    done: torch.futures.Future[Any] = torch.futures.Future()
    with _cleanups_lock:
        _cleanups.append(done)

    def announce() -> None:
        futs: list[torch.futures.Future[Any]] = []
        try:
            for c in ctxs:
                futs += _announce(c, skip, False)
        finally:
            if futs:
                torch_collect_all(futs).add_done_callback(lambda _: done.set_result(None))
            else:
                done.set_result(None)

    agent.pool.submit(announce)


@async_execution
def _on_cleanup(context_ids: list[int], sender: int) -> torch.futures.Future[Any]:
    futs = _release_many(context_ids, sender)
    done: torch.futures.Future[Any] = torch.futures.Future()
    if not futs:
        done.set_result(None)
        return done
    # Errors (a dead worker) do not matter: there is nothing left to clean there.
    torch_collect_all(futs).add_done_callback(lambda _: done.set_result(None))
    return done


def wait_cleanups() -> None:
    """Wait until the cleanup messages this worker sent were handled, including the ones
    their receivers passed on to the workers they touched (for tests)."""
    flush()
    with _cleanups_lock:
        futs = list(_cleanups)
    settle(futs)  # a dead worker has nothing left to clean


# Contexts released by the worker that made them: called by name under serializer='safe'.
allowlist.internal(_on_cleanup)
