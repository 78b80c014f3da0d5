"""Remote references: owners, users, and the fork/confirm/delete protocol.

The RRef group, bottom-up (each module imports only those before it):

- ``state``: ids, the per-process tables (the owner's entries: value, user forks, local
  handles; the users' live handles, unconfirmed forks, waiting deletes) and the owner-side
  handlers (``_on_create``, ``_on_fetch``, ``_on_fork``, ``_on_user_deletes``, ...).
- ``release``: the release loop that turns garbage-collected handles into deletes.
- ``handle``: the ``RRef`` class, its proxies, and ``remote()``.
- ``fork``: how RRefs travel (forks by pickling) and the protocol's agent plug-ins.

Protocol (every message is an ordinary RPC to one of the ``_on_*`` functions):
- ``remote()`` registers the creator's fork with ``_on_create``, which runs the function and
  stores its result or exception; the reply confirms the creator's RRef.
- Sending an RRef forks it (``fork``): a fork is always registered on the owner
  before its parent can be deleted, and a function that receives RRefs runs only after
  their forks are confirmed.
- A garbage-collected user RRef is deleted on its owner (``release``); deletes ride on
  the next request to the owner (``rdel``), or go on their own shortly after.

This module is the group's face: the names the rest of rpc_core uses. Tests that look
inside (the tables, the handlers) import ``state`` and ``release`` themselves.
"""

from __future__ import annotations

# Re-exported (noqa: F401): the group's names, where the rest of rpc_core finds them.
from .fork import RRefMiddleware, install, on_request_failed  # noqa: F401
from .handle import RRef, invoke_on_owner, owner_id_of, remote, rref_id_of  # noqa: F401
from .release import delete_all_user_rrefs, flush  # noqa: F401
from .state import HANDLER_DISPLAY_NAMES, Id, debug_info, owned_value, reset  # noqa: F401

__all__ = [
    "RRef",
    "remote",
    # the group's face for the rest of rpc_core
    "HANDLER_DISPLAY_NAMES",
    "Id",
    "RRefMiddleware",
    "debug_info",
    "delete_all_user_rrefs",
    "flush",
    "install",
    "invoke_on_owner",
    "on_request_failed",
    "owned_value",
    "owner_id_of",
    "reset",
    "rref_id_of",
]
