"""What a ps_train step moves and computes, from a model's shapes: the workloads that
``scale_model.py`` fits and plans with.

A dense model (MLP, CNN) is a chain of stages placed on the servers in contiguous groups
(``ps_train/stage_sharding.py``: ``balanced`` placement, consecutive stages of one server
form one shard). Per trainer step each shard is called once in the forward (the activation
in, its output back) and once in the backward (the output's gradient in, the input's
gradient back, except for the first shard, whose input is the data), and every server gets
one update request. A DLRM's tables are split by rows over all servers: each server also
gets its share of the rows a step pulls and of their gradients.

Sizes are float32 per sample (``*_floats``); bytes below are a trainer step's, both ways.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

__all__ = ["Stage", "Workload", "ServerLoad", "server_loads", "mlp", "WORKLOADS"]

FLOAT = 4  # bytes


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


def server_loads(w: Workload, servers: int) -> list[ServerLoad]:
    """Each server's share of one trainer step of ``w`` with ``servers`` servers."""
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    groups = _placement([s.params for s in w.stages], min(servers, len(w.stages)))
    table_share = w.table_bytes / servers
    out = []
    for r in range(servers):
        extra = 2 if w.table_bytes else 0  # a DLRM step's lookup and its gradient
        if r >= len(groups):
            out.append(ServerLoad(table_share, table_share / 2, 1 + extra, w.table_flops / servers, False))
            continue
        a, b = groups[r]
        first, last = w.stages[a], w.stages[b - 1]
        # In: the activation and, in the backward, the output's gradient. Out: the output and
        # the input's gradient (none for the data). Rows and their gradients: half each way.
        floats_in = first.in_floats + last.out_floats
        floats = floats_in + last.out_floats + (first.in_floats if a > 0 else 0)
        flops = 3.0 * sum(s.flops for s in w.stages[a:b])  # forward + backward ~ 3 forwards
        out.append(
            ServerLoad(
                w.batch * floats * FLOAT + table_share,
                w.batch * floats_in * FLOAT + table_share / 2,
                3 + extra,
                w.batch * flops + w.table_flops / servers,
                True,
            )
        )
    return out


def mlp(hidden: tuple[int, ...] = (128, 64), batch: int = 32) -> Workload:
    """model=mlp on digits (8x8 = 64 features, 10 classes): the default is hidden [128, 64], batch 32."""
    widths = (64, *hidden, 10)
    return Workload("mlp", batch, tuple(_linear(i, o) for i, o in zip(widths, widths[1:], strict=False)))


def _cnn() -> Workload:
    # model=cnn on digits (1x8x8): conv3x3 blocks of 32 and 64 channels, each with a 2x2
    # max-pool (8x8 -> 4x4 -> 2x2), fc 256 -> 128, classifier 128 -> 10; batch 32.
    conv1 = Stage(64, 32 * 16, 32 * 9 + 32, 2.0 * 64 * 32 * 9)
    conv2 = Stage(32 * 16, 64 * 4, 64 * 32 * 9 + 64, 2.0 * 16 * 64 * 32 * 9)
    return Workload("cnn", 32, (conv1, conv2, _linear(256, 128), _linear(128, 10)))


def _dlrm_large() -> Workload:
    # preset=dlrm_large: 13 dense features, bottom MLP [64, 32] -> 64, 26 one-hot tables of
    # dim 64, dot interaction (26 + 1 vectors: 351 pairs + 64), top MLP [64, 32] -> 1; batch
    # 512. Every lookup counted as a distinct row (an upper bound): 512 x 26 rows of 64
    # floats pulled, the same pushed back as gradients; an Adagrad row update ~ 4 flops a value.
    rows = 512 * 26
    bottom = (_linear(13, 64), _linear(64, 32), _linear(32, 64))
    top = (_linear(351 + 64, 64), _linear(64, 32), _linear(32, 1))
    return Workload("dlrm_large", 512, bottom + top, 2.0 * rows * 64 * FLOAT, 4.0 * rows * 64)


WORKLOADS = {w.name: w for w in (mlp(), _cnn(), _dlrm_large())}
