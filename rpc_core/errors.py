"""Exception hierarchy of rpc_core.

Every error derives from ``RpcError``, itself a ``RuntimeError`` so that code written for
``torch.distributed.rpc`` (which raises ``RuntimeError``) keeps catching what it caught.
Messages say what happened, where (which worker) and how to fix it.
"""

from __future__ import annotations

from collections.abc import Sequence


class RpcError(RuntimeError):
    """Base class of all rpc_core errors. ``worker``: the name of the worker the error is
    about (the one that is unavailable, left the group or did not answer in time), when
    there is one; ``failed_worker`` finds it along an error's causes."""

    def __init__(self, *args: object, worker: str | None = None) -> None:
        super().__init__(*args)
        self.worker = worker


class RpcNotInitializedError(RpcError):
    """An API was used before ``init_rpc`` (or after ``shutdown``)."""


class RpcTimeoutError(RpcError, TimeoutError):
    """A call did not complete within its timeout. The message contains
    ``"RPC ran for more than"`` like torch's, so existing ``assertRaisesRegex`` checks match."""


class RendezvousError(RpcError):
    """Workers could not find each other: bad init_method, port in use, world never filled,
    duplicate or invalid names. ``missing_ranks``: when the world never filled, the ranks
    that did not join (an application names them by its own roles)."""

    def __init__(self, *args: object, worker: str | None = None, missing_ranks: Sequence[int] = ()) -> None:
        super().__init__(*args, worker=worker)
        self.missing_ranks = tuple(missing_ranks)


class AuthenticationError(RpcError):
    """A peer failed the shared-secret challenge (wrong or missing secret)."""


class ProtocolError(RpcError):
    """Malformed bytes on a connection (garbage, truncated frame, absurd length)."""


class WorkerUnavailableError(RpcError, ConnectionError):
    """The destination worker is dead, unreachable, or closed its connection."""


class WorkerLeftError(WorkerUnavailableError):
    """The destination worker left the (dynamic) group with ``shutdown()``: its name, rank
    and RRefs are no longer served. The message says "worker X left the group"."""


class RemoteFunctionError(RpcError):
    """A remote exception whose original type could not be rebuilt on the caller."""


class NotAllowedError(RpcError):
    """Under ``serializer="safe"``: a message named a function or class that is not in this
    worker's allowlist (``rpc_core.safe.allow``), or held a value the safe serializer does
    not encode. The message names it and says how to allow it; nothing was run."""


# Where torch raises RuntimeError for what is a bad value or type, rpc_core raises these:
# ``except RuntimeError`` (code written for torch) and ``except ValueError``/``TypeError``
# (code written for rpc_core's earlier releases) both catch them.
class RpcValueError(RpcError, ValueError):
    """A bad value where torch raises ``RuntimeError``: an invalid worker name, a negative
    ``rpc_timeout``, ``num_worker_threads`` < 1."""


class RpcTypeError(RpcError, TypeError):
    """A value of the wrong type where torch raises ``RuntimeError``: an ``@async_execution``
    function that returned something other than a Future."""


def not_a_future(value: object) -> RpcTypeError:
    """The error for an ``@async_execution`` function that returned ``value``, not a Future:
    torch's words first (tests match them), then how to fix it."""
    t = type(value)
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    return RpcTypeError(
        f"Functions decorated with @rpc.async_function must return a torch.futures.Future object, but got {name}. "
        "Return a Future (e.g. rpc_async(...).then(...)), or drop @async_execution to return a value."
    )


# Set on an exception of another type than RpcError rebuilt from another worker's answer:
# the worker its chain of causes named there (a rebuilt RpcError carries it in ``worker``).
PEER_ATTRIBUTE = "_rpc_core_peer"


def failed_worker(error: BaseException) -> str | None:
    """The name of the worker ``error`` is about -- unavailable, gone, or silent past a
    timeout -- from the first of its causes (``__cause__``/``__context__``) that names one,
    an error another worker sent back included; None if none does."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        worker = e.worker if isinstance(e, RpcError) else getattr(e, PEER_ATTRIBUTE, None)
        if worker:
            return str(worker)
        e = e.__cause__ or e.__context__
    return None


def format_many(errors: Sequence[BaseException], what: str) -> str:
    """One message reporting every failure when several futures fail, not just the first."""
    lines = [f"{len(errors)} of the {what} failed:"]
    for i, err in enumerate(errors):
        lines.append(f"  [{i}] {type(err).__name__}: {err}")
    return "\n".join(lines)
