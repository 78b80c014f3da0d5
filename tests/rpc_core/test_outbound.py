"""Who reads answers: the caller waiting for one reads it itself; a background thread reads
only for calls nobody waits on (rpc_core/agent/outbound.py)."""

import threading
import time

import pytest
import torch

import rpc_core
from rpc_core.agent import agent as agent_mod
from rpc_core.agent import deadlines
from tests._world import run_world

_gate = threading.Event()


def _noop():
    return None


def _double(t):
    return t * 2


def _wait_for_gate():
    if not _gate.wait(60):
        raise TimeoutError("gate never opened")
    return True


def _open_gate():
    _gate.set()


class _Collector:
    """A done-callback that keeps the values of ``n`` futures and says when all arrived."""

    def __init__(self, n):
        self.n, self.values, self.all_done = n, [], threading.Event()

    def __call__(self, f):
        self.values.append(f.value())
        if len(self.values) == self.n:
            self.all_done.set()


def _counters():
    link = agent_mod.current_agent().connections.links[1]
    return link.read_by_waiters, link.read_in_background


def _body_sync_reads_itself(ctx):
    if ctx.rank != 0:
        return None
    rpc_core.rpc_sync(1, _noop)  # dials the connection
    w0, b0 = _counters()
    x = torch.arange(6.0)
    for _ in range(30):
        assert torch.equal(rpc_core.rpc_sync(1, _double, args=(x,)), x * 2)
    w1, b1 = _counters()
    return w1 - w0, b1 - b0


def test_a_sync_caller_reads_its_own_answer_and_no_background_read_happens():
    (by_waiters, in_background), _ = run_world(_body_sync_reads_itself, 2)
    assert by_waiters == 30
    assert in_background == 0


def _body_mixed(ctx):
    if ctx.rank != 0:
        return None
    n = 50
    cb = _Collector(n)
    # Futures nobody waits on: only their callbacks observe them, so a background reader
    # must read their answers while the main thread reads its own sync answers.
    for i in range(n):
        rpc_core.rpc_async(1, _double, args=(torch.tensor(float(i)),)).add_done_callback(cb)
    sync_results = [rpc_core.rpc_sync(1, _double, args=(torch.tensor(1.0),)).item() for _ in range(10)]
    assert cb.all_done.wait(30), f"only {len(cb.values)} of {n} callbacks ran"
    return sorted(t.item() for t in cb.values), sync_results


def test_unwaited_async_calls_complete_while_sync_callers_read_their_own_answers():
    (async_values, sync_values), _ = run_world(_body_mixed, 2)
    assert async_values == [2.0 * i for i in range(50)]
    assert sync_values == [2.0] * 10


def _body_timeout(ctx):
    if ctx.rank != 0:
        return None
    rpc_core.rpc_sync(1, _noop)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="RPC ran for more than"):
        rpc_core.rpc_sync(1, _wait_for_gate, timeout=0.5)
    waited = time.monotonic() - t0
    rpc_core.rpc_sync(1, _open_gate)
    return waited


def test_a_sync_call_times_out_on_time_while_its_caller_is_the_reader():
    waited, _ = run_world(_body_timeout, 2)
    assert 0.5 <= waited < 5.0, waited


def _body_callbacks_and_wait(ctx):
    if ctx.rank != 0:
        return None
    seen = []
    out = []
    for i in range(20):
        # A future with a callback completes on a pool thread; waiting on it right away
        # must still return its value (the waiter reads the answer, then waits for that
        # completion instead of reading on).
        fut = rpc_core.rpc_async(1, _double, args=(torch.tensor(float(i)),))
        chained = fut.then(lambda f: seen.append(f.value().item()) or f.value() + 1)
        out.append((fut.wait().item(), chained.wait().item()))
    return out, sorted(seen)


def test_waiting_on_a_future_with_callbacks_returns_its_value_and_runs_them():
    (pairs, seen), _ = run_world(_body_callbacks_and_wait, 2)
    assert pairs == [(2.0 * i, 2.0 * i + 1) for i in range(20)]
    assert seen == [2.0 * i for i in range(20)]


# -- remote()'s acknowledgement is read lazily ----------------------------------------------------------
def _ones():
    return torch.ones(3)


def _body_remote_then_to_here(ctx):
    if ctx.rank != 0:
        return None
    deadlines._LAZY_DELAY = 60.0  # no kick within the test: only waiters may read
    rpc_core.rpc_sync(1, _noop)  # dials the connection
    w0, b0 = _counters()
    kept = []  # no deletes during the loop: one sent on its own would be read in the background
    for _ in range(20):
        kept.append(rpc_core.remote(1, _ones))
        assert torch.equal(kept[-1].to_here(), torch.ones(3))
    w1, b1 = _counters()
    return w1 - w0, b1 - b0


def test_to_here_reads_the_remote_acknowledgement_on_its_way_and_no_background_read_happens():
    (by_waiters, in_background), _ = run_world(_body_remote_then_to_here, 2)
    assert by_waiters == 40  # 20 acknowledgements and 20 values
    assert in_background == 0


def _body_remote_nobody_waits_on(ctx):
    if ctx.rank != 0:
        return None
    rref = rpc_core.remote(1, _ones)
    confirmed = threading.Event()
    torch.futures.Future.add_done_callback(rref._get_future(), lambda f: confirmed.set())
    # Nobody reads the connection: only the kick after _LAZY_DELAY wakes the background reader.
    return confirmed.wait(30), rref.confirmed_by_owner(), _counters()[1] >= 1


def test_a_remote_nobody_waits_on_is_still_acknowledged_by_the_background_reader():
    assert run_world(_body_remote_nobody_waits_on, 2)[0] == (True, True, True)


# -- bursts: the issuing thread reads their answers -----------------------------------------------------
def _body_burst(ctx):
    if ctx.rank != 0:
        return None
    rpc_core.rpc_sync(1, _noop)
    link = agent_mod.current_agent().connections.links[1]
    by_issuers = link.read_by_issuers
    n = 2000
    futs = [rpc_core.rpc_async(1, _double, args=(torch.tensor(float(i)),)) for i in range(n)]
    torch.futures.wait_all(futs)
    values = [f.value().item() for f in futs]
    return values, link.read_by_issuers - by_issuers, link.in_flight()


def test_a_burst_of_async_calls_completes_in_order_and_its_issuer_reads_answers_on_the_way():
    (values, by_issuers, left), _ = run_world(_body_burst, 2)
    assert values == [2.0 * i for i in range(2000)]
    assert by_issuers > 0  # the issuing thread read some answers itself, between its calls
    assert left == 0


def _body_burst_then_stop(ctx):
    if ctx.rank != 0:
        return None
    rpc_core.rpc_sync(1, _noop)
    # 40 calls: the last few are queued for the issuer's next batch, which never comes (it
    # stops and only waits for the callbacks): the background reader must write and read them.
    n = 40
    cb = _Collector(n)
    for _ in range(n):
        rpc_core.rpc_async(1, _noop).add_done_callback(cb)
    return cb.all_done.wait(30), len(cb.values)


def test_when_a_burst_stops_the_background_reader_sends_and_reads_what_is_left():
    assert run_world(_body_burst_then_stop, 2)[0] == (True, 40)


def _body_answer_not_held_behind_a_blocked_request(ctx):
    if ctx.rank != 0:
        return None
    rpc_core.rpc_sync(1, _noop)
    # 31 quick calls then one that blocks until the caller opens the gate; they reach the
    # callee in one batch, so the quick ones' answers may be queued behind the blocked one.
    quick = [rpc_core.rpc_async(1, _noop) for _ in range(31)]
    blocked = rpc_core.rpc_async(1, _wait_for_gate)
    for f in quick:
        f.wait()  # the caller opens the gate only after these: a held answer would deadlock
    rpc_core.rpc_sync(1, _open_gate)
    return blocked.wait()


def test_answers_queued_on_the_callee_are_not_held_behind_a_request_that_blocks():
    assert run_world(_body_answer_not_held_behind_a_blocked_request, 2)[0] is True


def _body_burst_mixed_sizes(ctx):
    if ctx.rank != 0:
        return None
    rpc_core.rpc_sync(1, _noop)
    # Small frames of a burst are queued for batches; large ones (copied by address on the
    # same host, answered by a RELEASE) go at once, after whatever is queued.
    args = [torch.full((1 << 18,) if i % 7 == 0 else (3,), float(i)) for i in range(300)]
    futs = [rpc_core.rpc_async(1, _double, args=(a,)) for a in args]
    torch.futures.wait_all(futs)
    return all(torch.equal(f.value(), a * 2) for f, a in zip(futs, args, strict=True))


def test_a_burst_mixing_small_and_large_tensors_returns_every_result_intact():
    assert run_world(_body_burst_mixed_sizes, 2)[0] is True


def _body_bursts_from_threads(ctx):
    if ctx.rank != 0:
        return None
    rpc_core.rpc_sync(1, _noop)
    results = {}

    def issue(k):
        futs = [rpc_core.rpc_async(1, _double, args=(torch.tensor(float(1000 * k + i)),)) for i in range(500)]
        torch.futures.wait_all(futs)
        results[k] = [f.value().item() for f in futs]

    threads = [threading.Thread(target=issue, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return {k: v == [2.0 * (1000 * k + i) for i in range(500)] for k, v in results.items()}


def test_bursts_from_several_threads_at_once_all_complete_with_their_own_results():
    assert run_world(_body_bursts_from_threads, 2)[0] == {0: True, 1: True, 2: True, 3: True}
