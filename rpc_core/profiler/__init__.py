"""Profiling RPC workloads across workers (``torch.distributed.rpc`` profiling semantics).

    import rpc_core.profiler as profiler
    with profiler.profile() as prof:          # same arguments as torch.autograd.profiler.profile
        fut = rpc_core.rpc_async("worker1", torch.add, args=(t1, t2))
        fut.wait()                            # wait inside: the RPC's event ends when it completes
    print(prof.key_averages().table())        # one row per (name, node), with a Node ID column
    prof.export_chrome_trace("trace.json")    # one process row per node, for Perfetto

The profile records this thread's ops with torch's legacy (thread-local) profiler, as torch
RPC does; the RPCs made meanwhile, and the callees' events, come from ``rpc_events``.
This module turns both into torch's result types (``EventList``, ``FunctionEvent``) and
exports them.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import torch
from torch._C._autograd import _disable_profiler_legacy, _enable_profiler_legacy
from torch._C._profiler import ProfilerState
from torch.autograd.profiler_util import EventList, FunctionEvent

from ..agent import agent as _agent_mod
from . import rpc_events as _rpc
from .rpc_events import (
    REMOTE_OP,
    RpcExecMode,
    _Collector,
    _ensure_middleware,
    _flatten,
    _Options,
    _parse,
    rpc_profiling_key,
)
from .rpc_events import _Middleware as _Middleware  # re-exported: tests and benchmarks look for it

__all__ = ["RpcExecMode", "profile", "record_function", "rpc_profiling_key"]

record_function = torch.autograd.profiler.record_function  # user scopes, shown on every node


# -- results ------------------------------------------------------------------------------------------
# torch's EventList is unannotated: calls into it carry ``type: ignore[no-untyped-call]``.
class _EventList(EventList):
    """torch's EventList, with full-width names in tables and a per-node chrome trace."""

    node_names: dict[int, str] = {}
    # Wall-clock microseconds (time.time() * 1e6) that the events' times count from: a trace
    # of several processes lines up their events with it.
    base_us: float = 0.0

    def table(
        self,
        sort_by: str | None = None,
        row_limit: int = 100,
        max_src_column_width: int = 75,
        max_name_column_width: int | None = None,
        max_shapes_column_width: int = 80,
        header: str | None = None,
        top_level_events_only: bool = False,
        time_unit: str | None = None,
    ) -> str:
        """Like ``EventList.table``; ``max_name_column_width=None`` fits the longest name (up to 160)."""
        if max_name_column_width is None:
            max_name_column_width = min(160, max([len(e.key) for e in self] + [20]) + 4)
        text: str = super().table(  # type: ignore[no-untyped-call]
            sort_by=sort_by,
            row_limit=row_limit,
            max_src_column_width=max_src_column_width,
            max_name_column_width=max_name_column_width,
            max_shapes_column_width=max_shapes_column_width,
            header=header,
            top_level_events_only=top_level_events_only,
            time_unit=time_unit,
        )
        return text

    def key_averages(self, *args: Any, **kwargs: Any) -> _EventList:
        avg = super().key_averages(*args, **kwargs)  # type: ignore[no-untyped-call]
        out = _EventList(
            avg,
            use_device=self._use_device,
            profile_memory=self._profile_memory,  # type: ignore[no-untyped-call]
            with_flops=self._with_flops,
        )
        out.node_names = self.node_names
        out.base_us = self.base_us
        return out

    def export_chrome_trace(self, path: str) -> None:
        """Write a Trace Event Format JSON file: one process per node (``node_id: N``), one
        thread row per profiled thread, RPCs as async slices, every event under its
        ``function_events`` name. Opens in Perfetto/chrome://tracing."""
        out: list[dict[str, Any]] = []
        seen = set()
        for i, e in enumerate(self):
            if getattr(e, "trace_name", None) is None or e.name == "[memory]":
                continue
            pid = max(e.node_id, 0)
            if pid not in seen:
                seen.add(pid)
                label = (
                    f"node_id: {pid}" + (f" ({self.node_names[pid]})" if pid in self.node_names else "")
                    if e.node_id >= 0
                    else "CPU functions"
                )
                out.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label}})
                out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
            # Under the name tables and key_averages() show, as torch's export writes it: a
            # remote event keeps its "{rpc}#remote_op: {op}" name, which tools look for.
            name, args = e.name, {"node_id": e.node_id}
            if e.is_remote and REMOTE_OP in name:
                args["rpc"], _, args["op"] = name.rpartition(REMOTE_OP)
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

    def __init__(
        self,
        enabled: bool = True,
        *,
        use_device: str | None = None,
        record_shapes: bool = False,
        with_flops: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        with_modules: bool = False,
        use_kineto: bool = False,
        use_cpu: bool = True,
        experimental_config: Any = None,
        acc_events: bool = False,
        custom_trace_id_callback: Any = None,
        post_processing_timeout_s: float | None = None,
        activity_filters: Any = None,
    ) -> None:
        self.enabled = enabled
        self.entered = False
        self._function_events: _EventList | None = None
        if not enabled:
            return
        if not use_cpu:
            raise ValueError(
                "rpc_core.profiler.profile records CPU events (legacy profiler); use_cpu=False is not supported"
            )
        self.use_device = use_device
        self._state = ProfilerState.CPU
        if use_device == "cuda" and torch.cuda.is_available():
            self._state = ProfilerState.CUDA
        elif use_device is not None:
            warnings.warn(
                f"rpc_core.profiler.profile: use_device={use_device!r} is not supported here "
                "(or not available); profiling CPU only",
                stacklevel=2,
            )
            self.use_device = None
        self.record_shapes = record_shapes or with_flops
        self.with_flops, self.profile_memory, self.with_stack = with_flops, profile_memory, with_stack
        self.with_modules, self.acc_events = with_modules, acc_events
        self._options = _Options(self.record_shapes, profile_memory, with_stack, with_flops, with_modules)

    def __enter__(self) -> profile | None:
        if not self.enabled:
            return None
        if self.entered:
            raise RuntimeError("Profiler context manager is not reentrant")
        agent = _agent_mod.current_agent_or_none()
        self._node = agent.me.id if agent is not None else -1
        self._names = {w.id: w.name for w in agent.roster.workers.values()} if agent is not None else {}
        self._collector = _Collector(self._options, self._node)
        if agent is not None:
            _ensure_middleware(agent)
        _enable_profiler_legacy(self._options.legacy(self._state))
        self.entered = True
        self._prev, _rpc._tls.collector = getattr(_rpc._tls, "collector", None), self._collector
        _rpc._active.append(self._collector)
        _rpc._use_wrapper(1)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if not self.enabled:
            return False
        if self._state == ProfilerState.CUDA:
            torch.cuda.synchronize()
        try:
            records = _disable_profiler_legacy()
        finally:
            _rpc._tls.collector = self._prev
            _rpc._active.remove(self._collector)
            _rpc._use_wrapper(-1)
            self.entered = False
        events, base, tid = _parse(records, self._node)
        rpc_events, unfinished = _flatten(self._collector.calls, self._node, tid)
        if unfinished:
            warnings.warn(
                f"rpc_core.profiler: {unfinished} RPC(s) made inside the profile had not completed when it "
                "exited and are not in the results; wait on their futures inside the profile",
                stacklevel=2,
            )
        all_events = events + rpc_events
        if base is None:
            base = min((e.start for e in all_events), default=0.0)
        fes = [
            FunctionEvent(
                id=i,
                name=e.name,
                trace_name=e.name,
                thread=e.thread,
                start_us=e.start - base,
                end_us=e.end - base,
                fwd_thread=e.fwd_thread,
                input_shapes=e.shapes,
                stack=e.stack,
                scope=e.scope,
                cpu_memory_usage=e.cpu_mem,
                is_async=e.is_async,
                is_remote=e.is_remote,
                sequence_nr=e.seq,
                node_id=e.node,
                is_legacy=True,
                flops=e.flops or None,
            )
            for i, e in enumerate(all_events, start=1)
        ]
        fes.sort(key=lambda fe: (fe.time_range.start, -fe.time_range.end))
        result = _EventList(
            fes,
            use_device=self.use_device,
            profile_memory=self.profile_memory,  # type: ignore[no-untyped-call]
            with_flops=self.with_flops,
        )
        result.node_names = self._names
        result.base_us = base
        result._build_tree()  # type: ignore[no-untyped-call]
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

    def key_averages(
        self,
        group_by_input_shape: bool = False,
        group_by_stack_n: int = 0,
        group_by_overload_name: bool = False,
        include_python_functions: bool = False,
    ) -> _EventList:
        return self.function_events.key_averages(
            group_by_input_shape, group_by_stack_n, group_by_overload_name, include_python_functions
        )

    def table(
        self,
        sort_by: str | None = None,
        row_limit: int = 100,
        max_src_column_width: int = 75,
        max_name_column_width: int | None = None,
        max_shapes_column_width: int = 80,
        header: str | None = None,
        top_level_events_only: bool = False,
    ) -> str:
        return self.function_events.table(
            sort_by=sort_by,
            row_limit=row_limit,
            max_src_column_width=max_src_column_width,
            max_name_column_width=max_name_column_width,
            max_shapes_column_width=max_shapes_column_width,
            header=header,
            top_level_events_only=top_level_events_only,
        )

    def export_chrome_trace(self, path: str) -> None:
        """One JSON trace for all nodes: a process row per node (``node_id: N``)."""
        self.function_events.export_chrome_trace(path)

    def export_stacks(self, path: str, metric: str = "self_cpu_time_total") -> None:
        if not self.with_stack:
            raise AssertionError("export_stacks() requires with_stack=True")
        self.function_events.export_stacks(path, metric)

    def total_average(self) -> Any:
        return self.function_events.total_average()  # type: ignore[no-untyped-call]

    @property
    def self_cpu_time_total(self) -> float:
        total: float = self.function_events.self_cpu_time_total
        return total

    def __str__(self) -> str:
        return "<unfinished rpc_core.profiler.profile>" if self._function_events is None else str(self._function_events)

    __repr__ = __str__
