"""A worker that leaves (a dynamic group's member) or shuts down (a static group's) delivers
every answer it owes first: a call it accepted and answered never fails because it left
(rpc_core/agent/departures.py, api._leave, docs/rpc_failure_model.md).

The pattern: worker0 and worker2 each call worker1, whose answer lets it go; worker1 shuts
down the moment both have. Its answers race the news of its leave, which travels on other
connections (the leave request to rank 0, rank 0's word to worker2). The race was lost about
one leave in four, so each test runs the pattern many times. Real worker processes on
loopback (tests/_world.py); steps are ordered by events and membership listeners, never by
sleeping."""
import threading

import pytest

import rpc_core
from tests._world import _mp_context, free_port, run_world

STEP = 60.0  # bound of any one wait for another process's step
LEAVES = 30  # dynamic group: worker1 joins and leaves this many times
SHUTDOWNS = 6  # static group: this many groups, one after the other

_allowed: dict[str, threading.Event] = {}
_allowed_lock = threading.Lock()


def _allowance(who):
    with _allowed_lock:
        return _allowed.setdefault(who, threading.Event())


def _allow_leave(who):
    """On worker1: ``who`` lets it go. Its answer races the shutdown that follows at once."""
    _allowance(who).set()
    return who


def _wait_until_allowed():
    for who in ("worker0", "worker2"):
        if not _allowance(who).wait(STEP):
            raise TimeoutError(f"{who} did not call within {STEP:g} s")
    _allowed.clear()


def _let_go(name):
    """Call worker1's ``_allow_leave``: its result, or the error's type and message."""
    try:
        return rpc_core.rpc_sync("worker1", _allow_leave, args=(name,))
    except rpc_core.RpcError as e:
        return f"{type(e).__name__}: {e}"


def _comings_and_goings(name):
    """Semaphores released each time ``name`` joins / leaves this worker's view of the group."""
    joined, left = threading.Semaphore(0), threading.Semaphore(0)

    def seen(info, is_join):
        if info.name == name:
            (joined if is_join else left).release()

    rpc_core.add_membership_listener(seen)
    return joined, left


def _init_dynamic(ctx, name, rank):
    rpc_core.init_rpc(name, rank=rank, world_size=None, rpc_backend_options=ctx.backend_options())


def _body_dynamic(ctx, founded, ready):
    if ctx.rank == 1:  # joins, is let go by both callers, leaves at once; LEAVES times
        if not (founded.wait(STEP) and ready.wait(STEP)):
            raise TimeoutError("the group was not ready")
        for _ in range(LEAVES):
            _init_dynamic(ctx, "worker1", 1)
            _wait_until_allowed()
            rpc_core.shutdown()
        return "left"
    if ctx.rank == 0:  # the registry: the leave request comes to it, not on the answer's connection
        _init_dynamic(ctx, "worker0", 0)
        joined, left = _comings_and_goings("worker1")
        founded.set()
    else:  # a member that hears of the leave from rank 0
        if not founded.wait(STEP):
            raise TimeoutError("worker0 did not found the group")
        _init_dynamic(ctx, "worker2", 2)
        joined, left = _comings_and_goings("worker1")
        ready.set()
    outcomes = []
    for _ in range(LEAVES):
        if not joined.acquire(timeout=STEP):
            raise TimeoutError("worker1 did not join")
        outcomes.append(_let_go(ctx.name))
        if not left.acquire(timeout=STEP):
            raise TimeoutError("worker1 did not leave")
    return outcomes


@pytest.mark.timeout(300)
def test_a_leaver_delivers_the_answers_it_owes_before_its_leave_fails_calls_to_it():
    mp = _mp_context()
    to0, left, to2 = run_world(_body_dynamic, 3, init=False, args=(mp.Event(), mp.Event()), timeout=280.0)
    assert left == "left"
    failed = [f"worker0: {o}" for o in to0 if o != "worker0"] + [f"worker2: {o}" for o in to2 if o != "worker2"]
    assert not failed and len(to0) == len(to2) == LEAVES, failed


def _body_static(ctx, ports):
    outcomes = []
    for port in ports:  # a new group on a new port each time
        options = ctx.backend_options(init_method=f"tcp://127.0.0.1:{port}")
        rpc_core.init_rpc(ctx.name, rank=ctx.rank, world_size=3, rpc_backend_options=options)
        if ctx.rank == 1:
            _wait_until_allowed()
        else:
            outcomes.append(_let_go(ctx.name))
        rpc_core.shutdown()
    return outcomes


@pytest.mark.timeout(300)
def test_a_static_group_shuts_down_only_once_every_answer_is_delivered():
    ports = [free_port() for _ in range(SHUTDOWNS)]
    to0, _, to2 = run_world(_body_static, 3, init=False, args=(ports,), timeout=280.0)
    assert to0 == ["worker0"] * SHUTDOWNS and to2 == ["worker2"] * SHUTDOWNS, (to0, to2)
