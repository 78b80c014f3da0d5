"""The public RPC functions: init_rpc, shutdown, rpc_sync, rpc_async, remote, ...

Same names, arguments and semantics as ``torch.distributed.rpc``. Graceful shutdown and
``_barrier``/``_all_gather`` run through a coordinator on rank 0, which also notices dead
workers (their connection to rank 0 drops), so a barrier with a dead peer fails fast and
names the peer instead of hanging.
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from . import agent as _agent_mod
from . import memory
from . import rref as _rref
from . import wire
from .agent import Agent, current_agent
from .errors import RpcError, RpcTimeoutError, WorkerUnavailableError
from .functions import async_execution
from .options import DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT, RpcBackendOptions
from .rendezvous import WorkerInfo, rendezvous

# Called with each new Agent (distributed autograd installs its middleware here).
init_hooks: List[Callable[[Agent], None]] = []
shutdown_hooks: List[Callable[[], None]] = []
# Called once every worker has entered graceful shutdown, before the in-flight work drains
# (e.g. distributed autograd sends its deferred context releases).
pre_shutdown_hooks: List[Callable[[], None]] = []
# Wrappers around outgoing user calls: fn(exec_mode, func, dst, send) -> Future, where func is
# the user's function (for remote, the one whose result the RRef holds) and send(extras=None)
# sends the call, optionally with message extras. Empty unless the profiler is on, so the
# call path pays nothing for it otherwise.
call_wrappers: List[Callable[..., torch.futures.Future]] = []


class BackendType(enum.Enum):
    """Accepted for compatibility; rpc_core has one backend."""

    TENSORPIPE = "TENSORPIPE"
    RPC_CORE = "RPC_CORE"


def is_available() -> bool:
    return True


def init_rpc(name: str, backend: Any = None, rank: int = -1, world_size: Optional[int] = None,
             rpc_backend_options: Optional[RpcBackendOptions] = None) -> None:
    """Join the group: rendezvous, authenticate, start this worker's agent."""
    if _agent_mod._agent is not None:
        raise RuntimeError("RPC is already initialized")
    if backend is not None and not isinstance(backend, BackendType):
        raise TypeError("Argument backend must be a member of BackendType")
    options = rpc_backend_options if rpc_backend_options is not None else RpcBackendOptions()
    if not isinstance(options, RpcBackendOptions):
        raise TypeError("Argument rpc_backend_options must be an instance of RpcBackendOptions")
    if world_size is None:
        raise ValueError("world_size is required: rpc_core supports static groups (dynamic membership is not implemented)")
    if not options.auth_secret:
        logging.getLogger("rpc_core").warning(
            "rpc_core worker %r runs without an auth secret: any process that can reach its port can make it "
            "run functions. Set RpcBackendOptions(auth_secret=...) or RPC_CORE_AUTH_SECRET, the same on every worker.",
            name)
    world = rendezvous(name, rank, world_size, options.init_method, options.auth_secret, options.effective_init_timeout())
    memory.tune()  # keep freed tensor memory in the process (see rpc_core.memory)
    agent = Agent(world, options)
    _rref.start_release_thread()
    agent.request_failed_hooks.append(_rref.on_request_failed)
    agent.middleware.append(_rref.RRefMiddleware())
    if world.me.id == 0:
        _coordinator.start(agent)
    for hook in init_hooks:
        hook(agent)
    _agent_mod.set_current_agent(agent)
    agent.start()


def get_worker_info(worker_name: Optional[str] = None) -> WorkerInfo:
    agent = current_agent()
    if worker_name is None:
        return agent.me
    return agent.worker_info(worker_name)


def get_rpc_timeout() -> float:
    return current_agent().default_timeout


def _set_rpc_timeout(rpc_timeout: float) -> None:
    """Change the default timeout of calls made from now on (calls in flight keep theirs)."""
    current_agent().default_timeout = float(rpc_timeout)


def _invoke_async(to: Any, func: Any, args: Optional[tuple], kwargs: Optional[dict], timeout: float,
                  exec_mode: str, user_func: Any = None, keepalive: Any = None,
                  extras: Optional[dict] = None, waited: bool = False) -> torch.futures.Future:
    """Send a call. ``keepalive`` is held until the answer arrives (an RRef whose id the call
    carries instead of a fork); ``extras`` travel in the frame head. ``waited``: the caller
    will wait on the returned future itself (as "sync" calls do), so its answer needs no
    background reader (see outbound)."""
    base_extras = extras
    agent = current_agent()
    if not callable(func):
        raise TypeError("function should be callable.")
    dst = agent.worker_info(to).id
    args = tuple(args) if args is not None else ()
    kwargs = kwargs if kwargs is not None else {}
    if call_wrappers:
        wrap = next(reversed(call_wrappers), None)  # one read: another thread may empty the list
        if wrap is not None:
            def send(f: Any = func, a: tuple = args, k: dict = kwargs, extras: Optional[dict] = None) -> torch.futures.Future:
                extras = dict(base_extras or {}, **(extras or {}))
                return agent.send_request(dst, f, a, k, timeout, extras=extras,
                                          call_extras=None if keepalive is None else dict(extras, keepalive=keepalive))

            return wrap(exec_mode, func if user_func is None else user_func, dst, send)
    # A "sync" caller waits on this very future at once, so its wait() reads the answer;
    # remote()'s acknowledgement is read lazily (see Agent.send_request).
    sync = exec_mode == "sync" or waited
    lazy = exec_mode == "remote"
    if keepalive is not None:
        return agent.send_request(dst, func, args, kwargs, timeout, extras=extras,
                                  call_extras=dict(extras or {}, keepalive=keepalive), sync=sync, lazy=lazy)
    return agent.send_request(dst, func, args, kwargs, timeout, extras=extras, sync=sync, lazy=lazy)


def _invoke(dst: int, func: Any, args: tuple, kwargs: Optional[dict], timeout: float, exec_mode: str,
            force_ctx: bool = False) -> Any:
    return _invoke_async(dst, func, args, kwargs, timeout, exec_mode).wait()


def rpc_sync(to: Any, func: Callable[..., Any], args: Optional[tuple] = None, kwargs: Optional[dict] = None,
             timeout: float = UNSET_RPC_TIMEOUT) -> Any:
    """Run ``func(*args, **kwargs)`` on worker ``to`` (name, WorkerInfo or rank) and return its result."""
    return _invoke_async(to, func, args, kwargs, timeout, "sync").wait()


def rpc_async(to: Any, func: Callable[..., Any], args: Optional[tuple] = None, kwargs: Optional[dict] = None,
              timeout: float = UNSET_RPC_TIMEOUT) -> torch.futures.Future:
    """Like ``rpc_sync`` but returns a ``torch.futures.Future`` at once."""
    return _invoke_async(to, func, args, kwargs, timeout, "async")


def remote(to: Any, func: Callable[..., Any], args: Optional[tuple] = None, kwargs: Optional[dict] = None,
           timeout: float = UNSET_RPC_TIMEOUT, _keepalive: Any = None) -> _rref.RRef:
    """Run ``func`` on ``to`` and return an RRef to its result, owned by ``to``, at once.
    Errors inside ``func`` surface at ``to_here()`` with their type."""
    agent = current_agent()
    if not callable(func):
        raise TypeError("function should be callable.")
    dst = agent.worker_info(to).id
    rref_id = _rref._new_id()
    call_args = (tuple(args) if args is not None else (), kwargs if kwargs is not None else {})
    if dst == agent.me.id:
        handle = _rref.RRef._owner_handle(rref_id)  # registers the entry; the value follows
        _invoke_async(dst, _rref._on_create, (rref_id, None, func) + call_args, None, timeout, "remote",
                      user_func=func, keepalive=_keepalive, extras={"rref_create": rref_id})
        return handle
    fork_id = _rref._new_id()
    # The id also travels in the frame head: if the callee cannot even unpickle the call
    # (function missing there), it still stores the error for to_here() to raise.
    creation = _invoke_async(dst, _rref._on_create, (rref_id, fork_id, func) + call_args, None, timeout, "remote",
                             user_func=func, keepalive=_keepalive, extras={"rref_create": rref_id})
    return _rref.new_user_for_remote(dst, rref_id, fork_id, creation)


# -- barriers and shutdown -------------------------------------------------------------------------
class _Coordinator:
    """Runs on rank 0: rounds of 'everyone arrives, everyone gets everyone's payload'."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rounds: Dict[Any, Dict[str, Any]] = {}
        self.agent: Optional[Agent] = None

    def start(self, agent: Agent) -> None:
        self.agent = agent
        self.rounds = {}
        agent.on_peer_lost.append(self.peer_lost)

    def peer_lost(self, rank: int, reason: str) -> None:
        with self.lock:
            rounds, self.rounds = self.rounds, {}
        for r in rounds.values():
            if not r["future"].done():
                r["future"].set_exception(WorkerUnavailableError(reason))

    def arrive(self, key: Any, rank: int, payload: Any, expected: int) -> torch.futures.Future:
        agent = self.agent
        assert agent is not None
        if agent.dead:
            f: torch.futures.Future = torch.futures.Future()
            f.set_exception(WorkerUnavailableError(next(iter(agent.dead.values()))))
            return f
        with self.lock:
            r = self.rounds.setdefault(key, {"payloads": {}, "future": torch.futures.Future()})
            r["payloads"][rank] = payload
            complete = len(r["payloads"]) == expected
            if complete:
                del self.rounds[key]
        if complete:
            r["future"].set_result(dict(r["payloads"]))
        return r["future"]


_coordinator = _Coordinator()


@async_execution
def _coord_arrive(key: Any, rank: int, payload: Any, expected: int) -> torch.futures.Future:
    return _coordinator.arrive(key, rank, payload, expected)


_round_ids: Dict[str, int] = {}


def _gather_round(tag: str, payload: Any, timeout: float, worker_names: Optional[List[str]] = None) -> Dict[int, Any]:
    agent = current_agent()
    n = _round_ids.get(tag, 0)
    _round_ids[tag] = n + 1
    members = len(agent.workers) if worker_names is None else len(worker_names)
    key = (tag, n, tuple(sorted(worker_names)) if worker_names else None)
    fut = agent.send_request(0, _coord_arrive, (key, agent.me.id, payload, members), {},
                             timeout=timeout if timeout > 0 else 0, flags=wire.CONTROL)
    try:
        return fut.wait()
    except RpcTimeoutError:
        raise RpcTimeoutError(f"{tag} on {agent.me.name!r} timed out after {timeout:g} s waiting for the other workers") from None


def _all_gather(obj: Any, worker_names: Optional[List[str]] = None, timeout: float = UNSET_RPC_TIMEOUT) -> Dict[str, Any]:
    agent = current_agent()
    t = agent.default_timeout if timeout < 0 else timeout
    got = _gather_round("all_gather", obj, t, worker_names)
    return {agent.workers[r].name: v for r, v in got.items()}


def _barrier(worker_names: List[str]) -> None:
    _gather_round("barrier", None, 0, list(worker_names))


def _wait_all_workers(timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    _gather_round("shutdown", None, timeout)


def shutdown(graceful: bool = True, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Stop this worker. Graceful: wait until every worker has called shutdown and no worker
    has work in flight (including nested and callback-spawned calls), then tear down. A dead
    peer makes it fail fast with an error naming that peer, after local teardown."""
    agent = current_agent()
    error: Optional[BaseException] = None
    try:
        if graceful:
            _wait_all_workers(timeout)
            for hook in pre_shutdown_hooks:
                hook()
            _rref.delete_all_user_rrefs(timeout)
            _wait_quiescent(agent, timeout)
    except RpcError as e:
        error = e
    finally:
        if graceful and agent.me.id == 0 and (error is None or agent.dead):
            # Let the peers close first, so they read our last replies before our sockets go
            # away: with a dead worker, those replies are what tell them which one died.
            agent.wait_incoming_closed(5.0)
        for hook in shutdown_hooks:
            hook()
        agent.close()
        _agent_mod.set_current_agent(None)
        _rref.reset()
        _round_ids.clear()
    if error is not None:
        raise RpcError(f"graceful shutdown of {agent.me.name!r} failed: {error}") from error


def _wait_quiescent(agent: Agent, timeout: float) -> None:
    """Termination detection: every worker reports (sent, done, received, answered) call
    counts; work is over when no worker has a call pending (sent == done) or a request
    unanswered (received == answered), every request sent has arrived (a timed-out call may
    still be on its way), and the counts did not move between two rounds. Requests from
    connections that are not workers' calls (raw clients) count as received only, so
    "arrived" is received >= sent rather than equality."""
    deadline = time.monotonic() + timeout if timeout > 0 else None
    previous = None
    while True:
        agent.wait_idle(deadline)
        got = _gather_round("quiesce", (agent.n_sent, agent.n_done, agent.n_received, agent.n_answered), timeout)
        counts = tuple(sorted(got.items()))
        idle = (all(sent == done and received == answered for sent, done, received, answered in got.values())
                and sum(v[2] for v in got.values()) >= sum(v[0] for v in got.values()))
        if idle and counts == previous:
            return
        previous = counts
        if not idle:
            time.sleep(0.005)  # work is still running somewhere; let it progress before re-polling
        if deadline is not None and time.monotonic() > deadline:
            raise RpcTimeoutError(f"shutdown timed out after {timeout:g} s: workers still have calls in flight")
