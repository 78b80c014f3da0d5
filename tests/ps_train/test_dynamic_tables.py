"""Dynamic embedding tables (``model.tables[i].kind=dynamic``): rows keyed by raw ids, created
on first use, admitted after k sightings, evicted by LRU or TTL.

- a sync run equals one process of plain torch whose table holds, for every id, the row the
  dynamic initialiser gives it (an ``nn.EmbeddingBag`` over the ids' range);
- ``DynamicTable``'s admission and eviction equal a plain Python model of the policy, step by step;
- a server's reused slot gets the new id's initial row and fresh optimizer state;
- a checkpointed and resumed run equals the uninterrupted one, bit for bit;
- bad declarations are config errors that say what to change.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from ps_train.checkpoint.files import latest_checkpoint
from ps_train.checkpoint.protocol import load_resume_state
from ps_train.checkpoint.rows_file import load_rows
from ps_train.config import Config, ConfigError, CriteoConfig, CtrDataConfig, DLRMConfig, SyntheticCtrConfig
from ps_train.launch.rank import table_settings
from ps_train.workloads.ctr.data import CtrSplit
from ps_train.workloads.ctr.data.loading import load_ctr_data
from ps_train.workloads.ctr.model import DLRM
from ps_train.workloads.ctr.tables.dynamic import DynamicSpec, DynamicTable
from ps_train.workloads.ctr.tables.dynamic_storage import DynamicStorage
from ps_train.workloads.ctr.tables.fused_storage import FusedStorage
from ps_train.workloads.ctr.tables.rows import FusedLayout, dynamic_init_rows, dynamic_owner
from ps_train.workloads.ctr.tables.service import TableServer
from tests.ps_train._app import make_cfg, run_app, scalars
from tests.ps_train.test_dlrm import ATOL, SMALL, _criteo_file, assert_losses_close, reference_run

# Three tables: fixed a (40 rows), dynamic b (ids 0..299), fixed c (7 rows).
TABLES = (
    "model.tables=[{name: a, num_embeddings: 40},"
    " {name: b, num_embeddings: 300, kind: dynamic, max_rows: %d, admit_after: %d, eviction: %s%s},"
    " {name: c, num_embeddings: 7, pooling: %s}]"
)
BASE = tuple(o for o in SMALL if not o.startswith(("data.table_sizes", "data.num_tables", "data.table_rows")))


def tables(max_rows: int = 400, admit_after: int = 1, eviction: str = "lru", ttl: int | None = None) -> str:
    return TABLES % (max_rows, admit_after, eviction, f", ttl_steps: {ttl}" if ttl else "", "sum")


def dynamic_rows(run_dir: Path, cfg: Config, t: int) -> dict[int, dict[str, torch.Tensor]]:
    """Table ``t``'s rows in the run's latest checkpoint, by id: every column (weight, optimizer state)."""
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None
    assert isinstance(cfg.model, DLRMConfig) and isinstance(cfg.data, CtrDataConfig)
    S = cfg.cluster.num_servers
    dyn = [int(cfg.model.tables[u].max_rows or 0) for u in range(len(cfg.model.tables))]
    layout = FusedLayout(cfg.model.table_sharding, tuple(cfg.data.sizes()), S, tuple(dyn))
    out: dict[int, dict[str, torch.Tensor]] = {}
    for s in range(S):
        state = load_resume_state(str(ckpt), f"ps{s}")["servers"][f"ps{s}"]["tables"]
        columns = load_rows(state["rows_files"])
        slot_ids = state["dynamic"][t]["slot_ids"]
        held = torch.nonzero(slot_ids >= 0).squeeze(1)
        base = layout.row_offsets(s)[t]
        for slot, x in zip(held.tolist(), slot_ids[held].tolist(), strict=True):
            assert int(dynamic_owner(torch.tensor([x]), S)) == s, f"id {x} held by ps{s}, not its owner"
            assert x not in out, f"id {x} has two rows"
            out[x] = {name: col[base + slot] for name, col in columns.items()}
    return out


def oracle(
    cfg: Config, steps: int, dynamic: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, list[float]], DLRM]:
    """``reference_run`` with table ``dynamic`` initialised as the dynamic initialiser does:
    one row per id the data can draw (its ``num_embeddings``), each id's initial row."""
    original = DLRM.__init__

    def init(self: DLRM, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        w = self.table_weights()[dynamic]
        with torch.no_grad():
            w.copy_(dynamic_init_rows(cfg.seed, dynamic, w.shape[0], w.shape[1], torch.arange(w.shape[0])))

    with monkeypatch.context() as m:
        m.setattr(DLRM, "__init__", init)
        return reference_run(cfg, steps)


def fused(server: TableServer) -> tuple[DynamicStorage, FusedStorage]:
    """A server's dynamic storage and the fused storage under it."""
    assert isinstance(server.storage, DynamicStorage) and isinstance(server.storage.inner, FusedStorage)
    return server.storage, server.storage.inner


def table_server(*overrides: str) -> tuple[TableServer, Config, DLRMConfig]:
    """Server 0's tables of a one-server config, built in this process."""
    cfg = make_cfg(*BASE, "cluster.num_servers=1", "cluster.num_trainers=1", *overrides)
    assert isinstance(cfg.model, DLRMConfig) and isinstance(cfg.data, CtrDataConfig)
    return TableServer(cfg.model, cfg.data, table_settings(cfg), 0), cfg, cfg.model


@pytest.mark.timeout(180)
@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
@pytest.mark.parametrize(
    "setup",
    [
        ("cluster.num_trainers=2", "model.table_optim=adagrad", tables()),
        # Multi-hot: table b's bags of up to 20 ids are pooled on the servers (marker rows in bags).
        (
            "cluster.num_trainers=1",
            "model.table_optim=rowwise_adagrad",
            "data.bag_sizes=[3,20,1]",
            "data.bag_size_dist=uniform",
            TABLES % (3000, 1, "lru", "", "mean"),
        ),
    ],
    ids=["one-hot-2trainers", "multi-hot-pooled"],
)
def test_sync_run_equals_plain_torch_with_the_same_initial_rows(
    tmp_path: Path, setup: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = 8
    overrides = (*BASE, "cluster.num_servers=2", "optim=sgd", "mode=sync", f"train.steps={steps}", *setup)
    metrics = run_app(tmp_path, *overrides, timeout=120)
    cfg = make_cfg(*overrides)
    losses, model = oracle(cfg, steps, 1, monkeypatch)
    assert_losses_close(metrics["losses"], losses, ATOL)
    want = model.table_weights()[1].detach()
    got = dynamic_rows(tmp_path, cfg, 1)
    assert got, "no dynamic rows were created"
    for x, cols in got.items():
        torch.testing.assert_close(cols["weight"], want[x], atol=ATOL, rtol=0, msg=f"id {x}")
    # Every id a batch used got a row (admit_after=1, no eviction), and nothing else.
    assert sum(metrics["dynamic_rows_live"].values()) == len(got)
    assert sum(metrics["dynamic_rows_created"].values()) == len(got)
    assert sum(metrics["dynamic_rows_evicted"].values()) == 0
    assert sum(metrics["dynamic_rows_admitted"].values()) == len(got)
    for s in ("ps0", "ps1"):  # the servers' TensorBoard folders
        tags = scalars(tmp_path / "tb" / s)
        assert tags["server/dynamic_rows_live"][-1][1] == metrics["dynamic_rows_live"][s]
        assert "server/dynamic_rows_created" in tags and "server/dynamic_rows_evicted" in tags


# -- the policy, against a plain Python model ---------------------------------------------------


class PolicyModel:
    """What ``DynamicTable`` should do, written plainly: ids -> last step used."""

    def __init__(self, spec: DynamicSpec) -> None:
        self.spec = spec
        self.rows: dict[int, int] = {}
        self.counts: dict[int, tuple[int, int]] = {}
        self.pending: dict[int, set[int]] = {}
        self.clock = 0

    def _lru(self, candidates: list[int], k: int) -> list[int]:
        return sorted(candidates, key=lambda x: (self.rows[x], x))[:k]

    def advance(self, step: int) -> None:
        for x, trainers in self.pending.items():
            if x not in self.rows:
                self.counts[x] = (self.counts.get(x, (0, 0))[0] + len(trainers), self.clock)
        self.pending = {}
        if len(self.counts) > self.spec.max_rows:
            old = sorted(self.counts, key=lambda x: (self.counts[x][1], x))
            for x in old[: len(old) - self.spec.max_rows // 2]:
                del self.counts[x]
        self.clock = step
        if self.spec.eviction == "ttl":
            assert self.spec.ttl_steps is not None
            for x in [x for x, u in self.rows.items() if u < step - self.spec.ttl_steps]:
                del self.rows[x]
        short = self.spec.spare - (self.spec.max_rows - len(self.rows))
        for x in self._lru(list(self.rows), max(short, 0)):
            del self.rows[x]

    def lookup(self, ids: list[int], step: int, trainer: int) -> set[int]:
        admitted = []
        for x in sorted(set(ids)):
            if x in self.rows:
                self.rows[x] = max(self.rows[x], step)
            elif self.counts.get(x, (0, 0))[0] + 1 >= self.spec.admit_after:
                admitted.append(x)
            else:
                self.pending.setdefault(x, set()).add(trainer)
        free = self.spec.max_rows - len(self.rows)
        if len(admitted) > free:
            old = [x for x, u in self.rows.items() if u < step]
            for x in self._lru(old, len(admitted) - free):
                del self.rows[x]
            free = self.spec.max_rows - len(self.rows)
        for x in admitted[free:]:
            self.pending.setdefault(x, set()).add(trainer)
        for x in admitted[:free]:
            self.rows[x] = step
            self.counts.pop(x, None)
        return set(self.rows)


@pytest.mark.parametrize(
    "spec",
    [
        DynamicSpec(max_rows=30, spare=8),
        DynamicSpec(max_rows=30, admit_after=3, spare=8),
        DynamicSpec(max_rows=30, admit_after=2, eviction="ttl", ttl_steps=3, spare=8),
        DynamicSpec(max_rows=12, admit_after=2, spare=0),  # out of slots mid-step: evicts at once, or refuses
    ],
    ids=["lru", "lru-admit3", "ttl-admit2", "mid-step"],
)
def test_admission_and_eviction_follow_the_policy(spec: DynamicSpec) -> None:
    rng = random.Random(0)
    table, model = DynamicTable(spec), PolicyModel(spec)
    evicted = 0
    for step in range(1, 60):
        table.advance(step)
        model.advance(step)
        for trainer in range(2):
            # Zipf-like: a few hot ids, a long tail (up to 2**62: raw 64-bit ids).
            ids = [rng.choice([1, 2, 3, 5, 8]) if rng.random() < 0.5 else rng.randrange(40) * 2**56 for _ in range(6)]
            res = table.lookup(torch.tensor(ids), step, trainer)
            want = model.lookup(ids, step, trainer)
            assert set(table.slots) == want, f"step {step} trainer {trainer}"
            for x, slot in zip(ids, res.slots.tolist(), strict=True):
                assert (slot >= 0) == (x in want), f"step {step}: id {x}"
                if slot >= 0:
                    assert int(table.slot_ids[slot]) == x
            assert set(res.created_ids.tolist()) <= want
        assert len(table.slots) <= spec.max_rows
        assert {x: c for x, (c, _) in table.counts.items()} == {x: c for x, (c, _) in model.counts.items()}
        evicted = table.counters().evicted
    assert evicted > 0, "the stream never filled the table"
    c = table.counters()
    assert c.live == len(table.slots) and c.created == c.live + c.evicted


def whole_array_lru(held: torch.Tensor, last_used: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """The LRU victims by a pass over every slot: all held slots if at most ``k`` (ascending),
    else those used before the k-th oldest step (ascending slots), then that step's by id."""
    if k <= 0:
        return torch.zeros(0, dtype=torch.int64)
    slots = torch.nonzero(held).squeeze(1)
    if len(slots) <= k:
        return slots
    order = sorted(slots.tolist(), key=lambda s: (int(last_used[s]), int(ids[s])))[:k]
    kth = int(last_used[order[-1]])
    below = sorted(s for s in order if int(last_used[s]) < kth)
    return torch.tensor(below + [s for s in order if int(last_used[s]) == kth], dtype=torch.int64)


@pytest.mark.parametrize("max_rows", [9, 30])
def test_lru_victims_from_the_use_log_equal_a_pass_over_every_slot(max_rows: int) -> None:
    """The use log (a step's rows found without scanning every slot) picks the same victims
    in the same order as a whole-array selection, with a trainer behind the clock and a log
    compacted many times over."""
    rng = random.Random(max_rows)
    spec = DynamicSpec(max_rows=max_rows, spare=4)
    table = DynamicTable(spec)
    for step in range(1, 300):
        held = table.slot_ids >= 0
        want = whole_array_lru(held, table.last_used, table.slot_ids, spec.spare - len(table.free))
        assert table.advance(step).tolist() == want.tolist(), f"step {step}"
        for trainer, behind in enumerate((0, 0, rng.randrange(3))):  # trainer 2 lags up to 2 steps
            ids = [rng.randrange(3) if rng.random() < 0.3 else rng.randrange(60) for _ in range(rng.randrange(1, 4))]
            table.lookup(torch.tensor(ids), max(1, step - behind), trainer)
    assert table.counters().evicted > 10 * max_rows


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_a_reused_slot_starts_with_the_new_ids_row_and_fresh_optimizer_state() -> None:
    server, cfg, model = table_server("model.table_optim=adagrad", tables(40))
    dyn, storage = fused(server)
    base = storage.shards.row_offsets[1]
    marker = torch.tensor([-2])  # table 1's marker row
    none = torch.zeros(0, dtype=torch.int64)

    def train(step: int, x: int) -> int:
        out = server.lookup(marker, none, None, torch.tensor([x]), step)
        out.sum().backward()
        grad = storage.shards.weight.grad
        assert grad is not None
        server.step({storage.shards.weight: grad})
        storage.shards.weight.grad = None
        return int(dyn.dynamic[1].slots[x])

    first = train(1, 1000)
    assert float(storage.optimizer.row_state()["sum.0"][base + first].sum()) > 0
    for step in range(2, 10):  # 9 rows held, 31 slots free: the next step keeps 32 free
        train(step, step)
    reused = train(10, 2000)  # so id 1000, used least recently, gives its slot up
    assert 1000 not in dyn.dynamic[1].slots and reused == first
    lr = model.table_lr or cfg.optim.lr
    want = dynamic_init_rows(cfg.seed, 1, 300, 4, torch.tensor([2000]))[0]
    # One Adagrad step from fresh state: the sum is that step's squared gradient (1) alone.
    torch.testing.assert_close(storage.optimizer.row_state()["sum.0"][base + reused], torch.ones(4))
    torch.testing.assert_close(storage.shards.weight.detach()[base + reused], want - lr / (1 + 1e-10))
    # Evaluation reads zeros for an id without a row, and creates none.
    assert torch.equal(server.read(marker, none, None, torch.tensor([123456])), torch.zeros(1, 4))
    assert 123456 not in dyn.dynamic[1].slots


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_ids_not_admitted_yet_read_zeros_and_their_gradients_are_dropped() -> None:
    server, _, _ = table_server(tables(40, admit_after=2))
    dyn, storage = fused(server)
    marker, none = torch.tensor([-2, -2]), torch.zeros(0, dtype=torch.int64)
    default = dyn.default_row
    for step, seen in ((1, False), (2, True)):  # the second batch with id 7 admits it
        out = server.lookup(marker, none, None, torch.tensor([7, 7]), step)
        assert bool((out != 0).any()) == seen
        out.sum().backward()
        grad = storage.shards.weight.grad
        assert grad is not None
        server.step({storage.shards.weight: grad})
        storage.shards.weight.grad = None
        assert torch.equal(storage.shards.weight.detach()[default], torch.zeros(4))
        assert server.rows_updated == (1 if seen else 0)
    assert server.dynamic_counts().created == 1


@pytest.mark.timeout(240)
def test_resume_with_dynamic_tables_continues_like_the_uninterrupted_run(tmp_path: Path) -> None:
    # 300 ids on 2 servers, 100 slots each, 64 kept free: rows are evicted; admitted after 2 sightings.
    cfg = (*BASE, "mode=sync", "checkpoint.every=2", "checkpoint.keep=0", tables(100, 2, "ttl", 3))
    whole = run_app(tmp_path / "whole", *cfg, "train.steps=8", timeout=120)
    run_app(tmp_path / "first", *cfg, "train.steps=4", timeout=120)
    second = run_app(tmp_path / "second", *cfg, "train.steps=8", f"resume={tmp_path / 'first'}", timeout=120)
    for trainer in ("trainer0", "trainer1"):
        assert second["losses"][trainer] == whole["losses"][trainer][4:]
    assert sum(whole["dynamic_rows_evicted"].values()) > 0
    c = make_cfg(*cfg)
    a, b = dynamic_rows(tmp_path / "whole", c, 1), dynamic_rows(tmp_path / "second", c, 1)
    assert a.keys() == b.keys()
    for x in a:
        for column in a[x]:
            assert torch.equal(a[x][column], b[x][column]), f"id {x} {column}"
    assert whole["dynamic_rows_live"] == second["dynamic_rows_live"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ("data.table_sizes=[40,300,8]",),
            r"data.table_sizes: model.tables declares the tables; drop data.table_sizes",
        ),
        (("model.pooling=[mean]",), r"model.pooling: model.tables declares the tables; drop model.pooling"),
        (
            ("model.tables=[{name: a, num_embeddings: 40, embedding_dim: 8}]",),
            r"model.tables\[0\].embedding_dim: 8, but every table row is model.embedding_dim=4",
        ),
        (("model.tables=[{name: a, num_embeddings: 40, kind: dynamic}]",), r"model.tables\[0\].max_rows: a dynamic"),
        (
            ("model.tables=[{name: a, num_embeddings: 40, kind: dynamic, max_rows: 99, eviction: ttl}]",),
            r"model.tables\[0\].ttl_steps: eviction=ttl needs",
        ),
        (
            ("model.tables=[{name: a, num_embeddings: 40, max_rows: 10}]",),
            r"model.tables\[0\].max_rows: only dynamic tables take it; drop it or set model.tables\[0\].kind=dynamic",
        ),
        (("model.tables=[{name: a, num_embeddings: 40, kind: hashed}]",), r"model.tables\[0\].kind: unknown 'hashed'"),
        (
            ("model.tables=[{name: a, num_embeddings: 40}, {name: a, num_embeddings: 9}]",),
            r"model.tables: table names \['a', 'a'\] repeat",
        ),
        (
            ("model.tables=[{name: a, num_embeddings: 40, feature_names: [x, y]}]",),
            r"feature_names: \['x', 'y'\]: ps_train gives each table one feature",
        ),
        (("checkpoint.differential=true",), r"checkpoint.differential: differential checkpoints do not hold dynamic"),
        (("model.cache_rows=10",), r"model.cache_rows: the trainers' row cache"),
        (
            ("model.tables=[{name: a, num_embeddings: 40, kind: dynamic, max_rows: 50}]",),
            r"model.tables\[0\].max_rows: 50 slots per server cannot hold one step's new ids.*= 64",
        ),
    ],
)
def test_table_declarations_are_checked(overrides: tuple[str, ...], message: str) -> None:
    has_tables = any(o.startswith("model.tables=") for o in overrides)
    with pytest.raises(ConfigError, match=message):
        make_cfg(*BASE, *([] if has_tables else [tables()]), *overrides)


def test_declared_tables_set_the_sizes_poolings_and_features() -> None:
    cfg = make_cfg(*BASE, tables())
    assert isinstance(cfg.model, DLRMConfig) and isinstance(cfg.data, CtrDataConfig)
    assert cfg.data.sizes() == [40, 300, 7]
    assert cfg.model.pooling == ["sum", "sum", "sum"] and cfg.model.feature_names == ["a", "b", "c"]
    assert cfg.model.dynamic_tables() == [1]


def test_the_data_hands_dynamic_tables_raw_ids(tmp_path: Path) -> None:
    # Criteo: the categorical's value + 1 (0: empty) instead of 1 + v % (rows - 1).
    _criteo_file(tmp_path / "day_0", 40)
    raw = load_ctr_data(CriteoConfig(root=str(tmp_path), table_rows=20), raw_ids=[0]).train
    folded = load_ctr_data(CriteoConfig(root=str(tmp_path), table_rows=20)).train
    assert isinstance(raw, CtrSplit) and isinstance(folded, CtrSplit)
    assert int(raw.ids[:, 0].max()) >= 20  # 32-bit values, not rows of 20
    assert torch.equal(torch.where(raw.ids[:, 0] > 0, 1 + (raw.ids[:, 0] - 1) % 19, 0), folded.ids[:, 0])
    assert torch.equal(raw.ids[:, 1:], folded.ids[:, 1:])
    # Synthetic: data.drawn_ids draws that many ids and folds them into fixed tables' rows only.
    cfg = SyntheticCtrConfig(num_samples=2000, num_tables=2, table_rows=50, drawn_ids=10**7, zipf_alpha=0.5)
    drawn = load_ctr_data(dataclasses.replace(cfg, table_rows=10**7, drawn_ids=0)).train
    hashed = load_ctr_data(cfg, raw_ids=[1]).train
    assert isinstance(drawn, CtrSplit) and isinstance(hashed, CtrSplit)
    assert torch.equal(hashed.ids[:, 0], drawn.ids[:, 0] % 50) and int(drawn.ids[:, 0].max()) >= 50
    assert torch.equal(hashed.ids[:, 1], drawn.ids[:, 1])
