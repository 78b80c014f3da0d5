"""Run a test body on N rpc_core workers, each on an emulated host of a ``netns.Network``.

    results = run_hosts(net, _body, 3, options={"heartbeat_timeout": 2.0})

Rank i runs on host i: in host i's network namespace and in a pid namespace of its own (the
worker is pid 1 there), so that, as between machines, a peer's pid names nothing it can
read (cross-memory attach fails its probe) and a peer's address is not local (no Unix
socket is tried). Rank 0 listens on ``tcp://<host 0>:MASTER_PORT``.

A body steers the network and its peers through ``control(op, *args)``, answered by the
parent (which alone sees every namespace): ``cut``/``link_down``/``heal``/``shape`` of the
``Network``, and ``stop``/``cont``/``kill`` of another rank's process. Results, failures,
hangs and stack dumps work as in ``tests._world.run_world``.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

from tests import _world
from tests.netns import CLONE_NEWPID, Network, setns, unshare

MASTER_PORT = 29400  # free by construction: nothing else lives in these namespaces
_PR_SET_PDEATHSIG = 1
_control: Any = None  # in a worker: its end of the control pipe
_control_lock = threading.Lock()


def control(op: str, *args: Any, timeout: float = 60.0) -> Any:
    """In a worker: have the parent do ``op(*args)`` (see the module doc); its result."""
    if _control is None:
        raise RuntimeError("control() works only in a worker started by run_hosts")
    with _control_lock:
        _control.send((op, args))
        if not _control.poll(timeout):
            raise TimeoutError(f"the parent did not do {op}{args} within {timeout:g} s")
        kind, value = _control.recv()
    if kind != "ok":
        raise RuntimeError(f"{op}{args} failed in the parent: {value}")
    return value


def _host_main(
    netns_path: str,
    body: Callable[..., Any],
    ctx: _world.WorkerContext,
    args: tuple,
    init: bool,
    env: dict[str, str],
    result: Any,
    ctl: Any,
) -> None:
    """The started process: enter the host's namespaces, fork the worker (pid 1 of a new pid
    namespace), wait for it and exit as it did."""
    global _control
    setns(netns_path)
    unshare(CLONE_NEWPID)
    pid = os.fork()
    if pid == 0:
        from tests.netns import _libc

        _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # never outlive the process the parent manages
        _control = ctl
        _world._child_main(body, ctx, args, init, env, result)  # exits
    result.close()
    ctl.close()
    _, status = os.waitpid(pid, 0)
    os._exit(min(255, abs(os.waitstatus_to_exitcode(status))))


class _Parent:
    """The parent's side of the controls."""

    def __init__(self, net: Network, procs: list[Any]) -> None:
        self.net, self.procs = net, procs

    def worker_pid(self, rank: int) -> int:
        """The worker's pid (in our namespace): the only child of the started process."""
        p = self.procs[rank].pid
        with open(f"/proc/{p}/task/{p}/children") as f:
            children = f.read().split()
        if not children:
            raise RuntimeError(f"rank {rank} has no worker process")
        return int(children[0])

    def dump_stacks(self, ranks: Sequence[int]) -> None:
        """Have the workers of ``ranks`` write their threads' stacks to stderr (tests._world's
        children register faulthandler on SIGUSR1), and give them a moment to do so."""
        for rank in ranks:
            try:
                pid = self.worker_pid(rank)
                os.kill(pid, signal.SIGCONT)  # a stopped worker cannot write
                os.kill(pid, signal.SIGUSR1)
            except (OSError, RuntimeError):
                pass
        for rank in ranks:
            self.procs[rank].join(2.0)

    def do(self, op: str, args: tuple) -> Any:
        if op in ("cut", "link_down", "heal", "shape"):
            return getattr(self.net, op)(*args)
        if op == "stop":
            _world.stop_process(self.worker_pid(args[0]))
            return None
        if op in ("cont", "kill"):
            os.kill(self.worker_pid(args[0]), signal.SIGCONT if op == "cont" else signal.SIGKILL)
            return None
        raise ValueError(f"unknown control {op!r}")


def run_hosts(
    net: Network,
    body: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout: float = 90.0,
    init: bool = True,
    options: dict[str, Any] | None = None,
    may_die: Iterable[int] = (),
    env: dict[str, str] | None = None,
) -> list[Any]:
    """``run_world`` on the emulated hosts: rank i on host i. Raises WorldError if a rank failed."""
    if world_size > len(net.hosts):
        raise ValueError(f"{world_size} ranks need {world_size} hosts, the network has {len(net.hosts)}")
    ctx_mp = _world._mp_context()
    secret = secrets.token_hex(16)
    where = f"{getattr(body, '__module__', '?')}:{getattr(body, '__qualname__', body)}"
    may_die = set(may_die)
    procs, results, ctls = [], [], []
    init_method = f"tcp://{net.address(0)}:{MASTER_PORT}"
    for rank in range(world_size):
        ctx = _world.WorkerContext(rank, world_size, init_method, secret, dict(options or {}))
        recv_end, send_end = ctx_mp.Pipe(duplex=False)
        ctl_parent, ctl_child = ctx_mp.Pipe(duplex=True)
        p = ctx_mp.Process(
            target=_host_main,
            name=f"worker{rank}",
            daemon=True,
            args=(net.path(rank), body, ctx, tuple(args), init, dict(env or {}), send_end, ctl_child),
        )
        p.start()
        send_end.close()
        ctl_child.close()
        procs.append(p)
        results.append(recv_end)
        ctls.append(ctl_parent)
    parent = _Parent(net, procs)
    outcomes: dict[int, tuple] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout
    first_failure: int | None = None
    try:
        pending = {results[r]: r for r in range(world_size)}
        controls = {ctls[r]: r for r in range(world_size)}
        while pending:
            left = max(0.0, deadline - time.monotonic())
            ready = multiprocessing.connection.wait([*pending, *controls], timeout=left)
            if not ready:
                stuck = sorted(pending.values())
                parent.dump_stacks(stuck)
                failures.append(
                    f"world of {world_size} running {where} timed out after {timeout:g} s "
                    f"(or {_world._FAIL_GRACE:g} s after a rank failed): ranks {stuck} were killed"
                )
                break
            for c in cast("list[multiprocessing.connection.Connection]", ready):
                if c in controls:
                    try:
                        op, op_args = c.recv()
                    except EOFError:
                        del controls[c]
                        continue
                    try:
                        c.send(("ok", parent.do(op, op_args)))
                    except Exception as e:  # noqa: BLE001 - reported to the body that asked
                        c.send(("error", f"{type(e).__name__}: {e}"))
                    continue
                rank = pending.pop(c)
                try:
                    outcomes[rank] = c.recv()
                except EOFError:
                    procs[rank].join(5.0)
                    outcomes[rank] = ("died", procs[rank].exitcode)
                failed = outcomes[rank][0] == "error" or (outcomes[rank][0] == "died" and rank not in may_die)
                if failed and first_failure is None:
                    first_failure = rank
                    deadline = min(deadline, time.monotonic() + _world._FAIL_GRACE)
        for rank, p in enumerate(procs):
            if rank in outcomes and outcomes[rank][0] != "died":
                p.join(_world._EXIT_GRACE)
                if p.is_alive():
                    failures.append(f"rank {rank} reported but did not exit")
    finally:
        for rank, p in enumerate(procs):
            if p.is_alive():
                try:
                    os.kill(parent.worker_pid(rank), signal.SIGKILL)  # a stopped worker too
                except (OSError, RuntimeError):
                    pass
                p.kill()
            p.join()
        for c in results + ctls:
            c.close()
    return _world.results_of(outcomes, world_size, may_die, failures, where)
