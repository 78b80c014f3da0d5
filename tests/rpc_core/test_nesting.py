"""Nested calls (rpc_core/agent/agent.py, agent/pool.py): a callee may call back into its caller, in cycles
deeper than ``num_worker_threads``, and fan out widely with async execution, without
deadlocking for want of threads. Worlds run with 1-2 worker threads to make that bite."""

import torch

import rpc_core
from rpc_core.functions import async_execution
from tests._world import run_world


def _me():
    return rpc_core.get_worker_info().id


def _path(route):
    """Call along ``route`` (a list of ranks) with rpc_sync at every hop; return the ranks visited.
    Every hop blocks a thread on its worker until the rest of the route answers."""
    here = [_me()]
    if not route:
        return here
    return here + rpc_core.rpc_sync(route[0], _path, args=(route[1:],))


def _ping_pong(peer, depth, x):
    """A -> B -> A -> B ... ``depth`` levels deep, each one waiting in rpc_sync."""
    if depth == 0:
        return x
    return rpc_core.rpc_sync(peer, _ping_pong, args=(_me(), depth - 1, x + 1))


@async_execution
def _fan_out(depth):
    """Every node calls every other worker, ``depth`` levels deep; returns the leaf count."""
    if depth == 0:
        fut = torch.futures.Future()
        fut.set_result(1)
        return fut
    others = [r for r in range(rpc_core.api.current_agent().roster.workers.__len__()) if r != _me()]
    futs = [rpc_core.rpc_async(r, _fan_out, args=(depth - 1,)) for r in others]
    return torch.futures.collect_all(futs).then(lambda f: sum(x.value() for x in f.value()))


def _body_cycles(ctx):
    if ctx.rank == 0:
        assert rpc_core.rpc_sync(1, _path, args=([0],)) == [1, 0]  # A -> B -> A
        assert rpc_core.rpc_sync(1, _path, args=([2, 0],)) == [1, 2, 0]  # A -> B -> C -> A
        assert rpc_core.rpc_sync(1, _path, args=([2, 0, 1, 2, 0, 1],)) == [1, 2, 0, 1, 2, 0, 1]
    # Every worker at once: cycles 12 deep between two workers with 1 thread each.
    peer = (ctx.rank + 1) % ctx.world_size
    assert rpc_core.rpc_sync(peer, _ping_pong, args=(ctx.rank, 12, 0)) == 12
    assert rpc_core.rpc_async(peer, _ping_pong, args=(ctx.rank, 12, 0)).wait() == 12
    return True


def test_nested_cycles_deeper_than_the_thread_pool_do_not_deadlock():
    assert run_world(_body_cycles, 3, options={"num_worker_threads": 1}) == [True] * 3


def _body_fan_out(ctx):
    if ctx.rank == 0:
        # 3 workers, 2 callees per node, 5 levels: 2**5 leaves, 62 calls in flight at the peak
        assert rpc_core.rpc_sync(1, _fan_out, args=(5,)) == 32
        assert rpc_core.remote(2, _fan_out, args=(4,)).to_here() == 16
    return True


def test_deep_fan_out_with_async_execution():
    assert run_world(_body_fan_out, 3, options={"num_worker_threads": 1}) == [True] * 3
