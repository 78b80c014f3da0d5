"""Remote references: owners, users, and the fork/confirm/delete protocol.

The owner of a value keeps one entry per RRef id: the value (a Future until it exists), the
set of user forks that reference it, and a count of local owner handles. It frees the value
when both are empty, so owner tables return to empty when users let go.

Protocol (every message is an ordinary RPC to one of the ``_on_*`` functions below):
- ``remote()`` registers the creator's fork with ``_on_create``, which runs the function and
  stores its result or exception; the reply confirms the creator's RRef.
- Sending an RRef forks it: the pickled form carries a fresh fork id and its parent. An
  owner registers the fork before sending (owner forks are born confirmed). A user keeps
  the parent alive (``_pending_children``) until the child is confirmed; the receiving
  user asks the owner to register the fork (``_on_fork``), then tells the parent
  (``_on_child_accept``). An owner that receives its own RRef needs no registration and
  tells the parent at once; when the RRef came in a request (the usual
  ``rpc_sync(rref.owner(), f, args=(rref,))``), that news rides on the response (``racc``)
  instead of a message of its own. A function that receives RRefs runs only after all its
  forks are confirmed. So a fork is always registered before its parent can be deleted.
- A user RRef that is garbage collected is deleted on its owner (after its creation was
  confirmed). Deletes ride along with the next request to that owner (``rdel`` in the frame
  head, applied by ``RRefMiddleware``), so a loop that creates and drops RRefs costs no
  message for them; deletes still waiting after ``_DELETE_DELAY`` go in one
  ``_on_user_deletes`` call per owner. ``delete_all_user_rrefs`` deletes every live user
  RRef at shutdown.
"""
from __future__ import annotations

import collections
import itertools
import queue
import threading
import weakref
from typing import Any, Deque, Dict, Generic, List, Optional, Set, Tuple, TypeVar

import torch

from . import agent as _agent_mod
from . import futures as _futures
from .errors import RpcError
from .futures import settle
from .functions import async_execution
from .rendezvous import WorkerInfo
from .serialization import defer_until, note_for_reply, register_reducer

T = TypeVar("T")
Id = Tuple[int, int]  # GloballyUniqueId(created_on, local_id)

_local_ids = itertools.count(0)


def _new_id() -> Id:
    return (_agent_mod.current_agent().me.id, next(_local_ids))


def _fmt(i: Id) -> str:
    return f"GloballyUniqueId(created_on={i[0]}, local_id={i[1]})"


class _Entry:
    __slots__ = ("value", "forks", "handles")

    def __init__(self) -> None:
        self.value: torch.futures.Future = torch.futures.Future()
        self.forks: Set[Id] = set()
        self.handles = 0


_FREED_MEMORY = 1 << 16
# How long a delete may wait for a request to ride on before it is sent on its own, and how
# many may pile up for one owner.
_DELETE_DELAY = 0.005
_DELETE_BATCH = 256
_POKE = ("poke", None, None, None, None)
# Response-extras key: forks of the caller's RRefs this owner accepted while unpickling the
# request (the child-accept of the fork protocol, without a message of its own).
_ACCEPTED = "racc"


class _Context:
    """Per-process RRef state."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.owners: Dict[Id, _Entry] = {}
        self.pending_children: Dict[Id, "RRef"] = {}
        self.users: "weakref.WeakValueDictionary[Id, RRef]" = weakref.WeakValueDictionary()
        self.unconfirmed: Set[Id] = set()
        self.releases: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self.in_flight: List[torch.futures.Future] = []
        # Ids this owner freed (ids are never reused): a late request for one fails at once
        # instead of waiting forever for a value that will not come. Bounded, oldest out.
        self.freed: "collections.OrderedDict[Id, None]" = collections.OrderedDict()
        # owner rank -> (rref id, fork id) deletes waiting to ride on a request to it
        self.deletes: Dict[int, List[Tuple[Id, Id]]] = {}
        self.deletes_out = 0  # deletes that left this worker, on requests or on their own
        self.deletes_seen = 0  # deletes_out when flush() last looked
        # Deletes of garbage-collected user handles whose creation was confirmed, appended
        # by ``__del__`` itself (a deque append is safe in a finalizer and wakes no thread);
        # the next look at the piles (a request to any owner, the release loop) moves them.
        self.collected: Deque[Tuple[int, Id, Id]] = collections.deque()
        self.n_collected = 0  # appends so far (approximate: it only paces the release loop)
        # Ids of garbage-collected owner handles (an RRef argument unpickled on its owner
        # makes one per call); the release loop drops them in batches, waking no thread each.
        self.dropped: Deque[Id] = collections.deque()
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
            owner, rref_id, fork_id = self.collected.popleft()
            self.deletes.setdefault(owner, []).append((rref_id, fork_id))

    def take_deletes(self, owner: int) -> List[Tuple[Id, Id]]:
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
                    f"RRef {_fmt(rref_id)} was already deleted on its owner: every user RRef to it "
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

    def debug_info(self) -> Dict[str, int]:
        with self.lock:
            return {
                "num_owner_rrefs": len(self.owners),
                "num_forks": sum(len(e.forks) for e in self.owners.values()),
                "num_user_rrefs": len(self.users),
                "num_pending_users": len(self.unconfirmed),
                "num_pending_children": len(self.pending_children),
            }


_ctx = _Context()


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
            item = _ctx.releases.get(timeout=None if idle else _DELETE_DELAY)
        except queue.Empty:
            _ctx.drop_handles()
            _send_deletes()  # nothing carried them in time
            continue
        finally:
            _ctx.release_asleep = False
        _ctx.drop_handles()  # before a barrier: flush() sees them applied
        kind, owner, rref_id, fork_id, creation = item
        if kind == "poke":
            continue
        if kind == "barrier":
            _send_deletes()
            owner.set_result(None)
        elif creation is not None and not creation.done():
            # Delete once the owner knows the fork. The delete is queued before the tracked
            # future completes: flush() sees the one or the other.
            _track(creation.then(lambda _, it=item: _collect(it[1], it[2], it[3])))
        else:
            _send_delete(owner, rref_id, fork_id)


def _collect(owner: int, rref_id: Id, fork_id: Id) -> None:
    """Queue a delete without waking any thread (safe in finalizers): it rides on the next
    request to the owner, or the release loop sends it within _DELETE_DELAY."""
    _ctx.collected.append((owner, rref_id, fork_id))
    _ctx.n_collected += 1
    if _ctx.release_asleep:
        _ctx.releases.put(_POKE)


def _send_delete(owner: int, rref_id: Id, fork_id: Id) -> None:
    with _ctx.lock:
        pile = _ctx.deletes.setdefault(owner, [])
        pile.append((rref_id, fork_id))
        full = len(pile) >= _DELETE_BATCH
    if full:
        _send_deletes(owner)


def _send_deletes(owner: Optional[int] = None) -> None:
    """Send the waiting deletes (of ``owner``, or of all owners) as calls of their own."""
    with _ctx.lock:
        _ctx.gather()
        owners = list(_ctx.deletes) if owner is None else [owner]
        piles = [(o, _ctx.deletes.pop(o, [])) for o in owners]
        _ctx.deletes_out += sum(len(p) for _, p in piles)
    agent = _agent_mod._agent
    if agent is None or agent._closing:
        return
    for o, pile in piles:
        if pile:
            try:
                _track(agent.send_request(o, _on_user_deletes, (pile,), {}, timeout=0))
            except RpcError:
                pass


def _track(fut: torch.futures.Future) -> None:
    """A protocol step in flight that ``flush`` (and shutdown) must wait for."""
    with _ctx.lock:
        _ctx.in_flight.append(fut)
        _ctx.in_flight = [f for f in _ctx.in_flight if not f.done()]


_release_thread: Optional[threading.Thread] = None


def start_release_thread() -> None:
    """Start the release loop (at init_rpc). Not at import: a process forked from one that
    imported rpc_core (a forkserver preloading it) inherits the module but not the thread."""
    global _release_thread
    if _release_thread is None or not _release_thread.is_alive():
        _release_thread = threading.Thread(target=_release_loop, name="rref-release", daemon=True)
        _release_thread.start()


class RRef(Generic[T]):
    """A reference to a value owned by some worker (torch.distributed.rpc.RRef)."""

    def __init__(self, value: T, type_hint: Optional[type] = None) -> None:
        agent = _agent_mod.current_agent()
        rref_id = _new_id()
        e = _ctx.entry(rref_id)
        e.value.set_result(value)
        self._init(agent.me.id, rref_id, None, True)

    # -- construction of the two flavours --------------------------------------------------------
    def _init(self, owner: int, rref_id: Id, fork_id: Optional[Id], confirmed: bool,
              creation: Optional[torch.futures.Future] = None) -> None:
        self._owner_id = owner
        self._rref_id = rref_id
        self._fork_id = fork_id
        self._confirmed = confirmed
        self._creation = creation
        self._deleted = False
        self._type: Optional[type] = None
        if fork_id is None:
            with _ctx.lock:
                _ctx.entry(rref_id).handles += 1
        else:
            _ctx.users[fork_id] = self

    @classmethod
    def _owner_handle(cls, rref_id: Id) -> "RRef":
        r = cls.__new__(cls)
        r._init(_agent_mod.current_agent().me.id, rref_id, None, True)
        return r

    @classmethod
    def _user(cls, owner: int, rref_id: Id, fork_id: Id, confirmed: bool,
              creation: Optional[torch.futures.Future] = None) -> "RRef":
        r = cls.__new__(cls)
        r._init(owner, rref_id, fork_id, confirmed, creation)
        return r

    def __del__(self) -> None:
        if getattr(self, "_rref_id", None) is None or self._deleted:
            return
        if self._fork_id is not None and (self._creation is None or self._confirmed):
            _collect(self._owner_id, self._rref_id, self._fork_id)  # the common case: wakes no thread
            return
        if self._fork_id is None:  # an owner handle: dropped on the release loop's next look
            _ctx.dropped.append(self._rref_id)
            _ctx.n_collected += 1
            if _ctx.release_asleep:
                _ctx.releases.put(_POKE)
            return
        # A user handle whose creation is not confirmed yet: its delete must wait for it.
        _ctx.releases.put(("user", self._owner_id, self._rref_id, self._fork_id, self._creation))

    # -- public API -------------------------------------------------------------------------------
    def is_owner(self) -> bool:
        return self._fork_id is None

    def owner(self) -> WorkerInfo:
        return _agent_mod.current_agent().workers[self._owner_id]

    def owner_name(self) -> str:
        return self.owner().name

    def confirmed_by_owner(self) -> bool:
        c = self._creation
        if not self._confirmed and c is not None and c.done():
            self._confirmed = _succeeded(c)  # a waiter on the creation may run before its callbacks
        return self._confirmed

    def _check_alive(self, what: str) -> None:
        if self._deleted:
            raise RpcError(f"{self} has been deleted. Cannot call {what}() on it after deletion.")

    def local_value(self) -> T:
        self._check_alive("local_value")
        if not self.is_owner():
            me = _agent_mod.current_agent().me
            raise RpcError(
                f"For {self}, can't call localValue() on user {me}. Call it on owner {self.owner()}"
            )
        return _ctx.entry(self._rref_id).value.wait()

    def to_here(self, timeout: float = -1) -> T:
        """Copy the value from the owner (the value itself on the owner); blocks."""
        self._check_alive("to_here")
        if self.is_owner():
            return _ctx.entry(self._rref_id).value.wait()
        self._raise_creation_error()
        from .api import _invoke

        return _invoke(self._owner_id, _on_fetch, (self._rref_id,), None, timeout, "sync", force_ctx=True)

    def _raise_creation_error(self) -> None:
        c = self._creation
        if c is not None and c.done():
            try:
                c.wait()
            except RpcError as e:
                if "RPC ran for more than" in str(e):
                    raise RpcError(
                        "RRef creation via rpc.remote() timed out, and it is possible that the RRef on the "
                        "owner node does not exist."
                    ) from e

    def _get_future(self) -> torch.futures.Future:
        if self._creation is not None:
            return self._creation
        f: torch.futures.Future = torch.futures.Future()
        f.set_result(None)
        return f

    def _get_type(self, timeout: float = -1, blocking: bool = True) -> Any:
        if self._type is None:
            if self.is_owner():
                self._type = type(self.local_value())
            else:
                from .api import _invoke

                self._type = _invoke(self._owner_id, _on_type, (self._rref_id,), None, timeout, "sync")
        if blocking:
            return self._type
        f: torch.futures.Future = torch.futures.Future()
        f.set_result(self._type)
        return f

    def rpc_sync(self, timeout: float = -1) -> "_Proxy":
        return _Proxy(self, "sync", timeout)

    def rpc_async(self, timeout: float = -1) -> "_Proxy":
        return _Proxy(self, "async", timeout)

    def remote(self, timeout: float = -1) -> "_Proxy":
        return _Proxy(self, "remote", timeout)

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        from .autograd import _rref_backward

        _rref_backward(self, dist_autograd_ctx_id, retain_graph)

    def __repr__(self) -> str:
        if self.is_owner():
            return f"OwnerRRef({_fmt(self._rref_id)})"
        return f"UserRRef(RRefId = {_fmt(self._rref_id)}, ForkId = {_fmt(self._fork_id)})"  # type: ignore[arg-type]

    def __reduce__(self):
        raise RuntimeError("Can not pickle rref in python pickler, rref can only be pickled when using RPC")

    @classmethod
    def __class_getitem__(cls, item: Any) -> Any:
        return cls


class _Proxy:
    """``rref.rpc_sync().method(*args)`` runs ``method`` on the owner's value."""

    def __init__(self, rref: RRef, mode: str, timeout: float) -> None:
        self._rref, self._mode, self._timeout = rref, mode, timeout

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            from . import api

            rref = self._rref
            rref._check_alive(self._mode)
            # The call names the RRef by id instead of forking it (no fork/accept messages);
            # holding the RRef until the answer keeps the owner's value alive meanwhile.
            call_args = (rref._rref_id, name, args, kwargs)
            if self._mode == "remote":
                return api.remote(rref._owner_id, _on_invoke, args=call_args, timeout=self._timeout, _keepalive=rref)
            fut = api._invoke_async(rref._owner_id, _on_invoke, call_args, None, self._timeout, self._mode,
                                    keepalive=rref)
            return fut.wait() if self._mode == "sync" else fut

        return call


# -- pickling RRefs inside RPC messages (forks) ----------------------------------------------------
def _reduce(rref: RRef) -> Tuple[Any, tuple]:
    rref._check_alive("fork")
    me = _agent_mod.current_agent().me.id
    fork_id = _new_id()
    if rref.is_owner():
        with _ctx.lock:
            _ctx.entry(rref._rref_id).forks.add(fork_id)  # owner forks are born confirmed
    else:
        with _ctx.lock:
            _ctx.pending_children[fork_id] = rref  # G2: keep the parent until the child is confirmed
    return _from_fork, (rref._owner_id, rref._rref_id, fork_id, me)


register_reducer(RRef, _reduce)


def _from_fork(owner: int, rref_id: Id, fork_id: Id, parent: int) -> RRef:
    agent = _agent_mod.current_agent()
    me = agent.me.id
    if owner == me:
        if parent == me:
            with _ctx.lock:
                _ctx.entry(rref_id).forks.discard(fork_id)  # our own fork came back: no user exists
        elif not note_for_reply(_ACCEPTED, fork_id):  # in a request: the parent learns it from the response
            _track(agent.send_request(parent, _on_child_accept, (fork_id,), {}, timeout=0))
        return RRef._owner_handle(rref_id)
    if parent == owner:
        return RRef._user(owner, rref_id, fork_id, True)
    rref = RRef._user(owner, rref_id, fork_id, False)
    with _ctx.lock:
        _ctx.unconfirmed.add(fork_id)
    confirmed = agent.send_request(owner, _on_fork, (rref_id, fork_id), {}, timeout=0)

    def on_confirmed(f: torch.futures.Future) -> None:
        rref._confirmed = True
        with _ctx.lock:
            _ctx.unconfirmed.discard(fork_id)
        _track(agent.send_request(parent, _on_child_accept, (fork_id,), {}, timeout=0))

    done = confirmed.then(on_confirmed)
    defer_until(done)  # the receiving user function waits for this
    return rref


# -- owner/parent side handlers (run as RPCs) ------------------------------------------------------
@async_execution
def _on_create(rref_id: Id, fork_id: Optional[Id], func: Any, args: tuple, kwargs: dict) -> torch.futures.Future:
    e = _ctx.entry(rref_id)
    if fork_id is not None:
        with _ctx.lock:
            e.forks.add(fork_id)
    try:
        result = func(*args, **(kwargs or {}))
        if getattr(func, "_wrapped_async_rpc_function", None) is not None:
            if not isinstance(result, torch._C.Future):
                raise TypeError("Functions decorated with @rpc.async_function must return a torch.futures.Future object")
            result.add_done_callback(lambda f: _copy_outcome(e.value, f))
        else:
            e.value.set_result(result)
    except BaseException as exc:
        _futures.set_error(e.value, exc)
    if e.value.done():  # the usual case: acknowledge at once, without a then() callback
        ack = torch.futures.Future()
        ack.set_result(None)
        return ack
    return e.value.then(lambda _: None)


def on_request_failed(extras: Dict[str, Any], error: BaseException) -> None:
    """The agent could not unpickle a request; if it was a remote() creation, store the
    error as the RRef's value so to_here() raises it instead of waiting forever. Deletes
    it carried still apply."""
    pile = extras.get("rdel")
    if pile:
        _on_user_deletes(pile)
    rref_id = extras.get("rref_create")
    if rref_id is not None:
        value = _ctx.entry(tuple(rref_id)).value
        if not value.done():
            _futures.set_error(value, error)


def _copy_outcome(target: torch.futures.Future, source: torch.futures.Future) -> None:
    try:
        target.set_result(source.value())
    except BaseException as exc:
        _futures.set_error(target, exc)


@async_execution
def _on_fetch(rref_id: Id) -> torch.futures.Future:
    # The creation request may still be queued behind this fetch: wait for the value.
    return _ctx.live_entry(rref_id).value


@async_execution
def _on_type(rref_id: Id) -> torch.futures.Future:
    return _ctx.live_entry(rref_id).value.then(lambda f: type(f.value()))


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


def _on_user_deletes(pile: List[Tuple[Id, Id]]) -> None:
    for rref_id, fork_id in pile:
        _on_user_delete(tuple(rref_id), tuple(fork_id))


class RRefMiddleware(_agent_mod.Middleware):
    """Carries waiting deletes to their owner on the next request there, and applies the
    deletes a request carries when it arrives."""

    def outgoing(self, dst: int, tensors: List[torch.Tensor], extras: Dict[str, Any],
                 request_extras: Optional[Dict[str, Any]]) -> None:
        if request_extras is None and (_ctx.deletes or _ctx.collected):
            pile = _ctx.take_deletes(dst)
            if pile:
                extras["rdel"] = pile

    def enter_call(self, src: int, extras: Dict[str, Any]) -> Any:
        pile = extras.get("rdel")
        if pile:
            _on_user_deletes(pile)

    def on_response(self, extras: Optional[Dict[str, Any]], call_extras: Dict[str, Any]) -> None:
        accepted = extras.get(_ACCEPTED) if extras else None
        if accepted:
            for fork_id in accepted:
                _on_child_accept(tuple(fork_id))


@async_execution
def _on_invoke(rref_id: Id, name: str, args: tuple, kwargs: dict) -> torch.futures.Future:
    """Run ``value.name(*args, **kwargs)`` on the owner (the RRef proxies)."""
    value = _ctx.live_entry(rref_id).value
    obj = value.wait() if value.done() else None
    if obj is None and not value.done():
        # Still being created by remote(): call once it exists, without holding a thread.
        return value.then(lambda f: _call_method(f.value(), name, args, kwargs)).then(_unwrap)
    return _call_method(obj, name, args, kwargs)


def _call_method(obj: Any, name: str, args: tuple, kwargs: dict) -> torch.futures.Future:
    method = getattr(obj, name)
    if getattr(method, "_wrapped_async_rpc_function", None) is not None:
        return method(*args, **kwargs)
    f: torch.futures.Future = torch.futures.Future()
    f.set_result(method(*args, **kwargs))
    return f


def _unwrap(f: torch.futures.Future) -> Any:
    return f.value().wait()


# -- used by api ------------------------------------------------------------------------------------
def new_user_for_remote(owner: int, rref_id: Id, fork_id: Id, creation: torch.futures.Future) -> RRef:
    rref = RRef._user(owner, rref_id, fork_id, False, creation)
    ref = weakref.ref(rref)

    def confirm(f: torch.futures.Future) -> None:
        r = ref()
        if r is not None:
            r._confirmed = _succeeded(f)

    # Not RpcFuture's add_done_callback: this one is safe to run inline on the thread that
    # reads the acknowledgement, and so needs no hop through the pool.
    torch.futures.Future.add_done_callback(creation, confirm)
    return rref


def _succeeded(f: torch.futures.Future) -> bool:
    try:
        f.wait()
        return True
    except BaseException:
        return False


def delete_all_user_rrefs(timeout: float) -> None:
    """Shutdown: tell owners that every live user RRef is gone, and wait for them to hear it."""
    agent = _agent_mod.current_agent()
    _send_deletes()
    futs = []
    for fork_id, rref in list(_ctx.users.items()):
        if rref._deleted:
            continue
        rref._deleted = True
        try:
            futs.append(agent.send_request(rref._owner_id, _on_user_delete, (rref._rref_id, fork_id), {}, timeout=timeout))
        except RpcError:
            pass
    with _ctx.lock:
        futs += _ctx.in_flight
        _ctx.in_flight = []
        _ctx.pending_children.clear()
    settle(futs)  # errors (a dead owner) leave nothing to delete


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


def debug_info() -> Dict[str, int]:
    return _ctx.debug_info()


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
        fut: torch.futures.Future = torch.futures.Future()
        _ctx.releases.put(("barrier", fut, None, None, None))  # processed in order after earlier releases
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
