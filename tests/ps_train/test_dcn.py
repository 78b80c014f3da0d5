"""model.interaction=dcn: DCN-v2's low-rank cross layers between the bottom MLP and the top
MLP, trained through the parameter servers, against a plain-torch DCN-v2 in one process.

The oracle (``PlainDCN``) is written here from the paper's formula, with its own tables
(``nn.EmbeddingBag(sparse=True)``), its own MLPs and cross weights, and plain optimizers;
it shares nothing with ps_train but the initial values (copied in) and the batches.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ps_train.config import ConfigError, CtrDataConfig, DLRMConfig
from ps_train.stage_sharding import model_shards
from ps_train.workloads.ctr.data.bags import Bags, as_bags
from ps_train.workloads.ctr.data.batches import CtrBatchIterator
from ps_train.workloads.ctr.data.loading import load_ctr_data
from ps_train.workloads.ctr.data.synthetic import SyntheticCtr
from ps_train.workloads.ctr.data.synthetic_bags import BagShape
from ps_train.workloads.ctr.model import DLRM, cross_spec, dense_stages, interaction_size
from ps_train.workloads.ctr.tables.rows import FusedLayout, RowSharding, init_rows
from tests.ps_train._app import final_weights, make_cfg, run_app, saved_tables

SMALL_DCN = (
    "model=dlrm",
    "data=synthetic_ctr",
    "data.num_samples=3000",
    "data.table_sizes=[40,7,300]",
    "data.num_dense=5",
    "model.embedding_dim=4",
    "model.bottom_mlp=[8]",
    "model.top_mlp=[8]",
    "model.interaction=dcn",
    "model.dcn_layers=2",
    "model.dcn_rank=3",
    "train.batch_size=32",
    "checkpoint.every=0",
)
# As test_dlrm's oracle: a row used by several samples gets their gradients summed in another
# order than EmbeddingBag's, so table values may differ in their last bits.
ATOL = 1e-6
# Parameters after six Adagrad steps are up to ~0.2 in size: their last bits, relative, differ
# with the CPU's vector kernels, which sum in another order on another machine.
RTOL = 1e-5


def _prefixed(what: str) -> Callable[[str], str]:
    """An ``assert_close`` message that keeps torch's own (the mismatch's size) after ``what``."""
    return lambda message: f"{what}: {message}"


class PlainDCN(nn.Module):
    """DLRM with a DCN-v2 interaction, in plain torch: x = bottom(dense); x0 = [x, e_1, .., e_T]
    [B, (T + 1) d]; x_{l+1} = x0 * (U_l (V_l x_l) + b_l) + x_l; logit = top(x_L)."""

    def __init__(
        self, num_dense: int, sizes: Sequence[int], dim: int, bottom: Sequence[int], top: Sequence[int], layers: int
    ) -> None:
        super().__init__()
        widths = [num_dense, *bottom, dim]
        self.bottom = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:], strict=True))
        self.tables = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum", sparse=True) for n in sizes)
        n = (len(sizes) + 1) * dim
        self.v = nn.ParameterList(nn.Parameter(torch.empty(0)) for _ in range(layers))  # [r, N] each, copied in
        self.u = nn.ParameterList(nn.Parameter(torch.empty(0)) for _ in range(layers))  # [N, r]
        self.b = nn.ParameterList(nn.Parameter(torch.empty(0)) for _ in range(layers))  # [N]
        widths = [n, *top, 1]
        self.top = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:], strict=True))

    def dense_parameters(self) -> list[nn.Parameter]:
        """In ps_train's stage order: bottom's, then per cross layer v, u, b, then top's."""
        cross = [p for layer in zip(self.v, self.u, self.b, strict=True) for p in layer]
        return [*self.bottom.parameters(), *cross, *self.top.parameters()]

    def forward(self, dense: Tensor, bags: Bags) -> Tensor:
        x = dense
        for linear in self.bottom:
            x = torch.relu(linear(x))
        emb = [table(*bags.table(t)) for t, table in enumerate(self.tables)]  # T x [B, d]
        x0 = torch.cat([x, *emb], dim=1)  # [B, (T + 1) d]
        xl = x0
        for v, u, b in zip(self.v, self.u, self.b, strict=True):
            xl = x0 * (F.linear(F.linear(xl, v), u, b)) + xl
        for i, linear in enumerate(self.top):
            xl = linear(xl) if i == len(self.top) - 1 else torch.relu(linear(xl))
        return xl.squeeze(1)


def _plain_model(cfg_overrides: tuple[str, ...]) -> tuple[PlainDCN, CtrDataConfig, DLRMConfig, int]:
    """The oracle with ps_train's initial values: the servers' dense stages and rows."""
    cfg = make_cfg(*cfg_overrides)
    d, m = cfg.data, cfg.model
    assert isinstance(d, CtrDataConfig) and isinstance(m, DLRMConfig)
    model = PlainDCN(d.dense_count(), d.sizes(), m.embedding_dim, m.bottom_mlp, m.top_mlp, m.dcn_layers)
    stages = dense_stages(
        d.dense_count(), len(d.sizes()), m.embedding_dim, m.bottom_mlp, m.top_mlp, cfg.seed, cross_spec(m)
    )
    initial = [p for stage in stages for p in stage.parameters()]
    with torch.no_grad():
        for mine, theirs in zip(model.dense_parameters(), initial, strict=True):
            mine.data = theirs.detach().clone()
        for t, (table, n) in enumerate(zip(model.tables, d.sizes(), strict=True)):
            assert isinstance(table, nn.EmbeddingBag)
            table.weight.copy_(init_rows(cfg.seed, t, n, m.embedding_dim, torch.arange(n)))
    return model, d, m, cfg.seed


def _rowwise_adagrad(weights: Sequence[Tensor], sums: list[Tensor], lr: float, eps: float = 1e-8) -> None:
    """Row-wise Adagrad on each table's sparse gradient: state[row] += mean(g^2);
    w[row] -= lr g / (sqrt(state[row]) + eps)."""
    for w, s in zip(weights, sums, strict=True):
        assert w.grad is not None
        g = w.grad.coalesce()
        rows, values = g.indices()[0], g.values()  # [U], [U, d]
        s.index_add_(0, rows, values.pow(2).mean(dim=1))
        w.data.index_add_(0, rows, -lr * values / (s[rows].sqrt() + eps).unsqueeze(1))


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "setup",
    [
        # The preset's optimizers: Adagrad on the dense layers, row-wise Adagrad on the
        # tables; multi-hot bags; 2 trainers whose gradients the servers add in rank order.
        (
            "cluster.num_trainers=2",
            "cluster.num_servers=2",
            "optim=adagrad",
            "optim.lr=0.05",
            "model.table_optim=rowwise_adagrad",
            "model.table_sharding=mod",
            "data.table_sizes=[40,7,3000]",
            "data.bag_sizes=[3,1,20]",
        ),
        # One server holds both dense stages (and every row); one-hot ids; plain SGD.
        ("cluster.num_trainers=1", "cluster.num_servers=1", "optim=sgd", "optim.momentum=0", "model.table_optim=sgd"),
    ],
    ids=["2x2-adagrad-rowwise-multihot", "1x1-sgd"],
)
@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_sync_dcn_run_equals_plain_torch_dcn(tmp_path: Path, setup: tuple[str, ...]) -> None:
    steps = 6
    overrides = (*SMALL_DCN, *setup, f"train.steps={steps}", "mode=sync")
    metrics = run_app(tmp_path, *overrides, timeout=180)

    model, d, m, seed = _plain_model(overrides)
    cfg = make_cfg(*overrides)
    lr = cfg.optim.lr
    dense_opt: torch.optim.Optimizer = (
        torch.optim.Adagrad(model.dense_parameters(), lr=lr)
        if cfg.optim.name == "adagrad"
        else torch.optim.SGD(model.dense_parameters(), lr=lr)
    )
    weights = [t.weight for t in model.tables if isinstance(t, nn.EmbeddingBag)]
    sums = [torch.zeros(w.shape[0]) for w in weights]
    train = load_ctr_data(d).train
    T = cfg.cluster.num_trainers
    batches = [CtrBatchIterator(train, k, T, cfg.train.batch_size, seed) for k in range(T)]
    losses: dict[str, list[float]] = {f"trainer{k}": [] for k in range(T)}
    scale = 1.0 / T if cfg.mode.aggregate == "mean" else 1.0  # the servers' sync rule
    for _ in range(steps):
        dense_opt.zero_grad(set_to_none=True)
        for w in weights:
            w.grad = None
        for k in range(T):  # .grad sums the trainers' mean-loss gradients in rank order
            dense, ids, labels = next(batches[k])
            loss = F.binary_cross_entropy_with_logits(model(dense, as_bags(ids)), labels)
            (loss * scale).backward()
            losses[f"trainer{k}"].append(loss.item())
        dense_opt.step()
        if m.table_optim == "rowwise_adagrad":
            _rowwise_adagrad(weights, sums, lr)
        else:
            with torch.no_grad():
                for w in weights:
                    assert w.grad is not None
                    w.add_(w.grad, alpha=-lr)

    for trainer, expected in losses.items():
        observed = metrics["losses"][trainer]
        assert len(observed) == steps
        assert max(abs(a - b) for a, b in zip(observed, expected, strict=True)) <= ATOL, (trainer, observed, expected)
    # The dense stages, cross layers included, as the servers saved them.
    saved = final_weights(tmp_path)
    got_dense = [
        saved[(f"ps{shard.server}", shard.index, key)]
        for shard in model_shards(cfg.model, cfg.data, cfg.cluster, cfg.seed)
        for key, _ in shard.module.named_parameters()
    ]
    want_dense = [p.detach() for p in model.dense_parameters()]
    assert [g.shape for g in got_dense] == [w.shape for w in want_dense]
    for i, (g, w) in enumerate(zip(got_dense, want_dense, strict=True)):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL, msg=_prefixed(f"dense parameter {i}"))
    # The tables, row by row.
    S = cfg.cluster.num_servers
    tables = saved_tables(tmp_path)
    layout = FusedLayout(m.table_sharding, tuple(d.sizes()), S)
    for t, w in enumerate(weights):
        sharding = RowSharding(m.table_sharding, w.shape[0], S)
        for s in range(S):
            lo, hi = layout.row_offsets(s)[t : t + 2]
            rows = w.detach()[sharding.global_ids(s)]
            torch.testing.assert_close(
                tables[f"ps{s}"]["weight"][lo:hi], rows, atol=ATOL, rtol=RTOL, msg=_prefixed(f"table {t}")
            )


def test_dlrm_with_cross_layers_is_the_plain_dcn() -> None:
    # ps_train's single-process model (what the TorchRec oracle also checks) against the
    # plain formula, on multi-hot bags.
    overrides = (*SMALL_DCN, "data.bag_sizes=[3,1,5]")
    plain, d, m, seed = _plain_model(overrides)
    ours = DLRM(d.dense_count(), d.sizes(), m.embedding_dim, m.bottom_mlp, m.top_mlp, seed, cross=cross_spec(m))
    dense, ids, _ = next(CtrBatchIterator(load_ctr_data(d).train, 0, 1, 64, seed))
    torch.testing.assert_close(ours(dense, ids), plain(dense, as_bags(ids)), atol=1e-6, rtol=0)


def test_dcn_settings_are_checked() -> None:
    cfg = make_cfg(*SMALL_DCN)
    assert isinstance(cfg.model, DLRMConfig)
    spec = cross_spec(cfg.model)
    assert spec is not None and (spec.layers, spec.rank) == (2, 3)
    assert interaction_size(3, 4, spec) == 16 and interaction_size(3, 4) == 4 + 6
    with pytest.raises(ConfigError, match=r"model.interaction: unknown 'cross'; choose one of \['dot', 'dcn'\]"):
        make_cfg("model=dlrm", "data=synthetic_ctr", "model.interaction=cross")
    with pytest.raises(ConfigError, match="model.dcn_rank: only model.interaction=dcn takes it"):
        make_cfg("model=dlrm", "data=synthetic_ctr", "model.dcn_rank=4")
    with pytest.raises(ConfigError, match="model.dcn_layers: 0 must be >= 1"):
        make_cfg(*SMALL_DCN, "model.dcn_layers=0")
    with pytest.raises(ConfigError, match=r"data.zipf_alphas: \[1.0, 1.0\] lists 2 skews for 3 tables"):
        make_cfg(*SMALL_DCN, "data.zipf_alphas=[1.0,1.0]")


def test_preset_dlrmv2_has_the_reference_shape() -> None:
    cfg = make_cfg("preset=dlrmv2")
    d, m = cfg.data, cfg.model
    assert isinstance(d, CtrDataConfig) and isinstance(m, DLRMConfig)
    sizes = d.sizes()
    assert len(sizes) == 26 and sum(sizes) == 204_184_588 and sizes.count(40_000_000) == 5
    assert sum(d.max_bag_sizes()) == 214
    assert (m.embedding_dim, m.interaction, m.dcn_layers, m.dcn_rank) == (128, "dcn", 3, 512)
    assert (m.table_optim, cfg.optim.name, cfg.train.batch_size) == ("rowwise_adagrad", "adagrad", 512)
    assert (m.lazy_rows, m.table_memory_budget, m.table_dtype) == (True, "1GB", "float16")
    bottom, top = model_shards(cfg.model, cfg.data, cfg.cluster, cfg.seed)
    linears = [mod for mod in top.module.modules() if isinstance(mod, nn.Linear)]
    assert [lin.out_features for lin in linears] == [1024, 1024, 512, 256, 1]
    assert [lin.out_features for lin in bottom.module.modules() if isinstance(lin, nn.Linear)] == [512, 256, 128]
    cross = [p.shape for name, p in top.module.named_parameters() if "layers" in name]
    assert cross == [torch.Size([512, 3456]), torch.Size([3456, 512]), torch.Size([3456])] * 3
    assert bottom.server == 0 and top.server == 1


def test_synthetic_ids_cover_40m_rows_with_per_table_skew_in_memory_independent_of_rows() -> None:
    # Per-table skew: a uniform table's most popular row is rare, a skewed one's is common;
    # ids reach the whole 40 M-row range; generating costs the same memory for 40 M rows as
    # for 1,000 (nothing per row: the hidden model hashes (seed, table, id)).
    def peak(rows: int) -> tuple[int, np.ndarray]:
        tracemalloc.start()
        gen = SyntheticCtr(4, [rows, rows], [0.0, 1.2], seed=1, bag_shape=BagShape((3, 5)))
        _, ids, _, _, bags = gen.generate_with_bags(20_000)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert bags is not None
        return top, ids

    small, _ = peak(1000)
    large, ids = peak(40_000_000)
    assert large < 1.1 * small, (small, large)
    uniform, skewed = ids[:, 0], ids[:, 1]
    assert uniform.max() > 39_000_000 and skewed.max() > 20_000_000
    share = [np.unique(col, return_counts=True)[1].max() / len(col) for col in (uniform, skewed)]
    assert share[0] < 0.001 < 0.05 < share[1]


@pytest.mark.timeout(300)
def test_preset_dlrmv2_trains_with_its_dense_shape_and_scaled_down_tables(tmp_path: Path) -> None:
    # The preset as it is (dense layers, cross layers of rank 512, bags of 214 ids, optimizers,
    # lazy float16 rows under a RAM budget) with every table at most 1,000 rows and small
    # batches: what fits a test.
    data = make_cfg("preset=dlrmv2").data
    assert isinstance(data, CtrDataConfig)
    sizes = [min(n, 1000) for n in data.sizes()]
    m = run_app(
        tmp_path,
        "preset=dlrmv2",
        f"data.table_sizes=[{','.join(map(str, sizes))}]",
        "data.num_samples=2000",
        "train.batch_size=32",
        "train.steps=3",
        "train.eval_batch_size=256",
        timeout=240,
    )
    assert m["steps"] == 3 and m["server_updates"] == [3, 3]  # sync: one update a step per server
    assert all(np.isfinite(v) for losses in m["losses"].values() for v in losses)
    assert 0.0 <= m["test_auc"] <= 1.0 and m["rows_pulled_per_step"] > 0
    saved = final_weights(tmp_path)
    cross = [t for (server, shard, key), t in saved.items() if server == "ps1" and shard == 1 and "layers" in key]
    assert [tuple(t.shape) for t in cross] == [(512, 3456), (3456, 512), (3456,)] * 3
