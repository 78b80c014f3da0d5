"""RPC events for the profiler: naming and recording them on the caller and the callee.

While a profile is active (``profiler.profile``), a wrapper in ``calls.call_wrappers`` turns
every RPC made from a profiled thread into an event ``rpc_{sync|async|remote}#{func}(caller ->
callee)`` (func: ``aten::add`` for torch builtins, else the qualified name) that lasts until
the call's future completes, and asks the callee to profile the call
(``wire.EXTRA_PROFILE``). The callee (``_Middleware``, installed by the first such request)
runs the function under a thread-local legacy profiler, stops at the response (for
``async_execution`` functions: when their future completes) and returns its events, and
those of the RPCs it made meanwhile, in the response extras. The caller adds them as
``{rpc event}#remote_op: {op}`` with ``node_id`` = the rank that ran them (nested calls
chain the prefix).

Clocks: events carry wall-clock microseconds. A callee's events are kept as they are when
they fit inside the caller's view of the call (same host), else centred in it (NTP-style),
so traces from several machines still nest correctly.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch._C._autograd import _disable_profiler_legacy, _enable_profiler_legacy, _profiler_enabled
from torch._C._profiler import ProfilerConfig, ProfilerState

from ..agent import agent as _agent_mod
from ..agent import calls
from ..agent import futures as _futures
from ..protocol import allowlist, wire
from ..protocol.serialization import register_reducer
from ..rref import HANDLER_DISPLAY_NAMES

REMOTE_OP = "#remote_op: "


class RpcExecMode(enum.Enum):
    """How an RPC was made, as its profiled event names it (torch's ``RPCExecMode`` values)."""

    SYNC = "sync"
    ASYNC = "async"
    ASYNC_JIT = "async_jit"
    REMOTE = "remote"


def rpc_profiling_key(exec_mode: RpcExecMode, func_name: str, caller: str, callee: str) -> str:
    """The name of an RPC's profiled event: ``rpc_async#aten::add(worker0 -> worker1)``; a
    callee's events are named ``{key}#remote_op: {op}`` under it."""
    return f"rpc_{exec_mode.value}#{func_name}({caller} -> {callee})"


_EXIT_WAIT = 10.0  # s a response waits for the executing thread to stop its profiler
_IGNORED_OPS = frozenset(
    (
        "profiler::_record_function_enter",
        "profiler::_record_function_enter_new",
        "profiler::_record_function_exit",
        "aten::is_leaf",
        "aten::output_nr",
        "aten::_version",
    )
)
_tls = threading.local()  # .collector: where RPC events made on this thread go


class _Options(NamedTuple):
    record_shapes: bool
    profile_memory: bool
    with_stack: bool
    with_flops: bool
    with_modules: bool

    def legacy(self, state: ProfilerState = ProfilerState.CPU) -> ProfilerConfig:
        return ProfilerConfig(
            state,
            self.record_shapes,
            self.profile_memory,
            self.with_stack,
            self.with_flops,
            self.with_modules,
            torch._C._profiler._ExperimentalConfig(),
        )


class _Event(NamedTuple):
    """One profiled range, picklable; times in wall-clock microseconds."""

    name: str
    start: float
    end: float
    thread: int
    node: int
    is_async: bool
    is_remote: bool
    shapes: list[Any]
    stack: list[Any]
    scope: int
    cpu_mem: int
    seq: int
    fwd_thread: int
    flops: int


def _parse(records: list[list[Any]], node: int) -> tuple[list[_Event], float | None, int]:
    """Legacy profiler records -> (events, profile start time, thread that profiled)."""
    pushes: dict[int, Any] = {}
    pops: dict[int, Any] = {}
    mem: dict[int, int] = {}
    start = None
    loose: list[_Event] = []
    for lst in records:
        open_here: list[int] = []
        prev = None
        for r in lst:
            kind = r.kind()
            if kind == "push":
                name = r.name()
                dup = prev is not None and prev.kind() == "push" and prev.name() == name  # op wrappers log twice
                prev = r
                if dup or name in _IGNORED_OPS:
                    continue
                h = r.handle()
                pushes[h], mem[h] = r, 0
                open_here.append(h)
            elif kind == "pop":
                prev = r
                h = r.handle()
                if h in pushes:
                    pops[h] = r
                    if h in open_here:
                        open_here.remove(h)
            elif kind == "memory_alloc":
                n = r.cpu_memory_usage()
                for h in open_here:
                    mem[h] += n
                if not open_here:
                    t = r.start_us()
                    loose.append(_Event("[memory]", t, t, r.thread_id(), node, False, False, [], [], 0, n, -1, 0, 0))
            elif kind == "mark" and start is None and r.name() == "__start_profile":
                start = r
    events = loose
    for h, s in pushes.items():
        e = pops.get(h)
        if e is not None:
            events.append(
                _Event(
                    s.name(),
                    s.start_us(),
                    e.start_us(),
                    s.thread_id(),
                    node,
                    s.is_async() or s.thread_id() != e.thread_id(),
                    False,
                    s.shapes(),
                    s.stack(),
                    s.scope(),
                    mem[h],
                    s.sequence_nr(),
                    s.fwd_thread_id(),
                    s.flops(),
                )
            )
    if start is None:
        return events, None, 0
    return events, start.start_us(), start.thread_id()


class _Call:
    """One profiled RPC, on the caller. Only the profiler options travel (``__reduce__``)."""

    __slots__ = ("key", "options", "t0", "t1", "t_reply", "reply")

    def __init__(self, key: str, options: _Options) -> None:
        self.key, self.options = key, options
        self.t0 = time.time_ns()
        self.t1 = self.t_reply = 0
        self.reply: tuple[Any, ...] | None = None  # (callee start us, callee end us, [event tuples])

    def __reduce__(self) -> Any:
        return _activate, (tuple(self.options),)


def _activate(options: tuple[Any, ...]) -> tuple[Any, ...]:
    """Runs on the callee as a profiled request's extras are unpickled: makes sure its
    agent has our middleware, which then profiles this request."""
    agent = _agent_mod.current_agent_or_none()
    if agent is not None:
        _ensure_middleware(agent)
    return options


# How a _Call travels under serializer="safe" too (its __reduce__ is pickle's).
register_reducer(_Call, _Call.__reduce__)
allowlist.internal(_activate)


class _Collector:
    """The RPCs made under one profile (a user's, or a callee's for one request)."""

    def __init__(self, options: _Options, node: int) -> None:
        self.options, self.node = options, node
        self.calls: list[_Call] = []
        self.agent = _agent_mod.current_agent_or_none()  # the agent known to have our middleware


def _flatten(calls: list[_Call], node: int, thread: int) -> tuple[list[_Event], int]:
    """The completed calls' events and their remote events, in this node's clock; and how
    many calls had not completed."""
    out: list[_Event] = []
    unfinished = 0
    for c in list(calls):
        if not c.t1:
            unfinished += 1
            continue
        t0, t1 = c.t0 / 1e3, c.t1 / 1e3
        out.append(_Event(c.key, t0, t1, thread, node, True, False, [], [], 0, 0, -1, 0, 0))
        if c.reply is None:
            continue
        r0, r1, remote = c.reply
        hi = (c.t_reply or c.t1) / 1e3
        shift = 0.0 if t0 <= r0 and r1 <= hi else (t0 + hi - r0 - r1) / 2
        prefix = c.key + REMOTE_OP
        for ev in map(_Event._make, remote):
            out.append(ev._replace(name=prefix + ev.name, start=ev.start + shift, end=ev.end + shift, is_remote=True))
    return out, unfinished


# -- the caller: a wrapper around outgoing user calls, installed while anything profiles ------------
_wrap_lock = threading.Lock()
_wrap_users = 0
_active: list[_Collector] = []  # user profiles in this process, innermost last


def _use_wrapper(delta: int) -> None:
    global _wrap_users
    with _wrap_lock:
        _wrap_users += delta
        if delta > 0 and _wrap_users == 1:
            calls.call_wrappers.append(_wrap_call)
        elif delta < 0 and _wrap_users == 0:
            calls.call_wrappers.remove(_wrap_call)


# Internal handlers users call by other names, by (module, qualified name): a key that
# needs no hashing of the called object, which may be any callable.
_DISPLAY_NAMES: dict[tuple[str | None, str | None], str] = {k: v for k, v in HANDLER_DISPLAY_NAMES.items()}


def _func_name(func: Any) -> str:
    special = _DISPLAY_NAMES.get((getattr(func, "__module__", None), getattr(func, "__qualname__", None)))
    if special is not None:
        return special
    builtin: str | None = torch.jit._builtins._find_builtin(func)
    if builtin is not None:
        return builtin
    if isinstance(func, torch.jit.ScriptFunction):
        return torch._jit_internal._qualified_name(func)
    return getattr(func, "__qualname__", None) or type(func).__qualname__


def _wrap_call(
    exec_mode: str, func: Any, dst: int, send: Callable[..., torch.futures.Future[Any]]
) -> torch.futures.Future[Any]:
    col = getattr(_tls, "collector", None)
    if col is None:  # e.g. a thread the legacy profiler propagated to (autograd engine)
        col = _active[-1] if _active and _profiler_enabled() else None
        if col is None:
            return send()
    agent = _agent_mod.current_agent()
    if col.agent is not agent:  # RPC was initialized after the profile started
        _ensure_middleware(agent)
        col.agent = agent
    callee = agent.roster.workers[dst].name
    call = _Call(rpc_profiling_key(RpcExecMode(exec_mode), _func_name(func), agent.me.name, callee), col.options)
    fut = send(extras={wire.EXTRA_PROFILE: call})
    col.calls.append(call)
    out = _futures.RpcFuture()  # the user waits on this one, so the end is stamped first

    def finish(f: torch.futures.Future[Any]) -> None:
        try:
            out.set_result(f.value())
        except BaseException as e:  # noqa: BLE001 - passed on to the user's future
            out.set_exception(e)

    def done(f: torch.futures.Future[Any]) -> None:
        call.t1 = time.time_ns()
        if out.has_callbacks:  # as the agent does: user callbacks never run on a reader thread
            agent.pool.submit(finish, f)
        else:
            finish(f)

    torch.futures.Future.add_done_callback(fut, done)  # not RpcFuture's: ``done`` may run inline
    return out


# -- the callee: middleware that profiles requests which ask for it ----------------------------------
class _Served:
    """The callee's profile of one request: legacy profiler on the executing thread from
    ``enter_call`` until the function returns; the RPCs it made are followed until the
    response leaves (for an async function: when its future completes)."""

    def __init__(self, options: _Options, node: int) -> None:
        self.node = node
        self.collector = _Collector(options, node)
        self.thread = threading.get_ident()
        self.exited = threading.Event()
        self.records: list[list[Any]] = []
        self.t_in = time.time_ns() / 1e3
        self.enabled = False
        if not _profiler_enabled():
            try:
                _enable_profiler_legacy(options.legacy())
                self.enabled = True
            except RuntimeError:  # never fail the call for want of a profile
                pass
        self.prev = getattr(_tls, "collector", None)
        _tls.collector = self.collector
        _use_wrapper(1)

    def exit(self) -> None:
        """On the executing thread, once the function has returned: stop profiling it."""
        if self.exited.is_set():
            return
        _tls.collector = self.prev
        if self.enabled:
            self.enabled = False
            self.records = _disable_profiler_legacy()
        _use_wrapper(-1)
        self.exited.set()

    def reply(self) -> tuple[Any, ...]:
        """The events for the response, which leaves only once this request stopped profiling."""
        if threading.get_ident() == self.thread:
            self.exit()  # the function has returned (sync, or an async one already done)
        else:  # an async function's future completed elsewhere; exit() is imminent
            self.exited.wait(_EXIT_WAIT)
        t_out = time.time_ns() / 1e3
        events, _, tid = _parse(self.records, self.node)
        nested, _ = _flatten(self.collector.calls, self.node, tid)
        return self.t_in, t_out, [tuple(e) for e in events + nested]


class _Middleware(_agent_mod.Middleware):
    def __init__(self, node: int) -> None:
        self.node = node

    def enter_call(self, src: int, extras: dict[str, Any]) -> Any:
        opts = extras.get(wire.EXTRA_PROFILE)
        if opts is None:
            return None
        served = extras[wire.LOCAL_PROFILE_SERVED] = _Served(_Options(*opts), self.node)
        return served

    def exit_call(self, token: Any, extras: dict[str, Any], result_future: torch.futures.Future[Any] | None) -> None:
        if token is not None:
            token.exit()

    def response_extras(self, extras: dict[str, Any], response: dict[str, Any]) -> None:
        served = extras.get(wire.LOCAL_PROFILE_SERVED)
        if served is not None:
            response[wire.EXTRA_PROFILE] = served.reply()

    def on_response(self, extras: dict[str, Any] | None, call_extras: dict[str, Any]) -> None:
        reply = extras.get(wire.EXTRA_PROFILE) if extras else None
        call = call_extras.get(wire.EXTRA_PROFILE)
        if reply is not None and isinstance(call, _Call):
            call.t_reply, call.reply = time.time_ns(), reply


def _ensure_middleware(agent: _agent_mod.Agent) -> None:
    """Install the middleware the first time a worker profiles or is asked to: until then
    the RPC path does not run a line of profiler code. Installed for good (appending is safe
    while requests run; removing is not), it then costs a few no-op calls per request."""
    with _wrap_lock:
        if not any(isinstance(m, _Middleware) for m in agent.middleware):
            agent.middleware.append(_Middleware(agent.me.id))
