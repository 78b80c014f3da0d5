"""The public RPC functions: init_rpc, shutdown, rpc_sync, rpc_async, remote, ...

Same names, arguments and semantics as ``torch.distributed.rpc``. This module only composes
the layers below it: a worker's start and end (agent, RRef protocol, ``lifecycle`` hooks and
coordinator) and the calls (``calls``, ``rref.remote``).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from typing import Any

from . import memory
from . import rref as _rref
from .agent import agent as _agent_mod
from .agent.agent import Agent, current_agent
from .agent.calls import call_wrappers, rpc_async, rpc_sync  # noqa: F401 (re-exported: the facade)
from .agent.calls import invoke_async as _invoke_async  # noqa: F401 (re-exported: its historical home)
from .agent.connections import ConnectionStats
from .agent.worlds import WorkerInfo
from .errors import RpcError, RpcTimeoutError, WorkerUnavailableError
from .group import lifecycle, registry
from .group.lifecycle import all_gather as _all_gather  # noqa: F401 (re-exported)
from .group.lifecycle import barrier as _barrier  # noqa: F401 (re-exported)
from .group.lifecycle import wait_all_workers as _wait_all_workers
from .group.rendezvous import rendezvous
from .options import DEFAULT_SHUTDOWN_TIMEOUT, RpcBackendOptions
from .protocol import allowlist, safe_codec
from .rref import remote  # noqa: F401 (re-exported: the facade)

__all__ = [
    "BackendType",
    "get_rpc_timeout",
    "get_worker_info",
    "init_rpc",
    "is_available",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
    # rpc_core's own (docs/torch_compatibility.md, "rpc_core extensions")
    "ConnectionStats",
    "add_membership_listener",
    "connection_stats",
    "remove_membership_listener",
    "tune_malloc",
    "watch_all_peers",
    # private helpers torch.distributed.rpc also has; the hooks tests and the profiler benchmark read
    "_all_gather",
    "_barrier",
    "_invoke_async",
    "_set_rpc_timeout",
    "_wait_all_workers",
    "call_wrappers",
    "current_agent",
]

# How long a leaving member (shutdown without a timeout) lets the requests that reached it
# as it left finish before it closes.
_LEAVE_GRACE = 5.0
_PEERS_CLOSE_FIRST = 5.0  # s rank 0 waits at the end of a graceful shutdown for its peers to close first


class BackendType(enum.Enum):
    """Accepted for compatibility; rpc_core has one backend."""

    TENSORPIPE = "TENSORPIPE"
    RPC_CORE = "RPC_CORE"


def is_available() -> bool:
    return True


def init_rpc(
    name: str,
    backend: Any = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: RpcBackendOptions | None = None,
) -> None:
    """Join the group: rendezvous, authenticate, start this worker's agent. ``world_size=None``
    makes the group dynamic (every member passes None): rank 0 founds it, other ranks join it
    while it runs, and ``shutdown`` leaves it (see ``registry``)."""
    if _agent_mod.current_agent_or_none() is not None:
        raise RuntimeError("RPC is already initialized")
    if backend is not None and not isinstance(backend, BackendType):
        raise TypeError("Argument backend must be a member of BackendType")
    options = rpc_backend_options if rpc_backend_options is not None else RpcBackendOptions()
    if not isinstance(options, RpcBackendOptions):
        raise TypeError("Argument rpc_backend_options must be an instance of RpcBackendOptions")
    if not options.auth_secret:
        logging.getLogger("rpc_core").warning(
            "rpc_core worker %r runs without an auth secret: any process that can reach its port can make it "
            "run functions. Set RpcBackendOptions(auth_secret=...) or RPC_CORE_AUTH_SECRET, the same on every worker.",
            name,
        )
    safe_codec.use(options.serializer)
    for module in options.allow_modules:
        allowlist.allow_module(module)
    world = rendezvous(
        name, rank, world_size, options.init_method, options.auth_secret, options.effective_init_timeout()
    )
    memory.tune()  # keep freed tensor memory in the process (see rpc_core.memory)
    agent = Agent(world, options)
    _rref.install(agent)
    if world.me.id == 0:
        lifecycle.start_coordinator(agent)
    registry.install(agent)
    for hook in lifecycle.init_hooks:
        hook(agent)
    _agent_mod.set_current_agent(agent)
    agent.start()


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    agent = current_agent()
    if worker_name is None:
        return agent.me
    return agent.worker_info(worker_name)


def _is_current_rpc_agent_set() -> bool:
    """Whether this process is a worker (``init_rpc`` done, ``shutdown`` not yet)."""
    return _agent_mod.current_agent_or_none() is not None


def _get_current_rpc_agent() -> Agent:
    """This worker's agent (torch's private ``_get_current_rpc_agent``): ``get_worker_info()``
    and ``get_worker_infos()`` list the group's members."""
    return current_agent(_agent_mod.AGENT_NOT_SET)


def get_rpc_timeout() -> float:
    return current_agent(_agent_mod.AGENT_NOT_SET).default_timeout


def _set_rpc_timeout(rpc_timeout: float) -> None:
    """Change the default timeout of calls made from now on (calls in flight keep theirs)."""
    current_agent().default_timeout = float(rpc_timeout)


# -- rpc_core's own: for applications built on it (not in torch) ----------------------------------------
def connection_stats() -> ConnectionStats:
    """Bytes this worker sent and received so far over its open connections, both ways (calls
    to itself not included), how many of them are same-host Unix sockets or may copy by
    cross-memory attach, and how many requests it sent and received (every call, gradient
    calls of the distributed backward included; its heartbeats and handshakes not), and how
    many of those it received are not answered yet (``requests_in_flight``).
    Raises RpcNotInitializedError before ``init_rpc``."""
    return current_agent().connections.connection_stats()


def tune_malloc(mmap_threshold: int = memory.MMAP_THRESHOLD, trim_threshold: int = memory.TRIM_THRESHOLD) -> bool:
    """Fix glibc's malloc thresholds for this process as ``init_rpc`` does (``rpc_core.memory``),
    for a launcher that wants the allocator settled before it builds its model, or a process
    that runs another RPC backend. The first call's thresholds stay: a process whose tensors
    are tens of MB and whose RAM must stay near its data passes lower ones (bytes) before
    ``init_rpc``. Returns whether they are set: False with ``RPC_CORE_MALLOC_TUNE=0``, the
    user's own ``MALLOC_*`` / ``GLIBC_TUNABLES``, or no glibc."""
    return memory.tune(mmap_threshold, trim_threshold)


def add_membership_listener(listener: Callable[[WorkerInfo, bool], None]) -> None:
    """Call ``listener(info, joined)`` each time a member joins (``joined`` True) or leaves a
    dynamic group (``world_size=None``), as this worker's view of the group changes: after the
    change, on the thread that applied it (so it must not block on a call to the group). A
    listener's exception is logged, never raised into the change. A static group never changes."""
    current_agent().roster.on_membership.append(listener)


def remove_membership_listener(listener: Callable[[WorkerInfo, bool], None]) -> None:
    """Stop calling ``listener``; ValueError if it is not one of this worker's listeners."""
    listeners = current_agent().roster.on_membership
    if listener not in listeners:
        raise ValueError(
            f"remove_membership_listener: {listener!r} is not a membership listener of this worker "
            "(add it with add_membership_listener)"
        )
    listeners.remove(listener)


def watch_all_peers(wanted: Callable[[], bool]) -> None:
    """While ``wanted()`` returns True (asked at each heartbeat look, a quarter of
    ``heartbeat_timeout``), this worker's heartbeats watch every member of the group, not only
    those its calls wait on. A member silent for ``heartbeat_timeout`` is then reported as
    unreachable; on rank 0 of a dynamic group that removes it (membership listeners hear it
    leave). Stays in place until ``shutdown``; no effect with ``heartbeat_timeout=0``."""
    current_agent().heartbeats.liveness_wanted.append(wanted)


def shutdown(graceful: bool = True, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Stop this worker. Graceful: wait until every worker has called shutdown and no worker
    has work in flight (including nested and callback-spawned calls), then tear down. A dead
    peer makes it fail fast with an error naming that peer, after local teardown. A positive
    ``timeout`` bounds the whole wait, whatever the peers do (frozen, never calling shutdown,
    dying meanwhile): past it, shutdown tears down and raises."""
    agent = current_agent()
    deadline = time.monotonic() + timeout if timeout > 0 else None

    def left() -> float:
        """What is left of ``timeout`` for the next step (0: no limit, as ``timeout`` 0)."""
        if deadline is None:
            return 0.0
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RpcTimeoutError(f"shutdown of {agent.me.name!r} timed out after {timeout:g} s")
        return remaining

    error: BaseException | None = None
    try:
        if graceful and agent.roster.dynamic:
            _leave(agent, timeout)
        elif graceful:
            _wait_all_workers(left(), whole=timeout)
            for hook in lifecycle.pre_shutdown_hooks:
                hook()
            _rref.delete_all_user_rrefs(left())
            lifecycle.wait_quiescent(agent, left(), whole=timeout)
    except RpcError as e:
        error = e
    finally:
        if (
            graceful
            and agent.me.id == 0
            and (error is None or agent.roster.dead or isinstance(error, WorkerUnavailableError))
        ):
            # Let the peers close first, so they read our last replies before our sockets go
            # away: with a dead or silent worker, those replies tell them which one it was.
            agent.connections.wait_incoming_closed(
                _PEERS_CLOSE_FIRST if deadline is None else min(_PEERS_CLOSE_FIRST, deadline - time.monotonic())
            )
        for hook in lifecycle.shutdown_hooks:
            hook()
        agent.close()
        _agent_mod.set_current_agent(None)
        _rref.reset()
        lifecycle.reset_rounds()
    if error is not None:
        raise RpcError(f"graceful shutdown of {agent.me.name!r} failed: {error}") from error


def _leave(agent: Agent, timeout: float) -> None:
    """Graceful shutdown of a dynamic group's member: finish this worker's own work (its
    calls, its RRefs' deletes, its autograd releases), answer the requests it accepted and
    write the answers out, leave the group, then answer what the others sent before they
    heard (each step bounded by ``timeout``; 0: no limit, but what arrives after the leave
    gets ``_LEAVE_GRACE``). The members wait for those answers on their connections to this
    worker, which close with the agent once they are written (see ``agent.departures``)."""
    deadline = time.monotonic() + timeout if timeout > 0 else None
    for hook in lifecycle.pre_shutdown_hooks:
        hook()
    _rref.delete_all_user_rrefs(timeout)
    agent.pending.wait_idle(deadline)
    if agent.me.id != 0:  # rank 0 leaves once the others have left (nobody waits on it then)
        lifecycle.answer_requests(agent, deadline)
    registry.leave(agent, timeout)
    agent.pending.wait_idle(deadline)
    end = time.monotonic() + _LEAVE_GRACE if deadline is None else deadline
    lifecycle.answer_requests(agent, end, arriving=True)  # sent to us before the news reached their callers
