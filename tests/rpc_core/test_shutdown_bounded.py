"""``shutdown(graceful=True, timeout=T)`` returns within ``T`` whatever the peers do.

torch's graceful shutdown waits for every peer (torch issue 63247: a worker that dies during
shutdown leaves the others hanging). Three workers, real processes; worker2 misbehaves:
it is frozen (SIGSTOP), never calls shutdown, or dies while the others are in it. Workers
0 and 1 call ``shutdown(graceful=True, timeout=T)``: each returns (raising ``RpcError``,
naming the cause) within ``T`` plus the local teardown, and the agent is gone after it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any

import pytest

from tests._world import WorkerContext, run_world

TIMEOUT = 4.0  # s given to shutdown
TEARDOWN = 3.0  # s of local teardown allowed past it (closing connections, joining threads)


def _body(ctx: WorkerContext, how: str) -> dict[str, Any] | None:
    import rpc_core

    ctx.init()
    pids = rpc_core._all_gather(os.getpid())  # every worker is up before worker2 misbehaves
    if ctx.rank == 2:
        if how == "frozen":
            os.kill(os.getpid(), signal.SIGSTOP)  # worker0 kills it once it has shut down
        elif how == "dies mid-round":
            # Enters the shutdown round, then dies before it ends.
            threading.Thread(target=rpc_core.shutdown, kwargs={"timeout": TIMEOUT}, daemon=True).start()
            os._exit(1)
        threading.Event().wait()  # "never calls shutdown": serves until worker0 kills it
    start = time.monotonic()
    error = None
    try:
        rpc_core.shutdown(graceful=True, timeout=TIMEOUT)
    except rpc_core.RpcError as e:
        error = str(e)
    took = time.monotonic() - start
    if ctx.rank == 0:
        with contextlib.suppress(ProcessLookupError):  # gone already when it died mid-round
            os.kill(pids["worker2"], signal.SIGKILL)
    return {"seconds": took, "error": error, "initialized": rpc_core._is_current_rpc_agent_set()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["frozen", "never calls shutdown", "dies mid-round"])
def test_graceful_shutdown_returns_within_its_timeout(how: str) -> None:
    results = run_world(_body, 3, args=(how,), init=False, may_die=[2], timeout=90)
    for rank in (0, 1):
        got = results[rank]
        assert got["initialized"] is False, f"{how}: worker{rank} still has an agent after shutdown"
        assert got["error"] is not None, f"{how}: worker{rank}'s shutdown reported no failure"
        assert got["seconds"] < TIMEOUT + TEARDOWN, (
            f"{how}: worker{rank}'s shutdown(timeout={TIMEOUT}) took {got['seconds']:.1f} s: {got['error']}"
        )
