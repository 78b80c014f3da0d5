"""Models as ordered stages, and how the stages are placed on parameter servers.

No RPC here: a model is a list of ``nn.Module`` stages whose composition
``nn.Sequential(*stages)`` is the whole network. ``place_stages`` assigns stage indices to
servers; ``build_shards`` groups consecutive stages that share a server into ``Shard``s, the
unit a server hosts and a trainer calls in forward order. Composing the shards in order is,
by construction, the same computation as the single-process reference model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ps_train.config import CNNConfig, MLPConfig, ModelConfig, ResNetConfig

__all__ = [
    "num_stages", "build_stages", "stage_param_bytes", "place_stages", "Shard",
    "build_shards", "shards_of_server", "build_model_shards", "reference_model",
]

_RESNET_STAGES = ("stem", "layer1", "layer2", "layer3", "layer4", "head")


def num_stages(cfg: ModelConfig) -> int:
    """Number of stages ``build_stages`` makes for ``cfg``, without building anything."""
    if isinstance(cfg, MLPConfig):
        return len(cfg.hidden_sizes) + 1
    if isinstance(cfg, CNNConfig):
        return len(cfg.channels) + 2
    if isinstance(cfg, ResNetConfig):
        return len(_RESNET_STAGES)
    raise ValueError(f"model.name: unknown model {cfg.name!r} ({type(cfg).__name__}); "
                     "choose model=mlp, model=cnn or model=resnet18")


def build_stages(cfg: ModelConfig, in_shape: tuple[int, ...], num_classes: int,
                 seed: int | None = None) -> list[nn.Module]:
    """Build the model's stages for samples of shape ``in_shape`` (no batch dim).

    Stage i maps the output of stage i-1 to its own output; the first takes ``[B, *in_shape]``
    and the last returns logits ``[B, num_classes]``. Initialisation draws from torch's global
    RNG, so the result is fixed by ``torch.manual_seed``; with ``seed`` given, the stages are
    built under that seed without disturbing the caller's RNG state.
    """
    in_shape = tuple(int(s) for s in in_shape)
    if not in_shape or any(s <= 0 for s in in_shape):
        raise ValueError(f"in_shape {in_shape} must be a non-empty tuple of positive sizes, e.g. (1, 28, 28)")
    if num_classes < 2:
        raise ValueError(f"num_classes {num_classes} must be >= 2")
    if seed is None:
        return _build(cfg, in_shape, num_classes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _build(cfg, in_shape, num_classes)


def _build(cfg: ModelConfig, in_shape: tuple[int, ...], num_classes: int) -> list[nn.Module]:
    if isinstance(cfg, MLPConfig):
        return _mlp(cfg, in_shape, num_classes)
    if isinstance(cfg, CNNConfig):
        return _cnn(cfg, in_shape, num_classes)
    if isinstance(cfg, ResNetConfig):
        return _resnet18(cfg, in_shape, num_classes)
    num_stages(cfg)  # raises the unknown-model error
    raise AssertionError("unreachable")


def _mlp(cfg: MLPConfig, in_shape: tuple[int, ...], num_classes: int) -> list[nn.Module]:
    # [B, *in_shape] -> flatten -> [B, D] -> hidden stages [B, h_i] -> [B, num_classes]
    stages: list[nn.Module] = []
    width = math.prod(in_shape)
    for i, hidden in enumerate(cfg.hidden_sizes):
        layers: list[nn.Module] = [nn.Flatten(1)] if i == 0 else []
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        if cfg.dropout > 0:
            layers.append(nn.Dropout(cfg.dropout))
        stages.append(nn.Sequential(*layers))
        width = hidden
    head: list[nn.Module] = [nn.Flatten(1)] if not cfg.hidden_sizes else []
    stages.append(nn.Sequential(*head, nn.Linear(width, num_classes)))
    return stages


def _cnn(cfg: CNNConfig, in_shape: tuple[int, ...], num_classes: int) -> list[nn.Module]:
    blocks = len(cfg.channels)
    if len(in_shape) != 3 or min(in_shape[1:]) < 2 ** blocks:
        raise ValueError(
            f"model=cnn with {blocks} conv blocks needs image samples [C, H, W] with H, W >= {2 ** blocks} "
            f"(each block halves them); got in_shape {in_shape}. Use fewer model.channels or model=mlp")
    c, h, w = in_shape
    stages: list[nn.Module] = []
    for out in cfg.channels:
        # [B, c, h, w] -> [B, out, h // 2, w // 2]
        stages.append(nn.Sequential(nn.Conv2d(c, out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)))
        c, h, w = out, h // 2, w // 2
    fc: list[nn.Module] = [nn.Flatten(1), nn.Linear(c * h * w, cfg.fc_size), nn.ReLU()]
    if cfg.dropout > 0:
        fc.append(nn.Dropout(cfg.dropout))
    stages.append(nn.Sequential(*fc))  # [B, c*h*w] -> [B, fc_size]
    stages.append(nn.Sequential(nn.Linear(cfg.fc_size, num_classes)))
    return stages


def _resnet18(cfg: ResNetConfig, in_shape: tuple[int, ...], num_classes: int) -> list[nn.Module]:
    if len(in_shape) != 3:
        raise ValueError(f"model=resnet18 needs image samples [C, H, W]; got in_shape {in_shape}")
    import torchvision  # here, not at the top: importing it costs every role ~2 s of CPU at start

    channels = in_shape[0]
    net = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    if cfg.small_input:
        # A 7x7/2 conv + max-pool would shrink 32x32 to 8x8 before layer1; for small images
        # use a 3x3/1 conv and no pool, so layer4 still sees 4x4 (32x32 input).
        net.conv1 = nn.Conv2d(channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    elif channels != 3:
        net.conv1 = nn.Conv2d(channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    if cfg.small_input or channels != 3:
        # Same init torchvision gives its own convs.
        nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
    stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)  # [B, C, H, W] -> [B, 64, H', W']
    head = nn.Sequential(net.avgpool, nn.Flatten(1), net.fc)  # [B, 512, h, w] -> [B, num_classes]
    return [stem, net.layer1, net.layer2, net.layer3, net.layer4, head]


def stage_param_bytes(stage: nn.Module) -> int:
    """Bytes of a stage's parameters (what a server stores and updates for it)."""
    return sum(p.numel() * p.element_size() for p in stage.parameters())


def place_stages(stages: Sequence[nn.Module], num_servers: int, strategy: str = "balanced") -> list[list[int]]:
    """Assign stage indices to servers; returns ``placement[server] = [stage indices]``.

    - ``round_robin``: stage i goes to server ``i % num_servers``.
    - ``balanced``: contiguous groups, one per server in order, minimising the largest
      group's parameter bytes, so the forward visits ps0, ps1, ... once each.

    Every server gets at least one stage. Deterministic: no randomness, ties go to the
    earliest split.
    """
    n = len(stages)
    if num_servers < 1:
        raise ValueError(f"cluster.num_servers={num_servers}: need at least 1 parameter server")
    if num_servers > n:
        raise ValueError(
            f"cluster.num_servers={num_servers} exceeds the model's {n} stages (each server needs at "
            f"least one); set cluster.num_servers<={n} or use a deeper model")
    if strategy == "round_robin":
        return [list(range(s, n, num_servers)) for s in range(num_servers)]
    if strategy == "balanced":
        bounds = _balanced_bounds([stage_param_bytes(s) for s in stages], num_servers)
        return [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]
    raise ValueError(f"cluster.placement={strategy!r} is unknown; use round_robin or balanced")


def _balanced_bounds(weights: list[int], k: int) -> list[int]:
    """Split ``weights`` into k contiguous non-empty groups minimising the max group sum.

    Returns group boundaries ``[0, b1, ..., n]``. Dynamic programming, O(k n^2); n is tiny.
    """
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[g][i]: minimal max-sum splitting the first i stages into g groups.
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for g in range(1, k + 1):
        for i in range(g, n - (k - g) + 1):
            for j in range(g - 1, i):  # last group is stages j..i-1
                cost = max(best[g - 1][j], prefix[i] - prefix[j])
                if cost < best[g][i]:
                    best[g][i], cut[g][i] = cost, j
    bounds = [n]
    for g in range(k, 0, -1):
        bounds.append(cut[g][bounds[-1]])
    return bounds[::-1]


@dataclass
class Shard:
    """Consecutive stages hosted by one server, called as one unit in the forward pass."""

    index: int  # position in the forward order
    server: int  # hosting server rank (ps<server>)
    stage_indices: list[int]
    module: nn.Sequential

    @property
    def name(self) -> str:
        return f"shard{self.index}"


def build_shards(stages: Sequence[nn.Module], placement: list[list[int]]) -> list[Shard]:
    """Group stages into shards in forward order; consecutive stages on one server merge.

    With ``balanced`` placement there is exactly one shard per server; with ``round_robin``
    a server may host several (e.g. 3 stages, 2 servers: ps0 hosts shard0 and shard2).
    The shard modules share the stage modules (no copies).
    """
    owner: dict[int, int] = {}
    for server, indices in enumerate(placement):
        if not indices:
            raise ValueError(f"placement gives server {server} no stage; every server needs at least one")
        for i in indices:
            if i in owner or not 0 <= i < len(stages):
                raise ValueError(f"placement {placement}: stage {i} is out of range or placed twice")
            owner[i] = server
    if len(owner) != len(stages):
        missing = sorted(set(range(len(stages))) - set(owner))
        raise ValueError(f"placement {placement} leaves stages {missing} unplaced")
    groups: list[tuple[int, list[int]]] = []
    for i in range(len(stages)):
        if groups and groups[-1][0] == owner[i]:
            groups[-1][1].append(i)
        else:
            groups.append((owner[i], [i]))
    return [Shard(k, server, idx, nn.Sequential(*(stages[i] for i in idx)))
            for k, (server, idx) in enumerate(groups)]


def shards_of_server(shards: Sequence[Shard], server: int) -> list[Shard]:
    """The shards a given server hosts, in forward order."""
    return [s for s in shards if s.server == server]


def build_model_shards(cfg: ModelConfig, in_shape: tuple[int, ...], num_classes: int,
                       num_servers: int, strategy: str, seed: int) -> list[Shard]:
    """Build the seeded model and split it: what every server computes identically,
    keeping only ``shards_of_server(result, rank)``."""
    stages = build_stages(cfg, in_shape, num_classes, seed=seed)
    return build_shards(stages, place_stages(stages, num_servers, strategy))


def reference_model(stages: Sequence[nn.Module]) -> nn.Sequential:
    """The single-process model: all stages in order (the oracle for sharded runs)."""
    return nn.Sequential(*stages)
