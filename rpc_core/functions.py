"""``async_execution``: remote functions that return a Future instead of a value; and
``after_response`` (an rpc_core extension): work a served function leaves for after its answer.

The callee runs the function, gets a ``torch.futures.Future`` back, and answers the caller
from that future's callback, so no server thread sits waiting (e.g. while the function
waits for other workers, or batches requests from several callers).

``after_response(fn)``, called while a request is being served (by the function itself, or by
code it runs, such as a backward hook of ``rpc_core.autograd``), runs ``fn`` on the same
thread right after that request's answer is written: the caller goes on while the callee
finishes work whose result the answer does not carry (a parameter server's optimizer step,
ordered before the next read by the server itself). torch has no such call.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger("rpc_core")

F = TypeVar("F", bound=Callable[..., Any])


def async_execution(fn: F) -> F:
    """Mark ``fn`` as returning a ``torch.futures.Future`` when run through RPC.

    With ``@staticmethod`` or ``@classmethod`` put this decorator innermost. Called locally,
    the function behaves as written (it returns the Future).
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    wrapper._wrapped_async_rpc_function = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


# The work left for after the answer of the request this thread is serving; None: none is.
_serving = threading.local()


def after_response(fn: Callable[[], Any]) -> None:
    """Run ``fn()`` on this thread once the answer of the request it is serving is written
    (an rpc_core extension). For an ``async_execution`` function, once its future's answer
    is; if the thread that completes that future is itself serving a request, also after
    that request's answer (so ``fn`` must not be what that request waits for). Outside a
    request (a function called locally, a hook of the caller's own backward) ``fn`` runs at
    once. What ``fn`` raises cannot reach the caller, who has its answer: it is logged as an
    error; handle failures inside ``fn``."""
    pending: list[Callable[[], Any]] | None = getattr(_serving, "after", None)
    if pending is None:
        run_after([fn])
    else:
        pending.append(fn)


def serving() -> list[Callable[[], Any]] | None:
    """(For the dispatcher.) Start collecting ``after_response`` work for a request served on
    this thread; returns what was being collected before (a request served inside another)."""
    outer: list[Callable[[], Any]] | None = getattr(_serving, "after", None)
    _serving.after = []
    return outer


def served(outer: list[Callable[[], Any]] | None) -> list[Callable[[], Any]]:
    """(For the dispatcher.) Stop collecting for the request ``serving`` started; returns its
    work, to run with ``run_after`` once its answer is written."""
    mine: list[Callable[[], Any]] = getattr(_serving, "after", None) or []
    _serving.after = outer
    return mine


def run_after(work: list[Callable[[], Any]]) -> None:
    """(For the dispatcher.) Run ``work`` left by ``after_response``, logging what raises."""
    for fn in work:
        try:
            fn()
        except Exception:  # noqa: BLE001 - the caller has its answer: nobody else can see this
            log.exception("rpc_core: %r, left by after_response for after an answer, raised", fn)
