"""The release loop: garbage-collected RRef handles become delete messages to their owners.

A user RRef that is garbage collected is deleted on its owner (after its creation was
confirmed). Deletes ride along with the next request to that owner (``rdel`` in the frame
head, applied by ``fork.RRefMiddleware``), so a loop that creates and drops RRefs costs
no message for them; deletes still waiting after ``_DELETE_DELAY`` go in one
``_on_user_deletes`` call per owner. ``delete_all_user_rrefs`` deletes every live user RRef
at shutdown, and ``flush`` lets tests wait until owners have applied every delete.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..agent import agent as _agent_mod
from ..agent.futures import settle
from ..errors import RpcError
from .state import Collected, Id, _ctx, _on_user_delete, _on_user_deletes

# How long a delete may wait for a request to ride on before it is sent on its own, and how
# many may pile up for one owner.
_DELETE_DELAY = 0.005
_DELETE_BATCH = 256

# Kinds of release-queue items.
POKE = "poke"  # wake a loop that sleeps without a deadline: something was collected
BARRIER = "barrier"  # flush(): send what waits, then complete ``done``
USER = "user"  # a user handle collected before its creation was confirmed


class Release(NamedTuple):
    """An item of the release queue (``_ctx.releases``)."""

    kind: str
    owner: int = -1
    rref_id: Id | None = None
    fork_id: Id | None = None
    creation: torch.futures.Future[Any] | None = None  # USER: the delete waits for it
    done: torch.futures.Future[Any] | None = None  # BARRIER: completed once earlier items are sent


_POKE = Release(POKE)


def _release_loop() -> None:
    """Turns garbage-collected handles into protocol messages. ``__del__`` only appends to
    ``_ctx.collected`` or puts on a SimpleQueue (both safe in finalizers); the sends happen
    here, outside any lock, or on the next request to the owner."""
    seen = 0
    while True:
        # Wait without a deadline only when nothing waits to be sent and no handle was
        # collected since the last look: a loop that keeps dropping RRefs wakes this thread
        # once per _DELETE_DELAY, not once per handle.
        idle = seen == _ctx.n_collected and not (_ctx.deletes or _ctx.collected or _ctx.dropped)
        seen = _ctx.n_collected
        if idle:
            _ctx.release_asleep = True
            idle = not (_ctx.collected or _ctx.dropped)  # appended after the look above, maybe without a poke
        try:
            item: Release = _ctx.releases.get(timeout=None if idle else _DELETE_DELAY)
        except queue.Empty:
            _ctx.drop_handles()
            _send_deletes()  # nothing carried them in time
            continue
        finally:
            _ctx.release_asleep = False
        _ctx.drop_handles()  # before a barrier: flush() sees them applied
        if item.kind == POKE:
            continue
        if item.kind == BARRIER:
            _send_deletes()
            assert item.done is not None
            item.done.set_result(None)
        elif item.creation is not None and not item.creation.done():
            # Delete once the owner knows the fork. The delete is queued before the tracked
            # future completes: flush() sees the one or the other.
            track(item.creation.then(_collector(item)))
        else:
            assert item.rref_id is not None and item.fork_id is not None  # a USER item
            _send_delete(item.owner, item.rref_id, item.fork_id)


def _collector(item: Release) -> Callable[[torch.futures.Future[Any]], None]:
    """``collect`` for a USER item, as a then() callback bound to this item (not the loop's next)."""
    owner, rref_id, fork_id = item.owner, item.rref_id, item.fork_id
    assert rref_id is not None and fork_id is not None  # a USER item
    return lambda _: collect(owner, rref_id, fork_id)


def collect(owner: int, rref_id: Id, fork_id: Id) -> None:
    """Queue a delete without waking any thread (safe in finalizers): it rides on the next
    request to the owner, or the release loop sends it within _DELETE_DELAY."""
    _ctx.collected.append(Collected(owner, rref_id, fork_id))
    _ctx.n_collected += 1
    if _ctx.release_asleep:
        _ctx.releases.put(_POKE)


def drop_owner_handle(rref_id: Id) -> None:
    """A collected owner handle: dropped at once if the state's lock is free, else on the
    release loop's next look (safe in finalizers either way)."""
    lock = _ctx.lock
    # A finalizer may run while this thread holds the lock (its state half-changed: never
    # re-enter it) or while another thread does (never wait for it: that thread may wait for
    # a lock this one holds). Neither: the drop costs less here than the loop's wake-up
    # (an RRef argument unpickled on its owner makes a handle per call).
    if not lock._is_owned() and lock.acquire(blocking=False):  # type: ignore[attr-defined]
        try:
            e = _ctx.owners.get(rref_id)
            if e is not None:
                e.handles -= 1
            _ctx.maybe_free(rref_id)  # re-enters the lock this thread now holds
        finally:
            lock.release()
        return
    _ctx.dropped.append(rref_id)
    _ctx.n_collected += 1
    if _ctx.release_asleep:
        _ctx.releases.put(_POKE)


def delete_after_creation(owner: int, rref_id: Id, fork_id: Id, creation: torch.futures.Future[Any]) -> None:
    """A collected user handle whose creation is not confirmed yet: its delete must wait for it."""
    _ctx.releases.put(Release(USER, owner, rref_id, fork_id, creation))


def _send_delete(owner: int, rref_id: Id, fork_id: Id) -> None:
    with _ctx.lock:
        pile = _ctx.deletes.setdefault(owner, [])
        pile.append((rref_id, fork_id))
        full = len(pile) >= _DELETE_BATCH
    if full:
        _send_deletes(owner)


def _send_deletes(owner: int | None = None) -> None:
    """Send the waiting deletes (of ``owner``, or of all owners) as calls of their own."""
    with _ctx.lock:
        _ctx.gather()
        owners = list(_ctx.deletes) if owner is None else [owner]
        piles = [(o, _ctx.deletes.pop(o, [])) for o in owners]
        _ctx.deletes_out += sum(len(p) for _, p in piles)
    agent = _agent_mod.current_agent_or_none()
    if agent is None or agent.closing:
        return
    for o, pile in piles:
        if pile:
            try:
                track(agent.send_request(o, _on_user_deletes, (pile,), {}, timeout=0))
            except RpcError:
                pass


def track(fut: torch.futures.Future[Any]) -> None:
    """A protocol step in flight that ``flush`` (and shutdown) must wait for."""
    with _ctx.lock:
        _ctx.in_flight.append(fut)
        _ctx.in_flight = [f for f in _ctx.in_flight if not f.done()]


_release_thread: threading.Thread | None = None


def start_release_thread() -> None:
    """Start the release loop (at init_rpc). Not at import: a process forked from one that
    imported rpc_core (a forkserver preloading it) inherits the module but not the thread."""
    global _release_thread
    if _release_thread is None or not _release_thread.is_alive():
        _release_thread = threading.Thread(target=_release_loop, name="rref-release", daemon=True)
        _release_thread.start()


def delete_all_user_rrefs(timeout: float) -> None:
    """Shutdown: tell owners that every live user RRef is gone, and wait for them to hear it."""
    agent = _agent_mod.current_agent()
    _send_deletes()
    futs: list[torch.futures.Future[Any]] = []
    for fork_id, rref in list(_ctx.users.items()):
        if rref._deleted:
            continue
        rref._deleted = True
        try:
            futs.append(
                agent.send_request(rref._owner_id, _on_user_delete, (rref._rref_id, fork_id), {}, timeout=timeout)
            )
        except RpcError:
            pass
    with _ctx.lock:
        futs += _ctx.in_flight
        _ctx.in_flight = []
        _ctx.pending_children.clear()
    settle(futs)  # errors (a dead owner) leave nothing to delete


def flush() -> int:
    """Send the deletes of handles already garbage collected and wait until owners applied
    them and parents heard their children's accepts (tests use this to check owner tables
    return to empty without sleeping). Repeats until no protocol step is in flight, since
    completing one (a creation, a child accept) can release more handles.

    Returns how many deletes and protocol steps it sent or waited for: 0 means this worker
    had nothing left. An owner that applies a delete may free a value holding further
    RRefs, whose deletes then start on *that* worker: callers settling a whole group repeat
    a flush on every worker until all of them return 0."""
    work = 0
    while True:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        _ctx.releases.put(Release(BARRIER, done=fut))  # processed in order after earlier releases
        fut.wait()
        with _ctx.lock:
            pending = _ctx.in_flight = [f for f in _ctx.in_flight if not f.done()]
            # Deletes sent since the last flush, also those that rode on other requests.
            work += _ctx.deletes_out - _ctx.deletes_seen
            _ctx.deletes_seen = _ctx.deletes_out
            # A creation confirmed after the barrier queued its delete just now: send it.
            unsent = bool(_ctx.collected or _ctx.deletes)
        if not pending and not unsent:
            return work
        work += len(pending)
        settle(pending)
