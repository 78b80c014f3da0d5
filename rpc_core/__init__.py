"""rpc_core: PyTorch's distributed RPC primitives, reimplemented: faster, authenticated, no hangs.

Port a ``torch.distributed.rpc`` program by changing its imports::

    import rpc_core as rpc                      # was: import torch.distributed.rpc as rpc
    import rpc_core.autograd as dist_autograd   # was: torch.distributed.autograd
    from rpc_core.optim import DistributedOptimizer
"""
from typing import Tuple

from . import autograd, functions, optim, profiler  # autograd installs its middleware at init_rpc
from . import rref as _rref
from .agent import current_agent as _current_agent
from .api import (
    BackendType,
    _all_gather,
    _barrier,
    _get_current_rpc_agent,
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
    WorkerLeftError,
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

# The layers of rpc_core, bottom-up: a module imports only modules of lower layers (never
# one of its own layer, never one above, and a package's modules never the package's
# __init__), so the package has no import cycle and each layer can be read, tested and
# replaced knowing only those below it. tests/rpc_core/test_layering.py enforces this on
# every import, module- or function-level; a new module must be placed here.
_LAYERS: tuple[tuple[str, ...], ...] = (
    # foundations: no rpc_core imports
    ("knobs", "polling", "middleware"),
    ("errors", "wire", "options", "functions", "memory", "cma", "pool", "serialization"),
    ("handshake", "futures"),
    ("buffers",),
    ("sending",),
    ("transport",),  # connections: bytes only
    ("worlds",),  # WorkerInfo, and the World a rendezvous gives
    ("rendezvous", "outbound"),
    ("roster",),  # who is in the group (a part of the agent)
    ("deadlines", "completion", "dispatch"),  # the worker's parts: timer, pending calls, requests
    ("connections",),
    ("agent",),  # the worker
    ("calls", "lifecycle", "registry"),  # a user call; init/shutdown hooks, barriers; joins and leaves
    ("autograd.context",),
    ("autograd.engine", "autograd.release"),
    ("autograd.recording",),
    ("autograd",),  # the distributed autograd package's face
    ("rref_state",),  # RRef tables and the owner's handlers
    ("rref_release",),  # garbage-collected handles -> deletes
    ("rref_handle",),  # the RRef class, proxies, remote()
    ("rref_fork",),  # RRefs in messages; the protocol's middleware
    ("rref",),  # the RRef group's face
    ("optim", "profiler_rpc"),
    ("profiler",),
    ("api",),  # the facade: composes the layers into init_rpc/shutdown/...
    ("",),  # rpc_core itself: the public names
)


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
    "RpcTimeoutError", "TensorPipeRpcBackendOptions", "UNSET_RPC_TIMEOUT", "WorkerInfo", "WorkerLeftError",
    "WorkerUnavailableError", "functions", "get_rpc_timeout", "get_worker_info", "init_rpc", "is_available",
    "remote", "rpc_async", "rpc_sync", "shutdown",
]
