"""Dynamic groups (rpc_core/group/registry.py, agent/roster.py): ``init_rpc(..., world_size=None)`` founds
(rank 0) or joins a running group, ``shutdown()`` leaves it.

Every test runs real worker processes on loopback (tests/_world.py, ``init=False``: each body
founds or joins itself). Processes order their steps through a small board of named events
on rank 0 (``_post`` / ``_wait_for``, ordinary RPCs), never by sleeping."""

import importlib
import os
import signal
import threading
import time

import pytest
import torch

import rpc_core
import rpc_core.autograd as dist_autograd
from rpc_core import AuthenticationError, RendezvousError, RpcBackendOptions, WorkerInfo, WorkerLeftError
from rpc_core.group.rendezvous import rendezvous
from tests._world import _mp_context, free_port, run_world, stop_process

STEP = 60.0  # bound of any one wait for another process's step


# -- the board: named events on a worker, posted and awaited over RPC --------------------------------------
_board: dict[str, threading.Event] = {}
_board_lock = threading.Lock()


def _event(key):
    with _board_lock:
        return _board.setdefault(key, threading.Event())


def _post(key):
    _event(key).set()


def _wait_for(key, timeout=STEP):
    if not _event(key).wait(timeout):
        raise TimeoutError(f"no {key!r} within {timeout:g} s")


def _on_leave(name, key):
    """Post ``key`` here once ``name`` leaves the group (as this worker's roster sees it)."""
    agent = rpc_core._get_current_rpc_agent()

    def seen(info, joined):
        if info.name == name and not joined:
            _post(key)

    rpc_core.add_membership_listener(seen)
    if name in agent.roster._departed_names:  # it left before the listener was in place
        _post(key)


def _broken_listener(info, joined):
    raise RuntimeError(f"a listener that fails on {info.name}")


# -- remote functions ------------------------------------------------------------------------------------------
def _whoami():
    return rpc_core.get_worker_info().name


def _call(name, func, *args):
    """From inside a call: call ``name`` in turn."""
    return rpc_core.rpc_sync(name, func, args=args)


def _names():
    return [w.name for w in rpc_core._get_current_rpc_agent().get_worker_infos()]


def _error_calling(name):
    try:
        rpc_core.rpc_sync(name, _whoami)
    except WorkerLeftError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


# -- starting workers --------------------------------------------------------------------------------------------
def _init(ctx, name, rank, **overrides):
    rpc_core.init_rpc(name, rank=rank, world_size=None, rpc_backend_options=ctx.backend_options(**overrides))


# -- join, then calls both ways ------------------------------------------------------------------------------------
def _body_join_and_call(ctx, founded):
    if ctx.rank == 0:
        _init(ctx, "worker0", 0)
        assert _names() == ["worker0"]
        founded.set()  # only now may the others join: the founder was alone until here
        _wait_for("worker1 in")
        _wait_for("worker2 in")
        assert _names() == ["worker0", "worker1", "worker2"]
        assert rpc_core.get_worker_info("worker2") == WorkerInfo("worker2", 2)
        out = {r: rpc_core.rpc_sync(f"worker{r}", torch.add, args=(torch.ones(2), r)).tolist() for r in (1, 2)}
        # an existing member (worker1) calls the newest (worker2) by name, and the reverse
        across = (
            rpc_core.rpc_sync("worker1", _call, args=("worker2", _whoami)),
            rpc_core.rpc_sync("worker2", _call, args=("worker1", _whoami)),
        )
        _post("done")
        return out, across
    name = ctx.name
    if not founded.wait(STEP):
        raise TimeoutError(f"worker0 did not found the group within {STEP:g} s")
    if ctx.rank == 2:
        # joins once worker1 has: worker1, an existing member, must hear of it
        rpc_core.init_rpc("probe", rank=9, world_size=None, rpc_backend_options=ctx.backend_options())
        rpc_core.rpc_sync("worker0", _wait_for, args=("worker1 in",))
        rpc_core.shutdown()
    _init(ctx, name, ctx.rank)
    # As soon as init_rpc returns: rank 0 and worker1 (for worker2) call us back by name.
    back = [rpc_core.rpc_sync("worker0", _call, args=(name, _whoami))]
    if ctx.rank == 2:
        back.append(rpc_core.rpc_sync("worker1", _call, args=(name, _whoami)))
    names = _names()
    rpc_core.rpc_sync("worker0", _post, args=(f"{name} in",))
    rpc_core.rpc_sync("worker0", _wait_for, args=("done",))
    return back, names


@pytest.mark.timeout(120)
def test_newcomers_call_and_are_called_by_name_as_soon_as_init_rpc_returns():
    results = run_world(_body_join_and_call, 3, init=False, args=(_mp_context().Event(),))
    out, across = results[0]
    assert out == {1: [2.0, 2.0], 2: [3.0, 3.0]}
    assert across == ("worker2", "worker1")
    back1, names1 = results[1]  # worker2's first incarnation ("probe", rank 9) may still be in
    assert back1 == ["worker1"] and names1 in (["worker0", "worker1"], ["worker0", "worker1", "probe"])
    assert results[2] == (["worker2", "worker2"], ["worker0", "worker1", "worker2"])


# -- RRefs and distributed autograd with a newcomer ------------------------------------------------------------------
def _make(n):
    return torch.arange(float(n))


def _sum_of(rref):
    return rref.to_here().sum()


def _body_rrefs(ctx):
    if ctx.rank == 0:
        _init(ctx, "worker0", 0)
        _wait_for("worker1 in")
        mine = rpc_core.RRef(torch.full((3,), 7.0))
        theirs = rpc_core.remote("worker1", _make, args=(4,))  # owned by the newcomer
        got = (
            theirs.to_here().tolist(),
            rpc_core.rpc_sync("worker1", _sum_of, args=(mine,)).item(),
            theirs.owner(),
            theirs.rpc_sync().sum().item(),
        )
        del theirs, mine
        _post("done")
        return got
    _init(ctx, "worker1", 1)
    ours = rpc_core.remote("worker0", _make, args=(5,))  # the newcomer's RRef to a value on rank 0
    got = (ours.to_here().tolist(), rpc_core.rpc_sync("worker0", _sum_of, args=(ours,)).item(), ours.owner_name())
    del ours
    rpc_core.rpc_sync("worker0", _post, args=("worker1 in",))
    rpc_core.rpc_sync("worker0", _wait_for, args=("done",))
    return got


@pytest.mark.timeout(120)
def test_rrefs_to_and_from_a_newcomer():
    (theirs, mine_sum, owner, theirs_sum), (ours, ours_sum, owner_name) = run_world(_body_rrefs, 2, init=False)
    assert theirs == [0.0, 1.0, 2.0, 3.0] and mine_sum == 21.0 and theirs_sum == 6.0
    assert owner == WorkerInfo("worker1", 1)
    assert ours == [0.0, 1.0, 2.0, 3.0, 4.0] and ours_sum == 10.0 and owner_name == "worker0"


def _linear(x, w):
    return (x @ w).tanh()


def _body_autograd(ctx, x, w):
    if ctx.rank == 0:
        _init(ctx, "worker0", 0)
        _wait_for("done")
        return None
    _init(ctx, "worker1", 1)
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    with dist_autograd.context() as cid:
        y = rpc_core.rpc_sync("worker0", _linear, args=(x, w))  # x: (4, 3), w: (3, 2) -> y: (4, 2)
        dist_autograd.backward(cid, [y.pow(2).sum()])
        grads = dist_autograd.get_gradients(cid)
        out = (grads[x].tolist(), grads[w].tolist(), cid)  # lists: tensors would travel as shared memory
    rpc_core.rpc_sync("worker0", _post, args=("done",))
    return out


@pytest.mark.timeout(120)
def test_distributed_autograd_through_a_newcomer_matches_local_autograd():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 3, generator=gen), torch.randn(3, 2, generator=gen)
    _, (gx, gw, cid) = run_world(_body_autograd, 2, init=False, args=(x, w))
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    _linear(xl, wl).pow(2).sum().backward()
    assert torch.allclose(torch.tensor(gx), xl.grad) and torch.allclose(torch.tensor(gw), wl.grad)
    assert cid >> 48 == 1  # the creator's rank in the top bits, as in a static group


# -- leaving ----------------------------------------------------------------------------------------------------------
def _body_leave(ctx):
    if ctx.rank == 0:
        _init(ctx, "worker0", 0)
        # a listener's error is logged: the registry still admits, removes and tells the others
        rpc_core.add_membership_listener(_broken_listener)
        _on_leave("worker1", "worker1 left")
        _wait_for("worker2 in")
        _wait_for("worker1 left")
        errors = [_error_calling("worker1"), rpc_core.rpc_sync("worker2", _error_calling, args=("worker1",))]
        try:
            rpc_core.rpc_sync(1, _whoami)
        except WorkerLeftError as e:
            errors.append(str(e))
        still = (_names(), rpc_core.rpc_sync("worker2", _call, args=("worker0", _whoami)))
        _post("done")
        return errors, still
    _init(ctx, ctx.name, ctx.rank)
    if ctx.rank == 1:
        rpc_core.rpc_sync("worker0", _wait_for, args=("worker2 in",))
        rpc_core.shutdown()  # leaves; the others go on
        assert not rpc_core.api._agent_mod._agent
        return "left"
    rpc_core.rpc_sync("worker0", _post, args=("worker2 in",))
    rpc_core.rpc_sync("worker0", _wait_for, args=("done",))
    return "stayed"


@pytest.mark.timeout(120)
def test_a_member_that_leaves_is_named_in_a_clear_error_and_the_others_go_on():
    (errors, still), left, stayed = run_world(_body_leave, 3, init=False)
    assert (left, stayed) == ("left", "stayed")
    for e in errors:
        assert "worker 'worker1' (rank 1) left the group" in e, e
    assert errors[0].startswith("WorkerLeftError")
    assert still == (["worker0", "worker2"], "worker0")


def _body_crash(ctx):
    if ctx.rank == 0:
        _init(ctx, "worker0", 0)
        _on_leave("worker1", "worker1 gone")
        _wait_for("worker1 gone")
        return _error_calling("worker1"), _names()
    _init(ctx, "worker1", 1)
    rpc_core.shutdown(graceful=False)  # tells nobody: rank 0 sees its connection drop
    return None


@pytest.mark.timeout(120)
def test_a_member_that_stops_without_leaving_is_removed_and_named():
    (error, names), _ = run_world(_body_crash, 2, init=False)
    assert "worker 'worker1' (rank 1) left the group without shutting down" in error, error
    assert names == ["worker0"]


HEARTBEAT = 0.8  # s
_watch = threading.Event()  # on rank 0: set once its heartbeats are to watch every member


def _pid():
    return os.getpid()


def _body_watch_all_peers(ctx):
    if ctx.rank == 0:
        _init(ctx, "worker0", 0, heartbeat_timeout=HEARTBEAT)
        left = threading.Event()

        def listener(info, joined):
            if info.name == "worker1" and not joined:
                left.set()

        rpc_core.add_membership_listener(listener)
        rpc_core.watch_all_peers(_watch.is_set)
        _wait_for("worker1 in")
        pid = rpc_core.rpc_sync("worker1", _pid)
        stop_process(pid)
        try:
            # No call of ours waits on worker1 and nothing asks to watch it: it stays a member.
            kept = not left.wait(3 * HEARTBEAT)
            start = time.monotonic()
            _watch.set()
            removed = left.wait(STEP)
            seconds = time.monotonic() - start
        finally:
            os.kill(pid, signal.SIGKILL)
        rpc_core.remove_membership_listener(listener)
        try:
            rpc_core.remove_membership_listener(listener)
            twice = "no error"
        except ValueError as e:
            twice = str(e)
        return kept, removed, seconds, _names(), twice
    _init(ctx, "worker1", 1, heartbeat_timeout=HEARTBEAT)
    rpc_core.rpc_sync("worker0", _post, args=("worker1 in",))
    threading.Event().wait(STEP)  # stopped, then killed by rank 0
    return None


@pytest.mark.timeout(120)
def test_watch_all_peers_makes_rank_0_remove_a_silent_member_no_call_waits_on():
    (kept, removed, seconds, names, twice), _ = run_world(_body_watch_all_peers, 2, init=False, may_die=(1,))
    assert kept and removed
    assert seconds < 1.5 * HEARTBEAT + 3, seconds
    assert names == ["worker0"]
    assert "is not a membership listener of this worker" in twice, twice


def _body_registry_first(ctx):
    if ctx.rank == 0:
        _init(ctx, "worker0", 0)
        _wait_for("worker1 in")
        _wait_for("worker2 in")
        try:
            rpc_core.shutdown(timeout=1.0)  # the others stay: rank 0 gives up waiting for them
        except rpc_core.RpcError as e:
            return str(e)
        return "no error"
    _init(ctx, ctx.name, ctx.rank)
    _on_leave("worker0", "worker0 left")
    _on_leave("worker2", "worker2 left")
    rpc_core.rpc_sync("worker0", _post, args=(f"{ctx.name} in",))
    _wait_for("worker0 left")
    if ctx.rank == 2:
        echo = rpc_core.rpc_sync("worker1", _whoami)  # the rest go on without the registry
        rpc_core.shutdown()  # told to worker1 directly
        return echo, _refused(ctx, "worker3", 3, init_timeout=1.0)
    _wait_for("worker2 left")
    return _error_calling("worker0"), _error_calling("worker2"), _names()


@pytest.mark.timeout(120)
def test_when_rank_0_leaves_first_the_rest_go_on_but_nobody_can_join():
    error0, (to_0, to_2, names), (echo, join) = run_world(_body_registry_first, 3, init=False)
    assert "timed out after 1 s waiting for the other members to leave the group first" in error0, error0
    assert "['worker1', 'worker2'] are still in it" in error0
    assert "worker 'worker0' (rank 0) left the group before ['worker1', 'worker2']" in to_0, to_0
    assert "it was the group's registry, so no worker can join" in to_0
    assert "worker 'worker2' (rank 2) left the group" in to_2 and names == ["worker1"]
    assert echo == "worker1"
    assert join.startswith("RendezvousError") and "could not reach the rendezvous" in join, join


# -- collisions, rank reuse, the wrong secret ----------------------------------------------------------------
def _refused(ctx, name, rank, **overrides):
    try:
        _init(ctx, name, rank, **overrides)
    except (RendezvousError, AuthenticationError) as e:
        assert not rpc_core.api._agent_mod._agent
        return f"{type(e).__name__}: {e}"
    rpc_core.shutdown()
    return "joined"


def _body_collisions(ctx):
    if ctx.rank == 0:
        _init(ctx, "worker0", 0)
        _wait_for("tried")
        # worker1's roster is read here, while "late" is still in: once "done" is posted it may leave
        names1 = rpc_core.rpc_sync("worker1", _names)
        out = _names(), names1, rpc_core.rpc_sync("worker1", _call, args=("worker0", _whoami))
        _post("done")
        return out
    if ctx.rank == 1:
        _init(ctx, "worker1", 1)
        rpc_core.rpc_sync("worker0", _post, args=("worker1 in",))
        rpc_core.rpc_sync("worker0", _wait_for, args=("done",))
        return None
    # Rank 2 waits for worker1 as a member itself, leaves, then tries the bad joins.
    _init(ctx, "waiter", 2)
    rpc_core.rpc_sync("worker0", _wait_for, args=("worker1 in",))
    rpc_core.shutdown()
    tries = [
        _refused(ctx, "worker1", 5),
        _refused(ctx, "fresh", 1),
        _refused(ctx, "worker0", 6),
        _refused(ctx, "intruder", 7, auth_secret="not-the-secret"),
    ]
    _init(ctx, "late", 2)  # the same rank, after its first holder (this process) left
    names = _names()
    rpc_core.rpc_sync("worker0", _post, args=("tried",))
    rpc_core.rpc_sync("worker0", _wait_for, args=("done",))
    return tries, names


@pytest.mark.timeout(120)
def test_taken_names_and_ranks_and_wrong_secrets_are_refused_and_the_group_is_unaffected():
    (names0, names1, echo), _, (tries, names2) = run_world(_body_collisions, 3, init=False)
    by_name, by_rank, founder, secret = tries
    assert by_name.startswith("RendezvousError") and "worker name 'worker1' is not unique" in by_name, by_name
    assert by_rank.startswith("RendezvousError") and "rank 1 is not unique" in by_rank, by_rank
    assert "worker1" in by_rank and "worker name 'worker0' is not unique" in founder, founder
    assert secret.startswith("AuthenticationError"), secret
    # everyone, worker1 included, knows the newcomer that took the freed rank 2
    assert names0 == names1 == names2 == ["worker0", "worker1", "late"] and echo == "worker0"


def _body_rank_reuse(ctx, x, w):
    if ctx.rank == 0:
        _init(ctx, "worker0", 0)
        _wait_for("done")
        return None
    if ctx.rank == 1:
        _init(ctx, "worker1", 1)
        rpc_core.rpc_sync("worker0", _wait_for, args=("worker2 in",))
        stale = rpc_core.remote("worker2", _make, args=(3,))
        first = stale.to_here().tolist()
        rpc_core.rpc_sync("worker0", _post, args=("rref made",))
        rpc_core.rpc_sync("worker0", _wait_for, args=("worker2 again",))
        errors = []
        for use in (stale.to_here, stale.owner, lambda: stale.rpc_sync().sum()):
            try:
                use()
                errors.append("no error")
            except WorkerLeftError as e:
                errors.append(str(e))
        new = rpc_core.rpc_sync("worker2", _whoami), rpc_core.rpc_sync(2, torch.add, args=(torch.ones(1), 1)).tolist()
        names = rpc_core.rpc_sync("worker0", _names)  # before "done": then worker1 and worker2 may leave
        rpc_core.rpc_sync("worker0", _post, args=("done",))
        return first, errors, new, names
    passes = []
    for again in (False, True):  # the same process holds rank 2 twice: the second is a new member
        _init(ctx, "worker2", 2)
        if not again:
            rpc_core.rpc_sync("worker0", _post, args=("worker2 in",))
            rpc_core.rpc_sync("worker0", _wait_for, args=("rref made",))
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        with dist_autograd.context() as cid:
            y = rpc_core.rpc_sync("worker1", _linear, args=(xg, wg))
            dist_autograd.backward(cid, [y.pow(2).sum()])
            grads = dist_autograd.get_gradients(cid)
            passes.append((cid, grads[xg].tolist(), grads[wg].tolist()))
        if not again:
            rpc_core.shutdown()
    rpc_core.rpc_sync("worker0", _post, args=("worker2 again",))  # worker1 may now check and go
    rpc_core.rpc_sync("worker0", _wait_for, args=("done",))
    return passes


@pytest.mark.timeout(120)
def test_a_reused_rank_is_a_new_member_whose_ids_and_rrefs_are_not_the_old_ones():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 3, generator=gen), torch.randn(3, 2, generator=gen)
    _, (first, errors, new, names), passes = run_world(_body_rank_reuse, 3, init=False, args=(x, w))
    assert names == ["worker0", "worker1", "worker2"]
    assert first == [0.0, 1.0, 2.0]
    for e in errors:
        assert "worker 'worker2' (rank 2) left the group" in e and "new member" in e, e
    assert new == ("worker2", [2.0])
    (cid_old, gx_old, gw_old), (cid_new, gx_new, gw_new) = passes
    assert cid_old != cid_new and cid_old >> 48 == cid_new >> 48 == 2
    # the new member's context is not taken for the old one's (released) on worker1
    assert gx_old == gx_new and gw_old == gw_new
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    _linear(xl, wl).pow(2).sum().backward()
    assert torch.allclose(torch.tensor(gx_new), xl.grad) and torch.allclose(torch.tensor(gw_new), wl.grad)


# -- static and dynamic do not mix; the secret applies to joins (in this process) -----------------------------------
def _opts(port, secret="s", **kw):
    kw.setdefault("init_timeout", 20.0)
    return RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", auth_secret=secret, **kw)


@pytest.mark.timeout(60)
def test_a_dynamic_join_of_a_static_group_is_refused_with_torchs_message():
    port = free_port()
    rpc_core.init_rpc("s0", rank=0, world_size=1, rpc_backend_options=_opts(port))
    try:
        with pytest.raises(RendezvousError, match="mixes statically and dynamically initialized members"):
            rendezvous("d1", 1, None, f"tcp://127.0.0.1:{port}", b"s", 20.0)
        assert _names() == ["s0"]
    finally:
        rpc_core.shutdown()


@pytest.mark.timeout(60)
def test_a_static_join_of_a_dynamic_group_and_a_wrong_secret_are_refused():
    port = free_port()
    rpc_core.init_rpc("d0", rank=0, world_size=None, rpc_backend_options=_opts(port))
    try:
        with pytest.raises(RendezvousError, match="mixes statically and dynamically.*world_size=None, not 2"):
            rendezvous("s1", 1, 2, f"tcp://127.0.0.1:{port}", b"s", 20.0)
        with pytest.raises(AuthenticationError, match="same secret"):
            rendezvous("d1", 1, None, f"tcp://127.0.0.1:{port}", b"wrong", 20.0)
        assert _names() == ["d0"]
    finally:
        rpc_core.shutdown()


def test_a_dynamic_worker_needs_its_rank():
    with pytest.raises(ValueError, match="rank parameter missing"):
        rpc_core.init_rpc("a", world_size=None, rpc_backend_options=_opts(free_port()))


# -- the same program on torch.distributed.rpc --------------------------------------------------------------------
def _whoami_on(backend):
    return importlib.import_module(backend).get_worker_info().name


def _body_both_backends(ctx, backend, founded, left):
    """Found, join, call both ways, leave, call the leaver: on ``backend`` (a module name)."""
    rpc = importlib.import_module(backend)
    if backend == "rpc_core":
        opts = ctx.backend_options(rpc_timeout=30.0)
    else:
        opts = rpc.TensorPipeRpcBackendOptions(init_method=ctx.init_method, rpc_timeout=30.0)
    if ctx.rank == 0:
        rpc.init_rpc("w0", rank=0, world_size=None, rpc_backend_options=opts)
        founded.set()
        _wait_for("w1 in", 150.0)
        infos = sorted((w.id, w.name) for w in rpc._get_current_rpc_agent().get_worker_infos())
        echo = rpc.rpc_sync("w1", _whoami_on, args=(backend,))
        _post("checked")
        if not left.wait(150.0):  # set by w1 once its shutdown returned
            raise TimeoutError("w1 did not leave")
        try:
            rpc.rpc_sync("w1", _whoami_on, args=(backend,))
            error = "no error"
        except RuntimeError as e:
            error = str(e)
        after = sorted((w.id, w.name) for w in rpc._get_current_rpc_agent().get_worker_infos())
        rpc.shutdown()
        return infos, echo, error, after
    # torch's joiner reads the member list from the store once: join after w0 has founded
    # the group, or w0 may be missing from it.
    if not founded.wait(150.0):
        raise TimeoutError("w0 did not found the group")
    rpc.init_rpc("w1", rank=1, world_size=None, rpc_backend_options=opts)
    echo = rpc.rpc_sync("w0", _whoami_on, args=(backend,))
    rpc.rpc_sync("w0", _post, args=("w1 in",))
    rpc.rpc_sync("w0", _wait_for, args=("checked", 150.0))
    rpc.shutdown()
    left.set()
    return echo


@pytest.mark.timeout(420)
def test_join_call_and_leave_behave_as_on_torch_rpc():
    outcomes = {}
    for backend in ("torch.distributed.rpc", "rpc_core"):
        founded, left = _mp_context().Event(), _mp_context().Event()
        outcomes[backend] = run_world(_body_both_backends, 2, init=False, args=(backend, founded, left), timeout=200.0)
    for backend, ((infos, echo0, error, after), echo1) in outcomes.items():
        assert infos == [(0, "w0"), (1, "w1")] and after == [(0, "w0")], backend
        assert (echo0, echo1) == ("w1", "w0"), backend
        assert "could not find destination" in error and "w1" in error, (backend, error)
    assert "worker 'w1' (rank 1) left the group" in outcomes["rpc_core"][0][2]
