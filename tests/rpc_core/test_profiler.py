"""rpc_core.profiler: the "Profiling PyTorch RPC-Based Workloads" recipe, on our RPC layer.

The bodies and the functions they call over RPC are module-level so that worker processes
(and RPC, which ships functions by reference) can import them.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from rpc_core.functions import async_execution
from tests._world import run_world

W0_W1 = "(worker0 -> worker1)"


# -- remote functions ----------------------------------------------------------------------------
def udf_with_ops() -> torch.Tensor:
    """The recipe's UDF: sleeps 1 s, then runs a few ops."""
    time.sleep(1)
    t1, t2 = torch.ones((2, 2)), torch.ones((2, 2))
    t = torch.add(t1, t2)
    t = torch.mul(t, t)
    t = t.relu()
    return t.sigmoid()


def udf_with_scope(x: torch.Tensor) -> torch.Tensor:
    with torch.autograd.profiler.record_function("user_scope_on_callee"):
        return torch.tanh(x)


@async_execution
def nested_async(x: torch.Tensor):
    """Calls worker2 and answers when that call completes (no thread waits)."""
    import rpc_core

    return rpc_core.rpc_async("worker2", torch.add, args=(x, x)).then(lambda f: f.value() * 2)


def raise_value_error() -> None:
    raise ValueError("boom from worker1")


def has_profiler_middleware() -> bool:
    from rpc_core import profiler
    from rpc_core.agent import agent

    return any(isinstance(m, profiler._Middleware) for m in agent.current_agent().middleware)


# -- bodies --------------------------------------------------------------------------------------
def _summary(prof) -> dict:
    avg = prof.key_averages()
    return {
        "avg": [(e.key, e.count, e.node_id, e.cpu_time_total) for e in avg],
        "events": [
            (e.name, e.node_id, e.time_range.start, e.time_range.end, e.is_remote, e.is_async)
            for e in prof.function_events
        ],
        "table": avg.table(),
    }


def _recipe_body(ctx, trace_path: str):
    import rpc_core
    from rpc_core import api, profiler

    if ctx.rank != 0:
        rpc_core._barrier(["worker0", "worker1"])  # stay up until worker0 is done
        return {"wrappers": len(api.call_wrappers), "middleware": has_profiler_middleware()}
    # never profiled: no profiler code on the RPC path of either worker
    untouched = not has_profiler_middleware() and not rpc_core.rpc_sync("worker1", has_profiler_middleware)
    t1, t2 = torch.rand((3, 3)), torch.rand((3, 3))
    prof = profiler.profile()
    with prof:
        futs = [
            rpc_core.rpc_async("worker1", torch.add, args=(t1, t2)),
            rpc_core.rpc_async("worker1", torch.mul, args=(t1, t2)),
            rpc_core.rpc_async("worker1", udf_with_ops),
        ]
        torch.futures.wait_all(futs)
    prof.export_chrome_trace(trace_path)
    out = _summary(prof)
    out["wrappers"], out["untouched"] = len(api.call_wrappers), untouched
    rpc_core._barrier(["worker0", "worker1"])
    return out


def _features_body(ctx):
    import rpc_core
    import rpc_core.autograd as dist_autograd
    from rpc_core import api, profiler

    if ctx.rank != 0:
        rpc_core._barrier([f"worker{r}" for r in range(ctx.world_size)])  # stay up until worker0 is done
        return {"wrappers": len(api.call_wrappers)}
    x = torch.ones(4)
    rpc_core.rpc_sync("worker1", torch.add, args=(x, x))  # outside any profile: not recorded anywhere
    with profiler.profile(record_shapes=True) as prof:
        nested = rpc_core.rpc_sync("worker1", nested_async, args=(x,))
        scoped = rpc_core.rpc_async("worker1", udf_with_scope, args=(x,)).wait()
        rref = rpc_core.remote("worker2", torch.sub, args=(x, torch.ones(4)))
        fetched = rref.to_here()
        via_proxy = rref.rpc_sync().add(x)
        w = torch.ones(4, requires_grad=True)
        with dist_autograd.context() as cid:
            loss = rpc_core.rpc_sync("worker1", torch.mul, args=(w, x)).sum()
            dist_autograd.backward(cid, [loss])
            grad = dist_autograd.get_gradients(cid)[w]
        try:
            rpc_core.rpc_sync("worker1", raise_value_error)
            raised = "no error"
        except ValueError as e:  # the remote exception keeps its type under profiling
            raised = str(e)
    assert torch.equal(nested, 4 * x) and torch.equal(scoped, torch.tanh(x))
    assert torch.equal(fetched, torch.zeros(4)) and torch.equal(via_proxy, x) and torch.equal(grad, x)
    out = _summary(prof)
    out["wrappers"], out["raised"] = len(api.call_wrappers), raised
    out["tanh_shapes"] = [
        e.input_shapes for e in prof.key_averages(group_by_input_shape=True) if e.key.endswith("#remote_op: aten::tanh")
    ]
    rpc_core._barrier([f"worker{r}" for r in range(ctx.world_size)])
    return out


# -- tests ---------------------------------------------------------------------------------------
def _avg(out: dict) -> dict:
    return {(k, node): (count, cpu_total) for k, count, node, cpu_total in out["avg"]}


def _check_remote_events_nest(events) -> None:
    """Each remote event lies within its RPC's event (clocks aligned, same host)."""
    spans: dict[str, list[tuple[Any, Any]]] = {}
    for name, _node, start, end, is_remote, is_async in events:
        if is_async and not is_remote:
            spans.setdefault(name, []).append((start, end))
    for name, _node, start, end, is_remote, _ in events:
        if is_remote:
            rpc = name.split("#remote_op: ")[0]
            assert any(s <= start and end <= e for s, e in spans[rpc]), (name, start, end, spans[rpc])


def _check_trace_format(evs) -> None:
    """What Perfetto's JSON importer needs: known phases, numeric times, integer ids, slices
    on one thread properly nested, async begin/end paired."""
    open_async = {}
    by_thread: dict[Any, list[Any]] = {}
    for e in evs:
        assert e["ph"] in ("M", "X", "b", "e") and isinstance(e["pid"], int), e
        if e["ph"] == "M":
            continue
        assert isinstance(e["tid"], int) and isinstance(e["ts"], (int, float)) and isinstance(e["name"], str), e
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
            by_thread.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
        else:
            key = (e["pid"], e["cat"], e["id"])
            if e["ph"] == "b":
                open_async[key] = e["ts"]
            else:
                assert open_async.pop(key) <= e["ts"], e
    assert not open_async
    for slices in by_thread.values():
        stack: list[Any] = []
        for start, end, name in sorted(slices, key=lambda x: (x[0], -x[1])):
            while stack and stack[-1][1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1][1] + 1e-3, (name, start, end, stack[-1])
            stack.append((start, end, name))


def _remote_ops(trace_events) -> set:
    """What a tool that reads torch's RPC traces does: remote events by their name,
    ``{rpc event}#remote_op: {op}``, and the node whose row they are on."""
    return {
        (*e["name"].split("#remote_op: ", 1), e["pid"])
        for e in trace_events
        if "#remote_op: " in e.get("name", "") and e["ph"] == "X"
    }


def test_recipe_table_and_trace(tmp_path):
    trace = tmp_path / "trace.json"
    out, callee = run_world(_recipe_body, 2, args=(str(trace),), timeout=120)
    avg = _avg(out)
    for op in ("add", "mul"):
        key = f"rpc_async#aten::{op}{W0_W1}"
        assert avg[(key, 0)][0] == 1, out["table"]
        assert avg[(f"{key}#remote_op: aten::{op}", 1)][0] == 1, out["table"]
    udf = f"rpc_async#udf_with_ops{W0_W1}"
    assert avg[(udf, 0)][0] == 1
    assert avg[(udf, 0)][1] >= 1e6, "the sleeping UDF's CPU total is its end-to-end latency (>= 1 s)"
    for op in ("add", "mul", "relu", "sigmoid", "ones"):
        assert avg[(f"{udf}#remote_op: aten::{op}", 1)][0] >= 1, out["table"]
    assert all(node in (0, 1) for _, node in avg)
    assert all(node == 1 for key, node in avg if "#remote_op: " in key)
    assert all(node == 0 for key, node in avg if "#remote_op: " not in key)
    _check_remote_events_nest(out["events"])
    table = out["table"]
    assert "Node ID" in table.splitlines()[1]
    assert f"{udf}#remote_op: aten::sigmoid" in table  # full names, not truncated
    assert out["untouched"] and callee["middleware"]  # installed by the first profiled request
    assert out["wrappers"] == 0 and callee["wrappers"] == 0  # no call wrapper left once the profile exits

    doc = json.loads(trace.read_text())
    evs = doc["traceEvents"]
    _check_trace_format(evs)
    procs = {e["pid"]: e["args"]["name"] for e in evs if e.get("name") == "process_name"}
    assert procs == {0: "node_id: 0 (worker0)", 1: "node_id: 1 (worker1)"}
    on1 = {(e["name"], e["args"].get("rpc"), e["args"].get("op")) for e in evs if e["pid"] == 1 and e["ph"] == "X"}
    for rpc, op in (
        (f"rpc_async#aten::add{W0_W1}", "aten::add"),
        (f"rpc_async#aten::mul{W0_W1}", "aten::mul"),
        (f"rpc_async#udf_with_ops{W0_W1}", "aten::sigmoid"),
    ):
        assert (f"{rpc}#remote_op: {op}", rpc, op) in on1
    # Every event under the name function_events and key_averages() show, so a tool that
    # reads torch's traces for "#remote_op:" finds each remote op, on its node's row.
    traced = {(e["name"], e["pid"]) for e in evs if e["ph"] in ("X", "b")}
    assert traced == set(avg), traced ^ set(avg)
    remote_keys = [(*key.split("#remote_op: "), node) for key, node in avg if "#remote_op: " in key]
    assert _remote_ops(evs) == set(remote_keys) and len(remote_keys) >= 7
    rpcs = [e for e in evs if e["pid"] == 0 and e.get("cat") == "rpc"]
    assert {e["ph"] for e in rpcs} == {"b", "e"} and len(rpcs) == 6


def test_nested_async_scopes_remote_and_backward():
    out, w1, w2 = run_world(_features_body, 3, timeout=120)
    avg = _avg(out)
    keys = set(avg)
    chain = (
        "rpc_sync#nested_async(worker0 -> worker1)#remote_op: "
        "rpc_async#aten::add(worker1 -> worker2)#remote_op: aten::add"
    )
    assert (chain, 2) in keys, out["table"]
    assert ("rpc_sync#nested_async(worker0 -> worker1)#remote_op: rpc_async#aten::add(worker1 -> worker2)", 1) in keys
    assert (f"rpc_async#udf_with_scope{W0_W1}#remote_op: user_scope_on_callee", 1) in keys, out["table"]
    assert (f"rpc_async#udf_with_scope{W0_W1}#remote_op: aten::tanh", 1) in keys
    assert ("rpc_remote#aten::sub(worker0 -> worker2)#remote_op: aten::sub", 2) in keys, out["table"]
    assert ("rpc_sync#RRef.to_here(worker0 -> worker2)", 0) in keys
    assert ("rpc_sync#_on_invoke(worker0 -> worker2)#remote_op: aten::add", 2) in keys, out["table"]  # RRef proxy
    assert ("rpc_sync#aten::mul(worker0 -> worker1)#remote_op: aten::mul", 1) in keys
    # distributed backward: the gradient RPC to worker1 and the backward work it did there
    grad_calls = [k for k, node in keys if k.startswith("rpc_async#_on_backward(worker0 -> worker1)") and node == 1]
    assert grad_calls, out["table"]
    # the call made before the profile is not in it
    assert not any(k.startswith("rpc_sync#aten::add") for k, _ in keys)
    assert "boom from worker1" in out["raised"]
    assert out["tanh_shapes"] == [[[4]]]  # record_shapes reaches the callee
    _check_remote_events_nest(out["events"])
    assert out["wrappers"] == w1["wrappers"] == w2["wrappers"] == 0


def _self_remote_body(ctx):
    import rpc_core
    from rpc_core import profiler

    if ctx.rank != 0:
        return None
    found = []
    for _ in range(5):  # to_here() may return before the call's answer is stamped: not once here
        with profiler.profile() as prof:
            rref = rpc_core.remote("worker0", torch.mul, args=(torch.ones(1), torch.ones(1)))
            rref.to_here()
            rref._get_profiling_future().wait()
        found.append(sum(e.name == "rpc_remote#aten::mul(worker0 -> worker0)" for e in prof.function_events))
    return found


def test_remote_to_itself_is_profiled_once_its_profiling_future_completes():
    # torch's test_profiler_with_remote_*: an RRef's profiling future covers a remote() to the
    # caller itself too, whose owner value is set before the call's answer arrives.
    found, _ = run_world(_self_remote_body, 2, timeout=120)
    assert found == [1] * 5, found
