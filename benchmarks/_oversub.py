"""The oversubscribed row of ``rpc_bench.py``: 4 callers and 4 callees on a machine with fewer cores.

Eight processes (ranks 0-3 "worker0".."worker3" call, ranks 4-7 answer): caller ``r`` makes
``rpc_sync(worker{r+4}, noop)`` calls back to back, all four at once. Each caller reports
its µs per call per repetition; the table shows the median over all callers' repetitions.
With more runnable processes than cores, a design that polls for its answer takes the core
its peer needs, and one that hands each message between threads pays a scheduler
wake-up per hop: the figure shows how each implementation copes.

Spawned by ``_rpc_runs.run_impl`` like ``_workloads.worker_main`` (same arguments and
queue messages); ``plan`` holds the one workload ``sync_noop_4x4``.
"""

from __future__ import annotations

import statistics
import time
import traceback

NAME = "sync_noop_4x4"
CALLERS = 4
WORLD_SIZE = 2 * CALLERS


def oversub_main(rank, world_size, impl_name, port, plan, options_extra, queue):
    from benchmarks import _workloads

    try:
        impl = _workloads.join_world(rank, world_size, impl_name, port, options_extra, queue, rpc_timeout=120)
        if impl is None:
            return
        if rank < CALLERS:
            counts = dict(plan)[NAME]
            callee = f"worker{rank + CALLERS}"
            try:
                for _ in range(counts["warmup"]):
                    impl.rpc.rpc_sync(callee, _workloads.noop)
                samples = []
                for _ in range(counts["reps"]):
                    t = time.perf_counter()
                    for _ in range(counts["iters"]):
                        impl.rpc.rpc_sync(callee, _workloads.noop)
                    samples.append((time.perf_counter() - t) / counts["iters"] * 1e6)
                queue.put(("result", NAME, statistics.median(samples), samples, None))
            except Exception as e:  # noqa: BLE001 - reported as this workload's error
                queue.put(("error", NAME, "error", f"{type(e).__name__}: {e}"))
        t0 = time.perf_counter()
        impl.rpc.shutdown()
        if rank == 0:
            queue.put(("shutdown", time.perf_counter() - t0))
    except BaseException:  # re-raised: the parent hears of it first
        queue.put(("fatal", rank, traceback.format_exc()))
        raise
