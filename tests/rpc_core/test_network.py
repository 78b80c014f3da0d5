"""rpc_core across an emulated network (tests/netns.py): workers on hosts of their own, links
with delay, jitter, loss and rate limits, cut and healed; frozen and killed peers; bad input
from another host. Needs root, ip and iptables; skipped, with the reason, where unavailable."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch

import rpc_core
import rpc_core.autograd as dist_autograd
from rpc_core import connection_stats
from rpc_core.optim import DistributedOptimizer
from tests.netns import Network, unavailable_reason
from tests.netns_world import control, run_hosts
from tests.rpc_core import test_agent, test_handshake

HEARTBEAT = 2.0  # s, the tests' heartbeat timeout: a silent peer is reported within 1.5x this
SLACK = 3.0  # s, for a loaded 2-core machine


@pytest.fixture(scope="module")
def network():
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no emulated network here: {reason}")
    net = Network(3)
    yield net
    net.close()


@pytest.fixture
def net(network):
    network.reset()
    yield network
    network.reset()


# -- functions the workers call --------------------------------------------------------------------
_gate = threading.Event()
_ready = threading.Event()
_count = [0]
_count_lock = threading.Lock()


def _whoami():
    return rpc_core.get_worker_info().name


def _echo(t):
    return t


def _block():
    """Holds the call open until the worker's gate opens (another call or the body opens it)."""
    if not _gate.wait(60):
        raise TimeoutError("the gate never opened")
    return rpc_core.get_worker_info().name


def _open_gate():
    _gate.set()


def _set_ready():
    _ready.set()


def _wait_ready():
    if not _ready.wait(60):
        raise TimeoutError("the peer never said it was ready")


def _add_one():
    with _count_lock:
        _count[0] += 1


def _counted():
    return _count[0]


def _linear(seed, n_in, n_out):
    torch.manual_seed(seed)
    return torch.nn.Linear(n_in, n_out)


def _param_rrefs(module_rref):
    return [rpc_core.RRef(p) for p in module_rref.local_value().parameters()]


def _transport():
    s = connection_stats()
    return s.connections, s.unix_connections, s.cma_connections, s.bytes_cma_sent + s.bytes_cma_received


def _outcome(fn):
    """(error type name or None, message, seconds) of ``fn()``."""
    start = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test checks the type
        return type(e).__name__, str(e), time.monotonic() - start
    return None, "", time.monotonic() - start


def _concurrently(fns):
    """Run each function on a thread of its own; their outcomes, in order."""
    out = [None] * len(fns)

    def run(i):
        out[i] = _outcome(fns[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _assert_unavailable(outcomes, peer, bound):
    for kind, message, seconds in outcomes:
        assert kind == "WorkerUnavailableError", (kind, message)
        assert f"worker '{peer}'" in message and "sent nothing for" in message, message
        assert seconds < bound, (seconds, message)


# -- same results on a slow, lossy network; no same-host shortcut between hosts -------------------------
def _warm_optimizers():
    """Build a throw-away optimizer: torch's first one imports torch._dynamo (seconds of CPU),
    done here while the network part of the test runs."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def _oracle(x, steps, lr):
    """The shaped test's model, trained in this process: losses and final parameters."""
    l1, l2 = _linear(1, 32, 16), _linear(2, 16, 4)
    opt = torch.optim.SGD([*l1.parameters(), *l2.parameters()], lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = l2(l1(x)).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [l1.weight, l1.bias, l2.weight, l2.bias]


def _body_shaped(ctx, x, steps, lr):
    warm = threading.Thread(target=_warm_optimizers)
    warm.start()
    if ctx.rank != 0:
        warm.join(120)
        return None
    big = torch.randn(1 << 17)  # 512 KB: same-host workers would copy it by cross-memory attach
    assert torch.equal(rpc_core.rpc_sync(1, torch.add, args=(x, 1)), x + 1)
    futs = [rpc_core.rpc_async(2, torch.mul, args=(x, i)) for i in range(40)]
    assert all(torch.equal(f.wait(), x * i) for i, f in enumerate(futs))
    assert torch.equal(rpc_core.rpc_sync(1, _echo, args=(big,)), big)
    rref = rpc_core.remote(1, torch.add, args=(x, 2))
    assert torch.equal(rref.to_here(), x + 2)
    assert torch.equal(rpc_core.rpc_sync(2, _echo, args=(rref,)).to_here(), x + 2)  # user -> user fork
    round_trips = []
    for _ in range(5):
        start = time.monotonic()
        rpc_core.rpc_sync(1, _whoami)
        round_trips.append(time.monotonic() - start)
    # Two shards of a model (32 -> 16 -> 4), distributed backward and optimizer.
    m1 = rpc_core.remote(1, _linear, args=(1, 32, 16))
    m2 = rpc_core.remote(2, _linear, args=(2, 16, 4))
    opt = DistributedOptimizer(
        torch.optim.SGD,
        rpc_core.rpc_sync(1, _param_rrefs, args=(m1,)) + rpc_core.rpc_sync(2, _param_rrefs, args=(m2,)),
        lr=lr,
    )
    losses = []
    for _ in range(steps):
        with dist_autograd.context() as cid:
            loss = m2.rpc_sync().forward(m1.rpc_sync().forward(x)).pow(2).mean()  # (64, 4) -> scalar
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
        losses.append(loss.item())
    l1, l2 = m1.to_here(), m2.to_here()
    transports = [_transport()] + [rpc_core.rpc_sync(r, _transport) for r in (1, 2)]
    warm.join(120)
    params = [p.tolist() for p in (l1.weight, l1.bias, l2.weight, l2.bias)]  # tensors would travel by shared memory
    return transports, losses, params, min(round_trips)


@pytest.mark.timeout(120)
def test_calls_rrefs_autograd_and_optimizer_on_a_slow_lossy_network_match_one_process(net):
    net.shape(loss=0.01, delay=0.005, jitter=0.001, rate="200mbit")
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    transports, losses, params, round_trip = run_hosts(net, _body_shaped, 3, args=(x, 3, 0.05), timeout=100)[0]
    want_losses, want_params = _oracle(x, 3, 0.05)
    assert losses == pytest.approx(want_losses, rel=1e-5, abs=1e-7)
    for got, want in zip(params, want_params, strict=True):
        assert torch.allclose(torch.tensor(got), want, atol=1e-6)
    # Every connection TCP, none by cross-memory attach, on every worker: between hosts
    # neither the Unix socket nor the memory probe may succeed.
    for connections, unix, cma, cma_bytes in transports:
        assert connections >= 1 and unix == 0 and cma == 0 and cma_bytes == 0, (connections, unix, cma, cma_bytes)
    assert net.relayed_connections() >= 3
    assert round_trip >= 0.008, round_trip  # 5 +- 1 ms each way: the relays delayed the bytes


# -- a link cut longer than the heartbeat timeout --------------------------------------------------
def _body_long_cut(ctx):
    if ctx.rank == 1:
        held = rpc_core.rpc_async(0, _block, timeout=0)  # in flight across the cut, no timeout
        rpc_core.rpc_sync(0, _set_ready)
        outcome = _outcome(held.wait)
        _wait_ready()  # until worker0 healed the link
        return outcome
    _wait_ready()
    rref = rpc_core.remote(1, torch.ones, args=(3,))
    rref.to_here()
    with dist_autograd.context() as cid:
        w = torch.ones(3, requires_grad=True)
        h = rpc_core.rpc_sync(1, torch.mul, args=(w, 2))
        held = rpc_core.rpc_async(1, _block, timeout=0)
        control("cut", 0, 1)
        start = time.monotonic()
        outcomes = _concurrently(
            [
                held.wait,
                lambda: rref.to_here(timeout=0),
                lambda: rpc_core.rpc_sync(1, _whoami, timeout=0),
                lambda: dist_autograd.backward(cid, [h.sum()]),
            ]
        )
        seconds = time.monotonic() - start
    control("heal")
    after = rpc_core.rpc_sync(1, _whoami), rref.to_here().tolist()  # a new connection, same workers
    rpc_core.rpc_sync(1, _open_gate)
    rpc_core.rpc_sync(1, _set_ready)
    _gate.set()
    return outcomes, seconds, after


@pytest.mark.timeout(90)
def test_a_cut_longer_than_the_heartbeat_fails_pending_calls_by_name_and_a_new_call_reconnects(net):
    (outcomes, seconds, after), peer_outcome = run_hosts(
        net, _body_long_cut, 2, timeout=40, options={"heartbeat_timeout": HEARTBEAT}
    )
    _assert_unavailable(outcomes, "worker1", 1.5 * HEARTBEAT + SLACK)
    _assert_unavailable([peer_outcome], "worker0", 1.5 * HEARTBEAT + SLACK + 5)
    assert seconds >= HEARTBEAT * 0.9  # not before the timeout
    assert after == ("worker1", [1.0, 1.0, 1.0])


# -- a link cut shorter than the heartbeat timeout ---------------------------------------------------
def _body_short_cut(ctx, outage):
    if ctx.rank == 1:
        held = rpc_core.rpc_async(0, _block, timeout=0)  # answered during the outage
        rpc_core.rpc_sync(0, _set_ready)
        return held.wait()
    _wait_ready()
    rpc_core.rpc_sync(1, _whoami)  # connected before the cut (a dial would wait for the heal)
    control("link_down", 1)
    _gate.set()  # the answer to worker1's call leaves while its link is down
    futs = [rpc_core.rpc_async(1, _add_one, timeout=0) for _ in range(20)]
    sync = [None]
    t = threading.Thread(target=lambda: sync.__setitem__(0, rpc_core.rpc_sync(1, _whoami, timeout=0)))
    t.start()
    time.sleep(outage)  # the outage itself
    control("heal")
    for f in futs:
        f.wait()
    t.join(60)
    return sync[0], rpc_core.rpc_sync(1, _counted)


@pytest.mark.timeout(60)
def test_a_cut_shorter_than_the_heartbeat_loses_nothing_and_runs_nothing_twice(net):
    heartbeat = 5.0  # well past the outage plus TCP's retransmission backoff (1.4 s for a 1 s outage)
    (sync, counted), held = run_hosts(
        net, _body_short_cut, 2, args=(1.0,), timeout=50, options={"heartbeat_timeout": heartbeat}
    )
    assert sync == "worker1" and held == "worker0"
    assert counted == 20  # each call ran once


# -- frozen peers ---------------------------------------------------------------------------------
def _body_frozen(ctx):
    if ctx.rank == 1:
        held = rpc_core.rpc_async(0, _block, timeout=0)  # in flight while this worker is stopped
        rpc_core.rpc_sync(0, _set_ready)
        answer = held.wait()  # after SIGCONT: nothing lost
        _wait_ready()
        return answer
    _wait_ready()
    rref = rpc_core.remote(1, torch.ones, args=(3,))
    rref.to_here()
    with dist_autograd.context() as cid:
        w = torch.ones(3, requires_grad=True)
        h = rpc_core.rpc_sync(1, torch.mul, args=(w, 2))
        control("stop", 1)
        try:
            outcomes = _concurrently(
                [
                    lambda: rpc_core.rpc_sync(1, _whoami, timeout=0),
                    lambda: rref.to_here(timeout=0),
                    lambda: dist_autograd.backward(cid, [h.sum()]),
                ]
            )
            _gate.set()  # answers worker1's call: the answer waits in the network for it
        finally:
            control("cont", 1)
    after = rpc_core.rpc_sync(1, _whoami)
    rpc_core.rpc_sync(1, _set_ready)
    return outcomes, after


@pytest.mark.timeout(90)
def test_a_frozen_peer_fails_calls_without_timeout_by_name_and_loses_nothing_once_resumed(net):
    (outcomes, after), answer = run_hosts(net, _body_frozen, 2, timeout=80, options={"heartbeat_timeout": HEARTBEAT})
    _assert_unavailable(outcomes, "worker1", 1.5 * HEARTBEAT + SLACK)
    assert after == "worker1"
    assert answer == "worker0"  # its own call, answered while it was stopped


def _body_frozen_shutdown(ctx):
    if ctx.rank == 1:
        _wait_ready()  # stopped meanwhile, then killed
        return None
    if ctx.rank == 0:
        rpc_core.rpc_sync(1, _whoami)
        control("stop", 1)
        rpc_core.rpc_sync(2, _set_ready)
    else:
        _wait_ready()
    # A member of the shutdown round is stopped: every worker's shutdown still ends, naming it.
    kind, message, seconds = _outcome(rpc_core.shutdown)
    if ctx.rank == 0:
        control("kill", 1)
    return kind, message, seconds


@pytest.mark.timeout(90)
def test_shutdown_ends_naming_a_peer_that_stays_frozen(net):
    results = run_hosts(
        net, _body_frozen_shutdown, 3, timeout=80, may_die={1}, options={"heartbeat_timeout": HEARTBEAT}
    )
    for kind, message, seconds in (results[0], results[2]):
        assert kind == "RpcError" and "worker 'worker1'" in message, (kind, message)
        assert seconds < 1.5 * HEARTBEAT + SLACK + 5, seconds  # rank 0 waits up to 5 s for peers to close


# -- a killed peer ---------------------------------------------------------------------------------
def _body_killed(ctx):
    if ctx.rank == 1:
        rpc_core.rpc_async(0, _block, timeout=0)  # in flight when this worker is killed
        rpc_core.rpc_sync(0, _set_ready)
        _wait_ready()  # killed meanwhile
        return None
    _wait_ready()
    held = rpc_core.rpc_async(1, _block, timeout=0)
    rpc_core.rpc_sync(1, _whoami)
    control("kill", 1)
    failed = _outcome(held.wait)
    _gate.set()  # let the call of the dead worker end
    return failed, _outcome(rpc_core.shutdown)


@pytest.mark.timeout(60)
def test_a_killed_peer_fails_calls_at_once_by_name_and_shutdown_is_bounded(net):
    (failed, shutdown), _ = run_hosts(net, _body_killed, 2, timeout=50, may_die={1})
    kind, message, seconds = failed
    assert kind == "WorkerUnavailableError" and "worker 'worker1'" in message, failed
    assert seconds < SLACK, failed  # the reset crosses the network: no heartbeat needed
    kind, message, seconds = shutdown
    assert kind == "RpcError" and "worker1" in message and seconds < SLACK + 5, shutdown


# -- bad input from another host -------------------------------------------------------------------
def _body_idle_client(ctx, deadline):
    if ctx.rank == 1:
        os.environ["RPC_CORE_HANDSHAKE_TIMEOUT"] = str(deadline)
    ctx.init()
    if ctx.rank == 1:
        _wait_ready()
        return None
    address = tuple(rpc_core.api.current_agent().roster.addresses[1])
    with socket.create_connection(address, timeout=30) as s:  # connects, then says nothing
        start = time.monotonic()
        s.settimeout(deadline + 10)
        try:
            while s.recv(4096):  # the worker's HELLO, then its end
                pass
        except (ConnectionResetError, TimeoutError):
            pass
        closed_after = time.monotonic() - start
    assert rpc_core.rpc_sync(1, _whoami) == "worker1"
    rpc_core.rpc_sync(1, _set_ready)
    return closed_after


@pytest.mark.timeout(120)
def test_garbage_wrong_secrets_truncated_frames_and_huge_lengths_from_another_host_are_dropped(net):
    # The loopback tests' bodies, run across hosts: each also checks that the worker keeps
    # serving its real peer and did not allocate what the frames claimed.
    assert run_hosts(net, test_agent._body_garbage, 2, timeout=80) == [True, None]
    assert run_hosts(net, test_agent._body_wrong_secret, 2, timeout=80) == [True, None]


@pytest.mark.timeout(120)
def test_silent_and_trickling_unauthenticated_clients_on_another_host_are_closed_at_the_deadline(net):
    deadline = 1.5
    closed_after, _ = run_hosts(net, _body_idle_client, 2, args=(deadline,), init=False, timeout=60)
    assert deadline * 0.9 <= closed_after < deadline + SLACK, closed_after
    (unauthenticated, identity), _ = run_hosts(
        net, test_handshake._body_trickle, 2, args=(deadline,), init=False, timeout=60
    )
    assert unauthenticated is not None and unauthenticated < deadline + 4
    assert identity is not None and identity < deadline + 4
