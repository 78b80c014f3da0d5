"""The torch-private names torch's RPC tests import, and what each is under the routes.

A name mapped here is rpc_core's equivalent of torch's (same role, same results). A name
not mapped resolves to a stand-in that raises ``routing.NotEmulated`` when used: the tests
that touch it fail with that error, and ``exclusions.TORCH_PRIVATE`` says why rpc_core
does not emulate it. This module only maps names: behaviour lives in rpc_core.
"""

from __future__ import annotations

from typing import Any

import rpc_core
import rpc_core.nn
import rpc_core.profiler
import rpc_core.rref

# torch.distributed.rpc
RPC: dict[str, Any] = {
    "_rref_context_get_debug_info": rpc_core.rref.debug_info,
}

# torch.distributed.rpc.api
API: dict[str, Any] = {
    # dist_init sets it on torch's module; rpc_core reports no leaks to ignore.
    "_ignore_rref_leak": True,
}

# torch.distributed.rpc.internal: torch's profiling key and call kinds; its pickler is not mapped.
INTERNAL: dict[str, Any] = {
    "_build_rpc_profiling_key": rpc_core.profiler.rpc_profiling_key,
    "RPCExecMode": rpc_core.profiler.RpcExecMode,
}

# torch.distributed.rpc.backend_registry
BACKEND_REGISTRY: dict[str, Any] = {
    "BackendType": rpc_core.BackendType,
}

# torch.distributed.nn.api.remote_module
REMOTE_MODULE: dict[str, Any] = {
    # torch's base class, which also takes ``_module_interface_cls`` (a scriptable
    # RemoteModule: rpc_core raises NotImplementedError, "no TorchScript RPC").
    "_RemoteModule": rpc_core.nn.RemoteModule,
}
