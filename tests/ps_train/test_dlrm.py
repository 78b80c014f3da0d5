"""model=dlrm end to end: the distributed run equals single-process torch (the oracle), in
every mode, with checkpoints and resume, and reports the CTR metrics.

The oracle is ``ps_train.workloads.ctr.model.DLRM``, whose tables are ``nn.EmbeddingBag(sparse=True)``: one
process, the same initial values, the same batches in the same order, the same optimizers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ps_train.config import (
    Config,
    ConfigError,
    CriteoConfig,
    CtrDataConfig,
    DLRMConfig,
    optimizer_spec,
)
from ps_train.workloads.ctr.data import CriteoFormatError, CtrSplit
from ps_train.workloads.ctr.data.batches import CtrBatchIterator
from ps_train.workloads.ctr.data.loading import load_ctr_data
from ps_train.workloads.ctr.metrics import auc
from ps_train.workloads.ctr.model import DLRM
from ps_train.workloads.ctr.tables.optimizers import TORCH_TABLE_OPTIMIZERS, make_table_optimizer, table_optimizer_spec
from ps_train.workloads.ctr.tables.rows import FusedLayout, RowSharding
from tests.ps_train._app import make_cfg, read_json, run_app, saved_tables, scalars

# Small and quick, with few rows per table so a batch uses rows several times (the
# trainer deduplicates them) and every server owns rows that batches use.
SMALL = (
    "model=dlrm",
    "data=synthetic_ctr",
    "data.num_samples=3000",
    "data.num_tables=3",
    "data.table_rows=40",
    "data.table_sizes=[40,7,300]",
    "data.num_dense=5",
    "model.embedding_dim=4",
    "model.bottom_mlp=[8]",
    "model.top_mlp=[8]",
    "train.batch_size=32",
    "checkpoint.every=0",
)


def ctr_parts(cfg: Config) -> tuple[CtrDataConfig, DLRMConfig]:
    assert isinstance(cfg.data, CtrDataConfig) and isinstance(cfg.model, DLRMConfig), (cfg.data, cfg.model)
    return cfg.data, cfg.model


def reference_run(cfg: Config, steps: int) -> tuple[dict[str, list[float]], DLRM]:
    """Single-process torch: each step sums the trainers' mean-loss gradients in rank order
    (trainer k's batches from the same CtrBatchIterator) and steps each optimizer once --
    the servers' sync rule (``ps_train.modes.sync``: sum of the trainers' gradients;
    with ``mode.aggregate=mean``, where that option exists, their mean)."""
    data, m = ctr_parts(cfg)
    train = load_ctr_data(data).train
    model = DLRM(
        data.dense_count(),
        data.sizes(),
        m.embedding_dim,
        m.bottom_mlp,
        m.top_mlp,
        cfg.seed,
        m.pooling_list(len(data.sizes())),
    )
    cls, kwargs = optimizer_spec(cfg.optim)
    dense_opt = cls([*model.bottom.parameters(), *model.top.parameters()], **kwargs)
    weights = model.table_weights()
    table_step: Callable[[], Any]
    if m.table_optim in TORCH_TABLE_OPTIMIZERS:  # torch's own optimizer on the EmbeddingBags' sparse gradients
        tcls, tkwargs = table_optimizer_spec(m.table_optim, cfg.optim, m.table_lr)
        table_step = tcls(weights, **tkwargs).step
    else:  # row-wise Adagrad (checked against a plain reference in test_table_optimizers.py)
        rows_opt = make_table_optimizer(m.table_optim, weights, cfg.optim, m.table_lr)

        def table_step() -> None:
            rows_opt.step([w.grad for w in weights])

    T = cfg.cluster.num_trainers
    scale = 1.0 / T if getattr(cfg.mode, "aggregate", "sum") == "mean" else 1.0
    batches = [CtrBatchIterator(train, k, T, cfg.train.batch_size, cfg.seed) for k in range(T)]
    losses: dict[str, list[float]] = {f"trainer{k}": [] for k in range(T)}
    for _ in range(steps):
        dense_opt.zero_grad(set_to_none=True)
        for w in weights:
            w.grad = None
        for k in range(T):  # .grad accumulates g0 + g1 + ...
            dense, ids, labels = next(batches[k])
            loss = F.binary_cross_entropy_with_logits(model(dense, ids), labels)
            (loss * scale).backward()
            losses[f"trainer{k}"].append(loss.item())
        dense_opt.step()
        table_step()
    return losses, model


def assert_tables_equal(run_dir: Path, cfg: Config, model: DLRM, atol: float) -> None:
    """Every server's saved rows equal the reference table's rows it owns."""
    S = cfg.cluster.num_servers
    tables = saved_tables(run_dir)
    layout = FusedLayout(ctr_parts(cfg)[1].table_sharding, tuple(ctr_parts(cfg)[0].sizes()), S)
    for t, weight in enumerate(model.table_weights()):
        sharding = RowSharding(ctr_parts(cfg)[1].table_sharding, weight.shape[0], S)
        for s in range(S):
            offsets = layout.row_offsets(s)
            got = tables[f"ps{s}"]["weight"][offsets[t] : offsets[t + 1]]
            want = weight.detach()[sharding.global_ids(s)]
            torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=f"table {t} ps{s}")


def assert_losses_close(got: dict[str, list[float]], want: dict[str, list[float]], atol: float) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert len(got[k]) == len(want[k])
        worst = max(abs(a - b) for a, b in zip(got[k], want[k], strict=True))
        assert worst <= atol, f"{k}: losses differ by up to {worst:.3g}: {got[k]} vs {want[k]}"


# Why 1e-6 and not bit-exact: a row used by several samples of a batch gets their gradients
# summed by the trainer's gather backward (deduplicated rows) and then coalesced on the
# server, where the reference's EmbeddingBag hands one gradient per sample to a sparse
# coalesce: the same terms, added in another order, so some table values differ in their
# last bit (seen: up to 4e-8). Everything else (dense layers, the sum over trainers in rank
# order) runs the same arithmetic as the reference; in these short runs the losses have come
# out bit-identical, but nothing guarantees that once table values differ.
ATOL = 1e-6


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "setup",
    [
        (
            "cluster.num_trainers=1",
            "cluster.num_servers=2",
            "optim=sgd",
            "model.table_optim=adagrad",
            "model.table_sharding=range",
        ),
        (
            "cluster.num_trainers=2",
            "cluster.num_servers=2",
            "optim=sgd",
            "model.table_optim=adagrad",
            "model.table_sharding=range",
        ),
        # ps2 holds table rows only; Adam on the MLPs, lazy Adam on the tables.
        (
            "cluster.num_trainers=2",
            "cluster.num_servers=3",
            "optim=adam",
            "optim.lr=0.01",
            "model.table_optim=sparse_adam",
            "model.table_sharding=mod",
        ),
        ("cluster.num_trainers=2", "cluster.num_servers=2", "optim=sgd", "model.table_optim=sgd"),
        # The same application on torch.distributed.rpc.
        ("cluster.num_trainers=2", "cluster.num_servers=2", "optim=sgd", "model.table_optim=adagrad", "backend=torch"),
        (
            "cluster.num_trainers=2",
            "cluster.num_servers=2",
            "optim=sgd",
            "model.table_optim=rowwise_adagrad",
            "model.table_sharding=mod",
        ),
        # Multi-hot bags, pooled on the servers that own the rows (table 2's bags of up to 20 ids
        # are pooled there: fewer bytes than its distinct rows), weighted ids; and mean pooling.
        (
            "cluster.num_trainers=2",
            "cluster.num_servers=2",
            "optim=sgd",
            "model.table_optim=rowwise_adagrad",
            "data.table_sizes=[40,7,3000]",
            "data.bag_sizes=[3,1,20]",
            "data.bag_size_dist=uniform",
            "data.id_weights=true",
        ),
        (
            "cluster.num_trainers=1",
            "cluster.num_servers=2",
            "optim=sgd",
            "model.table_optim=adagrad",
            "model.table_sharding=mod",
            "data.table_sizes=[40,7,3000]",
            "data.bag_sizes=[4,2,20]",
            "model.pooling=[mean,sum,mean]",
        ),
    ],
    ids=[
        "1trainer-sgd-adagrad-range",
        "2trainers-sgd-adagrad-range",
        "2trainers-3servers-adam-sparseadam-mod",
        "2trainers-sgd-sgd",
        "torch-backend",
        "rowwise-adagrad",
        "multi-hot-weighted-sum",
        "multi-hot-mean",
    ],
)
@pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # the reference's Adagrad, see table_server
def test_sync_dlrm_equals_single_process_embedding_bags(tmp_path: Path, setup: tuple[str, ...]) -> None:
    steps = 8
    overrides = (*SMALL, *setup, f"train.steps={steps}", "mode=sync")
    metrics = run_app(tmp_path, *overrides, timeout=120)
    cfg = make_cfg(*overrides)
    losses, model = reference_run(cfg, steps)
    assert_losses_close(metrics["losses"], losses, ATOL)
    assert_tables_equal(tmp_path, cfg, model, atol=ATOL)
    # Only touched rows moved, and the trainer asked for each distinct row once per step.
    one_hot = not any("bag_sizes" in o for o in setup)
    assert (
        0
        < metrics["rows_pulled_per_step"]
        <= (cfg.train.batch_size * len(ctr_parts(cfg)[0].sizes()) if one_hot else float("inf"))
    )
    assert metrics["rows_pushed_per_step"] == metrics["rows_pulled_per_step"]


@pytest.mark.timeout(180)
def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path: Path) -> None:
    # Table rows and their Adagrad sums are in the checkpoint: resumed == uninterrupted, bit
    # for bit (the same distributed arithmetic both ways).
    cfg = (*SMALL, "mode=sync", "checkpoint.every=2", "checkpoint.keep=0")
    whole = run_app(tmp_path / "whole", *cfg, "train.steps=6", timeout=120)
    run_app(tmp_path / "first", *cfg, "train.steps=4", timeout=120)
    second = run_app(tmp_path / "second", *cfg, "train.steps=6", f"resume={tmp_path / 'first'}", timeout=120)
    for trainer in ("trainer0", "trainer1"):
        assert second["losses"][trainer] == whole["losses"][trainer][4:]
    a, b = saved_tables(tmp_path / "whole"), saved_tables(tmp_path / "second")
    for server in ("ps0", "ps1"):
        assert a[server].keys() == b[server].keys() == {"weight", "sum.0"}  # rows and Adagrad sums
        for column, x in a[server].items():
            assert torch.equal(x, b[server][column]), f"{server} {column}"
    with pytest.raises(ConfigError, match=r"data.table_sizes: the checkpoint has \[40, 7, 300\]"):
        run_app(
            tmp_path / "other", *cfg, "train.steps=6", "data.table_sizes=[40,7,301]", f"resume={tmp_path / 'first'}"
        )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_and_ssp_train_and_report_ctr_metrics(tmp_path: Path, mode: str) -> None:
    steps = 40
    extra = ("mode.staleness=1",) if mode == "ssp" else ()
    m = run_app(
        tmp_path,
        *SMALL,
        f"mode={mode}",
        *extra,
        f"train.steps={steps}",
        "train.batch_size=64",
        "model.table_lr=0.2",
        timeout=150,
    )
    # Every trainer's update reaches every server: dense shards and table rows alike.
    assert m["server_updates"] == [2 * steps, 2 * steps]
    assert all(n > 0 for n in m["table_rows_updated"].values())
    assert 0.5 < m["test_auc"] <= 1.0 and m["test_best_auc"] > m["test_auc"] - 0.05
    assert m["test_log_loss"] < m["test_base_log_loss"] + 0.05
    assert set(m["peak_rss_bytes"]) == {"ps0", "ps1", "trainer0", "trainer1"}
    assert all(200e6 < v < 1.5e9 for v in m["peak_rss_bytes"].values())
    assert set(m["server_bytes_per_step"]) == {"ps0", "ps1"}
    assert all(v["sent"] > 0 and v["received"] > 0 for v in m["server_bytes_per_step"].values())
    assert m["samples_per_s"] > 0 and m["rows_pulled_per_step"] > 0
    assert read_json(tmp_path / "metrics.json")["test_auc"] == m["test_auc"]
    tags = scalars(tmp_path / "tb" / "trainer0")
    for tag in (
        "test/auc",
        "test/log_loss",
        "train/rows_pulled",
        "train/rows_pushed",
        "rpc/bytes_sent/ps0",
    ):
        assert tag in tags, f"{tag} missing from TensorBoard"
    ps0 = scalars(tmp_path / "tb" / "ps0")  # the servers' table metrics
    assert ps0["server/rows_live"][-1][1] > 0 and "server/rows_read_per_s" in ps0


def _criteo_file(path: Path, n: int, bad_line: int | None = None) -> None:
    rng = np.random.default_rng(0)
    lines = []
    for i in range(n):
        ints = [str(int(v)) for v in rng.integers(0, 100, 13)]
        cats = [f"{int(v):08x}" for v in rng.integers(0, 2**32, 26)]
        label = "x" if i + 1 == bad_line else str(int(rng.integers(2)))
        lines.append("\t".join([label, *ints, *cats]) + "\n")
    path.write_text("".join(lines))


def test_criteo_malformed_line_fails_naming_file_line_and_flag_or_is_skipped(tmp_path: Path) -> None:
    _criteo_file(tmp_path / "day_0", 50, bad_line=7)
    cfg = CriteoConfig(root=str(tmp_path), table_rows=20)
    with pytest.raises(CriteoFormatError, match=r"day_0, line 7: the label is 'x'.*data.skip_malformed=true"):
        load_ctr_data(cfg)
    train, test, best, skipped = load_ctr_data(CriteoConfig(root=str(tmp_path), table_rows=20, skip_malformed=True))
    assert (len(train) + len(test), best) == (49, None)
    assert skipped == (
        f"data=criteo: skipped 1 malformed of 50 lines (day_0: 1); first: {tmp_path / 'day_0'}, "
        "line 7: the label is 'x', not 0 or 1"
    )
    assert load_ctr_data(CriteoConfig(root=str(tmp_path), table_rows=20, skip_malformed=True)).skipped == skipped


@pytest.mark.timeout(180)
def test_criteo_files_train_end_to_end(tmp_path: Path) -> None:
    _criteo_file(tmp_path / "day_0", 400)
    m = run_app(
        tmp_path / "run",
        "model=dlrm",
        "data=criteo",
        f"data.root={tmp_path}",
        "data.table_rows=50",
        "train.batch_size=16",
        "train.steps=5",
        "cluster.num_trainers=1",
        "checkpoint.every=0",
        timeout=120,
    )
    assert m["steps"] == 5 and "test_best_auc" not in m and 0.0 <= m["test_auc"] <= 1.0


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_default_dlrm_run_reaches_the_generators_best_auc_single_process() -> None:
    # `python -m ps_train model=dlrm data=synthetic_ctr`'s hyper-parameters, replayed as sync
    # mode runs them (the oracle above): the run's AUC is within 0.02 of the best possible.
    cfg = make_cfg("model=dlrm", "data=synthetic_ctr")
    assert cfg.train.steps is not None
    _, model = reference_run(cfg, cfg.train.steps)
    _, test, best, _ = load_ctr_data(ctr_parts(cfg)[0])
    assert best is not None and isinstance(test, CtrSplit)
    with torch.no_grad():
        z = torch.cat([model(test.dense[i : i + 8192], test.ids[i : i + 8192]) for i in range(0, len(test), 8192)])
    assert best - auc(z, test.labels) < 0.02
