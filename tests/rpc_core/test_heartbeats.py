"""Heartbeats (rpc_core/agent/heartbeats.py) on loopback: a stopped peer is reported by name within
the heartbeat timeout, a live one never, however long its calls run; heartbeats go out on
idle connections only. The emulated-network cases are in test_network.py."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import rpc_core
from rpc_core import RpcBackendOptions
from rpc_core.agent import heartbeats
from tests._world import run_world, stop_process

HEARTBEAT = 0.8  # s


_beats = [0]


def _count_beats():
    """On the callee: count the heartbeat calls it answers (the caller names the function by
    its qualified name, so the callee runs whatever its module holds under that name)."""

    def counted():
        _beats[0] += 1

    heartbeats.beat = counted


def _beats_answered():
    return _beats[0]


def _pid():
    return os.getpid()


def _sleep(seconds):
    time.sleep(seconds)  # the workload: a call that runs long without a byte on its connection
    return seconds


def _spin(seconds):
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:  # the workload: pure Python holding the GIL between switches
        n += 1
    return n > 0


def _noop():
    return None


_release = threading.Event()


def _set_release():
    _release.set()


def _wait_release():
    if not _release.wait(60):
        raise TimeoutError("never released")


def _body_live(ctx):
    if ctx.rank == 1:
        _count_beats()
        _wait_release()
        return None
    # Calls that run for several heartbeat timeouts, without and with a timeout of their own.
    slept = rpc_core.rpc_sync(1, _sleep, args=(3 * HEARTBEAT,), timeout=0)
    spun = rpc_core.rpc_async(1, _spin, args=(3 * HEARTBEAT,)).wait()
    idle_beats = rpc_core.rpc_sync(1, _beats_answered)
    # A busy connection: calls back to back for several heartbeat periods carry no heartbeat.
    end = time.monotonic() + 3 * HEARTBEAT
    while time.monotonic() < end:
        rpc_core.rpc_sync(1, _noop)
    busy_beats = rpc_core.rpc_sync(1, _beats_answered) - idle_beats
    rpc_core.rpc_sync(1, _set_release)
    return slept, spun, idle_beats, busy_beats


@pytest.mark.timeout(90)
def test_a_live_peer_with_long_calls_is_never_reported_and_busy_connections_carry_no_heartbeat():
    (slept, spun, idle_beats, busy_beats), _ = run_world(_body_live, 2, options={"heartbeat_timeout": HEARTBEAT})
    assert slept == 3 * HEARTBEAT and spun
    assert idle_beats >= 2  # the long calls' connection was idle: heartbeats kept it proven alive
    assert busy_beats <= 1  # at most one that was already out when the traffic started


BUSY_HEARTBEAT = 2.0  # s: the timer looks every 0.5 s; a heartbeat needs 0.5 s without a byte
BUSY_LOOKS = 8  # looks at the busy connection (two heartbeat timeouts' worth) before it goes idle
WINDOW = 8  # calls in flight during the busy phase


def _count_sends_and_looks():
    """On the caller: count the heartbeats it sends (each one frame) and the timer's looks
    that found a connection watched (calls pending on it)."""
    agent = rpc_core._get_current_rpc_agent()
    counts = {"sent": 0, "looks": 0}
    send, tick = agent.heartbeats._send_beat, agent.heartbeats._heartbeat_tick

    def counted_send(*args):
        counts["sent"] += 1
        return send(*args)

    def counted_tick():
        tick()
        if agent.heartbeats._watches:
            counts["looks"] += 1

    agent.heartbeats._send_beat = counted_send  # the timer submits self._send_beat, looked up each time
    agent.heartbeats._heartbeat_tick = counted_tick  # the timer re-arms with self._heartbeat_tick
    return counts


def _body_busy(ctx):
    if ctx.rank == 1:
        _count_beats()
        _wait_release()
        return None
    counts = _count_sends_and_looks()
    # Busy: calls back to back, WINDOW in flight, until the timer looked BUSY_LOOKS times at
    # the connection they wait on (counted, not timed; bounded by the test's timeout).
    window = []
    calls = 0
    while counts["looks"] < BUSY_LOOKS:
        window.append(rpc_core.rpc_async(1, _noop))
        calls += 1
        if len(window) >= WINDOW:
            window.pop(0).wait()
    for f in window:
        f.wait()
    busy = counts["sent"], rpc_core.rpc_sync(1, _beats_answered), counts["looks"], calls
    # Idle: one call that runs 1.5 heartbeat timeouts, nothing received meanwhile: the same
    # counters now see heartbeats (the counting works).
    rpc_core.rpc_sync(1, _sleep, args=(1.5 * BUSY_HEARTBEAT,), timeout=0)
    idle = counts["sent"] - busy[0], rpc_core.rpc_sync(1, _beats_answered) - busy[1]
    rpc_core.rpc_sync(1, _set_release)
    return busy, idle


@pytest.mark.timeout(60)
def test_a_connection_busy_with_calls_carries_no_heartbeat_frame_and_an_idle_one_does():
    (busy, idle), _ = run_world(_body_busy, 2, options={"heartbeat_timeout": BUSY_HEARTBEAT})
    sent, answered, looks, calls = busy
    assert looks >= BUSY_LOOKS and calls > WINDOW * BUSY_LOOKS, busy
    assert (sent, answered) == (0, 0), busy  # not one heartbeat frame while answers kept coming
    sent, answered = idle
    assert sent >= 1 and answered == sent, idle  # silent for >= 2 looks: heartbeats went out, were answered


def _body_stopped(ctx):
    if ctx.rank == 1:
        _wait_release()  # stopped, resumed, then released
        return None
    pid = rpc_core.rpc_sync(1, _pid)
    stop_process(pid)
    try:
        start = time.monotonic()
        try:
            rpc_core.rpc_sync(1, _noop, timeout=0)
            error = None
        except rpc_core.WorkerUnavailableError as e:
            error = str(e)
        seconds = time.monotonic() - start
    finally:
        os.kill(pid, signal.SIGCONT)
    after = rpc_core.rpc_sync(1, _pid) == pid  # the same worker, reconnected
    rpc_core.rpc_sync(1, _set_release)
    return error, seconds, after


@pytest.mark.timeout(60)
def test_a_stopped_peer_fails_a_call_without_timeout_by_name_within_the_heartbeat_timeout():
    (error, seconds, after), _ = run_world(_body_stopped, 2, options={"heartbeat_timeout": HEARTBEAT})
    assert error is not None and "worker 'worker1' (rank 1) sent nothing for" in error, error
    assert "heartbeat" in error and "RPC_CORE_HEARTBEAT_TIMEOUT" in error, error
    assert HEARTBEAT * 0.9 <= seconds < 1.5 * HEARTBEAT + 3, seconds
    assert after


def test_heartbeat_timeout_option_and_variable(monkeypatch):
    monkeypatch.delenv("RPC_CORE_HEARTBEAT_TIMEOUT", raising=False)
    assert RpcBackendOptions().effective_heartbeat_timeout() == 30.0
    monkeypatch.setenv("RPC_CORE_HEARTBEAT_TIMEOUT", "0")
    assert RpcBackendOptions().effective_heartbeat_timeout() == 0.0  # off
    assert RpcBackendOptions(heartbeat_timeout=2.5).effective_heartbeat_timeout() == 2.5
    monkeypatch.setenv("RPC_CORE_HEARTBEAT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="RPC_CORE_HEARTBEAT_TIMEOUT='soon': expected"):
        RpcBackendOptions().effective_heartbeat_timeout()
    for bad in (-1, float("inf"), "5", True):
        with pytest.raises(ValueError, match="heartbeat_timeout must be a number of seconds >= 0"):
            RpcBackendOptions(heartbeat_timeout=bad)
