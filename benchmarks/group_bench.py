"""Large groups on one host: N workers init_rpc, rank 0 calls every rank, all shut down.

    python -m benchmarks.group_bench [--workers 128 512 1024] [--timeout 1200] [--result]

As a new user would try it: the ranks are forked from a fork server that preloaded torch, each
calls ``init_rpc("w<rank>", rank, world_size=N)`` over ``tcp://127.0.0.1``, rank 0 then calls
every other rank once (``rpc_sync``, the answer checked), and every rank calls ``shutdown()``
(graceful). Per size it prints which phase each failed rank failed in and its first error line,
the wall time of each phase (the slowest rank's), and what a worker holds once the calls are
done: threads, open file descriptors and resident memory (rank 0's, and the median of the
others'), with the load average. The limits this meets are in docs/rpc_core.md ("Large groups").
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.connection
import os
import re
import secrets
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ._results import add_result_option, run_recorded


@dataclass(frozen=True)
class RankOutcome:
    """What one rank reports: the phase it reached, its error if any, and what it held."""

    rank: int
    phase: str  # "init", "calls", "shutdown" (the phase it failed in) or "done"
    error: str | None
    init_s: float
    calls_s: float
    shutdown_s: float
    threads: int  # after the calls, before shutdown
    fds: int
    rss_mb: float
    private_mb: float = 0.0  # pages of its own (the rest it shares with the fork server and the other ranks)
    thread_kinds: tuple[tuple[str, int], ...] = ()  # thread names (digits dropped) and counts


def _memory_mb(path: str, *keys: str) -> float:
    kb = 0
    with open(path, encoding="ascii") as f:
        for line in f:
            if line.startswith(keys):
                kb += int(line.split()[1])
    return kb / 1024


def _thread_kinds() -> tuple[tuple[str, int], ...]:
    kinds = Counter(re.sub(r"[-_]?\d+", "", t.name) for t in threading.enumerate())
    return tuple(sorted(kinds.items(), key=lambda kv: -kv[1]))


def _to_double(x: int) -> int:
    return 2 * x


def _rank_main(rank: int, world_size: int, port: int, secret: str, init_timeout: float, conn: Any) -> None:
    import torch

    torch.set_num_threads(1)
    import rpc_core

    phase, error = "init", None
    times = {"init": 0.0, "calls": 0.0, "shutdown": 0.0}
    held: tuple[Any, ...] = (0, 0, 0.0)
    t0 = time.monotonic()
    try:
        opts = rpc_core.RpcBackendOptions(
            init_method=f"tcp://127.0.0.1:{port}", auth_secret=secret, init_timeout=init_timeout, rpc_timeout=300
        )
        rpc_core.init_rpc(f"w{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)
        times["init"] = time.monotonic() - t0
        phase, t0 = "calls", time.monotonic()
        if rank == 0:
            futs = [rpc_core.rpc_async(f"w{r}", _to_double, args=(r,)) for r in range(1, world_size)]
            for r, fut in enumerate(futs, start=1):
                if fut.wait() != 2 * r:
                    raise RuntimeError(f"w{r} answered {fut.wait()!r}, not {2 * r}")
        times["calls"] = time.monotonic() - t0
        held = (
            threading.active_count(),
            len(os.listdir("/proc/self/fd")),
            _memory_mb("/proc/self/status", "VmRSS:"),
            _memory_mb("/proc/self/smaps_rollup", "Private_Clean:", "Private_Dirty:"),
            _thread_kinds(),
        )
        phase, t0 = "shutdown", time.monotonic()
        rpc_core.shutdown()
        times["shutdown"] = time.monotonic() - t0
        phase = "done"
    except BaseException as e:  # noqa: BLE001 - any failure is the rank's outcome
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    conn.send(RankOutcome(rank, phase, error, times["init"], times["calls"], times["shutdown"], *held))
    conn.close()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_group(world_size: int, timeout: float, preload: list[str]) -> tuple[list[RankOutcome], list[int], float]:
    """Run one group; return the outcomes that came back, the ranks that never reported, and
    the wall time."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    port, secret = _free_port(), secrets.token_hex(16)
    procs, pending = [], {}
    start = time.monotonic()
    for rank in range(world_size):
        recv_end, send_end = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_rank_main, args=(rank, world_size, port, secret, timeout, send_end), name=f"w{rank}", daemon=True
        )
        p.start()
        send_end.close()
        procs.append(p)
        pending[recv_end] = rank
    outcomes: list[RankOutcome] = []
    deadline = start + timeout
    while pending:
        ready: list[Any] = multiprocessing.connection.wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        for c in ready:
            rank = pending.pop(c)
            try:
                outcomes.append(c.recv())
            except EOFError:
                outcomes.append(RankOutcome(rank, "died", "exited without reporting", 0, 0, 0, 0, 0, 0))
            c.close()
    wall = time.monotonic() - start
    missing = sorted(pending.values())
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    return outcomes, missing, wall


def _report(world_size: int, outcomes: list[RankOutcome], missing: list[int], wall: float) -> None:
    failed = [o for o in outcomes if o.phase != "done"]
    verdict = "pass" if not failed and not missing else "FAIL"
    load = os.getloadavg()
    print(
        f"\n## {world_size} workers: {verdict} in {wall:.1f} s (load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f})"
    )
    by_phase = Counter(o.phase for o in failed)
    if missing:
        print(f"- {len(missing)} ranks never reported (killed at the timeout), first {missing[:10]}")
    for phase, n in sorted(by_phase.items()):
        errors = Counter(o.error for o in failed if o.phase == phase)
        print(f"- {n} ranks failed in {phase}; e.g. {errors.most_common(1)[0][0]}")
    ok = [o for o in outcomes if o.phase in ("done", "shutdown") and o.threads]
    if not ok:
        return
    zero = [o for o in ok if o.rank == 0]
    others = [o for o in ok if o.rank != 0]
    print("\n| worker | init s | calls s | shutdown s | threads | fds | RSS MB | private MB |")
    print("|---|---|---|---|---|---|---|---|")
    for label, group in (("rank 0", zero), ("others (median)", others)):
        if group:
            fields = ("init_s", "calls_s", "shutdown_s", "threads", "fds", "rss_mb", "private_mb")
            med = {k: statistics.median(getattr(o, k) for o in group) for k in fields}
            print(
                f"| {label} | {med['init_s']:.1f} | {med['calls_s']:.2f} | {med['shutdown_s']:.1f} | "
                f"{med['threads']:.0f} | {med['fds']:.0f} | {med['rss_mb']:.0f} | {med['private_mb']:.0f} |"
            )
    if others:
        print(
            f"| others (slowest) | {max(o.init_s for o in others):.1f} | {max(o.calls_s for o in others):.2f} | "
            f"{max(o.shutdown_s for o in others):.1f} | {max(o.threads for o in others)} | "
            f"{max(o.fds for o in others)} | {max(o.rss_mb for o in others):.0f} | "
            f"{max(o.private_mb for o in others):.0f} |"
        )
    for label, group in (("rank 0", zero), ("rank 1", [o for o in others if o.rank == 1])):
        if group:
            print(f"- {label}'s threads: " + ", ".join(f"{name} {n}" for name, n in group[0].thread_kinds))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[128, 512, 1024], help="group sizes to run")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds for one group (also its init_timeout)")
    parser.add_argument(
        "--preload",
        default="torch",
        help="modules the fork server imports before forking the ranks, comma-separated; torch,rpc_core "
        "shares rpc_core's ~10 MB of module objects between the ranks instead of one copy each",
    )
    add_result_option(parser, "group_bench")
    args = parser.parse_args()
    if any(n < 2 for n in args.workers):
        parser.error("--workers: each size must be at least 2")
    handshake = os.environ.get("RPC_CORE_HANDSHAKE_TIMEOUT", "10 (default)")
    print(
        f"# Large groups on one host ({os.cpu_count()} cores, RLIMIT_NOFILE {_nofile()}, preloaded {args.preload}, "
        f"RPC_CORE_HANDSHAKE_TIMEOUT {handshake})"
    )
    code = 0
    for n in args.workers:
        outcomes, missing, wall = run_group(n, args.timeout, args.preload.split(","))
        _report(n, outcomes, missing, wall)
        if missing or any(o.phase != "done" for o in outcomes):
            code = 1
    return code


def _nofile() -> int:
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


if __name__ == "__main__":
    sys.exit(run_recorded("group_bench", main))
