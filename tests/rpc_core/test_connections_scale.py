"""Connections are made when a worker first calls a peer, not at rendezvous, barriers or
shutdown: in a parameter-server group (rank 0 the server, the others trainers calling only
it) no trainer ever holds a connection to another trainer, and the server's connections grow
with the trainers while a trainer's stay constant."""

from __future__ import annotations

import os

import pytest
import torch

from tests._world import run_world

TRAINERS = 4


def _connections() -> tuple[list[int], int, int]:
    """(ranks this worker dialled, connections others dialled to it, sockets it holds)."""
    from rpc_core.agent.agent import current_agent

    agent = current_agent()
    sockets = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            continue  # closed while listed
    dialled = sorted(r for r in agent.connections.out if r != agent.me.id)
    return dialled, len(agent.connections._incoming), sockets


def _trainers_call_the_server(ctx):
    import rpc_core
    from rpc_core.group import lifecycle

    seen = {"init": _connections()}
    if ctx.rank > 0:
        for _ in range(5):
            assert torch.equal(
                rpc_core.rpc_sync("worker0", torch.add, args=(torch.ones(2), ctx.rank)), torch.ones(2) + ctx.rank
            )
        rpc_core.rpc_async("worker0", torch.mul, args=(torch.ones(2), 2)).wait()
        rref = rpc_core.remote("worker0", torch.add, args=(torch.ones(2), 1))
        assert torch.equal(rref.to_here(), torch.full((2,), 2.0))
        del rref
    seen["calls"] = _connections()
    lifecycle.barrier([f"worker{r}" for r in range(ctx.world_size)])
    seen["barrier"] = _connections()
    lifecycle.wait_all_workers(60)  # the first round of shutdown, through rank 0 only
    seen["shutdown"] = _connections()
    return seen


@pytest.mark.timeout(300)
def test_trainers_that_call_only_the_server_never_connect_to_each_other():
    results = run_world(_trainers_call_the_server, 1 + TRAINERS, timeout=240)
    for rank, seen in enumerate(results[1:], start=1):
        for when, (dialled, incoming, _sockets) in seen.items():
            assert dialled == [0], (rank, when, dialled)  # the server, nobody else
            assert incoming == 0, (rank, when, incoming)  # no trainer dialled it
    # A trainer's sockets do not depend on how many trainers there are: the same on each.
    assert len({seen["shutdown"][2] for seen in results[1:]}) == 1
    server = results[0]["shutdown"]
    assert server[0] == [] and server[1] >= TRAINERS  # every trainer dialled it; it dialled none
