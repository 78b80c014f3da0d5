"""Who is in the group, as one worker knows it: ranks, names, addresses, and who left.

A static group's roster is fixed at the rendezvous. A dynamic group's (``world_size=None``)
changes as members join and leave (``registry`` tells every member); each member then
carries a generation, the number of the join that brought it in, so a rank that is reused
after a leave names a new member: its connections, RRefs and autograd context ids are
never taken for those of the member that held the rank before (see ``id_base``).

``Roster`` is a part of ``agent.Agent`` (every call resolves its destination here), the
lowest of them: it knows nothing of connections or calls, and tells the agent of a member it
forgets through the ``forget`` callable it was made with. The tables are replaced, never
changed in place, so a reader needs no lock and never sees a table half updated.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ..errors import RpcError, WorkerLeftError
from .worlds import WorkerInfo, World

log = logging.getLogger("rpc_core")

# A member's RRef and autograd context ids start at its generation shifted by this, so ids
# made by two holders of one rank never meet (2**32 ids per member, 2**16 joins: context
# ids keep the creator's rank in their top 16 of 64 bits).
ID_SHIFT = 32
# How many departed names and ranks a worker remembers for its "left the group" errors.
_MAX_DEPARTED = 1 << 12


class Roster:
    """The members of the group and the departed, for one worker (part of the Agent).

    ``forget(rank, name, reason, graceful)`` is called when a member other than this worker
    leaves (``graceful``: by its shutdown) or is replaced: the agent drops its connection to
    it and fails the calls still on their way to it with ``reason`` (after a graceful leave,
    once the answers the leaver sent before it left have arrived)."""

    def __init__(self, world: World, forget: Callable[[int, str, str, bool], None]) -> None:
        self.me = world.me
        self._on_forget = forget
        self.workers: dict[int, WorkerInfo] = {w.id: w for w in world.workers}
        self.by_name: dict[str, WorkerInfo] = {w.name: w for w in world.workers}
        self.addresses: dict[int, tuple[str, int]] = dict(world.addresses)
        self.dynamic = world.dynamic
        self.generations: dict[int, int] = dict(world.generations)
        self.id_base = self.generations.get(world.me.id, 0) << ID_SHIFT
        # Why each departed name / rank is gone, for the errors of calls to it.
        self._departed_names: dict[str, str] = {}
        self._departed_ranks: dict[int, str] = {}
        # (rank, generation) -> (its name, why)
        self._departed_members: dict[tuple[int, int], tuple[str, str]] = {}
        self._roster_lock = threading.Lock()
        # Called with each WorkerInfo that joined or left: (info, joined).
        self.on_membership: list[Callable[[WorkerInfo, bool], None]] = []
        self.dead: dict[int, str] = {}  # rank -> why it is known to be gone (its connection was lost)

    # -- lookups (every call) ---------------------------------------------------------------------
    def worker_info(self, to: Any) -> WorkerInfo:
        if isinstance(to, WorkerInfo):
            if self.workers.get(to.id) == to:
                return to
            raise self._unknown(to.name, to.id)
        if isinstance(to, str):
            info = self.by_name.get(to)
            if info is None:
                raise self._unknown(to, None)
            return info
        if isinstance(to, int) and not isinstance(to, bool):
            info = self.workers.get(to)
            if info is None:
                raise self._unknown(None, to)
            return info
        raise ValueError(
            f"Cannot get WorkerInfo from name {to!r} (type {type(to).__name__}); pass a name, WorkerInfo or rank"
        )

    def _unknown(self, name: str | None, rank: int | None) -> RpcError:
        gone = (self._departed_names.get(name) if name is not None else None) or (
            self._departed_ranks.get(rank) if rank is not None and name is None else None
        )
        if gone is not None:  # torch's words first (its tests match them), then ours
            return WorkerLeftError(
                f"could not find destination {name if name is not None else rank!r}: {gone}", worker=name
            )
        if name is not None and rank is not None:
            if rank in self.workers:
                return RpcError(
                    f"could not find destination {WorkerInfo(name, rank)}: rank {rank} is "
                    f"{self.workers[rank].name!r} in this group"
                )
            return RpcError(
                f"could not find destination worker {name!r} (rank {rank}); known workers: {sorted(self.by_name)}"
            )
        if name is not None:
            return RpcError(f"could not find destination worker {name!r}; known workers: {sorted(self.by_name)}")
        if self.dynamic:
            return RpcError(f"could not find destination rank {rank}; the members' ranks are {sorted(self.workers)}")
        return RpcError(f"could not find destination rank {rank}; ranks are 0..{len(self.workers) - 1}")

    def name_of(self, rank: int) -> str | None:
        """The name of the member of ``rank`` (None if none holds it): errors about it carry it."""
        info = self.workers.get(rank)
        return info.name if info is not None else None

    def describe(self, rank: int) -> str:
        """How errors and logs name the worker of ``rank``."""
        info = self.workers.get(rank)
        return f"worker {info.name!r} (rank {rank})" if info is not None else f"the worker of rank {rank}"

    def get_worker_infos(self) -> list[WorkerInfo]:
        """The members, by rank (torch's ``agent.get_worker_infos()``)."""
        return [self.workers[r] for r in sorted(self.workers)]

    def get_worker_info(self, worker_name: str | None = None) -> WorkerInfo:
        return self.me if worker_name is None else self.worker_info(worker_name)

    def generation(self, rank: int) -> int | None:
        """Which join brought in the current holder of ``rank`` (0 in a static group); None if
        no member holds it."""
        if rank not in self.workers:
            return None
        return self.generations.get(rank, 0)

    def check_generation(self, rank: int, generation: int | None, what: str) -> None:
        """Raise WorkerLeftError if the member of ``rank`` that ``what`` belongs to (which
        held the rank at ``generation``) has left, even if a newcomer holds the rank now."""
        if rank in self.workers and self.generations.get(rank, 0) == generation:
            return
        unknown: tuple[str | None, str] = (None, f"the worker of rank {rank} left the group")
        name, gone = self._departed_members.get((rank, generation or 0), unknown)
        if rank in self.workers:
            gone += f"; rank {rank} now belongs to a new member, {self.workers[rank].name!r}"
        raise WorkerLeftError(f"{what}: {gone}", worker=name)

    # -- connections: tell the departed's from the members' ------------------------------------------
    def tag_connection(self, conn: Any, peer: int) -> None:
        """Mark an accepted connection as the current member of ``peer``'s (see is_member_connection)."""
        conn.member_generation = self.generations.get(peer, 0)

    def is_member_connection(self, conn: Any, peer: int) -> bool:
        """Whether ``conn`` is with the member that holds ``peer`` now (not with one that left):
        only then does its loss mean that member is gone."""
        if getattr(conn, "departed", False) or peer not in self.workers:
            return False
        return getattr(conn, "member_generation", None) in (None, self.generations.get(peer, 0))

    # -- changes (dynamic groups, from the registry) ----------------------------------------------------
    def add_member(self, info: WorkerInfo, address: tuple[str, int], generation: int) -> None:
        """``info`` joined the group at ``address``."""
        with self._roster_lock:
            old = self.workers.get(info.id)
            if old is not None:  # a member we never heard leave: the newcomer replaces it
                self._forget(info.id, f"{self.describe(info.id)} was replaced by a new member")
            self.addresses = {**self.addresses, info.id: tuple(address)}  # type: ignore[dict-item]
            self.generations = {**self.generations, info.id: generation}
            self.by_name = {**self.by_name, info.name: info}
            self.workers = {**self.workers, info.id: info}
            self._departed_names.pop(info.name, None)
            self._departed_ranks.pop(info.id, None)
            self.dead.pop(info.id, None)
        self._tell_listeners(info, True)

    def remove_member(
        self, rank: int, generation: int | None, reason: str, graceful: bool = False
    ) -> WorkerInfo | None:
        """The member of ``rank`` (if it is still the one of ``generation``; None: any) left
        (``graceful``: by its shutdown, not lost): forget it, and make calls to it fail with
        ``reason``. Returns who left, or None."""
        with self._roster_lock:
            info = self.workers.get(rank)
            if info is None or generation is not None and self.generations.get(rank, 0) != generation:
                return None
            self._forget(rank, reason, graceful)
        self._tell_listeners(info, False)
        return info

    def _tell_listeners(self, info: WorkerInfo, joined: bool) -> None:
        # A listener's error is its own: the join or leave it hears of has happened, and the
        # registry's request that made it must not fail (the leaver would see it as refused).
        for cb in list(self.on_membership):
            try:
                cb(info, joined)
            except Exception:
                log.exception(
                    "rpc_core %s: a membership listener failed on %s %s",
                    self.me.name,
                    info.name,
                    "joining" if joined else "leaving",
                )

    def _forget(self, rank: int, reason: str, graceful: bool = False) -> None:
        info = self.workers[rank]
        workers = dict(self.workers)
        del workers[rank]
        self.workers = workers
        self.by_name = {n: w for n, w in self.by_name.items() if n != info.name}
        _trim(self._departed_names)
        _trim(self._departed_ranks)
        _trim(self._departed_members)
        self._departed_names[info.name] = reason
        self._departed_ranks[rank] = reason
        self._departed_members[(rank, self.generations.get(rank, 0))] = (info.name, reason)
        if rank != self.me.id:
            self._on_forget(rank, info.name, reason, graceful)


def _trim(table: dict[Any, Any]) -> None:
    """Make room for one more departed member, forgetting the oldest."""
    while len(table) >= _MAX_DEPARTED:
        del table[next(iter(table))]
