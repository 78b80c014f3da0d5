"""The public RPC functions: init_rpc, shutdown, rpc_sync, rpc_async, remote, ...

Same names, arguments and semantics as ``torch.distributed.rpc``. This module only composes
the layers below it: a worker's start and end (agent, RRef protocol, ``lifecycle`` hooks and
coordinator) and the calls (``calls``, ``rref.remote``).
"""
from __future__ import annotations

import enum
import logging
from typing import Any

from . import agent as _agent_mod
from . import lifecycle, memory
from . import rref as _rref
from .agent import Agent, current_agent
from .calls import call_wrappers, rpc_async, rpc_sync  # noqa: F401 (re-exported: the facade)
from .calls import invoke_async as _invoke_async  # noqa: F401 (re-exported: its historical home)
from .errors import RpcError, WorkerUnavailableError
from .lifecycle import all_gather as _all_gather  # noqa: F401 (re-exported)
from .lifecycle import barrier as _barrier  # noqa: F401 (re-exported)
from .lifecycle import wait_all_workers as _wait_all_workers
from .options import DEFAULT_SHUTDOWN_TIMEOUT, RpcBackendOptions
from .rendezvous import WorkerInfo, rendezvous
from .rref import remote  # noqa: F401 (re-exported: the facade)

__all__ = [
    "BackendType", "get_rpc_timeout", "get_worker_info", "init_rpc", "is_available", "remote", "rpc_async", "rpc_sync",
    "shutdown",
    # private helpers torch.distributed.rpc also has; the hooks tests and the profiler benchmark read
    "_all_gather", "_barrier", "_invoke_async", "_set_rpc_timeout", "_wait_all_workers", "call_wrappers",
    "current_agent",
]

class BackendType(enum.Enum):
    """Accepted for compatibility; rpc_core has one backend."""

    TENSORPIPE = "TENSORPIPE"
    RPC_CORE = "RPC_CORE"


def is_available() -> bool:
    return True


def init_rpc(name: str, backend: Any = None, rank: int = -1, world_size: int | None = None,
             rpc_backend_options: RpcBackendOptions | None = None) -> None:
    """Join the group: rendezvous, authenticate, start this worker's agent."""
    if _agent_mod._agent is not None:
        raise RuntimeError("RPC is already initialized")
    if backend is not None and not isinstance(backend, BackendType):
        raise TypeError("Argument backend must be a member of BackendType")
    options = rpc_backend_options if rpc_backend_options is not None else RpcBackendOptions()
    if not isinstance(options, RpcBackendOptions):
        raise TypeError("Argument rpc_backend_options must be an instance of RpcBackendOptions")
    if world_size is None:
        raise ValueError("world_size is required: rpc_core supports static groups (dynamic membership is not "
                         "implemented)")
    if not options.auth_secret:
        logging.getLogger("rpc_core").warning(
            "rpc_core worker %r runs without an auth secret: any process that can reach its port can make it "
            "run functions. Set RpcBackendOptions(auth_secret=...) or RPC_CORE_AUTH_SECRET, the same on every worker.",
            name)
    world = rendezvous(name, rank, world_size, options.init_method, options.auth_secret,
                       options.effective_init_timeout())
    memory.tune()  # keep freed tensor memory in the process (see rpc_core.memory)
    agent = Agent(world, options)
    _rref.install(agent)
    if world.me.id == 0:
        lifecycle.start_coordinator(agent)
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
    return _agent_mod._agent is not None


class _RpcAgentView:
    """What programs read from torch's ``_get_current_rpc_agent()``: the group's workers."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent

    def get_worker_info(self, worker_name: str | None = None) -> WorkerInfo:
        return self._agent.me if worker_name is None else self._agent.worker_info(worker_name)

    def get_worker_infos(self) -> list[WorkerInfo]:
        return list(self._agent.workers)


def _get_current_rpc_agent() -> _RpcAgentView:
    return _RpcAgentView(current_agent())


def get_rpc_timeout() -> float:
    return current_agent().default_timeout


def _set_rpc_timeout(rpc_timeout: float) -> None:
    """Change the default timeout of calls made from now on (calls in flight keep theirs)."""
    current_agent().default_timeout = float(rpc_timeout)


def shutdown(graceful: bool = True, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Stop this worker. Graceful: wait until every worker has called shutdown and no worker
    has work in flight (including nested and callback-spawned calls), then tear down. A dead
    peer makes it fail fast with an error naming that peer, after local teardown."""
    agent = current_agent()
    error: BaseException | None = None
    try:
        if graceful:
            _wait_all_workers(timeout)
            for hook in lifecycle.pre_shutdown_hooks:
                hook()
            _rref.delete_all_user_rrefs(timeout)
            lifecycle.wait_quiescent(agent, timeout)
    except RpcError as e:
        error = e
    finally:
        if graceful and agent.me.id == 0 and (error is None or agent.dead or isinstance(error, WorkerUnavailableError)):
            # Let the peers close first, so they read our last replies before our sockets go
            # away: with a dead or silent worker, those replies tell them which one it was.
            agent.wait_incoming_closed(5.0)
        for hook in lifecycle.shutdown_hooks:
            hook()
        agent.close()
        _agent_mod.set_current_agent(None)
        _rref.reset()
        lifecycle.reset_rounds()
    if error is not None:
        raise RpcError(f"graceful shutdown of {agent.me.name!r} failed: {error}") from error
