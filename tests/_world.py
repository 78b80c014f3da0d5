"""Run a test body on N worker processes, each an rpc_core worker, and collect the results.

    results = run_world(_body, 3, args=(...))      # _body is a module-level function

Each child process (started clean: see ``_mp_context``) calls ``rpc_core.init_rpc(f"worker{rank}",
rank=rank, world_size=N, ...)`` on ``tcp://127.0.0.1:<free port>`` with a fresh shared secret,
runs ``body(ctx, *args)``, shuts down gracefully, and sends back ``("ok", result)`` or
``("error", traceback)`` through a pipe (a rank whose body raised reports at once and exits
without shutting down). The parent waits on those pipes (no polling, no sleeps) up to a hard
timeout, shortened once a rank failed; then it asks the stragglers for a stack dump and kills
them, so a hung world fails with a message instead of stalling the suite.

Bodies that manage init/shutdown themselves (rendezvous and failure tests) pass ``init=False``
and call ``ctx.init(...)``; ranks listed in ``may_die`` are allowed to die without reporting.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import secrets
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_TIMEOUT = 90.0
_EXIT_GRACE = 20.0  # a child that reported must be gone within this
_FAIL_GRACE = 15.0  # once a rank failed, how long the others get to report


class WorldError(AssertionError):
    """A multi-process test world failed: a rank raised, died, hung, or did not exit."""


def _mp_context() -> Any:
    """Children start clean, never as forks of the pytest process (its threads and state).

    Default: ``forkserver`` with torch preloaded. The fork server is itself a freshly spawned
    interpreter that has imported torch and nothing else (no threads; rpc_core is imported by
    each child, after the fork), so a child costs ~0.1 s instead of the 2-6 s a spawned one
    pays to import torch on this 2-core machine. ``RPC_CORE_TEST_START=spawn`` uses plain spawn.
    """
    method = os.environ.get("RPC_CORE_TEST_START", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        # RPC_CORE_TEST_PRELOAD lets a test preload more, like ps_train's launcher does.
        ctx.set_forkserver_preload(os.environ.get("RPC_CORE_TEST_PRELOAD", "torch").split(","))
    return ctx


@dataclass
class WorkerContext:
    """What a body gets: its rank and how to (re)join the world."""

    rank: int
    world_size: int
    init_method: str
    secret: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"worker{self.rank}"

    def backend_options(self, **overrides: Any):
        from rpc_core import RpcBackendOptions

        kw: dict[str, Any] = {"init_method": self.init_method, "auth_secret": self.secret}
        kw.update(self.options)
        kw.update(overrides)
        return RpcBackendOptions(**kw)

    def init(self, name: str | None = None, rank: int | None = None, **overrides: Any) -> None:
        import rpc_core

        rpc_core.init_rpc(
            self.name if name is None else name,
            rank=self.rank if rank is None else rank,
            world_size=self.world_size,
            rpc_backend_options=self.backend_options(**overrides),
        )


def _is_initialized() -> bool:
    from rpc_core.agent import agent

    return agent._agent is not None


def _child_main(
    body: Callable[..., Any], ctx: WorkerContext, args: tuple, init: bool, env: dict[str, str], conn: Any
) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for stacks on timeout
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)  # 2 shared cores: don't oversubscribe them
    outcome: tuple
    try:
        if init:
            ctx.init()
        outcome = ("ok", body(ctx, *args))
    except BaseException:  # noqa: BLE001 - any failure is the rank's outcome
        outcome = ("error", f"rank {ctx.rank} raised:\n{traceback.format_exc()}")
    if outcome[0] == "ok" and _is_initialized():
        import rpc_core

        try:
            rpc_core.shutdown()
        except BaseException:  # noqa: BLE001 - any failure is the rank's outcome
            outcome = ("error", f"rank {ctx.rank}: shutdown() raised:\n{traceback.format_exc()}")
    # A failed rank reports at once and exits without a graceful shutdown (its peers may be
    # waiting for it in a barrier); its closed connections tell them it is gone.
    try:
        conn.send(outcome)
    except BaseException:  # noqa: BLE001 - the parent must hear of it
        conn.send(("error", f"rank {ctx.rank}: could not send its result back:\n{traceback.format_exc()}"))
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown (torch's takes ~0.5 s a process); rpc_core's own threads are
    # daemons, and tests/rpc_core/test_port.py runs real scripts that exit normally.
    os._exit(0)


def run_world(
    body: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout: float = DEFAULT_TIMEOUT,
    init: bool = True,
    options: dict[str, Any] | None = None,
    may_die: Iterable[int] = (),
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> list[Any]:
    """Run ``body(ctx, *args)`` on ``world_size`` worker processes; return the per-rank results
    (``None`` for ranks in ``may_die`` that died). Raise WorldError if any rank failed."""
    ctx_mp = _mp_context()
    port = free_port() if port is None else port
    secret = secrets.token_hex(16)
    where = f"{getattr(body, '__module__', '?')}:{getattr(body, '__qualname__', body)}"
    may_die = set(may_die)
    procs, conns = [], []
    for rank in range(world_size):
        ctx = WorkerContext(rank, world_size, f"tcp://127.0.0.1:{port}", secret, dict(options or {}))
        recv_end, send_end = ctx_mp.Pipe(duplex=False)
        p = ctx_mp.Process(
            target=_child_main,
            args=(body, ctx, tuple(args), init, dict(env or {}), send_end),
            name=f"worker{rank}",
            daemon=True,
        )
        p.start()
        send_end.close()  # so the parent sees EOF when a child dies
        procs.append(p)
        conns.append(recv_end)

    outcomes: dict[int, tuple] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout
    first_failure: int | None = None
    try:
        pending = {conns[r]: r for r in range(world_size)}
        while pending:
            remaining = deadline - time.monotonic()
            ready: list[Any] = multiprocessing.connection.wait(list(pending), timeout=max(0.0, remaining))
            if not ready:
                stuck = sorted(pending.values())
                _dump_stacks([procs[r] for r in stuck])
                why = (
                    f"timed out after {timeout:g} s"
                    if first_failure is None
                    else f"gave up {_FAIL_GRACE:g} s after rank {first_failure} failed"
                )
                failures.append(
                    f"world of {world_size} running {where} {why}: ranks {stuck} did not finish and "
                    "were killed (their thread stacks are in the captured stderr)"
                )
                break
            for c in ready:
                rank = pending.pop(c)
                try:
                    outcomes[rank] = c.recv()
                except EOFError:
                    procs[rank].join(5.0)
                    outcomes[rank] = ("died", procs[rank].exitcode)
                failed = outcomes[rank][0] == "error" or (outcomes[rank][0] == "died" and rank not in may_die)
                if failed and first_failure is None:
                    # The others may wait for the failed rank forever: collect what they
                    # report soon, then stop them.
                    first_failure = rank
                    deadline = min(deadline, time.monotonic() + _FAIL_GRACE)
        for rank, p in enumerate(procs):
            if rank in outcomes and outcomes[rank][0] != "died":
                p.join(_EXIT_GRACE)
                if p.is_alive():
                    _dump_stacks([p])
                    failures.append(f"rank {rank} reported but did not exit")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        for c in conns:
            c.close()

    return results_of(outcomes, world_size, may_die, failures, where)


def _dump_stacks(procs: Sequence[Any]) -> None:
    for p in procs:
        if p.is_alive() and p.pid:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except OSError:
                pass
    for p in procs:
        p.join(2.0)  # give faulthandler a moment to write the dump before the kill


def results_of(
    outcomes: dict[int, tuple[Any, ...]], world_size: int, may_die: Collection[int], failures: list[str], where: str
) -> list[Any]:
    """Each rank's result from its outcome (``("ok", result)``, ``("error", text)`` or
    ``("died", exit code)``); raise WorldError naming every failure, ``failures`` included."""
    results: list[Any] = [None] * world_size
    for rank in range(world_size):
        kind, *rest = outcomes.get(rank, ("missing",))
        if kind == "ok":
            results[rank] = rest[0]
        elif kind == "error":
            failures.append(rest[0])
        elif kind == "died" and rank not in may_die:
            failures.append(f"rank {rank} died with exit code {rest[0]} before reporting a result")
    if failures:
        raise WorldError(f"{where} failed:\n" + "\n".join(failures))
    return results


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (bind port 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of process ``pid`` (``/proc/<pid>/stat``: "T" stopped by
    a signal, "S" sleeping, "R" running, ...), or None if there is no such process (or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ')'.
    return stat.rsplit(")", 1)[-1].split()[0] if ")" in stat else "?"


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once the kernel reports it stopped. The signal arrives
    asynchronously: without the wait the process may still answer a call sent right after."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while process_state(pid) != "T":
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} not stopped {timeout:g} s after SIGSTOP: state {process_state(pid)!r}")
        time.sleep(0.001)  # a state poll, bounded by the deadline (not a guess at a delay)
