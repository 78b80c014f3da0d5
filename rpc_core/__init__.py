"""rpc_core: PyTorch's distributed RPC primitives, reimplemented: faster, authenticated, no hangs.

Port a ``torch.distributed.rpc`` program by changing its imports::

    import rpc_core as rpc                      # was: import torch.distributed.rpc as rpc
    import rpc_core.autograd as dist_autograd   # was: torch.distributed.autograd
    from rpc_core.optim import DistributedOptimizer
"""
from typing import Any

from . import autograd, constants, functions, optim, profiler  # autograd installs its middleware at init_rpc
from . import rref as _rref

# imported for its effect: scripted functions and modules travel in messages
from . import torchscript as _torchscript  # noqa: F401
from .agent import current_agent as _current_agent
from .api import (
    BackendType,
    get_rpc_timeout,
    get_worker_info,
    init_rpc,
    is_available,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)

# private helpers torch.distributed.rpc also has (tests use them), re-exported by the `as` form
from .api import _all_gather as _all_gather
from .api import _barrier as _barrier
from .api import _get_current_rpc_agent as _get_current_rpc_agent
from .api import _is_current_rpc_agent_set as _is_current_rpc_agent_set
from .api import _set_rpc_timeout as _set_rpc_timeout
from .api import _wait_all_workers as _wait_all_workers
from .errors import (
    AuthenticationError,
    ProtocolError,
    RendezvousError,
    RpcError,
    RpcNotInitializedError,
    RpcTimeoutError,
    RpcTypeError,
    RpcValueError,
    WorkerLeftError,
    WorkerUnavailableError,
)

# torch's private constants, under torch's names
from .options import DEFAULT_INIT_METHOD as _DEFAULT_INIT_METHOD  # noqa: F401
from .options import DEFAULT_NUM_WORKER_THREADS as _DEFAULT_NUM_WORKER_THREADS  # noqa: F401
from .options import (
    DEFAULT_RPC_TIMEOUT_SEC,
    DEFAULT_SHUTDOWN_TIMEOUT,
    UNSET_RPC_TIMEOUT,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
)
from .options import DEFAULT_RPC_TIMEOUT_SEC as _DEFAULT_RPC_TIMEOUT_SEC  # noqa: F401
from .options import UNSET_RPC_TIMEOUT as _UNSET_RPC_TIMEOUT  # noqa: F401
from .rref import RRef
from .worlds import WorkerInfo

PyRRef = RRef  # torch's RRef derives from PyRRef; isinstance checks against either name hold

# The layers of rpc_core, bottom-up: a module imports only modules of lower layers (never
# one of its own layer, never one above, and a package's modules never the package's
# __init__), so the package has no import cycle and each layer can be read, tested and
# replaced knowing only those below it. tests/rpc_core/test_layering.py enforces this on
# every import, module- or function-level; a new module must be placed here.
_LAYERS: tuple[tuple[str, ...], ...] = (
    # foundations: no rpc_core imports
    ("knobs", "polling", "middleware", "constants", "errors"),
    ("wire", "options", "functions", "memory", "cma", "pool", "serialization"),
    ("handshake", "futures", "torchscript"),
    ("buffers",),
    ("sending",),
    ("transport",),  # connections: bytes only
    ("worlds",),  # WorkerInfo, and the World a rendezvous gives
    ("rendezvous", "outbound"),
    ("roster",),  # who is in the group (a part of the agent)
    ("deadlines", "completion", "dispatch"),  # the worker's parts: timer, pending calls, requests
    ("heartbeats",),  # the worker's liveness watch of the peers it waits on
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
    ("optim", "profiler_rpc", "nn.remote_module"),
    ("profiler", "nn"),  # nn: RemoteModule's package face
    ("api",),  # the facade: composes the layers into init_rpc/shutdown/...
    ("",),  # rpc_core itself: the public names
)


def _get_debug_info() -> dict[str, Any]:
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
    "RpcTimeoutError", "RpcTypeError", "RpcValueError", "TensorPipeRpcBackendOptions", "UNSET_RPC_TIMEOUT",
    "WorkerInfo", "WorkerLeftError",
    "WorkerUnavailableError", "functions", "get_rpc_timeout", "get_worker_info", "init_rpc", "is_available",
    "remote", "rpc_async", "rpc_sync", "shutdown", "autograd", "constants", "optim", "profiler",
]
