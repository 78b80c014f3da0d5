"""Futures of RPC calls, and how a call's error reaches the code waiting for it.

``RpcFuture`` is the ``torch.futures.Future`` every call returns. ``set_error`` completes a
future with an exception that each waiter gets as a fresh copy, and ``rebuild_exception``
turns the ``ExceptionInfo`` a callee sent back into an exception of the original type.

torch's C++ core does not see an error stored so (no Python API can mark a Future failed
with its original exception), so ``set_error`` also tells those who asked to hear of it
(``watch_failures``): ``early_exit``'s ``torch.futures.wait_all``, which must return at the
first failure as torch's does for its own RPC futures.
"""

from __future__ import annotations

import copy
import importlib
import threading
import traceback
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from ..errors import PEER_ATTRIBUTE, RemoteFunctionError, RpcError
from ..protocol import allowlist, serialization, wire
from .pool import handoff_current

S = TypeVar("S")

# Set (to True) on a future that ``set_error`` failed, before it completes it.
_FAILED = "_rpc_core_failed"
# Who hears of each failure ``set_error`` makes (see watch_failures); replaced, never changed.
_watchers: tuple[Callable[[torch._C.Future[Any]], None], ...] = ()
_watchers_lock = threading.Lock()


def watch_failures(watcher: Callable[[torch._C.Future[Any]], None]) -> None:
    """Call ``watcher(fut)`` each time ``set_error`` fails a future (on the thread that fails
    it, once it is completed), until ``unwatch_failures``. A failure made before this is
    found with ``failed_here``."""
    global _watchers
    with _watchers_lock:
        _watchers = (*_watchers, watcher)


def unwatch_failures(watcher: Callable[[torch._C.Future[Any]], None]) -> None:
    global _watchers
    with _watchers_lock:
        _watchers = tuple(w for w in _watchers if w is not watcher)


def failed_here(fut: torch._C.Future[Any]) -> bool:
    """Whether ``set_error`` failed ``fut`` (True as soon as it began to: check ``done()`` too)."""
    return getattr(fut, _FAILED, False)


def set_error(fut: torch._C.Future[Any], error: BaseException) -> None:
    """Complete ``fut`` with ``error``; every ``wait()``/``value()`` then raises a fresh copy.

    torch's ``set_exception`` re-raises the stored exception object itself, so each waiter's
    frames are appended to its traceback and stay reachable from the future: a frame that
    holds the future (``self`` in ``wait``) or an RRef makes a cycle through C++ that the
    garbage collector cannot break, and RRefs in those frames are never released. Here the
    stored exception keeps only the lines of the frames it was raised in (their locals are
    cleared), and waiters get a copy with the same type and message, chained to it.
    """
    if fut.done():  # before touching its unwrap function, which would apply to the old value
        raise RuntimeError("set_error: this Future is already completed")
    tb = error.__traceback__
    if tb is not None:
        # The first frame is the one that caught it, still running: drop it; clear the rest.
        traceback.clear_frames(tb.tb_next)
        error.__traceback__ = tb.tb_next
    fut._set_unwrap_func(_raise_copy)
    try:
        setattr(fut, _FAILED, True)  # before it completes: see watch_failures
    except AttributeError:
        pass  # a future made by torch's C++ core (then()): its own waiters only
    fut.set_result(error)
    for watcher in _watchers:
        watcher(fut)


def _raise_copy(error: BaseException) -> None:
    try:
        fresh = copy.copy(error)
    except Exception:  # noqa: BLE001 - a type whose constructor cannot rebuild it from its args
        raise error from None  # its constructor cannot rebuild it from its args: raise the original
    raise fresh from (error if error.__traceback__ is not None else None)


class RpcFuture(torch.futures.Future[Any]):
    """A torch Future that knows whether user callbacks hang on it, so a reader thread
    completes it inline only when no callback could block that reader. Errors set on it
    raise fresh copies (see ``set_error``)."""

    _has_callbacks = False
    _reader: Any = None  # the Outbound of the call's connection: a waiter may read its answer
    _deadline: float | None = None
    _answered = False  # the answer (or failure) arrived; completing may still be queued
    _rpc_core_failed = False  # set_error failed it (see failed_here; here for a fast lookup)

    def __init__(self) -> None:
        # Straight to the C++ constructor: torch.futures.Future.__init__ only converts a
        # device list, which RPC futures never have, and one is built per call.
        torch._C.Future.__init__(self, [])

    @property
    def has_callbacks(self) -> bool:
        """Whether a user callback hangs on it (``then``, ``add_done_callback``): such a callback
        may block, so the future must be completed off the connections' reader threads."""
        return self._has_callbacks

    def set_exception(self, result: BaseException) -> None:
        set_error(self, result)

    def then(self, callback: Callable[[torch.futures.Future[Any]], S]) -> torch.futures.Future[S]:
        self._has_callbacks = True
        return super().then(callback)

    def add_done_callback(self, callback: Callable[[torch.futures.Future[Any]], None]) -> None:
        self._has_callbacks = True
        return super().add_done_callback(callback)

    # torch.futures.Future's done/value/wait are Python wrappers of these C++ methods; RPC
    # paths call them several times per call.
    done = torch._C.Future.done
    value = torch._C.Future.value

    def wait(self) -> Any:
        if not self.done():
            handoff_current()  # a pool or reader thread about to block must not hold up other calls
            if self._reader is not None:
                self._reader.read_until(self, self._deadline)  # read our answer ourselves
        return _wait(self)


_wait = torch._C.Future.wait


def map_result(fut: torch.futures.Future[Any], fn: Callable[[Any], Any]) -> torch.futures.Future[Any]:
    """A future of ``fn(fut's value)``. Unlike ``fut.then(...)``, an error of ``fut`` or of
    ``fn`` reaches its waiters as it was raised (its type and message), not as the
    RuntimeError("Got the following error when running the callback: ...") that ``then``
    makes of an exception in its callback."""
    out = RpcFuture()  # a call's future, as the one it maps (early_exit's wait_all knows it)

    def done(f: torch.futures.Future[Any]) -> None:
        try:
            result = fn(f.value())
        except BaseException as e:  # noqa: BLE001 - the error goes to the future's waiters
            set_error(out, e)
            return
        out.set_result(result)

    fut.add_done_callback(done)
    return out


def settle(futures: Iterable[torch.futures.Future[Any]]) -> tuple[list[Any], list[BaseException]]:
    """Wait for every future, even after one failed; return (values of those that
    succeeded, errors of those that failed), each in order."""
    values: list[Any] = []
    errors: list[BaseException] = []
    for f in futures:
        try:
            values.append(f.wait())
        except BaseException as e:  # noqa: BLE001 - collected for the caller
            errors.append(e)
    return values, errors


# The attribute that marks an exception rebuilt from another worker's answer (see raised_on).
# In the instance's __dict__, so the copies waiters get (set_error) keep it.
_RAISED_ON = "_rpc_core_raised_on"


def raised_on(error: BaseException) -> str | None:
    """The name of the worker ``error`` was raised on, if it came back from another worker
    as a call's exception; None if it arose here (a timeout, a lost peer, ...)."""
    return getattr(error, _RAISED_ON, None)


def _original_type(info: wire.ExceptionInfo) -> type[BaseException] | None:
    if serialization.codec_name() == "safe":
        # Only a type this worker allows (or a builtin one) is rebuilt: the wire never
        # chooses a module to import.
        return allowlist.exception_type(info.type_module, info.type_qualname)
    try:
        obj: Any = importlib.import_module(info.type_module)
        for part in info.type_qualname.split("."):
            obj = getattr(obj, part)
    except Exception:  # noqa: BLE001 - importing another worker's type may fail in any way
        return None
    return obj if isinstance(obj, type) and issubclass(obj, BaseException) else None


def rebuild_exception(info: wire.ExceptionInfo) -> BaseException:
    """The remote exception with its original type, or a RuntimeError saying why not;
    marked with the worker it was raised on (``raised_on``)."""
    error: BaseException | None = None
    cls = _original_type(info)
    if cls is not None:
        try:
            error = cls(info.message)
        except Exception:  # noqa: BLE001 - building another worker's type may fail in any way
            pass
    if error is None:
        error = RemoteFunctionError(
            f"Error on {info.worker}; its type could not be rebuilt here. Original exception on remote side was "
            f"{info.type_module}.{info.type_qualname}: {info.message}"
        )
    setattr(error, _RAISED_ON, info.worker)
    if info.peer and isinstance(error, RpcError):
        error.worker = info.peer
    elif info.peer:
        setattr(error, PEER_ATTRIBUTE, info.peer)  # another type has no ``worker``
    return error
