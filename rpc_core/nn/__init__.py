"""``torch.distributed.nn``'s RPC part: ``RemoteModule``.

from rpc_core.nn import RemoteModule      # was: from torch.distributed.nn import RemoteModule
"""

from __future__ import annotations

from .remote_module import RemoteModule

__all__ = ["RemoteModule"]
