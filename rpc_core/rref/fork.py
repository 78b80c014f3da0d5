"""How RRefs travel: forks made by pickling, and the agent plug-ins of the protocol.

Sending an RRef forks it: the pickled form carries a fresh fork id and its parent. An owner
registers the fork before sending (owner forks are born confirmed). A user keeps the
parent alive (``pending_children``) until the child is confirmed; the receiving user asks
the owner to register the fork (``_on_fork``), then tells the parent (``_on_child_accept``).
An owner that receives its own RRef needs no registration and tells the parent at once;
when the RRef came in a request, that news rides on the response (``racc``) instead of a
message of its own. A function that receives RRefs runs only after all its forks are
confirmed. So a fork is always registered before its parent can be deleted.
"""

from __future__ import annotations

from typing import Any

import torch

from ..agent import agent as _agent_mod
from ..agent.worlds import WorkerInfo
from ..protocol import allowlist, wire
from ..protocol.serialization import defer_until, note_for_reply, register_reducer
from .handle import RRef
from .release import start_release_thread, track
from .state import (
    Id,
    _ctx,
    _on_child_accept,
    _on_fork,
    _on_user_deletes,
    forget_owner,
    new_id,
    start_ids,
    store_creation_error,
)


def _reduce(rref: RRef[Any]) -> tuple[Any, tuple[Any, ...]]:
    rref._check_alive("fork")
    me = _agent_mod.current_agent().me.id
    fork_id = new_id()
    if rref.is_owner():
        with _ctx.lock:
            _ctx.entry(rref._rref_id).forks.add(fork_id)  # owner forks are born confirmed
    else:
        with _ctx.lock:
            _ctx.pending_children[fork_id] = rref  # G2: keep the parent until the child is confirmed
    return _from_fork, (rref._owner_id, rref._rref_id, fork_id, me)


register_reducer(RRef, _reduce)


def _from_fork(owner: int, rref_id: Id, fork_id: Id, parent: int) -> RRef[Any]:
    agent = _agent_mod.current_agent()
    me = agent.me.id
    if owner == me:
        if parent == me:
            with _ctx.lock:
                _ctx.entry(rref_id).forks.discard(fork_id)  # our own fork came back: no user exists
        elif not note_for_reply(wire.EXTRA_RREF_ACCEPTED, fork_id):  # a request: the parent learns it from the response
            track(agent.send_request(parent, _on_child_accept, (fork_id,), {}, timeout=0))
        return RRef._owner_handle(rref_id)
    if parent == owner:
        return RRef._user(owner, rref_id, fork_id, True)
    rref = RRef._user(owner, rref_id, fork_id, False)
    with _ctx.lock:
        _ctx.unconfirmed.add(fork_id)
    confirmed = agent.send_request(owner, _on_fork, (rref_id, fork_id), {}, timeout=0)

    def on_confirmed(f: torch.futures.Future[Any]) -> None:
        rref._confirmed = True
        with _ctx.lock:
            _ctx.unconfirmed.discard(fork_id)
        track(agent.send_request(parent, _on_child_accept, (fork_id,), {}, timeout=0))

    done = confirmed.then(on_confirmed)
    defer_until(done)  # the receiving user function waits for this
    return rref


allowlist.internal(_from_fork)  # what a sent RRef rebuilds through (serializer='safe')


def on_request_failed(extras: dict[str, Any], error: BaseException) -> None:
    """The agent could not unpickle a request; if it was a remote() creation, store the
    error as the RRef's value so to_here() raises it instead of waiting forever. Deletes
    it carried still apply."""
    pile = extras.get(wire.EXTRA_RREF_DELETES)
    if pile:
        _on_user_deletes(pile)
    rref_id = extras.get(wire.EXTRA_RREF_CREATE)
    if rref_id is not None:
        store_creation_error(tuple(rref_id), error)


class RRefMiddleware(_agent_mod.Middleware):
    """Carries waiting deletes to their owner on the next request there, and applies the
    deletes a request carries when it arrives."""

    def outgoing(
        self, dst: int, tensors: list[torch.Tensor], extras: dict[str, Any], request_extras: dict[str, Any] | None
    ) -> None:
        if request_extras is None and (_ctx.deletes or _ctx.collected):
            pile = _ctx.take_deletes(dst)
            if pile:
                extras[wire.EXTRA_RREF_DELETES] = pile

    def enter_call(self, src: int, extras: dict[str, Any]) -> Any:
        pile = extras.get(wire.EXTRA_RREF_DELETES)
        if pile:
            _on_user_deletes(pile)

    def on_response(self, extras: dict[str, Any] | None, call_extras: dict[str, Any]) -> None:
        accepted = extras.get(wire.EXTRA_RREF_ACCEPTED) if extras else None
        if accepted:
            for fork_id in accepted:
                _on_child_accept(tuple(fork_id))


def _release_departed_owner(info: WorkerInfo, joined: bool) -> None:
    """A membership listener: the user RRefs of a member that left are released here."""
    agent = _agent_mod.current_agent_or_none()
    if not joined and agent is not None:
        forget_owner(info.id, agent.roster.generations.get(info.id, 0))


def install(agent: _agent_mod.Agent) -> None:
    """At init_rpc, before the agent starts: the release loop and the protocol's plug-ins."""
    start_release_thread()
    start_ids(agent.roster.id_base)
    agent.request_failed_hooks.append(on_request_failed)
    agent.roster.on_membership.append(_release_departed_owner)
    agent.middleware.append(RRefMiddleware())
