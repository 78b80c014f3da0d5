"""The vision workload's models as ordered stages: MLP, a small CNN, torchvision's ResNet-18.

No RPC here: a model is a list of ``nn.Module`` stages whose composition
``nn.Sequential(*stages)`` (``reference_model``) is the whole network, the single-process
oracle for sharded runs. How many stages a config gives is the config's own answer
(``ModelConfig.num_stages``); ``build_stages`` builds exactly that many. Placing stages on
servers is ``ps_train.stage_sharding``'s business.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from ps_train.config import CNNConfig, MLPConfig, ModelConfig, ResNetConfig
from ps_train.stage_sharding import Shard, build_shards, place_stages

__all__ = ["build_stages", "reference_model", "build_model_shards"]


def build_stages(
    cfg: ModelConfig, in_shape: tuple[int, ...], num_classes: int, seed: int | None = None
) -> list[nn.Module]:
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
    cfg.num_stages()  # raises the unknown-model error
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
    if len(in_shape) != 3 or min(in_shape[1:]) < 2**blocks:
        raise ValueError(
            f"model=cnn with {blocks} conv blocks needs image samples [C, H, W] with H, W >= {2**blocks} "
            f"(each block halves them); got in_shape {in_shape}. Use fewer model.channels or model=mlp"
        )
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


def reference_model(stages: Sequence[nn.Module]) -> nn.Sequential:
    """The single-process model: all stages in order (the oracle for sharded runs)."""
    return nn.Sequential(*stages)


def build_model_shards(
    cfg: ModelConfig, in_shape: tuple[int, ...], num_classes: int, num_servers: int, strategy: str, seed: int
) -> list[Shard]:
    """Build the seeded model and split it: what every server computes identically,
    keeping only ``shards_of_server(result, rank)``."""
    stages = build_stages(cfg, in_shape, num_classes, seed=seed)
    return build_shards(stages, place_stages(stages, num_servers, strategy))
