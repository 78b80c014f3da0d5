"""When a distributed autograd context is released on the workers it touched.

A caller that leaves a context tells each worker it touched with its next request there
(the release rides on that request), or, if no request follows soon, with a cleanup call of
its own. Two promises are checked here:

- a release never overtakes a request of that context that arrived before it: a call that
  is still running when the release arrives keeps its context until it has answered, even
  when the worker's reading loop moved on to the requests behind it (a blocking call) or
  the call's thread was slow to start;
- an idle worker holds no context: releases that no request carries go out on their own
  within a short bound.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

import rpc_core as rpc
import rpc_core.autograd as dist_autograd
from tests._world import run_world

W1, W2 = "worker1", "worker2"

_gate = threading.Event()


def _read_context_later(context_id: int) -> int:
    """Blocks (its reading loop moves on to the requests behind it) until ``_open_gate``
    runs, then reads its context: the release that arrived meanwhile must not have freed it."""
    if not _gate.wait(30):
        raise RuntimeError("the gate was never opened")
    return len(dist_autograd.get_gradients(context_id))


def _open_gate() -> None:
    _gate.set()


def _num_contexts() -> int:
    return dist_autograd._get_debug_info()["num_autograd_contexts"]


def _overtaking_world(ctx: Any) -> dict[str, Any]:
    if ctx.rank != 0:
        return {}
    with dist_autograd.context() as cid:
        pending = rpc.rpc_async(W1, _read_context_later, args=(cid,))
    # The release of ``cid`` rides on this request, which worker1 reads while
    # _read_context_later still blocks; the request then opens the gate.
    rpc.rpc_sync(W1, _open_gate)
    out = {"grads": pending.wait()}
    # The answer is sent after the context was let go, so nothing is left on worker1.
    out["left"] = rpc.rpc_sync(W1, _num_contexts)
    return out


def test_a_release_waits_for_the_running_call_of_its_context() -> None:
    out = run_world(_overtaking_world, 2, timeout=60)[0]
    assert out == {"grads": 0, "left": 0}


def _forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


_W = torch.randn(8, 4)


def _w() -> torch.Tensor:
    return _W


def _idle_world(ctx: Any, steps: int) -> dict[str, Any]:
    if ctx.rank == 0:
        w = rpc.rpc_sync(W1, _w)
        for _ in range(steps):
            with dist_autograd.context() as cid:
                x = torch.randn(2, 8, requires_grad=True)
                loss = rpc.rpc_sync(W1, _forward, args=(x, w.requires_grad_())).sum()
                dist_autograd.backward(cid, [loss])
        # No further request goes to worker1 from here: the last release must go out alone.
        rpc.rpc_sync(W2, _open_gate)
        return {}
    if ctx.rank == 2:
        if not _gate.wait(60):
            raise RuntimeError("worker0 never finished its steps")
        # Asked by a worker that holds no release for worker1, so asking carries none.
        deadline = time.monotonic() + 10.0
        seen = []
        while time.monotonic() < deadline:
            seen.append(rpc.rpc_sync(W1, _num_contexts))
            if seen[-1] == 0:
                break
            time.sleep(0.02)  # re-asks a condition with a deadline; never a fixed wait
        return {"last": seen[-1], "asked": len(seen)}
    return {}


def test_an_idle_worker_holds_no_context() -> None:
    out = run_world(_idle_world, 3, args=(200,), timeout=90)[2]
    assert out["last"] == 0, out
