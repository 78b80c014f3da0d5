"""Profiling RPC workloads across workers (``torch.distributed.rpc`` profiling semantics).

    import rpc_core.profiler as profiler
    with profiler.profile() as prof:          # same arguments as torch.autograd.profiler.profile
        fut = rpc_core.rpc_async("worker1", torch.add, args=(t1, t2))
        fut.wait()                            # wait inside: the RPC's event ends when it completes
    print(prof.key_averages().table())        # one row per (name, node), with a Node ID column
    prof.export_chrome_trace("trace.json")    # one process row per node, for Perfetto

How it works. The profile records this thread's ops with torch's legacy (thread-local)
profiler, as torch RPC does. While one is active, a wrapper in ``calls.call_wrappers`` turns
every RPC made from a profiled thread into an event ``rpc_{sync|async|remote}#{func}(caller ->
callee)`` (func: ``aten::add`` for torch builtins, else the qualified name) that lasts until
the call's future completes, and asks the callee to profile the call. The callee (our
middleware, installed by the first such request) runs the function under a thread-local legacy
profiler, stops at the response (for ``async_execution`` functions: when their future
completes) and returns its events, and those of the RPCs it made meanwhile, in the response
extras. The caller adds them as ``{rpc event}#remote_op: {op}`` with ``node_id`` = the rank
that ran them (nested calls chain the prefix); its own events carry its rank.

Clocks: events carry wall-clock microseconds. A callee's events are kept as they are when
they fit inside the caller's view of the call (same host), else centred in it (NTP-style),
so traces from several machines still nest correctly.
"""
from __future__ import annotations

import json
import threading
import time
import warnings
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch.autograd import ProfilerConfig, ProfilerState, _disable_profiler_legacy, _enable_profiler_legacy
from torch.autograd.profiler_util import EventList, FunctionEvent

from . import agent as _agent_mod
from . import futures as _futures
from . import calls, wire
from .rref import _on_fetch

__all__ = ["profile", "record_function"]

record_function = torch.autograd.profiler.record_function  # user scopes, shown on every node
REMOTE_OP = "#remote_op: "
_EXIT_WAIT = 10.0  # s a response waits for the executing thread to stop its profiler
_IGNORED_OPS = frozenset((
    "profiler::_record_function_enter", "profiler::_record_function_enter_new",
    "profiler::_record_function_exit", "aten::is_leaf", "aten::output_nr", "aten::_version",
))
_tls = threading.local()  # .collector: where RPC events made on this thread go


class _Options(NamedTuple):
    record_shapes: bool
    profile_memory: bool
    with_stack: bool
    with_flops: bool
    with_modules: bool

    def legacy(self, state: ProfilerState = ProfilerState.CPU) -> ProfilerConfig:
        return ProfilerConfig(state, self.record_shapes, self.profile_memory, self.with_stack,
                              self.with_flops, self.with_modules, torch._C._profiler._ExperimentalConfig())


class _Event(NamedTuple):
    """One profiled range, picklable; times in wall-clock microseconds."""

    name: str
    start: float
    end: float
    thread: int
    node: int
    is_async: bool
    is_remote: bool
    shapes: list
    stack: list
    scope: int
    cpu_mem: int
    seq: int
    fwd_thread: int
    flops: int


def _parse(records: List[list], node: int) -> Tuple[List[_Event], Optional[float], int]:
    """Legacy profiler records -> (events, profile start time, thread that profiled)."""
    pushes: Dict[int, Any] = {}
    pops: Dict[int, Any] = {}
    mem: Dict[int, int] = {}
    start = None
    loose: List[_Event] = []
    for lst in records:
        open_here: List[int] = []
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
            events.append(_Event(
                s.name(), s.start_us(), e.start_us(), s.thread_id(), node,
                s.is_async() or s.thread_id() != e.thread_id(), False, s.shapes(), s.stack(), s.scope(),
                mem[h], s.sequence_nr(), s.fwd_thread_id(), s.flops()))
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
        self.reply: Optional[tuple] = None  # (callee start us, callee end us, [event tuples])

    def __reduce__(self) -> Any:
        return _activate, (tuple(self.options),)


def _activate(options: tuple) -> tuple:
    """Runs on the callee as a profiled request's extras are unpickled: makes sure its
    agent has our middleware, which then profiles this request."""
    agent = _agent_mod._agent
    if agent is not None:
        _ensure_middleware(agent)
    return options


class _Collector:
    """The RPCs made under one profile (a user's, or a callee's for one request)."""

    def __init__(self, options: _Options, node: int) -> None:
        self.options, self.node = options, node
        self.calls: List[_Call] = []
        self.agent = _agent_mod._agent  # the agent known to have our middleware


def _flatten(calls: List[_Call], node: int, thread: int) -> Tuple[List[_Event], int]:
    """The completed calls' events and their remote events, in this node's clock; and how
    many calls had not completed."""
    out: List[_Event] = []
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
_active: List[_Collector] = []  # user profiles in this process, innermost last


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
_DISPLAY_NAMES = {(_on_fetch.__module__, _on_fetch.__qualname__): "RRef.to_here"}


def _func_name(func: Any) -> str:
    special = _DISPLAY_NAMES.get((getattr(func, "__module__", None), getattr(func, "__qualname__", None)))
    if special is not None:
        return special
    builtin = torch.jit._builtins._find_builtin(func)
    if builtin is not None:
        return builtin
    if isinstance(func, torch.jit.ScriptFunction):
        return torch._jit_internal._qualified_name(func)
    return getattr(func, "__qualname__", None) or type(func).__qualname__


def _wrap_call(exec_mode: str, func: Any, dst: int, send: Any) -> torch.futures.Future:
    col = getattr(_tls, "collector", None)
    if col is None:  # e.g. a thread the legacy profiler propagated to (autograd engine)
        col = _active[-1] if _active and torch.autograd._profiler_enabled() else None
        if col is None:
            return send()
    agent = _agent_mod.current_agent()
    if col.agent is not agent:  # RPC was initialized after the profile started
        _ensure_middleware(agent)
        col.agent = agent
    call = _Call(f"rpc_{exec_mode}#{_func_name(func)}({agent.me.name} -> {agent.workers[dst].name})", col.options)
    fut = send(extras={wire.EXTRA_PROFILE: call})
    col.calls.append(call)
    out = _futures.RpcFuture()  # the user waits on this one, so the end is stamped first

    def finish(f: torch.futures.Future) -> None:
        try:
            out.set_result(f.value())
        except BaseException as e:
            out.set_exception(e)

    def done(f: torch.futures.Future) -> None:
        call.t1 = time.time_ns()
        if out._has_callbacks:  # as the agent does: user callbacks never run on a reader thread
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
        self.records: List[list] = []
        self.t_in = time.time_ns() / 1e3
        self.enabled = False
        if not torch.autograd._profiler_enabled():
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

    def reply(self) -> tuple:
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

    def enter_call(self, src: int, extras: Dict[str, Any]) -> Any:
        opts = extras.get(wire.EXTRA_PROFILE)
        if opts is None:
            return None
        served = extras[wire.LOCAL_PROFILE_SERVED] = _Served(_Options(*opts), self.node)
        return served

    def exit_call(self, token: Any, extras: Dict[str, Any], result_future: Optional[torch.futures.Future]) -> None:
        if token is not None:
            token.exit()

    def response_extras(self, extras: Dict[str, Any], response: Dict[str, Any]) -> None:
        served = extras.get(wire.LOCAL_PROFILE_SERVED)
        if served is not None:
            response[wire.EXTRA_PROFILE] = served.reply()

    def on_response(self, extras: Optional[Dict[str, Any]], call_extras: Dict[str, Any]) -> None:
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


# -- results ------------------------------------------------------------------------------------------
class _EventList(EventList):
    """torch's EventList, with full-width names in tables and a per-node chrome trace."""

    node_names: Dict[int, str] = {}

    def table(self, sort_by=None, row_limit=100, max_src_column_width=75, max_name_column_width=None,  # type: ignore[override]
              max_shapes_column_width=80, header=None, top_level_events_only=False, time_unit=None) -> str:
        """Like ``EventList.table``; ``max_name_column_width=None`` fits the longest name (up to 160)."""
        if max_name_column_width is None:
            max_name_column_width = min(160, max([len(e.key) for e in self] + [20]) + 4)
        return super().table(sort_by=sort_by, row_limit=row_limit, max_src_column_width=max_src_column_width,
                             max_name_column_width=max_name_column_width, max_shapes_column_width=max_shapes_column_width,
                             header=header, top_level_events_only=top_level_events_only, time_unit=time_unit)

    def key_averages(self, *args: Any, **kwargs: Any) -> "_EventList":  # type: ignore[override]
        avg = super().key_averages(*args, **kwargs)
        out = _EventList(avg, use_device=self._use_device, profile_memory=self._profile_memory, with_flops=self._with_flops)
        out.node_names = self.node_names
        return out

    def export_chrome_trace(self, path: str) -> None:
        """Write a Trace Event Format JSON file: one process per node (``node_id: N``), one
        thread row per profiled thread, RPCs as async slices. Opens in Perfetto/chrome://tracing."""
        out: List[Dict[str, Any]] = []
        seen = set()
        for i, e in enumerate(self):
            if getattr(e, "trace_name", None) is None or e.name == "[memory]":
                continue
            pid = max(e.node_id, 0)
            if pid not in seen:
                seen.add(pid)
                label = (f"node_id: {pid}" + (f" ({self.node_names[pid]})" if pid in self.node_names else "")
                         if e.node_id >= 0 else "CPU functions")
                out.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label}})
                out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
            name, args = e.name, {"node_id": e.node_id}
            if e.is_remote and REMOTE_OP in name:
                rpc, _, name = name.rpartition(REMOTE_OP)
                args["rpc"] = rpc
            if e.input_shapes:
                args["input_shapes"] = e.input_shapes
            ts, dur = e.time_range.start, e.time_range.elapsed_us()
            common = {"name": name, "pid": pid, "tid": e.thread, "args": args}
            if e.is_async:
                common.update(cat="rpc" if name.startswith("rpc_") else "async", id=i)
                out.append(dict(common, ph="b", ts=ts))
                out.append(dict(common, ph="e", ts=ts + dur))
            else:
                out.append(dict(common, ph="X", cat="remote_op" if e.is_remote else "cpu_op", ts=ts, dur=dur))
        with open(path, "w") as f:
            json.dump({"traceEvents": out, "displayTimeUnit": "ms"}, f)


class profile:
    """``torch.autograd.profiler.profile`` for RPC programs: same arguments, same result API
    (``function_events``, ``key_averages()``, ``table()``, ``export_chrome_trace()``, ...).

    Events are recorded by torch's legacy profiler on the thread that enters the profile,
    like torch RPC profiling (which works only with it); ``use_kineto``,
    ``experimental_config``, ``custom_trace_id_callback``, ``post_processing_timeout_s`` and
    ``activity_filters`` are accepted and ignored. Remote workers profile CPU only.
    Wait on RPC futures inside the profile: calls that have not completed when it exits are
    left out (with a warning). ``acc_events=True`` keeps the events of earlier runs of the
    same profile object.
    """

    def __init__(self, enabled: bool = True, *, use_device: Optional[str] = None, record_shapes: bool = False,
                 with_flops: bool = False, profile_memory: bool = False, with_stack: bool = False,
                 with_modules: bool = False, use_kineto: bool = False, use_cpu: bool = True,
                 experimental_config: Any = None, acc_events: bool = False, custom_trace_id_callback: Any = None,
                 post_processing_timeout_s: Optional[float] = None, activity_filters: Any = None) -> None:
        self.enabled = enabled
        self.entered = False
        self._function_events: Optional[_EventList] = None
        if not enabled:
            return
        if not use_cpu:
            raise ValueError("rpc_core.profiler.profile records CPU events (legacy profiler); use_cpu=False is not supported")
        self.use_device = use_device
        self._state = ProfilerState.CPU
        if use_device == "cuda" and torch.cuda.is_available():
            self._state = ProfilerState.CUDA
        elif use_device is not None:
            warnings.warn(f"rpc_core.profiler.profile: use_device={use_device!r} is not supported here "
                          "(or not available); profiling CPU only", stacklevel=2)
            self.use_device = None
        self.record_shapes = record_shapes or with_flops
        self.with_flops, self.profile_memory, self.with_stack = with_flops, profile_memory, with_stack
        self.with_modules, self.acc_events = with_modules, acc_events
        self._options = _Options(self.record_shapes, profile_memory, with_stack, with_flops, with_modules)

    def __enter__(self) -> Optional["profile"]:
        if not self.enabled:
            return None
        if self.entered:
            raise RuntimeError("Profiler context manager is not reentrant")
        agent = _agent_mod._agent
        self._node = agent.me.id if agent is not None else -1
        self._names = {w.id: w.name for w in agent.workers} if agent is not None else {}
        self._collector = _Collector(self._options, self._node)
        if agent is not None:
            _ensure_middleware(agent)
        _enable_profiler_legacy(self._options.legacy(self._state))
        self.entered = True
        self._prev, _tls.collector = getattr(_tls, "collector", None), self._collector
        _active.append(self._collector)
        _use_wrapper(1)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if not self.enabled:
            return False
        if self._state == ProfilerState.CUDA:
            torch.cuda.synchronize()
        try:
            records = _disable_profiler_legacy()
        finally:
            _tls.collector = self._prev
            _active.remove(self._collector)
            _use_wrapper(-1)
            self.entered = False
        events, base, tid = _parse(records, self._node)
        rpc_events, unfinished = _flatten(self._collector.calls, self._node, tid)
        if unfinished:
            warnings.warn(f"rpc_core.profiler: {unfinished} RPC(s) made inside the profile had not completed when it "
                          "exited and are not in the results; wait on their futures inside the profile", stacklevel=2)
        all_events = events + rpc_events
        if base is None:
            base = min((e.start for e in all_events), default=0.0)
        fes = [FunctionEvent(
            id=i, name=e.name, trace_name=e.name, thread=e.thread, start_us=e.start - base, end_us=e.end - base,
            fwd_thread=e.fwd_thread, input_shapes=e.shapes, stack=e.stack, scope=e.scope,
            cpu_memory_usage=e.cpu_mem, is_async=e.is_async, is_remote=e.is_remote, sequence_nr=e.seq,
            node_id=e.node, is_legacy=True, flops=e.flops or None)
            for i, e in enumerate(all_events, start=1)]
        fes.sort(key=lambda fe: (fe.time_range.start, -fe.time_range.end))
        result = _EventList(fes, use_device=self.use_device, profile_memory=self.profile_memory, with_flops=self.with_flops)
        result.node_names = self._names
        result._build_tree()
        if self.acc_events and self._function_events is not None:
            result[:0] = list(self._function_events)
        self._function_events = result
        return False

    # -- results (torch.autograd.profiler.profile's API) ----------------------------------------------
    @property
    def function_events(self) -> _EventList:
        if self._function_events is None:
            raise RuntimeError("Profiler didn't finish running")
        return self._function_events

    def key_averages(self, group_by_input_shape: bool = False, group_by_stack_n: int = 0,
                     group_by_overload_name: bool = False, include_python_functions: bool = False) -> _EventList:
        return self.function_events.key_averages(group_by_input_shape, group_by_stack_n,
                                                 group_by_overload_name, include_python_functions)

    def table(self, sort_by: Optional[str] = None, row_limit: int = 100, max_src_column_width: int = 75,
              max_name_column_width: Optional[int] = None, max_shapes_column_width: int = 80,
              header: Optional[str] = None, top_level_events_only: bool = False) -> str:
        return self.function_events.table(sort_by=sort_by, row_limit=row_limit, max_src_column_width=max_src_column_width,
                                          max_name_column_width=max_name_column_width,
                                          max_shapes_column_width=max_shapes_column_width, header=header,
                                          top_level_events_only=top_level_events_only)

    def export_chrome_trace(self, path: str) -> None:
        """One JSON trace for all nodes: a process row per node (``node_id: N``)."""
        self.function_events.export_chrome_trace(path)

    def export_stacks(self, path: str, metric: str = "self_cpu_time_total") -> None:
        if not self.with_stack:
            raise AssertionError("export_stacks() requires with_stack=True")
        self.function_events.export_stacks(path, metric)

    def total_average(self) -> Any:
        return self.function_events.total_average()

    @property
    def self_cpu_time_total(self) -> float:
        return self.function_events.self_cpu_time_total

    def __str__(self) -> str:
        return "<unfinished rpc_core.profiler.profile>" if self._function_events is None else str(self._function_events)

    __repr__ = __str__
