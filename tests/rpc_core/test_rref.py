"""Remote references (rpc_core/rref/): the RRef API, proxies, RRefs inside arguments and
return values, forwarding between users, and owner-side reference counting (tables return
to empty once users let go). Bodies run on worker processes (tests/_world.py).

One module, though past 400 lines: one test module for the RRef group, whose bodies share
the helpers at the top (table checks, flushes)."""

import gc
import io
import os
import pickle
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

import rpc_core
from rpc_core import RpcTimeoutError, RRef, WorkerInfo
from rpc_core import rref as rref_mod
from rpc_core.rref import release as rref_release
from rpc_core.rref import state as rref_state
from tests._world import run_world

EMPTY = {
    "num_owner_rrefs": 0,
    "num_owner_entries": 0,
    "num_forks": 0,
    "num_user_rrefs": 0,
    "num_pending_users": 0,
    "num_pending_children": 0,
    "num_pending_futures": 0,
}


# -- helpers every body can call --------------------------------------------------------------------
def _names():
    return [f"worker{r}" for r in range(rpc_core.api.current_agent().roster.workers.__len__())]


def _rref_tables():
    info = rpc_core._get_debug_info()
    return {k: info[k] for k in EMPTY}


def _settle_and_count():
    """Every worker calls this last: once all are done, drop what is garbage, let the deletes
    reach the owners, and report this worker's RRef tables.

    Rounds of (collect garbage, flush, all-gather whether the flush had anything to do) until
    a round in which no worker had: a delete an owner applies can free a value that holds
    more RRefs (a chain of remote() results), whose deletes start on other workers, and a
    child's accept releases its parent's handle. The all-gather makes every worker finish a
    round before any starts the next."""
    names = _names()
    rpc_core._barrier(names)
    for _ in range(50):
        gc.collect()
        work = rpc_core.api._all_gather(rref_mod.flush(), names)
        if not any(work.values()):
            return _rref_tables()
    raise AssertionError(f"RRef deletes still cascading after 50 rounds: {work}")


# -- remote functions and classes ---------------------------------------------------------------------
def _add(a, b):
    return a + b


def _sleep_then(seconds, value):
    time.sleep(seconds)  # a slow remote function (timeout tests)
    return value


def _raise_value_error():
    raise ValueError("raised inside remote")


def _value_of(rref):
    return rref.local_value() if rref.is_owner() else rref.to_here()


def _owner_side_view(rref):
    return rref.is_owner(), rref.confirmed_by_owner(), rref.local_value()


def _sum_rrefs(rrefs, extra):
    assert all(r.confirmed_by_owner() for r in rrefs), "a user function ran before its RRefs were confirmed"
    assert all(r.confirmed_by_owner() for r in extra.values())
    return sum(r.to_here() for r in rrefs) + sum(r.to_here() for r in extra.values())


def _make_owned_rref(value):
    return RRef(value)


def _make_user_rref(owner, value):
    """Return an RRef this worker holds as a user (owned by ``owner``): user -> user."""
    return rpc_core.remote(owner, _add, args=(value, 0))


def _forward(rref, hops):
    """Pass ``rref`` on to another non-owner worker ``hops`` times, then fetch it."""
    if hops == 0:
        assert rref.confirmed_by_owner()
        return rref.to_here()
    me = rpc_core.get_worker_info().id
    owner = rref.owner().id
    nxt = next(r for r in range(3) if r not in (me, owner))
    return rpc_core.rpc_sync(nxt, _forward, args=(rref, hops - 1))


def _forward_chain(dst, rref, ttl):
    """torch's test_rref_forward_chain: each level wraps the next level's RRef in a list."""
    if ttl > 0:
        nxt = (dst + 1) % 3
        return [rpc_core.remote(nxt, _forward_chain, args=(nxt, rref, ttl - 1))]
    return rref.to_here()


_kept: list[Any] = []


def _keep(rref):
    _kept.append(rref)
    return rref.confirmed_by_owner()


def _use_kept_then_drop():
    value = _kept[0].to_here()
    _kept.clear()
    return value


class Counter:
    def __init__(self, start):
        self.value = start

    def add(self, n):
        self.value += n
        return self.value

    def slow(self, seconds):
        time.sleep(seconds)
        return self.value

    @staticmethod
    def static_sum(a, b):
        return a + b

    @classmethod
    def class_name(cls):
        return cls.__name__


# -- the RRef API -------------------------------------------------------------------------------
def _body_api(ctx):
    if ctx.rank == 0:
        rref = rpc_core.remote(1, torch.add, args=(torch.ones(2), 1))
        assert not rref.is_owner()
        assert rref.owner() == WorkerInfo("worker1", 1) and rref.owner_name() == "worker1"
        assert torch.equal(rref.to_here(), torch.full((2,), 2.0))
        rref._get_future().wait()
        assert rref.confirmed_by_owner()
        with pytest.raises(
            RuntimeError,
            match=r"^For UserRRef\(rref_id=GloballyUniqueId\(created_on=0, local_id=\d+"
            r"\), fork_id=GloballyUniqueId\(created_on=0, local_id=\d+\)\), "
            r"can't call localValue\(\) on user WorkerInfo\(id=0, name=worker0\)\. "
            r"Call it on owner WorkerInfo\(id=1, name=worker1\); to_here\(\)",
        ):
            rref.local_value()
        assert repr(rref).startswith("UserRRef(RRefId = GloballyUniqueId(created_on=0, local_id=")
        # the owner sees its own value through the same RRef
        assert rpc_core.rpc_sync(1, _owner_side_view, args=(rref,))[:2] == (True, True)

        value = {"a": [1, 2]}
        own = RRef(value)
        assert own.is_owner() and own.confirmed_by_owner()
        assert own.local_value() is value and own.to_here() is value
        assert own.owner() == rpc_core.get_worker_info() and own.owner_name() == "worker0"
        assert repr(own).startswith("OwnerRRef(GloballyUniqueId(created_on=0, local_id=")
        assert rpc_core.rpc_sync(1, _value_of, args=(own,)) == value

        to_self = rpc_core.remote("worker0", _add, args=(2, 3))
        assert to_self.is_owner() and to_self.to_here() == 5 and to_self.local_value() == 5

        for r in (rref, own):
            with pytest.raises(
                RuntimeError, match="Can not pickle rref in python pickler, rref can only be pickled when using RPC"
            ):
                pickle.dumps(r)
            with pytest.raises(RuntimeError, match="Can not pickle rref"):
                torch.save(r, io.BytesIO())
        del rref, own, to_self, r
    return _settle_and_count()


def test_rref_api_to_here_local_value_owner_and_pickling_outside_rpc():
    assert run_world(_body_api, 2) == [EMPTY, EMPTY]


def _body_proxies(ctx):
    if ctx.rank == 0:
        for owner in (1, 0):
            rref = rpc_core.remote(owner, Counter, args=(5,))
            assert rref.rpc_sync().add(2) == 7
            assert rref.rpc_async().add(3).wait() == 10
            assert rref.remote().add(1).to_here() == 11
            assert rpc_core.rpc_sync(owner, _value_of, args=(rref,)).value == 11  # state persisted
            assert rref.rpc_sync().static_sum(1, 2) == 3
            assert rref.rpc_async().static_sum(3, 4).wait() == 7
            assert rref.remote().static_sum(5, 6).to_here() == 11
            assert rref.rpc_sync().class_name() == "Counter"
            assert rref.remote().class_name().to_here() == "Counter"
            with pytest.raises(AttributeError, match="no_such_method"):
                rref.rpc_sync().no_such_method()
            with pytest.raises(AttributeError):
                rref.remote().no_such_method().to_here()
        slow = rpc_core.remote(1, Counter, args=(0,))
        with pytest.raises(RpcTimeoutError, match="RPC ran for more than"):
            slow.rpc_sync(timeout=0.2).slow(1.0)
        with pytest.raises(RpcTimeoutError, match="RPC ran for more than"):
            slow.rpc_async(timeout=0.2).slow(1.0).wait()
        del rref, slow
    return _settle_and_count()


def test_proxies_call_instance_static_and_class_methods_on_the_owner():
    assert run_world(_body_proxies, 2) == [EMPTY, EMPTY]


class Scaler:
    """Records the order its calls arrive in; ``scale`` is differentiable."""

    def __init__(self, tag):
        self.tag = tag

    def scale(self, t):
        _ARRIVALS.append(self.tag)
        return t * 3


_ARRIVALS: list[str] = []  # on the owner: the tags of the Scalers called, in arrival order


def _arrivals():
    return list(_ARRIVALS)


def _body_first_async_call(ctx):
    import rpc_core.autograd as dist_autograd

    if ctx.rank == 0:
        known = rpc_core.remote(1, Scaler, args=("known",))
        known.rpc_sync().scale(torch.ones(1))  # this RRef's type is known from here on
        fresh = rpc_core.remote(1, Scaler, args=("fresh",))
        x = torch.ones(2, requires_grad=True)
        with dist_autograd.context() as cid:
            # The first proxy call of ``fresh`` (type not known yet) goes out at once, in
            # this thread's order and inside its autograd context.
            first = fresh.rpc_async().scale(x)
            second = known.rpc_async().scale(x)
            loss = (first.wait() + second.wait()).sum()
            dist_autograd.backward(cid, [loss])
            grad = dist_autograd.get_gradients(cid)[x]
        assert grad.tolist() == [6.0, 6.0]
        assert rpc_core.rpc_sync(1, _arrivals) == ["known", "fresh", "known"]
        # The owner checks the type for a call whose caller did not know it.
        with pytest.raises(AttributeError, match="no_such_method"):
            rpc_core.remote(1, Scaler, args=("other",)).rpc_async().no_such_method().wait()
        del known, fresh, first, second
    return _settle_and_count()


def test_a_first_async_proxy_call_keeps_its_order_and_autograd_context():
    assert run_world(_body_first_async_call, 2) == [EMPTY, EMPTY]


# -- RRefs inside arguments and return values -------------------------------------------------------
def _body_args_and_returns(ctx):
    if ctx.rank == 0:
        a = rpc_core.remote(1, _add, args=(1, 0))
        b = rpc_core.remote(1, _add, args=(2, 0))
        c = rpc_core.remote(2, _add, args=(4, 0))  # owned by the callee below
        own = RRef(8)
        # user -> user (a, b to worker2), user -> owner (c), owner -> user (own), in containers
        assert rpc_core.rpc_sync(2, _sum_rrefs, args=([a, b, c], {"own": own})) == 15
        assert rpc_core.rpc_async(2, _sum_rrefs, args=([a], {"b": b})).wait() == 3
        assert rpc_core.remote(2, _sum_rrefs, args=([a, b], {})).to_here() == 3
        # owner -> user as a return value
        returned = rpc_core.rpc_sync(1, _make_owned_rref, args=(16,))
        assert returned.owner_name() == "worker1" and not returned.is_owner()
        assert returned.to_here() == 16
        # user -> user as a return value (worker2 holds a user RRef owned by worker1)
        passed_on = rpc_core.rpc_sync(2, _make_user_rref, args=(1, 32))
        assert passed_on.owner_name() == "worker1" and passed_on.to_here() == 32
        # an RRef that comes back to its owner is the owner's own value
        assert rpc_core.rpc_sync(1, _owner_side_view, args=(a,)) == (True, True, 1)
        assert rpc_core.rpc_sync(0, _owner_side_view, args=(own,)) == (True, True, 8)
        # returned RRefs dropped right away must not leak (delete vs. fork confirmation)
        for i in range(10):
            rpc_core.rpc_sync(2, _make_user_rref, args=(1, i))
            rpc_core.rpc_sync(1, _make_owned_rref, args=(i,))
        del a, b, c, own, returned, passed_on
    return _settle_and_count()


def test_rrefs_in_args_and_return_values_and_user_functions_see_them_confirmed():
    assert run_world(_body_args_and_returns, 3) == [EMPTY] * 3


def _body_forwarding(ctx):
    if ctx.rank == 0:
        rref = rpc_core.remote(1, torch.add, args=(torch.ones(2), 1))
        assert torch.equal(rpc_core.rpc_sync(2, _forward, args=(rref, 5)), torch.full((2,), 2.0))
        ret = rpc_core.remote(0, _forward_chain, args=(0, rref, 6))
        for _ in range(6):
            ret = ret.to_here()[0]
        assert torch.equal(ret.to_here(), torch.full((2,), 2.0))
        del rref, ret
    return _settle_and_count()


def test_rrefs_forwarded_user_to_user_across_three_workers():
    assert run_world(_body_forwarding, 3) == [EMPTY] * 3


# -- owner-side reference counting -----------------------------------------------------------------
def _body_lifetime(ctx):
    names = _names()
    if ctx.rank == 0:
        rref = rpc_core.remote(1, _add, args=(torch.ones(3), 0))
        assert rpc_core.rpc_sync(2, _keep, args=(rref,))  # worker2 keeps a fork, confirmed
        del rref
    rpc_core._barrier(names)  # _keep ran on worker2
    if ctx.rank == 2:
        # worker2 tells worker0 (the fork's parent) that it accepted the fork with a call of
        # its own, which may come after _keep's answer; until it does, worker0 keeps its
        # handle. flush() here waits until worker0 has heard it.
        rref_mod.flush()
    rpc_core._barrier(names)
    if ctx.rank == 0:
        gc.collect()
        rref_mod.flush()  # worker0's delete reaches the owner
    rpc_core._barrier(names)  # worker0 let go; worker2 still holds its fork
    if ctx.rank == 1:
        tables = _rref_tables()
        assert tables["num_owner_rrefs"] == 1 and tables["num_forks"] == 1, tables
    rpc_core._barrier(names)
    if ctx.rank == 0:  # the value is still alive on the owner for worker2
        assert torch.equal(rpc_core.rpc_sync(2, _use_kept_then_drop), torch.ones(3))
    return _settle_and_count()


def test_owner_keeps_the_value_while_any_user_holds_it_and_frees_it_after():
    assert run_world(_body_lifetime, 3) == [EMPTY] * 3


def _body_late_request(ctx):
    if ctx.rank == 0:
        rref = rpc_core.remote(1, _add, args=(torch.ones(2), 1))
        assert torch.equal(rref.to_here(), torch.full((2,), 2.0))
        rref_id = rref._rref_id
        del rref
        gc.collect()
        rref_mod.flush()  # the owner has freed the value
        # A request naming the freed RRef (what a buggy program could send) fails at once.
        for handler, args in ((rref_state._on_fetch, (rref_id,)), (rref_state._on_invoke, (rref_id, "sum", (), {}))):
            with pytest.raises(rpc_core.RpcError, match="already deleted on its owner"):
                rpc_core.rpc_sync(1, handler, args=args, timeout=30)
    return _settle_and_count()


def test_a_request_for_an_rref_its_owner_already_freed_fails_instead_of_waiting():
    assert run_world(_body_late_request, 2) == [EMPTY] * 2


def test_rrefs_are_freed_in_workers_forked_from_a_process_that_imported_rpc_core():
    # ps_train's launcher forks roles from a server that preloaded rpc_core: the fork keeps
    # the module but not its threads, so the RRef release loop must start at init_rpc.
    code = (
        "from tests._world import run_world\n"
        "from tests.rpc_core.test_rref import _body_lifetime, EMPTY\n"
        "assert run_world(_body_lifetime, 3, timeout=60) == [EMPTY] * 3\n"
    )
    env = dict(os.environ, RPC_CORE_TEST_START="forkserver", RPC_CORE_TEST_PRELOAD="torch,rpc_core")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]


# -- errors -------------------------------------------------------------------------------------
def _body_errors(ctx):
    if ctx.rank == 0:
        for owner in (1, 0):
            rref = rpc_core.remote(owner, _raise_value_error)
            with pytest.raises(ValueError, match="raised inside remote"):
                rref.to_here()
            with pytest.raises(ValueError, match="raised inside remote"):
                rref.to_here()  # and again
        # the owner cannot even load the function
        from tests.rpc_core.test_api import _install_caller_only_function

        only_here, _ = _install_caller_only_function()
        rref = rpc_core.remote(1, only_here)
        with pytest.raises(RuntimeError, match="RPC pickler does not serialize function code"):
            rref.to_here()
        # the creation times out (the owner still runs it, and must not keep it forever)
        rref = rpc_core.remote(1, _sleep_then, args=(1.0, "late"), timeout=0.2)
        with pytest.raises(RpcTimeoutError, match="RPC ran for more than"):
            rref._get_future().wait()
        with pytest.raises(RuntimeError, match=r"RRef creation via rpc.remote\(\) timed out"):
            rref.to_here()
        del rref
    return _settle_and_count()


def test_errors_inside_remote_surface_at_to_here_with_their_type_and_leave_no_entries():
    assert run_world(_body_errors, 2) == [EMPTY, EMPTY]


def _body_after_shutdown(ctx):
    rref = rpc_core.remote(1 - ctx.rank, _add, args=(1, 1))
    assert rref.to_here() == 2
    rpc_core.shutdown()
    with pytest.raises(RuntimeError, match=r"has been deleted\. Cannot call to_here\(\) on it after deletion"):
        rref.to_here()
    with pytest.raises(RuntimeError, match="has been deleted"):
        rref.rpc_sync().bit_length()
    return True


def test_rrefs_cannot_be_used_after_shutdown():
    assert run_world(_body_after_shutdown, 2) == [True, True]


# -- deletes ride on requests ---------------------------------------------------------------------------
def _owner_holds(rref_id):
    return tuple(rref_id) in rref_state._ctx.owners


def _body_delete_rides_on_next_request(ctx):
    if ctx.rank != 0:
        return None
    r = rpc_core.remote(1, _add, args=(1, 2))
    assert r.to_here() == 3
    rref_id, fork_id = r._rref_id, r._fork_id
    held_before = rpc_core.rpc_sync(1, _owner_holds, args=(rref_id,))
    # What the release thread does with a garbage-collected user RRef, done here so the test
    # knows when: the delete waits for a request to the owner instead of a message of its own.
    r._deleted = True
    rref_release._send_delete(1, rref_id, fork_id)
    waiting = dict(rref_state._ctx.deletes)
    # The next call to the owner carries it; the owner applies it before running the call.
    held_after = rpc_core.rpc_sync(1, _owner_holds, args=(rref_id,))
    return held_before, waiting, held_after, dict(rref_state._ctx.deletes)


def test_a_user_delete_rides_on_the_next_request_to_the_owner():
    (held_before, waiting, held_after, left), _ = run_world(_body_delete_rides_on_next_request, 2)
    assert held_before is True
    assert list(waiting) == [1] and len(waiting[1]) == 1
    assert held_after is False
    assert left == {}


class _RecordingQueue:
    """The release queue, recording what ``__del__`` puts on it (each put wakes a thread)."""

    def __init__(self, real):
        self.real, self.kinds = real, []

    def put(self, item):
        self.kinds.append(item[0])
        self.real.put(item)

    def get(self, *args, **kwargs):
        return self.real.get(*args, **kwargs)


def _body_collected_user_rref(ctx):
    if ctx.rank != 0:
        return None
    r = rpc_core.remote(1, _add, args=(1, 2))
    assert r.to_here() == 3  # reads the creation's acknowledgement too: r is confirmed
    rref_id = r._rref_id
    rref_state._ctx.releases = recording = _RecordingQueue(rref_state._ctx.releases)
    try:
        del r  # the last reference: __del__ runs here
        held_after = rpc_core.rpc_sync(1, _owner_holds, args=(rref_id,))
    finally:
        rref_state._ctx.releases = recording.real
    return recording.kinds, held_after


def test_a_collected_confirmed_user_rref_wakes_no_thread_and_its_delete_still_reaches_the_owner():
    (kinds, held_after), _ = run_world(_body_collected_user_rref, 2)
    assert "user" not in kinds  # at most a poke of a release loop that slept without deadline
    assert held_after is False  # carried by the call (or sent by the release loop before it)


# -- an RRef passed to its owner (torch's ``rpc_sync(rref.owner(), f, args=(rref,))``) ----------------
def _local_value(rref):
    return rref.local_value()


def _record_releases():
    rref_state._ctx.releases = _RecordingQueue(rref_state._ctx.releases)


def _recorded_releases():
    gc.collect()
    rref_mod.flush()  # applies the dropped handles
    recording = rref_state._ctx.releases
    rref_state._ctx.releases = recording.real
    entry = rref_state._ctx.owners.get(_owner_rref_id[0])
    return recording.kinds, None if entry is None else entry.handles


_owner_rref_id = [None]


def _remember(rref_id):
    _owner_rref_id[0] = tuple(rref_id)


def _body_rref_to_its_owner(ctx):
    if ctx.rank != 0:
        return None
    r = rpc_core.remote(1, _add, args=(1, 2))
    assert r.to_here() == 3
    rpc_core.rpc_sync(1, _remember, args=(r._rref_id,))
    rpc_core.rpc_sync(1, _record_releases)
    agent = rpc_core.api.current_agent()
    received_before = agent.dispatch.n_received
    pending = []
    for _ in range(5):
        assert rpc_core.rpc_sync(1, _local_value, args=(r,)) == 3
        pending.append(rref_mod.debug_info()["num_pending_children"])  # no flush: the response said so
    received = agent.dispatch.n_received - received_before
    kinds, handles = rpc_core.rpc_sync(1, _recorded_releases)
    return pending, received, kinds, handles


def test_an_rref_passed_to_its_owner_costs_no_message_and_no_thread_wake_of_its_own():
    (pending, received, kinds, handles), _ = run_world(_body_rref_to_its_owner, 2)
    assert pending == [0] * 5  # each child accept came with the call's response...
    assert received == 0  # ...not as a call to this worker
    assert "owner" not in kinds  # the owner handles each call made were dropped without a wake
    assert handles == 0  # and all of them were dropped


def _fail_with(rref):
    raise ValueError(f"no use for {rref.local_value()}")


def _body_rref_to_its_owner_that_raises(ctx):
    if ctx.rank != 0:
        return None
    r = rpc_core.remote(1, _add, args=(1, 2))
    r.to_here()
    with pytest.raises(ValueError, match="no use for 3"):
        rpc_core.rpc_sync(1, _fail_with, args=(r,))
    return rref_mod.debug_info()["num_pending_children"]


def test_the_child_accept_also_comes_with_an_exception_response():
    pending, _ = run_world(_body_rref_to_its_owner_that_raises, 2)
    assert pending == 0
