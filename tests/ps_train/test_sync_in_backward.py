"""Sync mode with the update in the backward (``SyncMode.in_backward``, ps_train/modes/sync.py):
each trainer's gradients are taken at once and its answer goes back before the round is
applied; the contribution that completes the round leaves its application for after its
answer (``ModeServer.after_answer``), and ``applied`` tells a trainer when it is done. The
mode runs here against a stand-in server whose ``after_answer`` keeps the work for the test
to run; the whole path, bit for bit against one process, is in test_reproducibility.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from ps_train.modes import make_mode
from ps_train.modes.base import UpdateRequest
from ps_train.modes.sync import SyncMode
from ps_train.roles.trainer import update_in_backward
from tests.ps_train._app import make_cfg
from tests.ps_train._mode_server import StandInServer


@dataclass
class Server(StandInServer):
    """The server side a mode sees (``ModeServer``): one parameter; ``step`` adds the gradient
    times -1 (SGD at lr 1), or raises ``fail``."""

    param: torch.Tensor = field(default_factory=lambda: torch.zeros(2))
    contexts: dict[int, dict[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    later: list[Callable[[], Any]] = field(default_factory=list)  # after_answer's work, not run yet
    fail: BaseException | None = None
    dense_params: list[torch.Tensor] = field(default_factory=list)

    def gradients(self, context_id: int) -> dict[torch.Tensor, torch.Tensor]:
        return self.contexts.pop(context_id)  # as a released context: gone once read

    def step(self, grads: Mapping[torch.Tensor, torch.Tensor], lr_factor: float = 1.0) -> None:
        if self.fail is not None:
            raise self.fail
        self.param -= grads[self.param]
        self.version += 1

    def after_answer(self, fn: Callable[[], Any]) -> None:
        self.later.append(fn)

    def hand_in(self, context_id: int, grad: float) -> None:
        self.contexts[context_id] = {self.param: torch.full((2,), grad)}

    def run_later(self) -> None:
        work, self.later = self.later, []
        for fn in work:
            fn()

    def run_shard(self, shard: int, x: torch.Tensor, trainer: int, step: int) -> torch.Tensor:
        return x + self.param


def sync(num_trainers: int) -> SyncMode:
    mode = make_mode(make_cfg())
    assert isinstance(mode, SyncMode)
    mode.num_trainers = num_trainers
    return mode


def test_answers_at_once_and_applies_the_round_after_the_last_answer() -> None:
    mode, server = sync(2), Server()
    server.hand_in(10, 1.0)
    server.hand_in(11, 3.0)
    first = mode.in_backward(server, 10, UpdateRequest(0, 0, None))
    assert first.done() and server.later == []  # answered; the round waits for trainer 1
    waiting = mode.applied(server, 0)
    assert not waiting.done()
    second = mode.in_backward(server, 11, UpdateRequest(1, 0, None))
    # Answered too, and the gradients are taken (the context may go), but nothing is applied
    # until the work left for after the answer runs.
    assert second.done() and server.contexts == {} and server.version == 0 and not waiting.done()
    server.run_later()
    assert server.version == 1 and torch.equal(server.param, torch.full((2,), -2.0))  # the mean, once
    assert waiting.wait() == 1
    assert mode.applied(server, 0).wait() == 1  # asked after the fact: at once
    # The step-1 forward ran only once round 0 was applied.
    assert torch.equal(mode.forward(server, 0, torch.zeros(2), 0, 1), torch.full((2,), -2.0))


def test_rounds_apply_in_step_order() -> None:
    mode, server = sync(1), Server()
    server.hand_in(20, 1.0)
    mode.in_backward(server, 20, UpdateRequest(0, 0, None))
    round0 = server.later.pop()
    server.hand_in(21, 10.0)
    mode.in_backward(server, 21, UpdateRequest(0, 1, None))
    round1 = server.later.pop()
    # Round 1's work, run first on another thread, waits for round 0's.
    t = threading.Thread(target=round1)
    t.start()
    t.join(0.2)
    assert t.is_alive() and server.version == 0
    round0()
    t.join(10)
    assert not t.is_alive() and server.version == 2 and mode.rounds == 2


def test_a_round_that_fails_after_its_answer_fails_whoever_waits_for_it() -> None:
    mode, server = sync(1), Server(fail=RuntimeError("optimizer broke"))
    server.hand_in(30, 1.0)
    assert mode.in_backward(server, 30, UpdateRequest(0, 0, None)).done()
    waiting = mode.applied(server, 0)
    with pytest.raises(RuntimeError, match="optimizer broke"):
        server.run_later()
    with pytest.raises(RuntimeError, match="step-0 update failed"):
        waiting.wait()
    with pytest.raises(RuntimeError, match="cannot run the step-1 forward: the step-0 update failed"):
        mode.forward(server, 0, torch.zeros(2), 0, 1)
    server.hand_in(31, 1.0)
    with pytest.raises(RuntimeError, match="cannot run the step-1 update"):
        mode.in_backward(server, 31, UpdateRequest(0, 1, None))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ((), True),  # sync: on by default
        (("mode=async",), False),
        (("mode=ssp",), False),
        (("cluster.update_in_backward=false",), False),
        (("mode=async", "cluster.update_in_backward=true"), True),
        (("model=dlrm", "data=synthetic_ctr", "model.cache_rows=10"), False),
        (("model=dlrm", "data=synthetic_ctr", "mode=hybrid"), False),
    ],
)
def test_where_the_update_rides_on_the_backward_by_default(overrides: tuple[str, ...], expected: bool) -> None:
    cfg = make_cfg(*overrides)
    assert update_in_backward(cfg, make_mode(cfg).applies_after_answer) is expected
