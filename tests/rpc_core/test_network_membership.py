"""Dynamic groups (``init_rpc(..., world_size=None)``) across an emulated network: members on
hosts of their own (tests/netns.py), every byte between them delayed 5 +- 1 ms each way.

A newcomer is callable by name from every member as soon as its ``init_rpc`` returns, a
member's graceful leave is known to all once its ``shutdown`` returns (calls to it then fail
with ``WorkerLeftError`` naming it), and a rank reused after a leave is a new member.
Processes order their steps with multiprocessing events handed to them at start, since a
worker outside the group has no RPC to wait with. Needs root, ip and iptables; skipped,
with the reason, where unavailable."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import rpc_core
from rpc_core import WorkerLeftError, connection_stats
from tests._world import _mp_context
from tests.netns import Network, unavailable_reason
from tests.netns_world import run_hosts

STEP = 60.0  # s, the bound of any one wait for another process's step
EVENTS = ("founded", "w1_in", "w2_in", "w1_left", "checked", "w1_back", "done")


@pytest.fixture(scope="module")
def net():
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no emulated network here: {reason}")
    network = Network(3)
    yield network
    network.close()


# -- functions the workers call ----------------------------------------------------------------------
_incarnation = [0]  # how many times this process joined the group


def _whoami() -> str:
    return rpc_core.get_worker_info().name


def _who_and_when() -> tuple[str, int]:
    return rpc_core.get_worker_info().name, _incarnation[0]


def _call(name: str, func: Any) -> Any:
    """From inside a call: call ``name`` in turn (an existing member reaching another)."""
    return rpc_core.rpc_sync(name, func)


def _make(n: int) -> torch.Tensor:
    return torch.arange(float(n))


def _tcp_only() -> bool:
    """This worker reached its peers over TCP only: no Unix socket, no cross-memory attach
    (as between machines)."""
    s = connection_stats()
    return s.connections >= 1 and s.unix_connections == 0 and s.cma_connections == 0


def _left_error(use: Any) -> str:
    """The message of the WorkerLeftError that ``use()`` raises, and how long it took."""
    start = time.monotonic()
    try:
        use()
    except WorkerLeftError as e:
        return f"{e} [{time.monotonic() - start:.3f} s]"
    return "no error"


# -- the body ------------------------------------------------------------------------------------------
def _wait(events: dict[str, Any], key: str) -> None:
    if not events[key].wait(STEP):
        raise TimeoutError(f"no {key!r} within {STEP:g} s")


def _init(ctx: Any, name: str, rank: int) -> None:
    rpc_core.init_rpc(name, rank=rank, world_size=None, rpc_backend_options=ctx.backend_options())
    _incarnation[0] += 1


def _body(ctx: Any, events: dict[str, Any]) -> Any:
    if ctx.rank == 0:  # the founder (and registry)
        _init(ctx, "worker0", 0)
        events["founded"].set()
        _wait(events, "w1_left")
        gone = [
            _left_error(lambda: rpc_core.rpc_sync("worker1", _whoami)),
            _left_error(lambda: rpc_core.rpc_sync(1, _whoami)),
        ]
        events["checked"].set()
        _wait(events, "done")
        return gone, [w.name for w in rpc_core._get_current_rpc_agent().get_worker_infos()], _tcp_only()
    if ctx.rank == 1:  # joins, leaves, joins again with the same rank and name
        _wait(events, "founded")
        _init(ctx, "worker1", 1)
        # At once: the founder calls the newcomer back by name, across the network.
        first = rpc_core.rpc_sync("worker0", _call, args=("worker1", _who_and_when))
        events["w1_in"].set()
        _wait(events, "w2_in")
        tcp = _tcp_only()
        rpc_core.shutdown()  # leaves: every member knows once this returns
        events["w1_left"].set()
        _wait(events, "checked")
        _init(ctx, "worker1", 1)
        again = [
            rpc_core.rpc_sync("worker0", _call, args=("worker1", _who_and_when)),
            rpc_core.rpc_sync("worker2", _call, args=("worker1", _who_and_when)),
        ]
        events["w1_back"].set()
        _wait(events, "done")
        return first, again, tcp
    # rank 2: joins a group of two; worker1 (not the registry) must already know it by name
    _wait(events, "w1_in")
    _init(ctx, "worker2", 2)
    first = [
        rpc_core.rpc_sync("worker0", _call, args=("worker2", _whoami)),
        rpc_core.rpc_sync("worker1", _call, args=("worker2", _whoami)),
        rpc_core.rpc_sync("worker1", _whoami),
    ]
    stale = rpc_core.remote("worker1", _make, args=(3,))  # owned by worker1's first incarnation
    owned = stale.to_here().tolist()
    events["w2_in"].set()
    _wait(events, "w1_left")
    gone = [_left_error(lambda: rpc_core.rpc_sync("worker1", _whoami)), _left_error(stale.to_here)]
    _wait(events, "w1_back")
    reused = [_left_error(stale.to_here), _left_error(lambda: stale.rpc_sync().sum())]
    new = rpc_core.rpc_sync("worker1", _who_and_when), rpc_core.rpc_sync(1, torch.add, args=(torch.ones(2), 1)).tolist()
    events["done"].set()
    return first, owned, gone, reused, new, _tcp_only()


def _left_within(message: str, bound: float) -> bool:
    """The error came from the roster, at once: no network wait (the bracket is its time)."""
    return float(message.rsplit("[", 1)[1].split(" ", 1)[0]) < bound


@pytest.mark.timeout(120)
def test_join_leave_and_rank_reuse_across_hosts_on_a_delayed_network(net):
    net.reset()
    net.shape(delay=0.005, jitter=0.001)
    try:
        mp = _mp_context()
        events = {key: mp.Event() for key in EVENTS}
        r0, r1, r2 = run_hosts(net, _body, 3, args=(events,), init=False, timeout=100)
    finally:
        relayed = net.relayed_connections()
        net.reset()
    (gone0, members, tcp0), (first1, again1, tcp1), (first2, owned, gone2, reused, new, tcp2) = r0, r1, r2
    # a newcomer is called by name as soon as its init_rpc returns, by the founder and by an
    # existing member that heard of it through the registry
    assert first1 == ("worker1", 1)
    assert first2 == ["worker2", "worker2", "worker1"] and owned == [0.0, 1.0, 2.0]
    # a leaver is gone for every member once its shutdown returned: by name, rank or RRef
    for message in [*gone0, *gone2]:
        assert "worker 'worker1' (rank 1) left the group" in message and "new member" not in message, message
        assert _left_within(message, 1.0), message
    # the same rank and name, joined again: a new member; the old one's RRefs name the change
    assert again1 == [("worker1", 2), ("worker1", 2)]
    for message in reused:
        assert "worker 'worker1' (rank 1) left the group" in message and "new member" in message, message
    assert new == (("worker1", 2), [2.0, 2.0])
    assert members == ["worker0", "worker1", "worker2"]
    # between hosts: TCP only, through the delaying relays
    assert tcp0 and tcp1 and tcp2
    assert relayed >= 3
