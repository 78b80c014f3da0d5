"""mode=hybrid: dense parameters in sync rounds, table rows async with bounded staleness.

The protocol on one server (a stand-in that records the optimizer steps it is asked for),
then whole runs: one trainer equals ``mode=sync`` bit for bit, two trainers with frozen
tables equal the plain-torch sync reference (so the dense parameters are averaged in
rounds), and a real two-trainer run learns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from ps_train.checkpoint.files import latest_checkpoint, load_checkpoint
from ps_train.config import Config, ConfigError, ModeConfig, validate
from ps_train.modes import make_mode
from ps_train.modes.hybrid import HybridMode
from tests.ps_train._app import make_cfg, run_app, saved_tables, scalars
from tests.ps_train._mode_server import StandInServer
from tests.ps_train.test_dlrm import ATOL, SMALL, assert_losses_close, reference_run


@dataclass
class StepCall:
    grads: dict[str, torch.Tensor]  # parameter name -> gradient it was stepped with
    lr_factor: float


@dataclass
class FakeServer(StandInServer):
    """The server side a mode sees (``ps_train.modes.base.ModeServer``), with one dense
    parameter and one table; ``step`` records its calls instead of changing anything."""

    dense: torch.Tensor = field(default_factory=lambda: torch.zeros(2))
    table: torch.Tensor = field(default_factory=lambda: torch.zeros(3, 2))
    contexts: dict[int, dict[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    steps: list[StepCall] = field(default_factory=list)

    def after_answer(self, fn: Callable[[], Any]) -> None:
        raise AssertionError("hybrid mode answers its updates once applied")

    @property
    def dense_params(self) -> Sequence[torch.Tensor]:
        return [self.dense]

    def gradients(self, context_id: int) -> dict[torch.Tensor, torch.Tensor]:
        return self.contexts[context_id]

    def step(self, grads: Mapping[torch.Tensor, torch.Tensor], lr_factor: float = 1.0) -> None:
        names = {id(self.dense): "dense", id(self.table): "table"}
        self.steps.append(StepCall({names[id(p)]: g for p, g in grads.items()}, lr_factor))
        self.version += 1

    def hand_in(self, context_id: int, dense: float, row: float) -> None:
        self.contexts[context_id] = {self.dense: torch.full((2,), dense), self.table: torch.full((3, 2), row)}


def hybrid(num_trainers: int, staleness: int = 0) -> HybridMode:
    mode = make_mode(make_cfg("model=dlrm", "data=synthetic_ctr", "mode=hybrid", f"mode.staleness={staleness}"))
    assert isinstance(mode, HybridMode)
    mode.num_trainers = num_trainers
    return mode


def test_rows_apply_on_arrival_dense_once_per_round_averaged() -> None:
    mode, server = hybrid(2), FakeServer()
    server.hand_in(10, dense=1.0, row=5.0)  # trainer 0's step-0 gradients
    server.hand_in(11, dense=3.0, row=7.0)  # trainer 1's
    rows = torch.ones(1, 2)
    for trainer in (0, 1):
        mode.lookup(server, lambda: rows, trainer, 0)
    second = mode.update(server, 11, 1, 0, None)
    # Trainer 1's rows are stepped at once, alone; its answer waits for the dense round.
    assert [(list(c.grads), c.lr_factor) for c in server.steps] == [(["table"], 1.0)]
    assert torch.equal(server.steps[0].grads["table"], torch.full((3, 2), 7.0))
    assert not second.done()
    first = mode.update(server, 10, 0, 0, None)
    # Then trainer 0's rows (one table update since its lookup: staleness 1, full rate),
    # then the round: the mean of both dense gradients, once.
    assert [list(c.grads) for c in server.steps] == [["table"], ["table"], ["dense"]]
    assert torch.equal(server.steps[1].grads["table"], torch.full((3, 2), 5.0))
    assert torch.equal(server.steps[2].grads["dense"], torch.full((2,), 2.0))
    assert first.wait() == 1 and second.wait() == 0
    assert mode.rounds == 1 and mode.stats()["max_staleness"] == 1


def test_lookups_wait_for_the_other_trainers_rows_within_the_bound() -> None:
    for bound, waits in ((0, True), (1, False)):
        mode, server = hybrid(2, staleness=bound), FakeServer()
        server.hand_in(10, dense=1.0, row=1.0)
        server.hand_in(11, dense=1.0, row=1.0)
        mode.lookup(server, lambda: torch.ones(1), 0, 0)
        mode.lookup(server, lambda: torch.ones(1), 1, 0)
        mode.update(server, 10, 0, 0, None)  # trainer 0's step 0 is in; trainer 1's is not
        read = threading.Event()
        t = threading.Thread(target=_lookup_then_set, args=(mode, server, read))
        t.start()
        # Bound 0: trainer 0's step-1 lookup must see trainer 1's step-0 rows, so it waits for
        # them; bound 1 lets it run one step behind the other trainer.
        assert read.wait(0.5 if waits else 10) is not waits
        mode.update(server, 11, 1, 0, None)
        t.join(10)
        assert read.is_set() and not t.is_alive()


def _lookup_then_set(mode: HybridMode, server: FakeServer, read: threading.Event) -> None:
    """Trainer 0's step-1 lookup; ``read`` is set once it read its rows."""

    def rows() -> torch.Tensor:
        read.set()
        return torch.ones(1)

    mode.lookup(server, rows, 0, 1)


def test_hybrid_needs_tables_and_a_nonnegative_bound() -> None:
    with pytest.raises(ConfigError, match=r"mode=hybrid splits dense parameters from embedding tables, and model=mlp"):
        validate(Config(mode=ModeConfig(name="hybrid")))
    with pytest.raises(ConfigError, match=r"mode.staleness: -1 must be >= 0 in hybrid mode"):
        make_cfg("model=dlrm", "data=synthetic_ctr", "mode=hybrid", "mode.staleness=-1")
    with pytest.raises(ConfigError, match=r"cluster.elastic=true needs .*got mode=hybrid"):
        make_cfg("model=dlrm", "data=synthetic_ctr", "mode=hybrid", "cluster.elastic=true")


@pytest.mark.timeout(240)
def test_one_trainer_hybrid_is_sync_bit_for_bit(tmp_path: Path) -> None:
    run = (
        *SMALL,
        "cluster.num_trainers=1",
        "train.steps=8",
        "optim=sgd",
        "model.table_optim=adagrad",
        "checkpoint.every=8",
        "checkpoint.keep=0",
    )
    sync = run_app(tmp_path / "sync", *run, "mode=sync", timeout=120)
    hyb = run_app(tmp_path / "hybrid", *run, "mode=hybrid", "mode.staleness=2", timeout=120)
    assert hyb["losses"] == sync["losses"]
    ta, tb = saved_tables(tmp_path / "sync"), saved_tables(tmp_path / "hybrid")
    a, b = (load_checkpoint(str(latest_checkpoint(tmp_path / run_dir)))[1] for run_dir in ("sync", "hybrid"))
    for server in ("ps0", "ps1"):
        for column, x in ta[server].items():  # the tables' rows and their optimizer state
            assert torch.equal(x, tb[server][column]), f"{server} {column}"
        for shard, sd in a[server]["shards"].items():
            for key, x in sd.items():
                assert torch.equal(x, b[server]["shards"][shard][key]), f"{server} shard {shard} {key}"
    assert hyb["max_staleness"] == 0 and hyb["mode"] == "hybrid"


@pytest.mark.timeout(240)
def test_two_trainers_dense_parameters_follow_sync_rounds(tmp_path: Path) -> None:
    # Tables frozen: a rate of 1e-30 moves no float32 row (|row| >= 1e-9 unless 0), so every
    # lookup reads the initial rows whatever the order of the async row updates, and the
    # dense parameters must then follow the plain-torch sync reference: the mean of both
    # trainers' gradients, once per step. A dense update per trainer (async) or a sum would
    # not; neither would a round that left one trainer's gradient out.
    steps = 8
    run = (
        *SMALL,
        "cluster.num_trainers=2",
        f"train.steps={steps}",
        "optim=sgd",
        "model.table_optim=sgd",
        "model.table_lr=1e-30",
        "mode=hybrid",
        "mode.staleness=1",
    )
    got = run_app(tmp_path, *run, timeout=120)
    want, _ = reference_run(make_cfg(*run), steps)
    assert_losses_close(got["losses"], want, ATOL)


@pytest.mark.timeout(240)
def test_two_trainers_hybrid_learns_and_reports_staleness(tmp_path: Path) -> None:
    steps = 40
    m = run_app(
        tmp_path,
        *SMALL,
        "mode=hybrid",
        "mode.staleness=1",
        f"train.steps={steps}",
        "train.batch_size=64",
        "model.table_lr=0.2",
        timeout=150,
    )
    # Per step and server: every trainer's rows on their own, the dense parameters once.
    assert m["server_updates"] == [3 * steps, 3 * steps]  # ps0: the bottom MLP, ps1: the top
    assert 0.5 < m["test_auc"] <= 1.0 and m["test_best_auc"] > m["test_auc"] - 0.05
    assert m["test_log_loss"] < m["test_base_log_loss"] + 0.05
    assert 0 <= m["max_staleness"] <= 3
    tags = scalars(tmp_path / "tb" / "trainer0")
    assert {"train/staleness", "train/table_lr_scale", "test/auc"} <= set(tags)
    assert m["rows_pulled_per_step"] > 0
