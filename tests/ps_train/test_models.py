"""Models: stages compose to the whole network, build deterministically, and number what
the config says (``ModelConfig.num_stages``)."""

import pytest
import torch
from torch import nn

from ps_train.config import CNNConfig, MLPConfig, ResNetConfig
from ps_train.workloads.vision.models import build_stages, reference_model

SHAPES = [(1, 8, 8), (1, 28, 28), (3, 32, 32)]
CONFIGS = [
    MLPConfig(),
    MLPConfig(hidden_sizes=[], dropout=0.0),
    MLPConfig(hidden_sizes=[16, 16, 8], dropout=0.3),
    CNNConfig(),
    CNNConfig(channels=[4, 8, 8], fc_size=16, dropout=0.2),
]


def _params(modules):
    return [p.detach().clone() for m in modules for p in m.parameters()]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["mlp", "mlp_linear", "mlp3_dropout", "cnn", "cnn3_dropout"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_stages_compose_to_logits_for_every_input_shape(cfg, shape):
    stages = build_stages(cfg, shape, num_classes=7, seed=0)
    assert len(stages) == cfg.num_stages()
    x = torch.randn(3, *shape)
    out = reference_model(stages).eval()(x)
    assert out.shape == (3, 7)


@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 32, 32)], ids=str)
def test_resnet18_has_six_stages_and_small_input_stem(shape):
    stages = build_stages(ResNetConfig(), shape, num_classes=10, seed=0)
    assert len(stages) == ResNetConfig().num_stages() == 6
    stem = stages[0]
    assert stem[0].in_channels == shape[0] and stem[0].stride == (1, 1) and isinstance(stem[3], nn.Identity)
    x = torch.randn(2, *shape)
    h = x
    with torch.no_grad():
        for s in stages:
            h = s.eval()(h)
    assert h.shape == (2, 10)
    # layer4 keeps 4x4 resolution at 32x32 input (the point of the small-input stem).
    if shape == (3, 32, 32):
        with torch.no_grad():
            feat = reference_model(stages[:5]).eval()(x)
        assert feat.shape == (2, 512, 4, 4)


def test_resnet18_imagenet_stem_when_small_input_false():
    stages = build_stages(ResNetConfig(small_input=False), (3, 64, 64), 10, seed=0)
    assert stages[0][0].kernel_size == (7, 7) and isinstance(stages[0][3], nn.MaxPool2d)


@pytest.mark.parametrize("cfg", [MLPConfig(dropout=0.5), CNNConfig(dropout=0.5)], ids=["mlp", "cnn"])
def test_build_is_deterministic_under_seed_and_leaves_global_rng_alone(cfg):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = build_stages(cfg, (1, 8, 8), 10, seed=5)
    assert torch.equal(torch.get_rng_state(), before)  # seed= forks the RNG
    b = build_stages(cfg, (1, 8, 8), 10, seed=5)
    c = build_stages(cfg, (1, 8, 8), 10, seed=6)
    assert all(torch.equal(p, q) for p, q in zip(_params(a), _params(b), strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(_params(a), _params(c), strict=True))
    # Without seed=, torch.manual_seed decides.
    torch.manual_seed(5)
    d = build_stages(cfg, (1, 8, 8), 10)
    assert all(torch.equal(p, q) for p, q in zip(_params(a), _params(d), strict=True))


def test_build_errors_are_explained():
    with pytest.raises(ValueError, match=r"H, W >= 8"):
        build_stages(CNNConfig(channels=[4, 4, 4]), (1, 4, 4), 10)
    with pytest.raises(ValueError, match=r"\[C, H, W\]"):
        build_stages(CNNConfig(), (64,), 10)
    with pytest.raises(ValueError, match="resnet18 needs image"):
        build_stages(ResNetConfig(), (64,), 10)
    with pytest.raises(ValueError, match="num_classes"):
        build_stages(MLPConfig(), (64,), 1)
