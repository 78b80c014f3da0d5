"""Exception hierarchy of rpc_core.

Every error derives from ``RpcError``, itself a ``RuntimeError`` so that code written for
``torch.distributed.rpc`` (which raises ``RuntimeError``) keeps catching what it caught.
Messages say what happened, where (which worker) and how to fix it.
"""
from __future__ import annotations

from collections.abc import Sequence


class RpcError(RuntimeError):
    """Base class of all rpc_core errors."""


class RpcNotInitializedError(RpcError):
    """An API was used before ``init_rpc`` (or after ``shutdown``)."""


class RpcTimeoutError(RpcError, TimeoutError):
    """A call did not complete within its timeout. The message contains
    ``"RPC ran for more than"`` like torch's, so existing ``assertRaisesRegex`` checks match."""


class RendezvousError(RpcError):
    """Workers could not find each other: bad init_method, port in use, world never filled,
    duplicate or invalid names."""


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


def format_many(errors: Sequence[BaseException], what: str) -> str:
    """One message reporting every failure when several futures fail, not just the first."""
    lines = [f"{len(errors)} of the {what} failed:"]
    for i, err in enumerate(errors):
        lines.append(f"  [{i}] {type(err).__name__}: {err}")
    return "\n".join(lines)
