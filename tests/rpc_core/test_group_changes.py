"""Training across a dynamic group that changes between steps, and the RRefs of a member that
left (``init_rpc(..., world_size=None)``; torch does not support distributed autograd there).

Real worker processes on loopback (tests/_world.py, ``init=False``: each body founds or joins
itself); steps are ordered through events posted on rank 0 over RPC (and, for a worker not
yet in the group, a multiprocessing Event), never by sleeping. The oracle is plain
single-process torch over the same steps."""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest
import torch

import rpc_core
import rpc_core.autograd as dist_autograd
from rpc_core import WorkerLeftError
from rpc_core.errors import failed_worker
from rpc_core.optim import DistributedOptimizer
from rpc_core.rref import release, state
from tests._world import _mp_context, run_world

STEP = 60.0  # bound of any one wait for another process's step
LR, MOMENTUM = 0.05, 0.9

_board: dict[str, threading.Event] = {}
_board_lock = threading.Lock()


def _event(key: str) -> threading.Event:
    with _board_lock:
        return _board.setdefault(key, threading.Event())


def _post(key: str) -> None:
    _event(key).set()


def _wait_for(key: str, timeout: float = STEP) -> None:
    if not _event(key).wait(timeout):
        raise TimeoutError(f"no {key!r} within {timeout:g} s")


def _post_on_leave(name: str, key: str) -> None:
    def seen(info: rpc_core.WorkerInfo, joined: bool) -> None:
        if info.name == name and not joined:
            _post(key)

    rpc_core.add_membership_listener(seen)


def _join(ctx: Any, name: str, rank: int) -> None:
    rpc_core.init_rpc(name, rank=rank, world_size=None, rpc_backend_options=ctx.backend_options())


# -- remote functions ---------------------------------------------------------------------------------------------
def _parameter(value: torch.Tensor) -> torch.Tensor:
    return value.clone().requires_grad_(True)


def _grad_on_owner(rref: rpc_core.RRef, context_id: int) -> torch.Tensor:
    return dist_autograd.get_gradients(context_id)[rref.local_value()]


def _user_tables() -> dict[str, int]:
    release.flush()
    return state.debug_info()


def _user_tables_once_left(name: str) -> dict[str, int]:
    """This worker's user tables once it heard that ``name`` left (each member hears it on its own)."""
    _wait_for(f"{name} left")
    return _user_tables()


def _call_through(rref: rpc_core.RRef) -> tuple[str, str | None, str | None]:
    try:
        rref.to_here()
    except WorkerLeftError as e:
        return str(e), e.worker, failed_worker(e)
    return "no error", None, None


def _pass_to(name: str, rref: rpc_core.RRef) -> tuple[str, str | None, str | None]:
    """Send ``rref`` in a call (a fork): refused before anything is sent once its owner left."""
    try:
        rpc_core.rpc_sync(name, _call_through, args=(rref,))
    except WorkerLeftError as e:
        return str(e), e.worker, failed_worker(e)
    return "no error", None, None


_kept: list[rpc_core.RRef] = []


def _call_through_kept() -> tuple[str, str | None, str | None]:
    return _call_through(_kept[0])


def _keep(rref: rpc_core.RRef) -> float:
    _kept.append(rref)
    return float(rref.to_here().sum())


# -- distributed autograd and DistributedOptimizer while members join and leave ----------------------------------
# The model: loss = ((x @ w0) @ stage(p1) @ stage(p2)).pow(2).mean(), w0 on the trainer (worker0), p1 on worker1, p2
# on worker2; a stage a member does not hold (not joined yet, or left) is left out. x: (4, 3), every weight (3, 3).
PHASES = (("worker1",), ("worker1", "worker2"), ("worker2",))  # members holding a stage, per phase
STEPS_PER_PHASE = 2


def _loss(x: torch.Tensor, w0: torch.Tensor, stages: list[torch.Tensor]) -> torch.Tensor:
    y = x @ w0
    for p in stages:
        y = y @ p
    return y.pow(2).mean()


def _matmul_stage(y: torch.Tensor, rref: rpc_core.RRef) -> torch.Tensor:
    return y @ rref.local_value()


def _train(x: torch.Tensor, init: dict[str, torch.Tensor], joined: Any) -> list[dict[str, torch.Tensor]]:
    """worker0: the steps of every phase; after each, the gradients and weights it saw."""
    _post_on_leave("worker1", "worker1 left")
    w0 = _parameter(init["worker0"])
    params: dict[str, rpc_core.RRef] = {}
    seen = []
    for phase, holders in enumerate(PHASES):
        if phase == 1:
            joined["worker2"].set()  # worker2 joins between steps
            _wait_for("worker2 in")
        if phase == 2:
            _post("worker1 may leave")  # and worker1 leaves between steps
            _wait_for("worker1 left")
            del params["worker1"]
        for name in holders:
            if name not in params:
                params[name] = rpc_core.remote(name, _parameter, args=(init[name],))
        # One optimizer per phase over the phase's parameters, as the oracle builds one per phase.
        rrefs = [rpc_core.RRef(w0), *(params[n] for n in holders)]
        opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=LR, momentum=MOMENTUM)
        for _ in range(STEPS_PER_PHASE):
            with dist_autograd.context() as cid:
                y = x @ w0
                for n in holders:
                    y = rpc_core.rpc_sync(n, _matmul_stage, args=(y, params[n]))
                dist_autograd.backward(cid, [y.pow(2).mean()])
                record = {"grad worker0": dist_autograd.get_gradients(cid)[w0].clone()}
                for n in holders:
                    record[f"grad {n}"] = rpc_core.rpc_sync(n, _grad_on_owner, args=(params[n], cid))
                opt.step(cid)
            record["worker0"] = w0.detach().clone()
            for n in holders:
                record[n] = params[n].to_here().detach()
            seen.append(record)
    return seen


def _body_training(ctx: Any, x: torch.Tensor, init: dict[str, torch.Tensor], joined: Any) -> Any:
    if ctx.rank == 0:
        _join(ctx, "worker0", 0)
        joined["worker1"].set()
        _wait_for("worker1 in")
        seen = _train(x, init, joined)
        _post("done")
        # Plain lists back to the test: a tensor would travel as a shared-memory handle that
        # dies with this process.
        return [{k: v.tolist() for k, v in record.items()} for record in seen]
    name = ctx.name
    if not joined[name].wait(STEP):
        raise TimeoutError(f"{name} was not let in within {STEP:g} s")
    _join(ctx, name, ctx.rank)
    if ctx.rank == 1:
        rpc_core.rpc_sync("worker0", _post, args=("worker1 in",))
        rpc_core.rpc_sync("worker0", _wait_for, args=("worker1 may leave",))
        return "left"  # the world's shutdown() leaves the group
    rpc_core.rpc_sync("worker0", _post, args=("worker2 in",))
    rpc_core.rpc_sync("worker0", _wait_for, args=("done",))
    return "stayed"


def _grad(t: torch.Tensor) -> torch.Tensor:
    if t.grad is None:
        raise AssertionError("the oracle's loss did not reach a weight")
    return t.grad.clone()


def _oracle(x: torch.Tensor, init: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    weights = {n: _parameter(v) for n, v in init.items()}
    seen = []
    for holders in PHASES:
        opt = torch.optim.SGD([weights["worker0"], *(weights[n] for n in holders)], lr=LR, momentum=MOMENTUM)
        for _ in range(STEPS_PER_PHASE):
            opt.zero_grad()
            _loss(x, weights["worker0"], [weights[n] for n in holders]).backward()
            record = {f"grad {n}": _grad(weights[n]) for n in ("worker0", *holders)}
            opt.step()
            record.update({n: weights[n].detach().clone() for n in ("worker0", *holders)})
            seen.append(record)
    return seen


@pytest.mark.timeout(180)
def test_autograd_and_distributed_optimizer_across_a_join_and_a_leave_match_one_process_torch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, generator=g)
    init = {n: torch.randn(3, 3, generator=g) * 0.5 for n in ("worker0", "worker1", "worker2")}
    mp = _mp_context()
    joined = {"worker1": mp.Event(), "worker2": mp.Event()}
    seen, left, stayed = run_world(_body_training, 3, init=False, args=(x, init, joined), timeout=150)
    assert (left, stayed) == ("left", "stayed")
    expected = _oracle(x, init)
    assert len(seen) == len(expected) == len(PHASES) * STEPS_PER_PHASE
    for step, (got, want) in enumerate(zip(seen, expected, strict=True)):
        assert got.keys() == want.keys(), step
        for key in want:
            assert torch.allclose(torch.tensor(got[key]), want[key], atol=1e-6), (step, key, got[key], want[key])


# -- RRefs owned by a member that left ---------------------------------------------------------------------------
def _body_rrefs_of_a_leaver(ctx: Any, joined: Any) -> Any:
    if ctx.rank == 0:
        _join(ctx, "worker0", 0)
        _post_on_leave("worker1", "worker1 left")
        joined.set()
        _wait_for("worker1 in")
        _wait_for("worker2 in")
        rrefs = [rpc_core.remote("worker1", torch.full, args=((2,), float(i))) for i in range(5)]
        values = [float(r.to_here().sum()) for r in rrefs]  # every creation confirmed
        kept_on_2 = rpc_core.rpc_sync("worker2", _keep, args=(rrefs[3],))  # a fork, held by worker2
        before = (_user_tables(), rpc_core.rpc_sync("worker2", _user_tables))
        _post("worker1 may leave")
        _wait_for("worker1 left")
        after = (_user_tables(), rpc_core.rpc_sync("worker2", _user_tables_once_left, args=("worker1",)))
        calls = (_call_through(rrefs[0]), _pass_to("worker2", rrefs[1]))
        kept_call = rpc_core.rpc_sync("worker2", _call_through_kept)
        del rrefs
        gc.collect()
        flushed = release.flush()  # nothing waits to be sent to the leaver, nothing fails
        _post("done")
        return values, kept_on_2, before, after, calls, kept_call, flushed, _user_tables()
    if not joined.wait(STEP):
        raise TimeoutError(f"{ctx.name} was not let in within {STEP:g} s")
    _join(ctx, ctx.name, ctx.rank)
    _post_on_leave("worker1", "worker1 left")
    rpc_core.rpc_sync("worker0", _post, args=(f"{ctx.name} in",))
    if ctx.rank == 1:
        rpc_core.rpc_sync("worker0", _wait_for, args=("worker1 may leave",))
        return None  # the world's shutdown() leaves the group
    rpc_core.rpc_sync("worker0", _wait_for, args=("done",))
    _kept.clear()
    return _user_tables()


@pytest.mark.timeout(150)
def test_rrefs_owned_by_a_member_that_left_are_released_and_a_call_through_one_names_it():
    results = run_world(_body_rrefs_of_a_leaver, 3, init=False, args=(_mp_context().Event(),), timeout=120)
    values, kept_on_2, before, after, calls, kept_call, flushed, final0 = results[0]
    assert values == [0.0, 2.0, 4.0, 6.0, 8.0] and kept_on_2 == 6.0
    # Before the leave: worker0 holds its 5 user RRefs (plus arguments' forks in flight: none
    # after the flush), worker2 the one it kept.
    assert before[0]["num_user_rrefs"] == 5 and before[1]["num_user_rrefs"] == 1
    for tables in after:  # after: every user table of the leaver's values is empty, on both
        assert tables["num_user_rrefs"] == 0 and tables["num_pending_users"] == 0, tables
        assert tables["num_pending_children"] == 0, tables
    for message, worker, named in (*calls, kept_call):
        assert "worker 'worker1' (rank 1) left the group" in message, message
        assert worker == "worker1" and named == "worker1"
    assert flushed == 0
    assert final0["num_user_rrefs"] == 0
    assert results[2]["num_user_rrefs"] == 0
