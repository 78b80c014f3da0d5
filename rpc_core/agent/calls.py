"""Issuing a call: ``rpc_sync``, ``rpc_async`` and the one path every user-level call takes.

Everything above the agent that sends a call on a user's behalf (RRef proxies and
``remote``, distributed autograd's gradient calls, the optimizer's steps) goes through
``invoke_async``, so the call wrappers (the profiler) see each of them. rpc_core's own
bookkeeping messages (RRef forks and deletes, context cleanups, barriers) go straight to
``Agent.send_request``: they are not the user's calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..options import UNSET_RPC_TIMEOUT
from ..protocol import wire
from .agent import current_agent

# Wrappers around outgoing user calls: fn(exec_mode, func, dst, send) -> Future, where func is
# the user's function (for remote, the one whose result the RRef holds) and send(extras=None)
# sends the call, optionally with message extras. Empty unless the profiler is on, so the
# call path pays nothing for it otherwise.
call_wrappers: list[Callable[..., torch.futures.Future[Any]]] = []


def invoke_async(
    to: Any,
    func: Any,
    args: tuple[Any, ...] | None,
    kwargs: dict[str, Any] | None,
    timeout: float,
    exec_mode: str,
    user_func: Any = None,
    keepalive: Any = None,
    extras: dict[str, Any] | None = None,
    waited: bool = False,
) -> torch.futures.Future[Any]:
    """Send a call. ``keepalive`` is held until the answer arrives (an RRef whose id the call
    carries instead of a fork); ``extras`` travel in the frame head. ``waited``: the caller
    will wait on the returned future itself (as "sync" calls do), so its answer needs no
    background reader (see outbound)."""
    base_extras = extras
    agent = current_agent()
    if not callable(func):
        raise TypeError("function should be callable.")
    dst = agent.worker_info(to).id
    args = tuple(args) if args is not None else ()
    kwargs = kwargs if kwargs is not None else {}
    if call_wrappers:
        # one read: another thread may empty the list
        wrap: Callable[..., torch.futures.Future[Any]] | None = next(reversed(call_wrappers), None)
        if wrap is not None:

            def send(
                f: Any = func,
                a: tuple[Any, ...] = args,
                k: dict[str, Any] = kwargs,
                extras: dict[str, Any] | None = None,
            ) -> torch.futures.Future[Any]:
                extras = dict(base_extras or {}, **(extras or {}))
                return agent.send_request(
                    dst,
                    f,
                    a,
                    k,
                    timeout,
                    extras=extras,
                    call_extras=None if keepalive is None else _held(extras, keepalive),
                )

            return wrap(exec_mode, func if user_func is None else user_func, dst, send)
    # A "sync" caller waits on this very future at once, so its wait() reads the answer;
    # remote()'s acknowledgement is read lazily (see Agent.send_request).
    sync = exec_mode == "sync" or waited
    lazy = exec_mode == "remote"
    if keepalive is not None:
        return agent.send_request(
            dst, func, args, kwargs, timeout, extras=extras, call_extras=_held(extras, keepalive), sync=sync, lazy=lazy
        )
    return agent.send_request(dst, func, args, kwargs, timeout, extras=extras, sync=sync, lazy=lazy)


def _held(extras: dict[str, Any] | None, keepalive: Any) -> dict[str, Any]:
    """The call's extras on the caller: those sent, plus ``keepalive``, held until the answer."""
    out = dict(extras) if extras else {}
    out[wire.LOCAL_KEEPALIVE] = keepalive
    return out


def invoke(
    to: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None, timeout: float, exec_mode: str
) -> Any:
    """``invoke_async`` and wait for the result."""
    return invoke_async(to, func, args, kwargs, timeout, exec_mode).wait()


def rpc_sync(
    to: Any,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Any:
    """Run ``func(*args, **kwargs)`` on worker ``to`` (name, WorkerInfo or rank) and return its result."""
    return invoke_async(to, func, args, kwargs, timeout, "sync").wait()


def rpc_async(
    to: Any,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> torch.futures.Future[Any]:
    """Like ``rpc_sync`` but returns a ``torch.futures.Future`` at once."""
    return invoke_async(to, func, args, kwargs, timeout, "async")
