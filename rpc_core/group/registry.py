"""Dynamic groups (``init_rpc(..., world_size=None)``): joining and leaving a running group.

Rank 0 founds the group alone and stays its registry while it runs: the rendezvous address
(its RPC port) is where a newcomer asks to join (the same authenticated connection and
request as a static rendezvous, with ``world_size`` None), and every leave goes through it
too. The registry makes one membership change at a time (torch's store token): it checks
the newcomer's name and rank are free, tells every member (``_member_joined``, each one
answers once its roster has the newcomer), and only then answers the newcomer with the
roster, so when ``init_rpc`` returns on the newcomer, everyone can call it by name and it
can call everyone. A member's graceful ``shutdown`` answers what it accepted, then asks the
registry to remove it, which tells the others (``_member_left``); calls to it then fail with
``WorkerLeftError`` ("worker X left the group"), those already pending once the answers it
sent have arrived (``agent.departures``). A member whose connection to rank 0 drops without a leave
(it crashed, or ``shutdown(graceful=False)``) is removed the same way, with the reason, and
so is one that rank 0's heartbeats find silent (frozen, stopped, cut off: see ``heartbeats``;
rank 0 watches a member while calls to it are pending, or every member while a higher layer
asks for it with ``liveness_wanted``).

Rank 0 leaves last: its graceful shutdown waits (up to the shutdown timeout) until every
other member has left. If the timeout passes first, the others are told it left and keep
calling each other, but nobody can join any more (no worker listens at the rendezvous
address) and each later leave is told to the members directly (so too after rank 0's
``shutdown(graceful=False)``, which tells nobody: the members find it gone).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ..agent.agent import Agent, current_agent
from ..agent.worlds import WorkerInfo
from ..errors import RpcError
from ..protocol import allowlist, wire
from ..protocol.safe_decoding import loads_plain
from .rendezvous import MIXED_GROUP
from .rendezvous import _dumps as dumps
from .rendezvous import _reply as reply

log = logging.getLogger("rpc_core")


def _left(info: WorkerInfo, how: str = "") -> str:
    """The reason calls to a departed member fail with: 'worker X left the group'."""
    return f"worker {info.name!r} (rank {info.id}) left the group{how}"


class _Registry:
    """Rank 0's side: admits newcomers, removes leavers, tells the members."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.lock = threading.Lock()  # one membership change at a time
        self.changed = threading.Condition(self.lock)  # a member left (rank 0's shutdown waits for none)
        self.next_generation = 1
        self.closing = False

    def join(self, conn: Any, msg_id: int, body: bytes) -> int | None:
        """A join request on a new connection (``Connector.join_handler``): the admitted rank, or
        None once the newcomer was told why not. Runs on the connection's accepting thread."""
        agent = self.agent
        try:
            name, rank, world_size, address = loads_plain(body)
            info = WorkerInfo(name, rank)
        except Exception as e:  # noqa: BLE001 - a bad name, or not a join request at all
            reply(conn, msg_id, f"bad join request for the group of {agent.me.name!r}: {e}")
            return None
        refusal = self._refusal(info, world_size)
        if refusal is not None:
            reply(conn, msg_id, refusal)
            return None
        with self.lock:
            refusal = self._taken(info)
            if refusal is not None:
                reply(conn, msg_id, refusal)
                return None
            generation = self.next_generation
            self.next_generation += 1
            others = [r for r in agent.roster.workers if r != agent.me.id]
            agent.roster.add_member(info, tuple(address), generation)
            _tell(agent, others, _member_joined, (info.name, info.id, tuple(address), generation))
            roster = agent.roster
            members = [(w.name, w.id) for w in roster.get_worker_infos()]
            table = (members, dict(roster.addresses), dict(roster.generations))
            try:
                conn.send(wire.RESPONSE, 0, msg_id, b"", dumps(table))
            except OSError as e:  # it gave up waiting: undo
                self._remove(info.id, generation, _left(info, f" as it joined ({e})"), graceful=False)
                return None
        log.info("rpc_core %s: %s joined the group", agent.me.name, agent.roster.describe(info.id))
        return info.id

    def _refusal(self, info: WorkerInfo, world_size: Any) -> str | None:
        agent = self.agent
        if not agent.roster.dynamic and world_size is not None:
            return (
                f"the static group of {agent.me.name!r} (world_size={len(agent.roster.workers)}) has completed its "
                f"rendezvous: worker {info.name!r} (rank {info.id}) cannot join it any more"
            )
        if not agent.roster.dynamic:
            return (
                f"{MIXED_GROUP} The group of {agent.me.name!r} is static (world_size={len(agent.roster.workers)}); "
                f"worker {info.name!r} cannot join it with world_size=None"
            )
        if world_size is not None:
            return (
                f"{MIXED_GROUP} The group of {agent.me.name!r} is dynamic: worker {info.name!r} must join it with "
                f"world_size=None, not {world_size!r}"
            )
        if isinstance(info.id, bool) or info.id < 1:
            return f"worker {info.name!r} asks to join with rank {info.id}: ranks are ints >= 0, and 0 is the founder"
        return None

    def _taken(self, info: WorkerInfo) -> str | None:
        agent = self.agent
        if self.closing:
            return (
                f"worker {info.name!r} cannot join: rank 0 ({agent.me.name!r}), the group's registry, is "
                "leaving the group"
            )
        workers, by_name = agent.roster.workers, agent.roster.by_name
        if info.id in workers:
            return (
                f"rank {info.id} is not unique: worker {workers[info.id].name!r} holds it in the group, "
                f"so {info.name!r} cannot join with it; choose a free rank (members: {sorted(workers)})"
            )
        if info.name in by_name:
            return (
                f"worker name {info.name!r} is not unique: rank {by_name[info.name].id} uses it in the "
                f"group, so rank {info.id} cannot join with it; choose another name"
            )
        return None

    def leave(self, rank: int, generation: int) -> None:
        """A member asks to leave (its graceful shutdown)."""
        info = self.agent.roster.workers.get(rank)
        if info is not None:
            self._remove(rank, generation, _left(info), graceful=True)

    def lost(self, rank: int, reason: str) -> None:
        """A member's connection to us dropped without a leave (it crashed or stopped), or
        heartbeats found it silent for the heartbeat timeout (frozen, stopped, cut off)."""
        info = self.agent.roster.workers.get(rank)
        if info is None or rank == self.agent.me.id:
            return
        generation = self.agent.roster.generation(rank)
        how = f" without shutting down: {reason}"
        # Off the reader that saw the loss: telling the others waits for their answers.
        self.agent.threads.start(self._remove, "rpc-registry", rank, generation, _left(info, how), False)

    def _remove(self, rank: int, generation: int | None, reason: str, graceful: bool) -> None:
        """Remove a member, here and on every other. ``graceful``: it left by its shutdown, so
        the answers it sent before are still awaited where calls to it are pending (see
        ``agent.departures``); otherwise it is gone, and those calls fail at once."""
        agent = self.agent
        with self.lock:
            info = agent.roster.remove_member(rank, generation, reason, graceful)
            if info is not None:
                others = [r for r in agent.roster.workers if r != agent.me.id]
                _tell(agent, others, _member_left, (rank, generation, reason, graceful))
            self.changed.notify_all()
        if info is not None:
            log.info("rpc_core %s: %s", agent.me.name, reason)

    def close(self, timeout: float) -> list[WorkerInfo]:
        """Rank 0's leave: wait (up to ``timeout`` s; 0: no limit) until the other members
        left, then refuse joins. Returns the members still there (told rank 0 left)."""
        agent = self.agent
        deadline = time.monotonic() + timeout if timeout > 0 else None
        with self.lock:
            while len(agent.roster.workers) > 1:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self.changed.wait(remaining)
            self.closing = True
            stayed = [w for w in agent.get_worker_infos() if w.id != agent.me.id]
        if stayed:
            reason = _left(
                agent.me,
                f" before {[w.name for w in stayed]}: it was the group's registry, "
                "so no worker can join the group any more",
            )
            me = agent.me
            _tell(agent, [w.id for w in stayed], _member_left, (me.id, agent.roster.generation(me.id), reason, True))
        return stayed


_registry: _Registry | None = None


def install(agent: Agent) -> None:
    """At init_rpc, before the agent starts. Rank 0 answers join requests: a dynamic group's
    registry admits newcomers; a static group's rank 0 refuses them with a clear error."""
    global _registry
    if agent.me.id != 0:
        return
    _registry = _Registry(agent)
    agent.connections.connector.join_handler = _registry.join
    if agent.roster.dynamic:
        agent.connections.on_peer_lost.append(_registry.lost)
        agent.heartbeats.on_peer_unreachable.append(_registry.lost)  # silent past the heartbeat timeout: gone too


def leave(agent: Agent, timeout: float) -> None:
    """A dynamic group member's graceful shutdown, once its own work is done: leave the group
    (rank 0: once every other member has). Raises RpcError if that did not happen in time."""
    me = agent.me
    if me.id == 0 and _registry is not None:
        stayed = _registry.close(timeout)
        if stayed:
            raise RpcError(
                f"rank 0 ({me.name!r}) timed out after {timeout:g} s waiting for the other members "
                f"to leave the group first: {[w.name for w in stayed]} are still in it (they were "
                "told it left; nobody can join the group any more)"
            )
        return
    generation = agent.roster.generation(me.id)
    if 0 in agent.roster.workers and 0 not in agent.roster.dead:
        fut = agent.send_request(0, _leave_request, (me.id, generation), {}, timeout=timeout, flags=wire.CONTROL)
        fut.wait()
    else:  # the registry left before us: tell the others ourselves
        others = [r for r in agent.roster.workers if r != me.id]
        _tell(agent, others, _member_left, (me.id, generation, _left(me), True), timeout)


def _tell(agent: Agent, ranks: list[int], func: Any, args: tuple[Any, ...], timeout: float = -1) -> None:
    """Call ``func(*args)`` on every rank of ``ranks`` and wait for all; a member that fails
    to answer is logged (it is crashing or gone, and its loss is handled as such)."""
    futs = [(r, agent.send_request(r, func, args, {}, timeout=timeout, flags=wire.CONTROL)) for r in ranks]
    for r, fut in futs:
        try:
            fut.wait()
        except Exception as e:  # noqa: BLE001 - any failure means the same: it did not hear it
            log.warning(
                "rpc_core %s: %s did not take the membership change %s%r: %s",
                agent.me.name,
                agent.roster.describe(r),
                func.__name__,
                args[:2],
                e,
            )


# -- the members' side (ordinary CONTROL calls, reached by reference) ----------------------------------
def _member_joined(name: str, rank: int, address: tuple[str, int], generation: int) -> None:
    current_agent().roster.add_member(WorkerInfo(name, rank), tuple(address), generation)  # type: ignore[arg-type]


def _member_left(rank: int, generation: int | None, reason: str, graceful: bool) -> None:
    current_agent().roster.remove_member(rank, generation, reason, graceful)


def _leave_request(rank: int, generation: int) -> None:
    if _registry is None:
        raise RpcError(f"{current_agent().me.name!r} is no group's registry: only rank 0 takes leave requests")
    _registry.leave(rank, generation)


# Membership news: called by name under serializer='safe'.
allowlist.internal(_member_joined, _member_left, _leave_request)
