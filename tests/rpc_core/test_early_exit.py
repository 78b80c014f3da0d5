"""torch.futures.wait_all / collect_all return at the first failed rpc_core future
(rpc_core/agent/early_exit.py), as torch's do for its own RPC futures, and are torch's own
for every other future. In one process: the futures are completed by the test's own threads.
The same program on torch.distributed.rpc and on rpc_core: test_torch_compat.py."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import rpc_core  # noqa: F401 - importing it installs the early exit
from rpc_core.agent import early_exit
from rpc_core.agent.futures import RpcFuture, map_result, set_error

BOUND = 30.0  # s: the longest a step of these tests may take; each normally takes microseconds


class _Waiter:
    """Runs ``wait`` in a thread; records what it raised or returned, and whether ``slow``
    was done at that moment."""

    def __init__(self, wait: Any, slow: torch.futures.Future[Any]) -> None:
        self.outcome: Any = None
        self.slow_done_then: bool | None = None
        self._ended = threading.Event()

        def run() -> None:
            try:
                self.outcome = ("returned", wait())
            except Exception as e:  # noqa: BLE001 - what it raised is the finding
                self.outcome = ("raised", e)
            self.slow_done_then = slow.done()
            self._ended.set()

        threading.Thread(target=run, daemon=True).start()

    def ended(self, timeout: float = BOUND) -> bool:
        return self._ended.wait(timeout)


def test_the_functions_in_torch_futures_are_rpc_cores_and_torchs_are_kept() -> None:
    assert torch.futures.wait_all is early_exit.wait_all and torch.futures.collect_all is early_exit.collect_all
    assert early_exit.torch_wait_all.__module__ == early_exit.torch_collect_all.__module__ == "torch.futures"


@pytest.mark.parametrize("failed_first", [False, True], ids=["fails-while-waiting", "failed-before"])
def test_wait_all_raises_a_failed_call_at_once_with_its_class(failed_first: bool) -> None:
    slow, bad = RpcFuture(), RpcFuture()
    if failed_first:
        set_error(bad, ValueError("Expected error"))
    waiter = _Waiter(lambda: torch.futures.wait_all([slow, bad]), slow)
    if not failed_first:
        bad.set_exception(ValueError("Expected error"))  # as a failed call's answer completes it
    try:
        assert waiter.ended()
        kind, error = waiter.outcome
        assert kind == "raised" and type(error) is ValueError and str(error) == "Expected error"
        assert waiter.slow_done_then is False
    finally:
        slow.set_result(None)


def test_collect_all_fails_at_once_and_its_future_is_an_rpc_core_future() -> None:
    slow, bad = RpcFuture(), RpcFuture()
    combined = torch.futures.collect_all([slow, bad])
    waiter = _Waiter(combined.wait, slow)
    bad.set_exception(KeyError("k"))
    try:
        assert waiter.ended()
        kind, error = waiter.outcome
        assert kind == "raised" and type(error) is KeyError and waiter.slow_done_then is False
        # a wait on the combined future exits early too
        slow2 = RpcFuture()
        assert isinstance(combined, RpcFuture)
        with pytest.raises(KeyError):
            torch.futures.wait_all([slow2, combined])
        assert not slow2.done()
    finally:
        slow.set_result(None)


def test_without_failures_both_give_every_value_in_order() -> None:
    futs: list[torch.futures.Future[Any]] = [RpcFuture() for _ in range(3)]
    waiter = _Waiter(lambda: torch.futures.wait_all(futs), futs[0])
    combined = torch.futures.collect_all(futs)
    for i in (2, 0, 1):
        futs[i].set_result(i * 10)
    assert waiter.ended() and waiter.outcome == ("returned", [0, 10, 20])
    assert combined.wait() == futs and [f.wait() for f in combined.wait()] == [0, 10, 20]


def test_a_future_mapped_from_a_call_counts_as_a_call() -> None:
    """RRef results come as futures mapped from a call's (``map_result``): a failure of the
    call reaches wait_all through them at once too."""
    call, slow = RpcFuture(), torch.futures.Future[Any]()
    mapped = map_result(call, lambda v: v + 1)
    waiter = _Waiter(lambda: torch.futures.wait_all([slow, mapped]), slow)
    call.set_exception(ValueError("owner failed"))
    try:
        assert waiter.ended()
        assert waiter.outcome[0] == "raised" and type(waiter.outcome[1]) is ValueError
        assert waiter.slow_done_then is False
    finally:
        slow.set_result(None)


def test_a_failure_of_torchs_core_among_rpc_core_futures_is_raised_as_torch_raises_it() -> None:
    slow = RpcFuture()
    base: torch.futures.Future[Any] = torch.futures.Future()
    chained = base.then(lambda f: 1 / 0)  # a then() callback's error fails the future in torch's core
    base.set_result(None)
    waiter = _Waiter(lambda: torch.futures.wait_all([slow, chained]), slow)
    try:
        assert waiter.ended()
        kind, error = waiter.outcome
        assert kind == "raised" and isinstance(error, RuntimeError) and "ZeroDivisionError" in str(error)
        assert waiter.slow_done_then is False
    finally:
        slow.set_result(None)


class _Spy:
    def __init__(self, real: Any) -> None:
        self.real, self.calls = real, 0

    def __call__(self, futures: list[Any]) -> Any:
        self.calls += 1
        return self.real(futures)


def test_futures_that_are_not_rpc_cores_and_the_opt_out_get_torchs_own(monkeypatch: pytest.MonkeyPatch) -> None:
    wait_spy, collect_spy = _Spy(early_exit.torch_wait_all), _Spy(early_exit.torch_collect_all)
    monkeypatch.setattr(early_exit, "torch_wait_all", wait_spy)
    monkeypatch.setattr(early_exit, "torch_collect_all", collect_spy)
    plain = [torch.futures.Future[Any]() for _ in range(2)]
    for i, f in enumerate(plain):
        f.set_result(i)
    assert torch.futures.wait_all(plain) == [0, 1] and len(torch.futures.collect_all(plain).wait()) == 2
    assert (wait_spy.calls, collect_spy.calls) == (1, 1)
    monkeypatch.setenv("RPC_CORE_WAIT_ALL_EARLY", "0")
    ours = RpcFuture()
    ours.set_result(5)
    assert torch.futures.wait_all([ours]) == [5] and [f.wait() for f in torch.futures.collect_all([ours]).wait()] == [5]
    assert (wait_spy.calls, collect_spy.calls) == (2, 2)
    monkeypatch.setenv("RPC_CORE_WAIT_ALL_EARLY", "1")
    assert torch.futures.wait_all([ours]) == [5]
    assert wait_spy.calls == 2  # rpc_core's again


def test_a_finished_wait_stops_watching() -> None:
    from rpc_core.agent import futures

    before = len(futures._watchers)
    bad = RpcFuture()
    set_error(bad, ValueError("x"))
    with pytest.raises(ValueError):
        torch.futures.wait_all([bad])
    with pytest.raises(ValueError):
        torch.futures.collect_all([bad, RpcFuture()]).wait()
    assert len(futures._watchers) == before
