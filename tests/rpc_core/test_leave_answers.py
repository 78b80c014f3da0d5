"""A worker that leaves (a dynamic group's member) or shuts down (a static group's) delivers
every answer it owes first: a call it accepted and answered never fails because it left
(rpc_core/agent/departures.py, api._leave, docs/rpc_failure_model.md).

The pattern: worker0 and worker2 each call worker1, whose answer lets it go; worker1 shuts
down the moment both have. Its answers race the news of its leave, which travels on other
connections (the leave request to rank 0, rank 0's word to worker2). The race was lost about
one leave in four, so each test runs the pattern many times. Real worker processes on
loopback (tests/_world.py); steps are ordered by events and membership listeners, never by
sleeping."""

import os
import signal
import threading
import time

import pytest

import rpc_core
from rpc_core.agent import departures
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


_released = threading.Event()  # on worker1: never set, so _block runs until its process ends


def _block():
    _released.wait(STEP)
    return "released"


def _pid():
    return os.getpid()


def _body_unanswered(ctx, freeze):
    """worker0 has a call pending on worker1 that worker1 never answers; worker1 leaves
    (shutdown(timeout=1) gives up on that call) and, with ``freeze``, is stopped by worker0 as
    soon as worker0 hears of the leave, so its connection never ends."""
    if ctx.rank == 1:
        _init_dynamic(ctx, "worker1", 1)
        if not _allowance("worker0").wait(STEP):
            raise TimeoutError("worker0 did not call")
        rpc_core.shutdown(timeout=1.0)  # _block still runs: it gives up answering it after 1 s
        return "left"
    _init_dynamic(ctx, "worker0", 0)
    departures.GRACE = 1.0 if freeze else 2 * STEP
    joined, _ = _comings_and_goings("worker1")
    if not joined.acquire(timeout=STEP):
        raise TimeoutError("worker1 did not join")
    pid = rpc_core.rpc_sync("worker1", _pid)
    fut = rpc_core.rpc_async("worker1", _block)
    heard, left = {}, threading.Event()

    def on_leave(info, is_join):
        if info.name == "worker1" and not is_join:
            heard["pending"], heard["at"] = not fut.done(), time.monotonic()
            if freeze:
                os.kill(pid, signal.SIGSTOP)  # before it hears that its leave is done: it never closes
            left.set()

    rpc_core.add_membership_listener(on_leave)
    rpc_core.rpc_sync("worker1", _allow_leave, args=("worker0",))
    try:
        if not left.wait(STEP):
            raise TimeoutError("worker1 did not leave")
        try:
            outcome = f"returned {fut.wait()!r}"
        except rpc_core.RpcError as e:
            outcome = f"{type(e).__name__}: {e}"
        return heard["pending"], outcome, time.monotonic() - heard["at"]
    finally:
        if freeze:
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("freeze", [False, True], ids=["its-connection-ends", "it-froze-as-it-left"])
def test_a_call_the_leaver_never_answers_fails_once_its_connection_ends_or_after_the_grace(freeze):
    (pending, outcome, waited), _ = run_world(
        _body_unanswered, 2, init=False, args=(freeze,), may_die=(1,) if freeze else ()
    )
    assert pending  # the leave was heard with the call still waiting for its answer
    assert outcome == "WorkerLeftError: worker 'worker1' (rank 1) left the group", outcome
    if freeze:
        assert waited >= 0.5, waited  # held for the grace (1 s), not failed when the leave was heard
    else:
        assert waited < STEP, waited  # failed when the connection ended, long before the grace (2 min)


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
