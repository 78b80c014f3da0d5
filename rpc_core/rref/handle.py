"""The ``RRef`` handle (``torch.distributed.rpc.RRef``), its proxies, and ``remote()``.

An RRef is an owner handle (``_fork_id`` None: the value lives here) or a user handle (a
fork of the owner's value, named by fork id). Handles register with the per-process state
(``state``) and, once garbage collected, hand their delete to the release loop
(``release``). How handles travel inside messages is in ``fork``.
"""

from __future__ import annotations

import weakref
from typing import Any, Generic, NoReturn, TypeVar

import torch

from ..agent import agent as _agent_mod
from ..agent import calls
from ..agent.futures import map_result, set_error
from ..agent.worlds import WorkerInfo
from ..autograd.engine import backward as _dist_backward
from ..errors import RpcError, RpcTimeoutError
from ..options import UNSET_RPC_TIMEOUT
from ..protocol import allowlist, wire
from .release import collect, delete_after_creation, drop_owner_handle
from .state import Id, _ctx, _on_create, _on_fetch, _on_invoke, _on_type, check_attribute, fmt, new_id

T = TypeVar("T")


class RRef(Generic[T]):
    """A reference to a value owned by some worker (torch.distributed.rpc.RRef)."""

    def __init__(self, value: T, type_hint: type | None = None) -> None:
        agent = _agent_mod.current_agent(_agent_mod.AGENT_NOT_SET)
        rref_id = new_id()
        e = _ctx.entry(rref_id)
        e.value.set_result(value)
        self._init(agent.me.id, rref_id, None, True)

    # -- construction of the two flavours --------------------------------------------------------
    def _init(
        self,
        owner: int,
        rref_id: Id,
        fork_id: Id | None,
        confirmed: bool,
        creation: torch.futures.Future[Any] | None = None,
    ) -> None:
        self._owner_id = owner
        # Which member held the owner's rank (a dynamic group may give a rank to a newcomer
        # once its holder left: this RRef is not the newcomer's).
        self._owner_gen = _agent_mod.current_agent().roster.generation(owner)
        self._rref_id = rref_id
        self._fork_id = fork_id
        self._confirmed = confirmed
        self._creation = creation
        # what _get_profiling_future waits on: the creation call (also a remote() to itself,
        # whose owner handle has no creation to confirm)
        self._profiling = creation
        self._deleted = False
        self._owner_left = False  # set by state.forget_owner: nothing to delete on the owner
        self._type: type | None = None  # the value's type, once known (see _get_type)
        self._type_fetch: torch.futures.Future[Any] | None = None
        if fork_id is None:
            with _ctx.lock:
                _ctx.entry(rref_id).handles += 1
        else:
            _ctx.users[fork_id] = self

    @classmethod
    def _owner_handle(cls, rref_id: Id) -> RRef[Any]:
        r = cls.__new__(cls)
        r._init(_agent_mod.current_agent().me.id, rref_id, None, True)
        return r

    @classmethod
    def _user(
        cls, owner: int, rref_id: Id, fork_id: Id, confirmed: bool, creation: torch.futures.Future[Any] | None = None
    ) -> RRef[Any]:
        r = cls.__new__(cls)
        r._init(owner, rref_id, fork_id, confirmed, creation)
        return r

    def __del__(self) -> None:
        if getattr(self, "_rref_id", None) is None or self._deleted or self._owner_left:
            return
        if self._fork_id is not None and (self._creation is None or self._confirmed):
            collect(self._owner_id, self._rref_id, self._fork_id)  # the common case: wakes no thread
        elif self._fork_id is None:
            drop_owner_handle(self._rref_id)
        else:
            delete_after_creation(self._owner_id, self._rref_id, self._fork_id, self._creation)  # type: ignore[arg-type]

    # -- public API -------------------------------------------------------------------------------
    def is_owner(self) -> bool:
        return self._fork_id is None

    def owner(self) -> WorkerInfo:
        agent = _agent_mod.current_agent()
        agent.roster.check_generation(self._owner_id, self._owner_gen, f"the owner of {self}")
        return agent.roster.workers[self._owner_id]

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
        if self._fork_id is not None:
            _agent_mod.current_agent().roster.check_generation(self._owner_id, self._owner_gen, f"{what}() on {self}")

    def local_value(self) -> T:
        self._check_alive("local_value")
        fork_id = self._fork_id
        if fork_id is not None:  # a user handle
            me = _agent_mod.current_agent().me
            # torch's words (tests match them), then the way out
            raise RpcError(
                f"For UserRRef(rref_id={fmt(self._rref_id)}, fork_id={fmt(fork_id)}), can't call localValue() on "
                f"user {me}. Call it on owner {self.owner()}; to_here() copies the value here."
            )
        value: T = _ctx.entry(self._rref_id).value.wait()
        return value

    def to_here(self, timeout: float = -1) -> T:
        """Copy the value from the owner (the value itself on the owner); blocks."""
        self._check_alive("to_here")
        value: T
        if self.is_owner():
            value = _ctx.entry(self._rref_id).value.wait()
            return value
        self._raise_creation_error()
        value = calls.invoke(self._owner_id, _on_fetch, (self._rref_id,), None, timeout, "sync")
        return value

    def _raise_creation_error(self) -> None:
        c = self._creation
        if c is not None and c.done():
            try:
                c.wait()
            except RpcTimeoutError as e:
                raise RpcError(
                    "RRef creation via rpc.remote() timed out, and it is possible that the RRef on the "
                    "owner node does not exist."
                ) from e
            except RpcError:
                pass  # other creation errors surface from the fetch itself

    def _get_future(self) -> torch.futures.Future[Any]:
        if self._creation is not None:
            return self._creation
        f: torch.futures.Future[Any] = torch.futures.Future()
        f.set_result(None)
        return f

    def _get_profiling_future(self) -> torch.futures.Future[Any]:
        """Completes when the ``remote()`` call that made this RRef has its profiled event
        (its creation answered), as torch's: the creation future, also for a ``remote()`` to
        this worker itself (whose value may be set before the call's event is)."""
        if self._profiling is not None:
            return self._profiling
        return self._get_future()

    def _get_type(self, timeout: float = -1, blocking: bool = True) -> Any:
        """The type of the value (``blocking=False``: a Future of it). A user handle asks
        its owner once (one call); the type is then kept on the handle, as torch keeps it."""
        if self._type is not None:
            if blocking:
                return self._type
            if self._type_fetch is None:  # the type came without a fetch: one future for every later call
                f: torch.futures.Future[Any] = torch.futures.Future()
                f.set_result(self._type)
                self._type_fetch = f
            return self._type_fetch  # the same future each time, as torch's cached one
        fut = self._type_future(timeout)
        if not blocking:
            return fut
        # Kept here too: the done-callback that keeps it may still be running on the thread
        # that completed the future when wait() returns, and the next proxy call must see it.
        self._type = fut.wait()
        return self._type

    def _type_future(self, timeout: float) -> torch.futures.Future[Any]:
        """A Future of the value's type, kept on the handle once it succeeded."""
        fut = self._type_fetch
        if fut is None or (fut.done() and not _succeeded(fut)):  # none yet, or failed (a timeout): ask again
            if self.is_owner():
                fut = map_result(_ctx.entry(self._rref_id).value, type)
            else:
                fut = calls.invoke_async(self._owner_id, _on_type, (self._rref_id,), None, timeout, "async")
            self._type_fetch = fut
            ref = weakref.ref(self)
            torch.futures.Future.add_done_callback(fut, lambda f: _keep_type(ref, f))
        return fut

    def rpc_sync(self, timeout: float = -1) -> _Proxy:
        return _Proxy(self, "sync", timeout)

    def rpc_async(self, timeout: float = -1) -> _Proxy:
        return _Proxy(self, "async", timeout)

    def remote(self, timeout: float = -1) -> _Proxy:
        return _Proxy(self, "remote", timeout)

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        _backward(self, dist_autograd_ctx_id, retain_graph)

    def __repr__(self) -> str:
        if self.is_owner():
            return f"OwnerRRef({fmt(self._rref_id)})"
        return f"UserRRef(RRefId = {fmt(self._rref_id)}, ForkId = {fmt(self._fork_id)})"  # type: ignore[arg-type]

    def __reduce__(self) -> NoReturn:
        raise RuntimeError("Can not pickle rref in python pickler, rref can only be pickled when using RPC")

    @classmethod
    def __class_getitem__(cls, item: Any) -> Any:
        return cls


def _keep_type(ref: weakref.ref[RRef[Any]], f: torch.futures.Future[Any]) -> None:
    rref = ref()
    if rref is not None and _succeeded(f):
        rref._type = f.value()


class _Proxy:
    """``rref.rpc_sync().method(*args)`` runs ``method`` on the owner's value. As torch's,
    it first checks that the value's type has ``method`` (``_get_type``: one call to the
    owner per RRef, then kept): a missing one raises AttributeError here, and for
    ``rpc_async()`` fails the returned future, with no call sent. An ``rpc_async()`` on an
    RRef whose type is not known yet sends its call at once and the owner makes the same
    check before running anything (``state.check_attribute``): the call stays in order
    with the thread's other calls to that owner and inside its autograd context, which a
    call sent later from a callback would leave."""

    def __init__(self, rref: RRef[Any], mode: str, timeout: float) -> None:
        self._rref, self._mode, self._timeout = rref, mode, timeout

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            rref = self._rref
            rref._check_alive(self._mode)
            if self._mode != "async":
                check_attribute(rref._get_type(self._timeout), name)
                return _invoke(rref, self._mode, self._timeout, name, args, kwargs)
            known = rref._type
            if known is not None:
                try:
                    check_attribute(known, name)
                except AttributeError as e:
                    failed: torch.futures.Future[Any] = torch.futures.Future()
                    set_error(failed, e)
                    return failed
            return _invoke(rref, "async", self._timeout, name, args, kwargs)

        return call


def _invoke(
    rref: RRef[Any], mode: str, timeout: float, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if mode == "remote":
        call_args = (rref._rref_id, name, args, kwargs)
        return remote(rref._owner_id, _on_invoke, args=call_args, timeout=timeout, _keepalive=rref)
    fut = invoke_on_owner(rref, name, args, kwargs, timeout, mode)
    return fut.wait() if mode == "sync" else fut


def invoke_on_owner(
    rref: RRef[Any],
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float = UNSET_RPC_TIMEOUT,
    mode: str = "async",
    user_func: Any = None,
    waited: bool = False,
) -> torch.futures.Future[Any]:
    """Call ``name(*args, **kwargs)`` on the RRef's value, on its owner, as the RRef proxies do.

    The call names the value by RRef id instead of forking the RRef (no fork, accept or delete
    messages), and holds ``rref`` until the answer, which keeps the owner's value alive
    meanwhile. ``mode`` ("sync" or "async") and ``user_func`` (the function to name) are what a
    profile shows; ``waited``: the caller waits on the future itself (``calls.invoke_async``).
    """
    call_args = (rref._rref_id, name, args, kwargs)
    return calls.invoke_async(
        rref._owner_id, _on_invoke, call_args, None, timeout, mode, user_func=user_func, keepalive=rref, waited=waited
    )


def owner_id_of(rref: RRef[Any]) -> int:
    """The rank of the RRef's owner (``rref.owner().id``, without checking it is still a member)."""
    return rref._owner_id


def rref_id_of(rref: RRef[Any]) -> Id:
    """The id the owner keeps the RRef's value under (for ``owned_value`` there)."""
    return rref._rref_id


# -- remote(): creating a value on its owner ---------------------------------------------------------
def remote(
    to: Any,
    func: Any,
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
    _keepalive: Any = None,
) -> RRef[Any]:
    """Run ``func`` on ``to`` and return an RRef to its result, owned by ``to``, at once.
    Errors inside ``func`` surface at ``to_here()`` with their type."""
    agent = _agent_mod.current_agent()
    if not callable(func):
        raise TypeError("function should be callable.")
    dst = agent.worker_info(to).id
    rref_id = new_id()
    call_args = (tuple(args) if args is not None else (), kwargs if kwargs is not None else {})
    # The id also travels in the frame head: if the callee cannot even unpickle the call
    # (function missing there), it still stores the error for to_here() to raise.
    extras = {wire.EXTRA_RREF_CREATE: rref_id}
    if dst == agent.me.id:
        handle = RRef._owner_handle(rref_id)  # registers the entry; the value follows
        handle._profiling = calls.invoke_async(
            dst,
            _on_create,
            (rref_id, None, func) + call_args,
            None,
            timeout,
            "remote",
            user_func=func,
            keepalive=_keepalive,
            extras=extras,
        )
        return handle
    fork_id = new_id()
    creation = calls.invoke_async(
        dst,
        _on_create,
        (rref_id, fork_id, func) + call_args,
        None,
        timeout,
        "remote",
        user_func=func,
        keepalive=_keepalive,
        extras=extras,
    )
    return _new_user_for_remote(dst, rref_id, fork_id, creation)


def _new_user_for_remote(owner: int, rref_id: Id, fork_id: Id, creation: torch.futures.Future[Any]) -> RRef[Any]:
    rref = RRef._user(owner, rref_id, fork_id, False, creation)
    ref = weakref.ref(rref)

    def confirm(f: torch.futures.Future[Any]) -> None:
        r = ref()
        if r is not None:
            r._confirmed = _succeeded(f)

    # Not RpcFuture's add_done_callback: this one is safe to run inline on the thread that
    # reads the acknowledgement, and so needs no hop through the pool.
    torch.futures.Future.add_done_callback(creation, confirm)
    return rref


def _succeeded(f: torch.futures.Future[Any]) -> bool:
    try:
        f.wait()
        return True
    except BaseException:  # noqa: BLE001 - any error means it did not succeed
        return False


# -- RRef.backward ------------------------------------------------------------------------------------
def _backward(rref: RRef[Any], context_id: int, retain_graph: bool) -> None:
    """Run backward from the RRef's value (on its owner)."""
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
        _dist_backward(context_id, [value], retain_graph)
        return
    calls.rpc_sync(rref.owner(), _backward_on_owner, args=(rref, context_id, retain_graph))


def _backward_on_owner(rref: RRef[Any], context_id: int, retain_graph: bool) -> None:
    _backward(rref, context_id, retain_graph)


allowlist.internal(_backward_on_owner)  # called by name on the owner (serializer='safe')
