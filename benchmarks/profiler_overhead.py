"""What RPC profiling costs when it is off (and, for reference, when it is on).

    python -m benchmarks.profiler_overhead [--reps 150] [--calls 50]

Two local workers (spawn, 127.0.0.1). worker0 times ``rpc_sync(worker1, noop)`` in
repetitions of ``--calls`` calls, alternating, in the same processes:

- ``without``: the profiler's middleware absent from both agents: the RPC path of a worker
  that has never profiled, identical to before rpc_core.profiler existed (``api.call_wrappers``
  is empty whenever no profile is active);
- ``with``: the middleware installed but idle, as on a worker after its first profile;
- ``profiling``: the same calls inside ``rpc_core.profiler.profile()``.

Interleaving the modes in the same processes cancels most of the drift that a busy machine
adds between separate runs. Prints the median us/call of each mode and the relative cost.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time

from benchmarks._results import add_result_option, run_recorded


def noop() -> None:
    return None


def _set_profiler_middleware(installed: bool) -> None:
    from rpc_core import profiler
    from rpc_core.agent import agent as agent_mod

    agent = agent_mod.current_agent()
    others = [m for m in agent.middleware if not isinstance(m, profiler._Middleware)]
    agent.middleware = others + [profiler._Middleware(agent.me.id)] if installed else others


def _worker(rank: int, port: int, reps: int, calls: int, out: mp.Queue) -> None:
    import torch

    torch.set_num_threads(1)
    import rpc_core
    from rpc_core import profiler

    rpc_core.init_rpc(
        f"worker{rank}",
        rank=rank,
        world_size=2,
        rpc_backend_options=rpc_core.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}"),
    )
    if rank == 0:
        from benchmarks.profiler_overhead import _set_profiler_middleware as toggle
        from benchmarks.profiler_overhead import noop as fn

        def rep() -> float:
            t0 = time.perf_counter()
            for _ in range(calls):
                rpc_core.rpc_sync("worker1", fn)
            return (time.perf_counter() - t0) / calls * 1e6

        samples: dict[str, list[float]] = {"without": [], "with": [], "profiling": []}
        for _ in range(3 * calls):  # warm up
            rpc_core.rpc_sync("worker1", fn)
        for i in range(reps):
            order = ("without", "with") if i % 2 == 0 else ("with", "without")
            for mode in order:
                installed = mode == "with"
                toggle(installed)
                rpc_core.rpc_sync("worker1", toggle, args=(installed,))
                samples[mode].append(rep())
            if i % 10 == 0:
                with profiler.profile():
                    samples["profiling"].append(rep())
        out.put(samples)
    rpc_core.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=150)
    ap.add_argument("--calls", type=int, default=50)
    add_result_option(ap, "profiler_overhead")
    args = ap.parse_args()
    from ps_train.launch.ports import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, args.reps, args.calls, out)) for r in range(2)]
    for p in procs:
        p.start()
    samples = out.get(timeout=600)
    for p in procs:
        p.join(60)
    med = {k: statistics.median(v) for k, v in samples.items()}
    paired = statistics.median(w / wo for w, wo in zip(samples["with"], samples["without"], strict=True))
    print(f"rpc_sync no-op, median of {args.reps} repetitions x {args.calls} calls (us/call):")
    print(f"  never profiled (= before):         {med['without']:8.1f}")
    print(
        f"  after a profile (idle middleware): {med['with']:8.1f}   "
        f"({(med['with'] / med['without'] - 1) * 100:+.1f}%; median paired ratio {(paired - 1) * 100:+.1f}%)"
    )
    print(
        f"  inside profiler.profile():         {med['profiling']:8.1f}   "
        f"({(med['profiling'] / med['without'] - 1) * 100:+.1f}%, {len(samples['profiling'])} repetitions)"
    )


if __name__ == "__main__":
    sys.exit(run_recorded("profiler_overhead", main))
