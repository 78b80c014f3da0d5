"""What a small tensor adds to a call's message, stage by stage, in one process.

    python -m benchmarks.tensor_path              # no-op request vs one 10x10 tensor argument
    python -m benchmarks.tensor_path --n 50000

A request's whole way (serialize, encode the head, send, receive, decode the head, rebuild
the tensors, unpickle the body) over a socket pair of real ``stream.Connection``s, timed
per stage with ``perf_counter_ns``: ``echo(t)`` (one 10x10 float32 tensor) against
``noop()``. No second process and no scheduler in the way, so the difference is the work a
tensor adds, and repeated runs agree within a few %.

Each stage inside this loop runs 1.5-2x slower than the same stage timed alone in a tight
loop (serialize of the tensor call: ~12 µs alone, ~18 µs here): the whole way's code and
data do not stay in the caches between two messages. So the figures here, not those of the
stages timed one by one, are what a call pays.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import time

import torch

from benchmarks import _workloads
from rpc_core.protocol import serialization as se
from rpc_core.protocol import wire
from rpc_core.transport import stream

STAGES = ("serialize", "encode_head", "send", "recv", "decode_head", "rebuild", "unpickle")


def measure(obj: tuple, n: int) -> dict[str, float]:
    """µs per message of each stage, over ``n`` messages (after a warm-up)."""
    a, b = socket.socketpair()
    ca, cb = stream.Connection(a), stream.Connection(b)
    ns = time.perf_counter_ns
    acc = [0] * len(STAGES)
    try:
        for i in range(n + n // 10):
            t0 = ns()
            s = se.serialize(obj)
            t1 = ns()
            head = se.encode_head(s.metas, None)
            t2 = ns()
            ca.send(wire.REQUEST, 0, 1, head, s.body, s.buffers)
            t3 = ns()
            _, head, body, storages = cb.recv()
            t4 = ns()
            metas, _ = se.decode_head(head)
            t5 = ns()
            tensors = se.rebuild_tensors(metas, storages) if metas else []
            t6 = ns()
            se.unpickle_body(body, tensors)
            t7 = ns()
            if i >= n // 10:
                for k, (p, q) in enumerate(((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t5, t6), (t6, t7))):
                    acc[k] += q - p
    finally:
        ca.close()
        cb.close()
    return {stage: v / n / 1e3 for stage, v in zip(STAGES, acc, strict=True)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20000, help="messages per case (default 20000)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per case (default 3)")
    args = ap.parse_args(argv)
    # Every frame is sent before it is read, so the reader never waits: nothing to poll for.
    os.environ["RPC_CORE_SPIN_US"] = "0"
    torch.set_num_threads(1)
    gc.collect()
    x = torch.ones(10, 10)
    cases: dict[str, tuple] = {"noop()": (_workloads.noop, (), {}), "echo(10x10)": (_workloads.echo, (x,), {})}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in cases}
    for _ in range(args.rounds):
        for name, obj in cases.items():
            runs[name].append(measure(obj, args.n))
    print(f"load average {os.getloadavg()[0]:.2f}; µs per message, best of {args.rounds} rounds per stage")
    print(f"{'stage':12s} " + " ".join(f"{k:>12s}" for k in cases) + f" {'difference':>12s}")
    best = {k: {s: min(r[s] for r in v) for s in STAGES} for k, v in runs.items()}
    base, tensor = best["noop()"], best["echo(10x10)"]
    for s in (*STAGES, "total"):
        a = sum(base.values()) if s == "total" else base[s]
        b = sum(tensor.values()) if s == "total" else tensor[s]
        print(f"{s:12s} {a:12.2f} {b:12.2f} {b - a:+12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
