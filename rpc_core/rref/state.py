"""Per-process RRef state, and the handlers that run on an owner.

The owner of a value keeps one entry per RRef id: the value (a Future until it exists), the
set of user forks that reference it, and a count of local owner handles. It frees the value
when both are empty, so owner tables return to empty when users let go. Users keep their
live handles, forks waiting for confirmation, and deletes waiting to be sent.

The ``_on_*`` functions are the owner's side of the protocol (see ``rref``): each runs as an
ordinary RPC on the owner, reached by reference.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
import weakref
from typing import Any, NamedTuple

import torch

from ..agent import agent as _agent_mod
from ..agent import futures as _futures
from ..agent.dispatch import log_call_error
from ..errors import NotAllowedError, RpcError, not_a_future
from ..functions import async_execution
from ..protocol import allowlist, serialization

Id = tuple[int, int]  # GloballyUniqueId(created_on, local_id)

_local_ids = itertools.count(0)
_FREED_MEMORY = 1 << 16


def new_id() -> Id:
    return (_agent_mod.current_agent().me.id, next(_local_ids))


def start_ids(base: int) -> None:
    """At init_rpc: number this worker's RRef ids from ``base`` (``Agent.id_base``: a rank
    reused in a dynamic group never makes the ids of the member that held it before)."""
    global _local_ids
    _local_ids = itertools.count(base)


def fmt(i: Id) -> str:
    created_on, local_id = i
    return f"GloballyUniqueId(created_on={created_on}, local_id={local_id})"


class Collected(NamedTuple):
    """A garbage-collected user handle whose delete is due at its owner."""

    owner: int
    rref_id: Id
    fork_id: Id


class _Entry:
    __slots__ = ("value", "forks", "handles")

    def __init__(self) -> None:
        self.value: torch.futures.Future[Any] = torch.futures.Future()
        self.forks: set[Id] = set()
        self.handles = 0


class _Context:
    """Per-process RRef state."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.owners: dict[Id, _Entry] = {}
        # Handles (handle.RRef, a layer above) by fork id: parents kept until their
        # child forks are confirmed, and the live user handles.
        self.pending_children: dict[Id, Any] = {}
        self.users: weakref.WeakValueDictionary[Id, Any] = weakref.WeakValueDictionary()
        self.unconfirmed: set[Id] = set()
        # The release loop's queue (items: release.Release).
        self.releases: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.in_flight: list[torch.futures.Future[Any]] = []
        # Ids this owner freed (ids are never reused): a late request for one fails at once
        # instead of waiting forever for a value that will not come. Bounded, oldest out.
        self.freed: collections.OrderedDict[Id, None] = collections.OrderedDict()
        # owner rank -> (rref id, fork id) deletes waiting to ride on a request to it; plain
        # tuples, as they travel in frame heads (wire.EXTRA_RREF_DELETES)
        self.deletes: dict[int, list[tuple[Id, Id]]] = {}
        self.deletes_out = 0  # deletes that left this worker, on requests or on their own
        self.deletes_seen = 0  # deletes_out when flush() last looked
        # Deletes of garbage-collected user handles whose creation was confirmed, appended
        # by ``__del__`` itself (a deque append is safe in a finalizer and wakes no thread);
        # the next look at the piles (a request to any owner, the release loop) moves them.
        self.collected: collections.deque[Collected] = collections.deque()
        self.n_collected = 0  # appends so far (approximate: it only paces the release loop)
        # Ids of garbage-collected owner handles (an RRef argument unpickled on its owner
        # makes one per call); the release loop drops them in batches, waking no thread each.
        self.dropped: collections.deque[Id] = collections.deque()
        self.release_asleep = False  # the release loop waits without a deadline: poke it

    def drop_handles(self) -> None:
        """Apply the drops of collected owner handles (their values may be freed)."""
        while self.dropped:
            rref_id = self.dropped.popleft()
            with self.lock:
                e = self.owners.get(rref_id)
                if e is not None:
                    e.handles -= 1
            self.maybe_free(rref_id)

    def gather(self) -> None:
        """Move collected deletes into the per-owner piles (call with the lock held)."""
        while self.collected:
            c = self.collected.popleft()
            self.deletes.setdefault(c.owner, []).append((c.rref_id, c.fork_id))

    def take_deletes(self, owner: int) -> list[tuple[Id, Id]]:
        with self.lock:
            self.gather()
            pile = self.deletes.pop(owner, [])
            self.deletes_out += len(pile)
            return pile

    def entry(self, rref_id: Id) -> _Entry:
        with self.lock:
            e = self.owners.get(rref_id)
            if e is None:
                e = self.owners[rref_id] = _Entry()
            return e

    def live_entry(self, rref_id: Id) -> _Entry:
        """The entry of a value a user asks for: pending (its creation may still be on its
        way) or present, but not one this owner already freed."""
        with self.lock:
            if rref_id in self.freed:
                raise RpcError(
                    f"RRef {fmt(rref_id)} was already deleted on its owner: every user RRef to it "
                    "had been released. Keep an RRef alive while calls through it are in flight."
                )
            return self.entry(rref_id)

    def maybe_free(self, rref_id: Id) -> None:
        with self.lock:
            e = self.owners.get(rref_id)
            if e is not None and not e.forks and e.handles <= 0:
                del self.owners[rref_id]
                self.freed[rref_id] = None
                if len(self.freed) > _FREED_MEMORY:
                    self.freed.popitem(last=False)

    def debug_info(self) -> dict[str, int]:
        with self.lock:
            # torch's keys first. Owner RRefs count once another worker knows them (a user
            # holds a fork, or a remote() made the value here): a local RRef() never shared
            # is not in torch's owner table either.
            return {
                "num_owner_rrefs": sum(1 for e in self.owners.values() if e.forks or e.handles <= 0),
                "num_pending_futures": sum(1 for f in self.in_flight if not f.done()),
                "num_owner_entries": len(self.owners),  # rpc_core's: every value held here, shared or not
                "num_forks": sum(len(e.forks) for e in self.owners.values()),
                "num_user_rrefs": len(self.users),
                "num_pending_users": len(self.unconfirmed),
                "num_pending_children": len(self.pending_children),
            }


_ctx = _Context()


def debug_info() -> dict[str, int]:
    return _ctx.debug_info()


def reset() -> None:
    """Forget all RRef state (after shutdown)."""
    with _ctx.lock:
        for rref in list(_ctx.users.values()):
            rref._deleted = True
        _ctx.owners.clear()
        _ctx.pending_children.clear()
        _ctx.unconfirmed.clear()
        _ctx.in_flight = []
        _ctx.freed.clear()
        _ctx.deletes.clear()
        _ctx.collected.clear()
        _ctx.dropped.clear()


# -- the owner's handlers (run as RPCs) ------------------------------------------------------------
@async_execution
def _on_create(
    rref_id: Id, fork_id: Id | None, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.futures.Future[Any]:
    e = _ctx.entry(rref_id)
    if fork_id is not None:
        with _ctx.lock:
            e.forks.add(fork_id)
    try:
        try:
            result = func(*args, **(kwargs or {}))
        except Exception as exc:  # logged as the function of a call is (dispatch)
            log_call_error(_agent_mod.current_agent().me, func, exc)
            raise
        if getattr(func, "_wrapped_async_rpc_function", None) is not None:
            if not isinstance(result, torch._C.Future):
                raise not_a_future(result)
            result.add_done_callback(lambda f: _copy_outcome(e.value, f))
        else:
            e.value.set_result(result)
    except BaseException as exc:  # noqa: BLE001 - the function's error is the RRef's outcome
        _futures.set_error(e.value, exc)
    if e.value.done():  # the usual case: acknowledge at once, without a then() callback
        ack: torch.futures.Future[None] = torch.futures.Future()
        ack.set_result(None)
        return ack
    return e.value.then(lambda _: None)


def store_creation_error(rref_id: Id, error: BaseException) -> None:
    """A remote() creation whose request could not even be unpickled here: its error becomes
    the value, so to_here() raises it instead of waiting forever."""
    value = _ctx.entry(rref_id).value
    if not value.done():
        _futures.set_error(value, error)


def _copy_outcome(target: torch.futures.Future[Any], source: torch.futures.Future[Any]) -> None:
    try:
        target.set_result(source.value())
    except BaseException as exc:  # noqa: BLE001 - the function's error is the RRef's outcome
        _futures.set_error(target, exc)


@async_execution
def _on_fetch(rref_id: Id) -> torch.futures.Future[Any]:
    # The creation request may still be queued behind this fetch: wait for the value.
    return _ctx.live_entry(rref_id).value


def owned_value(rref_id: Id) -> Any:
    """The value this worker owns under ``rref_id`` (``RRef.local_value`` by id, for calls that
    name an RRef instead of forking it), once created; an RpcError if it was already freed."""
    return _ctx.live_entry(rref_id).value.wait()


@async_execution
def _on_type(rref_id: Id) -> torch.futures.Future[Any]:
    # A creation error reaches the caller as it was raised (torch's _get_type passes it on).
    return _futures.map_result(_ctx.live_entry(rref_id).value, type)


# The owner's handlers that users know under another name, by the (module, qualified name)
# a request carries: what a profile calls them.
HANDLER_DISPLAY_NAMES: dict[tuple[str, str], str] = {
    (_on_fetch.__module__, _on_fetch.__qualname__): "RRef.to_here",
    (_on_type.__module__, _on_type.__qualname__): "_rref_typeof_on_owner",  # torch's name for it
}


def _on_fork(rref_id: Id, fork_id: Id) -> None:
    e = _ctx.entry(rref_id)
    with _ctx.lock:
        e.forks.add(fork_id)


def _on_child_accept(fork_id: Id) -> None:
    with _ctx.lock:
        _ctx.pending_children.pop(fork_id, None)


def _on_user_delete(rref_id: Id, fork_id: Id) -> None:
    with _ctx.lock:
        e = _ctx.owners.get(rref_id)
        if e is not None:
            e.forks.discard(fork_id)
    _ctx.maybe_free(rref_id)


def _on_user_deletes(pile: list[tuple[Id, Id]]) -> None:
    for rref_id, fork_id in pile:
        _on_user_delete((rref_id[0], rref_id[1]), (fork_id[0], fork_id[1]))  # lists or tuples: Ids


@async_execution
def _on_invoke(rref_id: Id, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.futures.Future[Any]:
    """Run ``value.name(*args, **kwargs)`` on the owner (the RRef proxies)."""
    value = _ctx.live_entry(rref_id).value
    obj = value.wait() if value.done() else None
    if obj is None and not value.done():
        # Still being created by remote(): call once it exists, without holding a thread.
        return _call_later(value, name, args, kwargs)
    return _call_method(obj, name, args, kwargs)


def _call_later(
    value: torch.futures.Future[Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.futures.Future[Any]:
    """``_call_method`` on ``value``'s result once it is there; a creation error, or the
    method's, reaches the caller as it was raised (not wrapped as then() would)."""
    out: torch.futures.Future[Any] = torch.futures.Future()

    def run(f: torch.futures.Future[Any]) -> None:
        try:
            result = _call_method(f.value(), name, args, kwargs)
        except BaseException as e:  # noqa: BLE001 - the error goes to the future's waiters
            _futures.set_error(out, e)
            return
        result.add_done_callback(lambda r: _copy_outcome(out, r))

    value.add_done_callback(run)
    return out


def check_attribute(rref_type: type, name: str) -> None:
    """Raise AttributeError, as torch's proxies do, if the value's type has no ``name``.
    (A scripted module's methods are not on its type: not checked.)"""
    try:
        getattr(rref_type, name)
    except AttributeError as e:
        if issubclass(rref_type, (torch.jit.ScriptModule, torch._C.ScriptModule)):
            return
        raise AttributeError(
            f"{e}. The RRef proxies call attributes of the value's type; reach others with a function run on "
            "the owner: rpc_sync(rref.owner(), f, args=(rref,)) where f uses rref.local_value()"
        ) from None


# The dunder methods RRef proxies may call under serializer="safe" (others reach the object's
# internals: __setattr__, __reduce_ex__, __getattribute__ ...).
_SAFE_DUNDERS = frozenset({"__call__", "__getitem__", "__len__", "__contains__"})


def _call_method(obj: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.futures.Future[Any]:
    check_attribute(type(obj), name)  # the caller checked too if it knew the type
    if name.startswith("_") and name not in _SAFE_DUNDERS and serialization.codec_name() == "safe":
        raise NotAllowedError(
            f"an RRef proxy call of {type(obj).__qualname__}.{name}: under serializer='safe' proxies call "
            f"public methods (and {', '.join(sorted(_SAFE_DUNDERS))}) only; wrap it in an allowed function"
        )
    method = getattr(obj, name)
    if getattr(method, "_wrapped_async_rpc_function", None) is not None:
        fut: torch.futures.Future[Any] = method(*args, **kwargs)
        return fut
    f: torch.futures.Future[Any] = torch.futures.Future()
    f.set_result(method(*args, **kwargs))
    return f


# The owner's handlers other workers call (under serializer="safe", by name: allowlist).
allowlist.internal(
    _on_create, _on_fetch, _on_type, _on_fork, _on_child_accept, _on_user_delete, _on_user_deletes, _on_invoke
)


def forget_owner(owner: int, generation: int) -> int:
    """The member that held rank ``owner`` at ``generation`` left: release this worker's user
    RRefs of its values. Their entries leave the user tables (a handle still held stays
    usable only for the error: a call through it raises WorkerLeftError naming the worker),
    and no delete is kept or sent for them (nobody would apply it). Returns how many handles
    and deletes were dropped."""
    dropped = 0
    with _ctx.lock:
        _ctx.gather()
        dropped += len(_ctx.deletes.pop(owner, []))
        for fork_id, handle in list(_ctx.users.items()):
            if handle._owner_id == owner and handle._owner_gen == generation:
                handle._owner_left = True  # its __del__ then sends nothing
                del _ctx.users[fork_id]
                _ctx.unconfirmed.discard(fork_id)
                dropped += 1
        for fork_id, parent in list(_ctx.pending_children.items()):
            if parent._owner_id == owner and parent._owner_gen == generation:
                del _ctx.pending_children[fork_id]
                dropped += 1
    return dropped
