"""rpc_core: PyTorch's distributed RPC primitives, reimplemented: faster, authenticated, no hangs.

Port a ``torch.distributed.rpc`` program by changing its imports::

    import rpc_core as rpc                      # was: import torch.distributed.rpc as rpc
    import rpc_core.autograd as dist_autograd   # was: torch.distributed.autograd
    from rpc_core.optim import DistributedOptimizer
"""
from . import autograd, functions, optim, profiler  # autograd installs its middleware at init_rpc
from . import rref as _rref
from .agent import current_agent as _current_agent
from .api import (
    BackendType,
    _all_gather,
    _barrier,
    _set_rpc_timeout,
    _wait_all_workers,
    get_rpc_timeout,
    get_worker_info,
    init_rpc,
    is_available,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from .errors import (
    AuthenticationError,
    ProtocolError,
    RendezvousError,
    RpcError,
    RpcNotInitializedError,
    RpcTimeoutError,
    WorkerUnavailableError,
)
from .options import (
    DEFAULT_RPC_TIMEOUT_SEC,
    DEFAULT_SHUTDOWN_TIMEOUT,
    UNSET_RPC_TIMEOUT,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
)
from .rendezvous import WorkerInfo
from .rref import RRef

def _get_debug_info() -> dict:
    """Counters for tests and debugging: RRef tables, agent state."""
    info = dict(_rref.debug_info())
    agent = _current_agent()
    info.update({
        "agent.thread_pool_size": agent.pool.size,
        "agent.num_pending_requests": agent.in_flight(),
        "agent.num_idle_threads": agent.pool.idle,
    })
    return info


__all__ = [
    "AuthenticationError", "BackendType", "DEFAULT_RPC_TIMEOUT_SEC", "DEFAULT_SHUTDOWN_TIMEOUT",
    "ProtocolError", "RRef", "RendezvousError", "RpcBackendOptions", "RpcError", "RpcNotInitializedError",
    "RpcTimeoutError", "TensorPipeRpcBackendOptions", "UNSET_RPC_TIMEOUT", "WorkerInfo",
    "WorkerUnavailableError", "functions", "get_rpc_timeout", "get_worker_info", "init_rpc", "is_available",
    "remote", "rpc_async", "rpc_sync", "shutdown",
]
