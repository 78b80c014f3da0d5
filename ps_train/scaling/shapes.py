"""What one ps_train trainer step moves and computes, from a model's shapes.

A dense model (MLP, CNN) is a chain of stages placed on the servers in contiguous groups
(``ps_train/stage_sharding.py``: ``balanced`` placement, consecutive stages of one server
form one shard). Per trainer step each shard is called once in the forward (the activation
in, its output back) and once in the backward (the output's gradient in, the input's
gradient back, except for the first shard, whose input is the data), and every server gets
one update request. A DLRM's tables are split by rows over all servers: each server also
gets its share of the rows a step pulls and of their gradients.

Sizes are float32 per sample (``*_floats``); bytes below are a trainer step's, both ways.
``workload_from_config`` reads them off a composed ps_train config's model, data and batch size.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ps_train.config.data import CtrDataConfig, DataConfig, SyntheticCtrConfig
from ps_train.config.model import CNNConfig, DLRMConfig, MLPConfig, ModelConfig
from ps_train.workloads.ctr.model import interaction_size

__all__ = [
    "Stage",
    "Workload",
    "ServerLoad",
    "Shard",
    "shards",
    "server_loads",
    "mlp",
    "cnn",
    "dlrm",
    "WORKLOADS",
    "workload_from_config",
]

FLOAT = 4  # bytes
ROW_UPDATE_FLOPS = 4.0  # an Adagrad row update, per value: square, accumulate, root, step


@dataclass(frozen=True)
class Stage:
    in_floats: int  # the activation entering the stage, per sample
    out_floats: int  # the activation leaving it, per sample
    params: int  # parameters (placement balances their bytes)
    flops: float  # forward floating-point operations per sample


@dataclass(frozen=True)
class Workload:
    name: str
    batch: int  # samples per trainer step
    stages: tuple[Stage, ...]
    table_bytes: float = 0.0  # DLRM: rows pulled plus their gradients per step, over all servers
    table_flops: float = 0.0  # DLRM: the servers' gather and row updates per step, over all servers


@dataclass(frozen=True)
class ServerLoad:
    """One server's share of one trainer step."""

    bytes: float  # payload both ways, from the shapes (the fit scales it to the wire)
    received: float  # of which the server receives (the rest it sends)
    messages: int  # requests it serves
    flops: float  # arithmetic it does
    shard: bool  # holds stages (is on the trainer's serial path)


def _linear(i: int, o: int) -> Stage:
    return Stage(i, o, i * o + o, 2.0 * i * o)


def _chain(widths: list[int]) -> Stage:
    """Linear layers ``widths[0] -> widths[1] -> ...`` as one stage (DLRM's bottom or top MLP)."""
    pairs = list(zip(widths, widths[1:], strict=False))
    return Stage(widths[0], widths[-1], sum(i * o + o for i, o in pairs), sum(2.0 * i * o for i, o in pairs))


def _placement(ws: list[int], groups: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) groups of ``ws`` (stage parameter counts) minimising the largest."""
    n = len(ws)
    best: list[tuple[int, int]] = [(0, n)]
    best_max = float("inf")
    for cuts in itertools.combinations(range(1, n), groups - 1):
        bounds = list(zip((0, *cuts), (*cuts, n), strict=True))
        worst = max(sum(ws[a:b]) for a, b in bounds)
        if worst < best_max:
            best, best_max = bounds, worst
    return best


@dataclass(frozen=True)
class Shard:
    """Consecutive stages one server holds, and what a trainer step sends it, per sample."""

    server: int
    forward_in: int  # floats: the activation entering the shard
    forward_out: int  # its output
    backward_in: int  # the output's gradient
    backward_out: int  # the input's gradient (0 for the first shard: the data needs none)
    flops: float  # forward floating-point operations per sample


def shards(w: Workload, servers: int) -> list[Shard]:
    """The shards of ``w`` on ``servers`` servers, in the order a forward visits them."""
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    groups = _placement([s.params for s in w.stages], min(servers, len(w.stages)))
    out = []
    for r, (a, b) in enumerate(groups):
        first, last = w.stages[a], w.stages[b - 1]
        flops = sum(s.flops for s in w.stages[a:b])
        out.append(Shard(r, first.in_floats, last.out_floats, last.out_floats, first.in_floats if a > 0 else 0, flops))
    return out


def server_loads(w: Workload, servers: int) -> list[ServerLoad]:
    """Each server's share of one trainer step of ``w`` with ``servers`` servers."""
    held = {sh.server: sh for sh in shards(w, servers)}
    table_share = w.table_bytes / servers
    extra = 2 if w.table_bytes else 0  # a DLRM step's lookup and its gradient
    out = []
    for r in range(servers):
        sh = held.get(r)
        if sh is None:
            out.append(ServerLoad(table_share, table_share / 2, 1 + extra, w.table_flops / servers, False))
            continue
        # In: the activation and, in the backward, the output's gradient. Out: the output and
        # the input's gradient (none for the data). Rows and their gradients: half each way.
        floats_in = sh.forward_in + sh.backward_in
        floats = floats_in + sh.forward_out + sh.backward_out
        out.append(
            ServerLoad(
                w.batch * floats * FLOAT + table_share,
                w.batch * floats_in * FLOAT + table_share / 2,
                3 + extra,
                w.batch * 3.0 * sh.flops + w.table_flops / servers,  # forward + backward ~ 3 forwards
                True,
            )
        )
    return out


def mlp(hidden: tuple[int, ...] = (128, 64), batch: int = 32, inputs: int = 64, classes: int = 10) -> Workload:
    """model=mlp: on digits (8x8 = 64 features, 10 classes) the default is hidden [128, 64], batch 32."""
    widths = (inputs, *hidden, classes)
    return Workload("mlp", batch, tuple(_linear(i, o) for i, o in zip(widths, widths[1:], strict=False)))


def cnn(
    channels: tuple[int, ...] = (32, 64),
    fc_size: int = 128,
    batch: int = 32,
    image: tuple[int, int, int] = (1, 8, 8),
    classes: int = 10,
) -> Workload:
    """model=cnn (``ps_train.models``): conv3x3 blocks, each with a 2x2 max-pool, then fc and classifier."""
    c, h, w = image
    stages = []
    for out in channels:
        # conv3x3 (padding 1) at h x w, then the pool halves h and w.
        stages.append(Stage(c * h * w, out * (h // 2) * (w // 2), out * c * 9 + out, 2.0 * h * w * out * c * 9))
        c, h, w = out, h // 2, w // 2
    return Workload("cnn", batch, (*stages, _linear(c * h * w, fc_size), _linear(fc_size, classes)))


def dlrm(
    dense: int, tables: int, dim: int, bottom: tuple[int, ...], top: tuple[int, ...], batch: int, ids: float = 1.0
) -> Workload:
    """model=dlrm: bottom MLP ``dense -> ... -> dim``, the trainer's dot interaction, top MLP
    ``-> 1``. ``ids``: the mean ids a sample's bag holds per table. Every lookup counted as a
    distinct row (an upper bound): rows pulled, the same pushed back as gradients."""
    rows = batch * tables * ids
    stages = (_chain([dense, *bottom, dim]), _chain([interaction_size(tables, dim), *top, 1]))
    return Workload("dlrm", batch, stages, 2.0 * rows * dim * FLOAT, ROW_UPDATE_FLOPS * rows * dim)


def _dlrm_large() -> Workload:
    # preset=dlrm_large: 13 dense features, bottom MLP [64, 32] -> 64, 26 one-hot tables of
    # dim 64, dot interaction (26 + 1 vectors: 351 pairs + 64), top MLP [64, 32] -> 1; batch
    # 512; each linear layer counted as a stage of its own (docs/scaling.md's tables).
    rows = 512 * 26
    bottom = (_linear(13, 64), _linear(64, 32), _linear(32, 64))
    top = (_linear(351 + 64, 64), _linear(64, 32), _linear(32, 1))
    return Workload("dlrm_large", 512, bottom + top, 2.0 * rows * 64 * FLOAT, ROW_UPDATE_FLOPS * rows * 64)


WORKLOADS = {w.name: w for w in (mlp(), cnn(), _dlrm_large())}


def _mean_ids(data: CtrDataConfig) -> float:
    """Mean ids per bag over the tables (1: one-hot)."""
    most = data.max_bag_sizes()
    if isinstance(data, SyntheticCtrConfig) and data.bag_size_dist == "uniform":
        return sum((1 + n) / 2 for n in most) / len(most)
    return sum(most) / len(most)


def workload_from_config(model: ModelConfig, data: DataConfig, batch: int) -> Workload:
    """The shapes of a job of ``model`` on ``data`` with ``batch`` samples a step (the
    ``model``, ``data`` and ``train.batch_size`` of a validated ps_train config)."""
    shape = data.sample_shape()
    if isinstance(model, MLPConfig):
        return mlp(tuple(model.hidden_sizes), batch, math.prod(shape), data.class_count())
    if isinstance(model, CNNConfig):
        c, h, w = shape  # validation checked [C, H, W]
        return cnn(tuple(model.channels), model.fc_size, batch, (c, h, w), data.class_count())
    if isinstance(model, DLRMConfig) and isinstance(data, CtrDataConfig):
        tables = len(model.tables) or len(data.sizes())
        return dlrm(
            data.dense_count(),
            tables,
            model.embedding_dim,
            tuple(model.bottom_mlp),
            tuple(model.top_mlp),
            batch,
            _mean_ids(data),
        )
    raise ValueError(
        f"model={model.name}: the cost model knows the shapes of mlp, cnn and dlrm only; "
        "plan with one of those (e.g. model=cnn) or add its shapes to ps_train/scaling/shapes.py"
    )
