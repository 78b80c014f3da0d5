"""Profiling an RPC workload across workers (PyTorch's "Profiling PyTorch RPC-Based Workloads"
recipe, on rpc_core).

Run from the repository root::

    python examples/profile_rpc.py                     # writes trace.json
    python examples/profile_rpc.py --trace /tmp/rpc_trace.json

Two local processes, worker0 and worker1 (127.0.0.1, a free port). Inside
``rpc_core.profiler.profile()``, worker0 makes three ``rpc_async`` calls to worker1:
``torch.add``, ``torch.mul`` and ``udf_with_ops`` (sleeps 1 s, then runs a few ops), and waits
for them. worker0 then prints ``prof.key_averages().table()``: one row per RPC
(``rpc_async#aten::add(worker0 -> worker1)``, Node ID 0, CPU total = end-to-end latency) and
one per op worker1 ran for it (``...#remote_op: aten::add``, Node ID 1). It writes a chrome
trace with one process row per node; open it at https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402


def udf_with_ops() -> torch.Tensor:
    """Runs on worker1: the sleep shows in the RPC's CPU total, the ops as remote events."""
    time.sleep(1)
    t1, t2 = torch.ones((2, 2)), torch.ones((2, 2))
    t = torch.add(t1, t2)
    t = torch.mul(t, t)
    t = t.relu()
    return t.sigmoid()


def worker(rank: int, port: int, trace_path: str) -> None:
    torch.set_num_threads(1)
    import rpc_core as rpc
    from examples import profile_rpc as this  # a module name both workers import the UDF from
    from rpc_core import profiler

    rpc.init_rpc(
        f"worker{rank}",
        rank=rank,
        world_size=2,
        rpc_backend_options=rpc.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}"),
    )
    if rank == 0:
        t1, t2 = torch.rand((3, 3)), torch.rand((3, 3))
        prof = profiler.profile()
        with prof:
            fut1 = rpc.rpc_async("worker1", torch.add, args=(t1, t2))
            fut2 = rpc.rpc_async("worker1", torch.mul, args=(t1, t2))
            fut3 = rpc.rpc_async("worker1", this.udf_with_ops)
            torch.futures.wait_all([fut1, fut2, fut3])  # wait inside the profile
        print(prof.key_averages().table())
        prof.export_chrome_trace(trace_path)
        print(f"chrome trace: {trace_path} (open it at https://ui.perfetto.dev or chrome://tracing)")
    rpc.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="trace.json", help="where to write the chrome trace")
    ap.add_argument("--timeout", type=float, default=120.0, help="kill the workers after this many seconds")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=worker, args=(rank, port, os.path.abspath(args.trace)), name=f"worker{rank}")
        for rank in range(2)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    failed = [p.name for p in procs if p.is_alive() or p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if failed:
        print(f"failed: {', '.join(failed)} (exit codes {[p.exitcode for p in procs]})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
