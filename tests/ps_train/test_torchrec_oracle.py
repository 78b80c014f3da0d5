"""TorchRec itself as the oracle of ps_train's embedding tables (the optional ``torchrec`` extra).

- Pooled embeddings: the same TorchRec ``KeyedJaggedTensor`` batches (multi-hot, empty bags,
  duplicate ids, keys in another order than the tables, int32 lengths, sum and mean pooling,
  with and without per-id weights) through ps_train's server path -- the trainer's
  ``BagPlanner`` requests, two servers' ``TableShards.lookup``, ``combine`` -- and through
  TorchRec's ``EmbeddingBagCollection`` holding the same rows give the same pooled embeddings,
  and their backward the same row gradients.
- Training: ``model.table_optim=rowwise_adagrad`` against TorchRec's fused row-wise Adagrad
  (``FusedEmbeddingBagCollection`` with ``torchrec.optim.RowWiseAdagrad``: FBGEMM's CPU
  ``EXACT_ROWWISE_ADAGRAD`` kernel, the update fused into the backward) over 100 steps: the
  servers' path in one process, and a real run (2 servers, 2 trainers, sync) against one
  process whose tables are TorchRec's.

Without torchrec (CI) every test here is skipped, saying so.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from ps_train.config import CtrDataConfig, DLRMConfig, OptimConfig, optimizer_spec
from ps_train.workloads.ctr.data.bags import Bags, as_bags
from ps_train.workloads.ctr.data.batches import CtrBatchIterator
from ps_train.workloads.ctr.data.jagged import is_keyed_jagged, keyed_jagged, to_bags
from ps_train.workloads.ctr.data.loading import load_ctr_data
from ps_train.workloads.ctr.model import DLRM, interact
from ps_train.workloads.ctr.tables.optimizers import make_table_optimizer
from ps_train.workloads.ctr.tables.plan import BagPlanner, combine
from ps_train.workloads.ctr.tables.rows import FusedLayout, RowSharding, init_rows
from ps_train.workloads.ctr.tables.shards import TableShards
from tests.ps_train._app import make_cfg, run_app, saved_tables

torchrec = pytest.importorskip(
    "torchrec", reason="torchrec is not installed (the optional `torchrec` extra: README, 'Optional: TorchRec')"
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType  # noqa: E402
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

SIZES = (50, 9, 400)  # the 9-row table makes duplicate ids within a bag common
NAMES = ("user", "ad", "page")  # each table's feature
MAX_BAG = (3, 2, 12)  # ids per bag: 0 up to this
DIM, SEED, SERVERS, BATCH = 4, 7, 2, 8
EPS = 1e-8  # FBGEMM's default; ps_train's RowWiseAdagrad's


def _kjt(seed: int, batch: int, weighted: bool, key_order: Sequence[int] = (2, 0, 1)) -> KeyedJaggedTensor:
    """A TorchRec batch: multi-hot bags (empty ones too), keyed in ``key_order``, int32 lengths."""
    g = torch.Generator().manual_seed(seed)
    values, lengths = [], []
    for t in key_order:
        n = torch.randint(0, MAX_BAG[t] + 1, (batch,), generator=g)
        lengths.append(n.to(torch.int32))
        values.append(torch.randint(0, SIZES[t], (int(n.sum()),), generator=g))
    v = torch.cat(values)
    w = torch.rand(len(v), generator=g) + 0.5 if weighted else None
    return KeyedJaggedTensor(keys=[NAMES[t] for t in key_order], values=v, lengths=torch.cat(lengths), weights=w)


def _configs(pooling: Sequence[str]) -> list[Any]:
    kind = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}
    return [
        EmbeddingBagConfig(
            name=f"t{t}", embedding_dim=DIM, num_embeddings=n, feature_names=[NAMES[t]], pooling=kind[pooling[t]]
        )
        for t, n in enumerate(SIZES)
    ]


def _rows() -> list[Tensor]:
    """Every table's rows [rows_t, DIM], as ps_train's servers build them from SEED."""
    return [init_rows(SEED, t, n, DIM, torch.arange(n)) for t, n in enumerate(SIZES)]


def _load_rows(collection: Any, rows: Sequence[Tensor]) -> None:
    """TorchRec's tables (plain or fused) hold ``rows``."""
    with torch.no_grad():
        for t, w in enumerate(rows):
            collection.embedding_bags[f"t{t}"].weight.copy_(w)


class _Servers:
    """ps_train's table path without RPC: the trainer's planner, ``SERVERS`` servers' shards."""

    def __init__(self, pooling: Sequence[str], kind: str) -> None:
        self.layout = FusedLayout(kind, SIZES, SERVERS)
        self.shards = [TableShards(SIZES, DIM, kind, s, SERVERS, SEED) for s in range(SERVERS)]
        self.planner = BagPlanner(self.layout, DIM, list(pooling))
        self.shardings = [RowSharding(kind, n, SERVERS) for n in SIZES]

    def pooled(self, batch: Any) -> Tensor:
        """[B, T, DIM]: what a trainer's step gets for ``batch`` (differentiable to the shards)."""
        plan = self.planner.plan(to_bags(batch, NAMES))
        return combine(plan, [shard.lookup(*plan.requests[s]) for s, shard in enumerate(self.shards)])

    def tables(self, column: list[Tensor] | None = None) -> list[Tensor]:
        """Each whole table [rows_t, ...] put together from the servers' storages (``column``:
        one per server, aligned with its storage's rows; default: the rows themselves)."""
        cols = column if column is not None else [shard.weight.detach() for shard in self.shards]
        out = []
        for t, (n, sharding) in enumerate(zip(SIZES, self.shardings, strict=True)):
            whole = cols[0].new_zeros((n, *cols[0].shape[1:]))
            for s in range(SERVERS):
                lo, hi = self.layout.row_offsets(s)[t : t + 2]
                whole[sharding.global_ids(s)] = cols[s][lo:hi]
            out.append(whole)
        return out


@pytest.mark.parametrize(
    "pooling, weighted, kind, build",
    [
        (("sum", "sum", "sum"), False, "range", "lengths"),
        (("sum", "sum", "sum"), True, "mod", "lengths"),
        (("mean", "mean", "mean"), False, "mod", "lengths"),
        (("mean", "sum", "mean"), False, "range", "lengths"),
        (("sum", "sum", "sum"), True, "range", "offsets-int32"),
    ],
    ids=["sum", "sum-weighted", "mean", "mean-and-sum", "weighted-from-offsets-int32"],
)
def test_pooled_embeddings_equal_torchrecs_embedding_bag_collection(
    pooling: tuple[str, ...], weighted: bool, kind: str, build: str
) -> None:
    kjt = _kjt(0, BATCH, weighted)
    if build == "offsets-int32":  # the other way TorchRec builds a batch, with int32 ids
        kjt = KeyedJaggedTensor.from_offsets_sync(
            keys=kjt.keys(), values=kjt.values().to(torch.int32), offsets=kjt.offsets(), weights=kjt.weights_or_none()
        )
    assert is_keyed_jagged(kjt) and keyed_jagged(kjt).keys == tuple(kjt.keys())
    ebc = torchrec.EmbeddingBagCollection(tables=_configs(pooling), is_weighted=weighted, device=torch.device("cpu"))
    _load_rows(ebc, _rows())
    servers = _Servers(pooling, kind)
    for t, rows in enumerate(servers.tables()):  # the servers' shards hold the rows TorchRec was given
        assert torch.equal(rows, _rows()[t])

    pooled = ebc(kjt).to_dict()
    want = torch.stack([pooled[n] for n in NAMES], dim=1)  # [B, T, DIM]
    got = servers.pooled(kjt)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)

    # The backward: the same gradient of every row (TorchRec's dense [rows_t, DIM], the servers' sparse).
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    (want * upstream).sum().backward()
    (got * upstream).sum().backward()
    grads = [shard.weight.grad for shard in servers.shards]
    assert all(g is not None and g.is_sparse for g in grads)
    ours = servers.tables([g.to_dense() for g in grads if g is not None])
    for t in range(len(SIZES)):
        theirs = ebc.embedding_bags[f"t{t}"].weight.grad
        torch.testing.assert_close(ours[t], theirs, rtol=0, atol=1e-6, msg=f"table {t}")


def test_a_keyed_jagged_tensor_with_a_batch_size_per_key_is_refused_with_the_reason() -> None:
    kjt = KeyedJaggedTensor(
        keys=list(NAMES),
        values=torch.arange(6),
        lengths=torch.tensor([1, 1, 1, 1, 2], dtype=torch.int32),
        stride_per_key_per_rank=[[2], [2], [1]],
    )
    with pytest.raises(ValueError, match="batch size per key is not supported: give every key B bags"):
        to_bags(kjt, NAMES)


def test_weighted_mean_pooling_equals_fbgemms_forward_and_has_the_true_gradient() -> None:
    """Weighted ids in mean-pooled tables: TorchRec's ``EmbeddingBagCollection``
    (``nn.EmbeddingBag``) refuses them; its fused collection (FBGEMM) pools ``sum(w * row) /
    ids``, as ps_train's servers do. FBGEMM's CPU backward of that leaves out the ``1 / ids``
    (it hands each row ``w * upstream``, sum pooling's gradient), so the gradient is checked
    against autograd of the same formula in plain torch instead."""
    kjt = _kjt(3, BATCH, weighted=True)
    ebc = torchrec.EmbeddingBagCollection(tables=_configs(("mean",) * 3), is_weighted=True, device=torch.device("cpu"))
    with pytest.raises(NotImplementedError, match="per_sample_weights is only supported for mode='sum'"):
        ebc(kjt)
    fused = _fused(("mean",) * 3, weighted=True, lr=0.0)
    pooled = fused(kjt).to_dict()
    servers = _Servers(("mean",) * 3, "mod")
    got = servers.pooled(kjt)
    torch.testing.assert_close(got, torch.stack([pooled[n] for n in NAMES], dim=1), rtol=0, atol=1e-6)

    upstream = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))
    (got * upstream).sum().backward()
    ours = servers.tables([shard.weight.grad.to_dense() for shard in servers.shards if shard.weight.grad is not None])
    features = kjt.to_dict()
    for t, name in enumerate(NAMES):
        table = _rows()[t].requires_grad_()
        f = features[name]
        per_bag = f.lengths().clamp(min=1).to(torch.float32).unsqueeze(1)  # [B, 1]
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), f.lengths().cumsum(0)[:-1]])
        want = F.embedding_bag(f.values(), table, offsets, mode="sum", per_sample_weights=f.weights()) / per_bag
        (grad,) = torch.autograd.grad((want * upstream[:, t]).sum(), [table])
        torch.testing.assert_close(ours[t], grad, rtol=0, atol=1e-6, msg=f"table {t}")


def _fused(pooling: Sequence[str], weighted: bool, lr: float) -> Any:
    """TorchRec's tables with FBGEMM's fused row-wise Adagrad, holding ps_train's initial rows."""
    fused = FusedEmbeddingBagCollection(
        tables=_configs(pooling),
        optimizer_type=torchrec.optim.RowWiseAdagrad,
        optimizer_kwargs={"lr": lr, "eps": EPS},
        is_weighted=weighted,
        device=torch.device("cpu"),
    )
    _load_rows(fused, _rows())
    return fused


def _momentum(fused: Any, num_tables: int) -> list[Tensor]:
    """Each table's row-wise Adagrad state [rows_t] (FBGEMM's ``momentum_1``)."""
    state = fused.fused_optimizer().state_dict()["state"]
    return [state[f"t{t}.weight"][f"t{t}.weight.momentum_1"].reshape(-1) for t in range(num_tables)]


@pytest.mark.parametrize(
    "pooling, weighted, kind",
    [
        (("sum", "sum", "sum"), True, "mod"),
        (("mean", "mean", "mean"), False, "range"),
    ],
    ids=["sum-weighted", "mean"],  # weighted mean: test_weighted_mean_pooling_... below
)
def test_rowwise_adagrad_on_the_servers_equals_torchrecs_fused_rowwise_adagrad(
    pooling: tuple[str, ...], weighted: bool, kind: str
) -> None:
    lr, steps = 0.05, 100
    fused = _fused(pooling, weighted, lr)
    servers = _Servers(pooling, kind)
    optimizers = [make_table_optimizer("rowwise_adagrad", [s.weight], OptimConfig(lr=lr)) for s in servers.shards]
    g = torch.Generator().manual_seed(2)
    for step in range(steps):
        kjt = _kjt(100 + step, BATCH, weighted)
        upstream = torch.randn(BATCH, len(SIZES), DIM, generator=g)  # the loss's gradient of the pooled vectors
        pooled = fused(kjt).to_dict()
        (torch.stack([pooled[n] for n in NAMES], dim=1) * upstream).sum().backward()  # FBGEMM updates here
        (servers.pooled(kjt) * upstream).sum().backward()
        for shard, opt in zip(servers.shards, optimizers, strict=True):
            opt.step([shard.weight.grad])
            shard.weight.grad = None
    ours, state = servers.tables(), servers.tables([opt.state_dict()["sum"][0] for opt in optimizers])
    for t, momentum in enumerate(_momentum(fused, len(SIZES))):
        theirs = fused.embedding_bags[f"t{t}"].weight.detach()
        assert not torch.equal(theirs, _rows()[t])  # training moved the rows
        torch.testing.assert_close(ours[t], theirs, rtol=0, atol=1e-5, msg=f"table {t} after {steps} steps")
        torch.testing.assert_close(state[t], momentum, rtol=1e-5, atol=1e-7, msg=f"table {t}'s row state")


# A small model=dlrm run with multi-hot weighted bags: table 2's bags of up to 20 ids are pooled
# on the servers, tables 0-1's rows fetched (ps_train.workloads.ctr.tables.plan); both trainers' gradients meet
# on the servers every step.
E2E = (
    "model=dlrm",
    "data=synthetic_ctr",
    "data.num_samples=3000",
    "data.num_tables=3",
    "data.table_sizes=[40,7,3000]",
    "data.bag_sizes=[3,1,20]",
    "data.bag_size_dist=uniform",
    "data.id_weights=true",
    "data.num_dense=5",
    "model.embedding_dim=4",
    "model.bottom_mlp=[8]",
    "model.top_mlp=[8]",
    "model.table_optim=rowwise_adagrad",
    "model.table_sharding=mod",
    "optim=sgd",
    "train.batch_size=32",
    "checkpoint.every=0",
    "cluster.num_servers=2",
    "cluster.num_trainers=2",
    "mode=sync",
)


def _batch_kjt(bags: Sequence[Bags], names: Sequence[str]) -> KeyedJaggedTensor:
    """The trainers' batches side by side as one TorchRec batch [T keys x (K * B) bags]:
    per table, trainer 0's bags, then trainer 1's, ..."""
    values, lengths, weights = [], [], []
    for t in range(len(names)):
        for b in bags:
            v, _, w = b.table(t)
            B = b.batch_size
            values.append(v)
            lengths.append(b.lengths()[t * B : (t + 1) * B])
            weights.append(w)
    w_all = torch.cat([w for w in weights if w is not None]) if bags[0].weights is not None else None
    return KeyedJaggedTensor(keys=list(names), values=torch.cat(values), lengths=torch.cat(lengths), weights=w_all)


@pytest.mark.timeout(240)
def test_a_rowwise_adagrad_run_trains_as_torchrec_fused_rowwise_adagrad(tmp_path: Path) -> None:
    """The run's losses and final tables against one process with ps_train's MLPs and TorchRec's
    fused tables: each step one TorchRec batch of both trainers' batches (one fused update of
    their summed row gradients, as the servers' sync step) and the trainers' losses averaged
    (``mode.aggregate=mean``)."""
    steps = 100
    overrides = (*E2E, f"train.steps={steps}")
    metrics = run_app(tmp_path, *overrides, timeout=180)
    cfg = make_cfg(*overrides)
    data, m = cfg.data, cfg.model
    assert isinstance(data, CtrDataConfig) and isinstance(m, DLRMConfig)
    T, K, lr = len(data.sizes()), cfg.cluster.num_trainers, m.table_lr or cfg.optim.lr
    assert cfg.mode.aggregate == "mean" and data.has_id_weights()
    model = DLRM(data.dense_count(), data.sizes(), m.embedding_dim, m.bottom_mlp, m.top_mlp, cfg.seed)
    names = m.feature_list(T)
    fused = FusedEmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=f"t{t}", embedding_dim=m.embedding_dim, num_embeddings=n, feature_names=[names[t]])
            for t, n in enumerate(data.sizes())
        ],
        optimizer_type=torchrec.optim.RowWiseAdagrad,
        optimizer_kwargs={"lr": lr, "eps": EPS},
        is_weighted=True,
        device=torch.device("cpu"),
    )
    _load_rows(fused, model.table_weights())
    cls, kwargs = optimizer_spec(cfg.optim)
    dense_opt = cls([*model.bottom.parameters(), *model.top.parameters()], **kwargs)
    train = load_ctr_data(data).train
    iterators = [CtrBatchIterator(train, k, K, cfg.train.batch_size, cfg.seed) for k in range(K)]
    losses: dict[str, list[float]] = {f"trainer{k}": [] for k in range(K)}
    B = cfg.train.batch_size
    for _ in range(steps):
        batches = [next(it) for it in iterators]
        pooled = fused(_batch_kjt([as_bags(ids) for _, ids, _ in batches], names)).to_dict()
        emb = torch.stack([pooled[n] for n in names], dim=1)  # [K * B, T, d]
        dense_opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for k, (dense, _, labels) in enumerate(batches):
            logit = model.top(interact(model.bottom(dense), emb[k * B : (k + 1) * B])).squeeze(1)
            loss = F.binary_cross_entropy_with_logits(logit, labels)
            losses[f"trainer{k}"].append(loss.item())
            total = total + loss / K
        total.backward()  # the fused tables update here
        dense_opt.step()

    for trainer, want in losses.items():
        worst = max(abs(a - b) for a, b in zip(metrics["losses"][trainer], want, strict=True))
        assert worst <= 1e-5, f"{trainer}: losses differ from TorchRec's by up to {worst:.3g}"
    saved = saved_tables(tmp_path)
    layout = FusedLayout(m.table_sharding, tuple(data.sizes()), cfg.cluster.num_servers)
    for t, momentum in enumerate(_momentum(fused, T)):
        sharding = RowSharding(m.table_sharding, data.sizes()[t], cfg.cluster.num_servers)
        theirs = fused.embedding_bags[f"t{t}"].weight.detach()
        for s in range(cfg.cluster.num_servers):
            lo, hi = layout.row_offsets(s)[t : t + 2]
            mine = sharding.global_ids(s)
            torch.testing.assert_close(saved[f"ps{s}"]["weight"][lo:hi], theirs[mine], rtol=0, atol=1e-5)
            torch.testing.assert_close(saved[f"ps{s}"]["sum.0"][lo:hi], momentum[mine], rtol=1e-5, atol=1e-7)
