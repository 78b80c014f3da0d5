"""rpc_core: PyTorch's distributed RPC primitives, reimplemented: faster, authenticated, no hangs.

Port a ``torch.distributed.rpc`` program by changing its imports::

    import rpc_core as rpc                      # was: import torch.distributed.rpc as rpc
    import rpc_core.autograd as dist_autograd   # was: torch.distributed.autograd
    from rpc_core.optim import DistributedOptimizer
"""

from typing import Any

from . import autograd, constants, functions, optim, profiler, safe  # autograd installs its middleware at init_rpc
from . import rref as _rref
from .agent import early_exit as _early_exit
from .agent.agent import current_agent as _current_agent
from .agent.worlds import WorkerInfo
from .api import (
    BackendType,
    ConnectionStats,
    add_membership_listener,
    connection_stats,
    get_rpc_timeout,
    get_worker_info,
    init_rpc,
    is_available,
    remote,
    remove_membership_listener,
    rpc_async,
    rpc_sync,
    shutdown,
    tune_malloc,
    watch_all_peers,
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
    NotAllowedError,
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

# imported for its effect: scripted functions and modules travel in messages
from .protocol import torchscript as _torchscript  # noqa: F401
from .rref import RRef

# torch.futures.wait_all / collect_all return at the first failed rpc_core call, as torch's do
# for its own RPC futures (see agent.early_exit)
_early_exit.install()

PyRRef = RRef  # torch's RRef derives from PyRRef; isinstance checks against either name hold

# The layers of rpc_core, bottom-up: a module imports only modules of lower layers (never
# one of its own layer, never one above, and a package's modules never the package's
# __init__), so the package has no import cycle and each layer can be read, tested and
# replaced knowing only those below it. tests/rpc_core/test_layering.py enforces this on
# every import, module- or function-level; a new module must be placed here.
_LAYERS: tuple[tuple[str, ...], ...] = (
    # foundations, at the top level: no other rpc_core imports but knobs
    ("knobs", "errors", "functions", "constants"),
    ("options", "memory"),
    # protocol/: what travels, independent of how
    ("protocol.wire", "protocol.serialization", "protocol.allowlist"),
    ("protocol.safe_encoding",),  # serializer="safe": rpc_core's own encoding, no pickle
    ("protocol.safe_decoding",),
    ("protocol.safe_codec", "protocol.torchscript"),
    ("protocol",),
    # transport/: authenticated connections that carry frames; bytes only
    ("transport.cma", "transport.polling"),
    ("transport.handshake",),  # every transport's: authentication, the cross-memory-attach probe
    ("transport.base",),  # the interface: Connection, Transport, Listener
    ("transport.buffers",),
    ("transport.sending",),
    ("transport.stream",),  # Connection over a stream socket
    ("transport.tcp", "transport.unix"),  # the transports
    ("transport.registry",),  # the transports in use, and the order they are tried in
    ("transport",),  # the face the agent and the rendezvous use
    # agent/: the worker and its parts
    ("agent.pool", "agent.middleware"),
    ("agent.futures", "agent.worlds"),  # futures of calls; WorkerInfo and the World a rendezvous gives
    ("agent.outbound", "agent.early_exit"),  # early_exit: torch.futures.wait_all that exits at a failure
    # The worker's parts, each an object the agent owns; a part imports those it is given.
    ("agent.roster",),  # who is in the group
    ("agent.deadlines", "agent.completion", "agent.dispatch"),  # the timer, calls made, requests served
    # departures: calls to a member that left, until its last answers arrive;
    # connecting: dialling a peer, accepting a peer's dial
    ("agent.departures", "agent.connecting"),
    ("agent.connections",),  # the table of dialled and accepted connections; hands frames to dispatch and completion
    ("agent.heartbeats",),  # the liveness watch of the peers calls wait on
    ("agent.agent",),  # the worker: makes its parts and wires them
    ("agent.calls",),  # a user call
    ("agent",),
    # group/: finding each other, joining and leaving, starting and ending together
    ("group.rendezvous",),
    ("group.lifecycle", "group.registry"),  # init/shutdown hooks, barriers; joins and leaves
    ("group",),
    # autograd/: distributed autograd
    ("autograd.context", "autograd.node_errors"),  # node_errors: "Error on Node <rank>: ..."
    ("autograd.hooks", "autograd.local_pass"),  # local_pass: one worker's part of a pass
    ("autograd.finish",),  # a worker's part done: its hooks run
    ("autograd.engine", "autograd.release"),
    ("autograd.recording",),
    ("autograd",),  # the distributed autograd package's face
    # rref/: remote references
    ("rref.state",),  # RRef tables and the owner's handlers
    ("rref.release",),  # garbage-collected handles -> deletes
    ("rref.handle",),  # the RRef class, proxies, remote()
    ("rref.fork",),  # RRefs in messages; the protocol's middleware
    ("rref",),  # the RRef group's face
    # the upper layers and their faces
    ("optim", "profiler.rpc_events", "nn.remote_module"),
    ("profiler", "nn"),  # nn: RemoteModule's package face
    # the facade: composes the layers into init_rpc/shutdown/...; safe: serializer="safe"'s allowlist
    ("api", "safe"),
    ("",),  # rpc_core itself: the public names
)


def _get_debug_info() -> dict[str, Any]:
    """Counters for tests and debugging, as torch's: the RRef tables, the agent's and
    distributed autograd's (``_rref.debug_info()``, ``agent.get_debug_info()``,
    ``autograd._get_debug_info()``)."""
    info = dict(_rref.debug_info())
    info.update(_current_agent().get_debug_info())
    info.update(autograd._get_debug_info())
    return info


__all__ = [
    "AuthenticationError",
    "NotAllowedError",
    "BackendType",
    "DEFAULT_RPC_TIMEOUT_SEC",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "ProtocolError",
    "RRef",
    "RendezvousError",
    "RpcBackendOptions",
    "RpcError",
    "RpcNotInitializedError",
    "RpcTimeoutError",
    "RpcTypeError",
    "RpcValueError",
    "TensorPipeRpcBackendOptions",
    "UNSET_RPC_TIMEOUT",
    "WorkerInfo",
    "WorkerLeftError",
    "WorkerUnavailableError",
    "functions",
    "get_rpc_timeout",
    "get_worker_info",
    "init_rpc",
    "is_available",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
    "autograd",
    "constants",
    "optim",
    "profiler",
    # rpc_core's own (docs/torch_compatibility.md, "rpc_core extensions")
    "ConnectionStats",
    "add_membership_listener",
    "connection_stats",
    "remove_membership_listener",
    "safe",
    "tune_malloc",
    "watch_all_peers",
]
