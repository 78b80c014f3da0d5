"""The errors of a distributed backward, named after the worker they happened on.

torch's distributed engine reports a failure as "Error on Node <rank>: <what>", and programs
match that prefix; rpc_core adds the worker's name after the first line. An error raised on
the worker that served a gradient call already names that worker (its handlers name every
error they raise), so a caller names only what arose on its own side (a peer that died, a
timeout). Several gradient calls that failed at once become one error listing them all.
Kept apart from the engine so the pass, the gradient calls and the hooks' finish all shape
their errors one way.
"""

from __future__ import annotations

from typing import Any

import torch

from ..agent import agent as _agent_mod
from ..agent.futures import raised_on, settle
from ..agent.worlds import WorkerInfo
from ..errors import format_many


def on_node(me: WorkerInfo, detail: object) -> str:
    """How an error of distributed backward names the worker it happened on: torch's
    "Error on Node 1: <what>" (programs match it), then the worker's name after the first
    line of ``detail`` (a remote traceback may follow it)."""
    first, nl, rest = str(detail).partition("\n")
    return f"Error on Node {me.id}: {first} (on {me.name}){nl}{rest}"


def settle_named(futures: list[torch.futures.Future[Any]]) -> tuple[list[Any], list[BaseException]]:
    """Wait for every gradient RPC; their answers, and their errors, each naming the node it happened on."""
    values, errors = settle(futures)
    return values, [_on_this_node(e) for e in errors]


def _on_this_node(e: BaseException) -> BaseException:
    """An error raised on the worker that ran the gradient call is kept as it is: that
    worker's ``_on_backward`` named itself in every error it raises (and the agent's remote
    traceback names it otherwise). An error that arose here (a peer that died, a timeout)
    is named after this node, which saw it."""
    if raised_on(e) is not None:
        return e
    me = _agent_mod.current_agent().me
    msg = on_node(me, f"in distributed backward: {e}")
    try:
        wrapped = type(e)(msg)  # keep the type (WorkerUnavailableError, RpcTimeoutError, ...)
    except Exception:  # noqa: BLE001 - a type's constructor may refuse a lone message
        wrapped = RuntimeError(on_node(me, f"in distributed backward: {type(e).__name__}: {e}"))
    wrapped.__cause__ = e
    return wrapped


def raise_all(errors: list[BaseException]) -> None:
    if errors:
        raise one_error(errors)


def one_error(errors: list[BaseException]) -> BaseException:
    if len(errors) == 1:
        return errors[0]
    return RuntimeError(format_many(errors, "distributed backward's gradient calls"))


def hook_error(me: WorkerInfo, e: BaseException) -> BaseException:
    """A hook's error, named after this worker (its type kept when it takes a message)."""
    msg = on_node(me, f"in a backward hook: {type(e).__name__}: {e}")
    try:
        wrapped = type(e)(msg)
    except Exception:  # noqa: BLE001 - a type's constructor may refuse a lone message
        wrapped = RuntimeError(msg)
    wrapped.__cause__ = e
    return wrapped
