"""Where a call's time goes: wall time, each side's CPU split by thread and by user/kernel
time, and (rpc_core) each side's Python profile grouped by module.

    python -m benchmarks.step_breakdown                    # grad-to-caller step and no-op, both impls
    python -m benchmarks.step_breakdown --spin 0 --profile # rpc_core with polling off, with profiles
    python -m benchmarks.step_breakdown --ps-train         # ps_train's MLP 1+1 step: CPU per step by role

``--ps-train`` instead measures a whole ps_train training step (``benchmarks/_ps_step.py``):
MLP 1+1 with ps_train's defaults on rpc_core, each role's CPU per step over a few windows, the
one-process loop's CPU per step, and (yappi, both processes, every thread) each role's self
time by category and its Python calls per step. CPU time, unlike wall time, hardly moves with
the machine's load, so runs made at different moments compare.

Runs two of rpc_bench's workloads for torch and rpc_core, one after the other: ``grad_step``
(``rpc_sync(owner, linear_owned, (rref, x))``, x 64x256 requiring grad, then a distributed
backward whose gradient for x comes back; ``local`` is the same in one process) and ``noop``.
First the machine's ping-pong floor (``_floor.py``). Per workload: wall time per call and, for
both processes, CPU per call of every thread that used any (user and kernel apart). When the
two sides' CPU adds up to the wall time the call is bound by their work; well below, by
waiting. ``--profile`` (rpc_core) prints each side's cProfile self time per call by module.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import importlib.util
import os
import pstats
import secrets
import socket
import statistics
import sys
import threading
import time

import torch
import torch.multiprocessing as mp
import torch.nn as nn

from benchmarks import _floor, _ps_step, _workloads
from benchmarks._format import fmt
from benchmarks._results import add_result_option, run_recorded

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


CALLEE = "worker1"
_profile: list[cProfile.Profile] = []


# -- run on the callee -------------------------------------------------------------------------------------------
def thread_cpu() -> dict[str, tuple[float, float]]:
    """CPU seconds (user, kernel) so far of each thread of this process, by thread name."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, tuple[float, float]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(tid), "native")
        u, s = out.get(name, (0.0, 0.0))
        out[name] = (u + int(fields[11]) / tick, s + int(fields[12]) / tick)
    return out


def start_profile() -> None:
    """Profile the thread that runs this request (rpc_core: the one that serves them)."""
    p = cProfile.Profile()
    _profile[:] = [p]
    p.enable()


def stop_profile() -> dict:
    p = _profile.pop()
    p.disable()
    return _by_module(p)


# -- profiles, grouped -------------------------------------------------------------------------------------------
SYSCALLS = "system calls (socket, select)"
# The modules that move bytes (framing, buffers, sockets, waiting, matching answers to calls):
# what a native transport would replace.
MESSAGE_PATH = {
    f"rpc_core/{m}.py"
    for m in (
        "transport/stream",
        "transport/buffers",
        "transport/sending",
        "transport/polling",
        "protocol/wire",
        "agent/outbound",
        "agent/completion",
        "transport/cma",
    )
}


def _module_of(filename: str, func: str) -> str:
    if filename == "~":  # a builtin: name the socket and select calls apart, they are the waits
        if "socket" in func or "select" in func:
            return SYSCALLS
        return "builtins and C methods (torch ops included)"
    for root, label in ((os.path.join(REPO, "rpc_core"), "rpc_core"), (os.path.dirname(torch.__file__), "torch")):
        if filename.startswith(root):
            rel = os.path.relpath(filename, root)
            return f"{label}/{rel}" if label == "rpc_core" else "torch (Python)"
    return "other Python"


def _by_module(p: cProfile.Profile) -> dict:
    stats = pstats.Stats(p).stats  # type: ignore[attr-defined]
    self_time: dict[str, float] = collections.defaultdict(float)
    py_calls = 0
    ran: dict[str, int] = collections.Counter()  # calls of the workloads' remote functions
    for (filename, _line, func), (_cc, ncalls, tottime, _ct, _callers) in stats.items():
        self_time[_module_of(filename, func)] += tottime
        if filename != "~":
            py_calls += ncalls
        if func in ("noop", "linear_owned"):
            ran[func] += ncalls
    return {"self_time": dict(self_time), "py_calls": py_calls, "ran": dict(ran)}


# -- the caller ---------------------------------------------------------------------------------------------------
def _workload(impl, name):
    rpc, dist_autograd = impl.rpc, impl.autograd
    if name == "noop":
        return lambda: rpc.rpc_sync(CALLEE, _workloads.noop), None
    lin = rpc.remote(CALLEE, nn.Linear, args=(256, 256))
    x = torch.randn(64, 256, requires_grad=True)

    def step():
        with dist_autograd.context() as ctx:
            out = rpc.rpc_sync(CALLEE, _workloads.linear_owned, args=(lin, x))
            dist_autograd.backward(ctx, [out.sum()])

    local_lin = nn.Linear(256, 256)

    def local():
        local_lin(x).sum().backward()

    return step, local


def _per_call(fn, n):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def _cpu_delta(before, after, n):
    return {
        k: ((u - before.get(k, (0, 0))[0]) / n, (s - before.get(k, (0, 0))[1]) / n)
        for k, (u, s) in after.items()
        if (u, s) != before.get(k, (0.0, 0.0))
    }


def measure(impl, name, n, profile):
    rpc = impl.rpc
    fn, local = _workload(impl, name)
    for _ in range(max(50, n // 10)):
        fn()
    out = {"local": _per_call(local, n) if local else None}
    callee0, caller0 = rpc.rpc_sync(CALLEE, thread_cpu), thread_cpu()
    out["wall"] = _per_call(fn, n)
    caller1, callee1 = thread_cpu(), rpc.rpc_sync(CALLEE, thread_cpu)
    out["caller"], out["callee"] = _cpu_delta(caller0, caller1, n), _cpu_delta(callee0, callee1, n)
    if profile:
        rpc.rpc_sync(CALLEE, start_profile)
        p = cProfile.Profile()
        p.enable()
        for _ in range(n):
            fn()
        p.disable()
        out["profile"] = {"caller": _by_module(p), "callee": rpc.rpc_sync(CALLEE, stop_profile), "n": n}
    return out


def worker(rank, impl_name, port, spin, jobs, profile, queue, secret):
    if impl_name == "rpc_core":
        os.environ["RPC_CORE_AUTH_SECRET"] = secret
        if spin is not None:
            os.environ["RPC_CORE_SPIN_US"] = str(spin)
    impl = _workloads.join_world(rank, 2, impl_name, port, {}, queue, rpc_timeout=60)
    if impl is not None and rank == 0:
        for name, n in jobs:
            queue.put(("result", name, measure(impl, name, n, profile)))
    if impl is not None:
        impl.rpc.shutdown()


def run(impl_name, spin, jobs, profile):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    secret = secrets.token_hex(16)
    procs = [
        ctx.Process(target=worker, args=(r, impl_name, port, spin, jobs, profile, queue, secret)) for r in range(2)
    ]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + 600
    while len(results) < len(jobs) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in procs):
            break
        try:
            msg = queue.get(timeout=1.0)
        except Exception:  # noqa: BLE001 - Empty, or a message cut by a dying rank: look at the processes
            continue
        if msg[0] == "unavailable":
            print(f"{impl_name}: unavailable: {msg[1]}")
            break
        if msg[0] == "result":
            results[msg[1]] = msg[2]
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    if len(results) < len(jobs):
        raise SystemExit(f"{impl_name}: the world failed before it measured {[j for j, _ in jobs if j not in results]}")
    return results


# -- report -------------------------------------------------------------------------------------------------------
def _threads(cpu: dict) -> str:
    top = sorted(cpu.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))
    return ", ".join(f"{k} {fmt(u * 1e6)}+{fmt(s * 1e6)}" for k, (u, s) in top if (u + s) * 1e6 >= 1)


def report(impl_name, spin, results):
    label = impl_name + (f" (RPC_CORE_SPIN_US={spin})" if spin is not None and impl_name == "rpc_core" else "")
    for name, r in results.items():
        cpu = {side: sum(u + s for u, s in r[side].values()) for side in ("caller", "callee")}
        local = f", local compute {fmt(r['local'] * 1e6)} us" if r["local"] else ""
        print(
            f"{label} {name}: wall {fmt(r['wall'] * 1e6)} us per call{local}; CPU per call caller "
            f"{fmt(cpu['caller'] * 1e6)} us, callee {fmt(cpu['callee'] * 1e6)} us "
            f"(sum {cpu['caller'] / r['wall'] + cpu['callee'] / r['wall']:.2f}x the wall time)"
        )
        for side in ("caller", "callee"):
            print(f"    {side} threads, user+kernel us per call: {_threads(r[side])}")
        prof = r.get("profile")
        if prof:
            served = prof["callee"]["ran"].get("noop" if name == "noop" else "linear_owned", 0)
            if served < 0.9 * prof["n"]:
                print(
                    f"    the callee's profiled thread ran {served} of the {prof['n']} calls (its reading loop "
                    "moved to another thread): its profile below is not the calls'"
                )
            for side in ("caller", "callee"):
                p = prof[side]
                total = sum(p["self_time"].values())
                print(
                    f"    {side} profile (the serving thread; cProfile slows Python ~2x): "
                    f"{p['py_calls'] / prof['n']:.0f} Python calls per call, self time by module:"
                )
                for mod, t in sorted(p["self_time"].items(), key=lambda kv: -kv[1])[:12]:
                    print(f"        {100 * t / total:5.1f}%  {fmt(t / prof['n'] * 1e6):>7} us  {mod}")
                working = total - p["self_time"].get(SYSCALLS, 0.0)
                ours = sum(t for m, t in p["self_time"].items() if m.startswith("rpc_core/"))
                path = sum(t for m, t in p["self_time"].items() if m in MESSAGE_PATH)
                names = ", ".join(sorted(m[len("rpc_core/") : -len(".py")] for m in MESSAGE_PATH))
                print(
                    f"        outside system calls: {fmt(working / prof['n'] * 1e6)} us per call; rpc_core's "
                    f"modules {100 * ours / working:.0f}% of it, their message path ({names}) "
                    f"{100 * path / working:.0f}%"
                )


def report_ps_train(steps: int, windows: int, top: int) -> None:
    # Checked first: without it both roles would train their windows, then fail in the
    # profiled one with a traceback from each process.
    if importlib.util.find_spec("yappi") is None:
        raise SystemExit("--ps-train profiles both roles with yappi, not installed: pip install -e '.[profile]'")
    single = _ps_step.measure_single(steps, windows)
    run = _ps_step.measure(steps, windows, profile=True)
    one = sorted(c for c, _ in single)[len(single) // 2]
    print(
        f"ps_train MLP 1+1 on rpc_core (sync, update in the backward; batch 32), {windows} windows of {steps} steps; "
        f"CPU per step, median window (each window's trainer/server/wall µs: "
        + "; ".join(f"{fmt(w.trainer_us)}/{fmt(w.server_us)}/{fmt(w.wall_us)}" for w in run.windows)
        + f"); one process: {fmt(one)} µs CPU per step (windows: {', '.join(fmt(c) for c, _ in single)})"
    )
    print()
    print("| per step | trainer | server | both |")
    print("|---|---|---|---|")
    t, s = run.median("trainer"), run.median("server")
    print(f"| CPU, µs | {fmt(t)} | {fmt(s)} | {fmt(t + s)} |")
    print(f"| CPU / one process's | {t / one:.2f}x | {s / one:.2f}x | {(t + s) / one:.2f}x |")
    pt, ps = run.py_calls["trainer"], run.py_calls["server"]
    print(f"| Python calls (exact) | {pt:.0f} | {ps:.0f} | {pt + ps:.0f} |")
    cats = [label for label, _ in _ps_step.CATEGORIES]
    for c in cats:
        ct, cs = run.by_category["trainer"].get(c, 0.0), run.by_category["server"].get(c, 0.0)
        print(f"| {c}, µs | {fmt(ct)} | {fmt(cs)} | {fmt(ct + cs)} |")
    print()
    for role in ("trainer", "server"):
        print(f"{role}: the {top} functions with the most self time (µs per step, scaled; calls per step):")
        for us, n, name in run.top[role][:top]:
            print(f"    {fmt(us):>7} µs  {n:6.2f}  {name}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", choices=["both", "torch", "rpc_core"], default="both")
    ap.add_argument("--spin", type=int, default=None, help="RPC_CORE_SPIN_US for rpc_core (default: its own)")
    ap.add_argument("--profile", action="store_true", help="rpc_core: cProfile both sides, grouped by module")
    ap.add_argument("--steps", type=int, default=2000, help="calls per workload (default 2000)")
    ap.add_argument("--ps-train", action="store_true", help="instead: ps_train's MLP 1+1 step, CPU by role and part")
    ap.add_argument("--windows", type=int, default=5, help="--ps-train: unprofiled windows (default 5)")
    ap.add_argument("--top", type=int, default=12, help="--ps-train: functions listed per role (default 12)")
    add_result_option(ap, "step_breakdown")
    args = ap.parse_args(argv)
    print(_floor.describe_machine(_floor.machine()))
    if args.ps_train:
        report_ps_train(min(args.steps, 400) if args.steps == 2000 else args.steps, args.windows, args.top)
        return 0
    floor = {polling: statistics.median(_floor._pingpong(_floor._unix_pair, polling)) for polling in (False, True)}
    print(
        f"floor: bare ping-pong over a Unix socketpair {fmt(floor[False])} us per round trip blocking, "
        f"{fmt(floor[True])} us polling"
    )
    jobs = [("grad_step", args.steps), ("noop", args.steps * 2)]
    impls = ["torch", "rpc_core"] if args.impl == "both" else [args.impl]
    for impl_name in impls:
        report(impl_name, args.spin, run(impl_name, args.spin, jobs, args.profile and impl_name == "rpc_core"))
    return 0


if __name__ == "__main__":
    sys.exit(run_recorded("step_breakdown", main))
