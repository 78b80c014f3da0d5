"""Stage sharding: shards composed in order equal the single-process model; placement is
deterministic, contiguous where asked, and explains its errors."""

import itertools
import random

import pytest
import torch
from torch import nn

from ps_train.config import ClusterConfig, CNNConfig, MLPConfig, ResNetConfig, SyntheticConfig
from ps_train.stage_sharding import (
    _balanced_bounds,
    build_shards,
    model_shards,
    place_stages,
    shard_layout,
    shards_of_server,
    stage_param_bytes,
)
from ps_train.workloads.vision.models import build_model_shards, build_stages, reference_model


@pytest.mark.parametrize("strategy", ["round_robin", "balanced"])
@pytest.mark.parametrize(
    "cfg,shape,servers",
    [
        (MLPConfig(hidden_sizes=[32, 16], dropout=0.25), (1, 8, 8), 2),
        (MLPConfig(hidden_sizes=[32, 16], dropout=0.25), (1, 8, 8), 3),
        (CNNConfig(channels=[4, 8], fc_size=16, dropout=0.25), (1, 28, 28), 3),
        (ResNetConfig(), (3, 8, 8), 4),
    ],
    ids=["mlp2", "mlp3", "cnn3", "resnet4"],
)
def test_shards_equal_single_process_model_forward_and_backward(cfg, shape, servers, strategy):
    # Oracle: two independent copies built from one seed; copy A is the plain model, copy B
    # is split into shards and run shard by shard, as trainers do over RPC.
    ref = reference_model(build_stages(cfg, shape, 10, seed=1))
    shards = build_model_shards(cfg, shape, 10, servers, strategy, seed=1)
    assert sorted(i for s in shards for i in s.stage_indices) == list(range(cfg.num_stages()))
    x, y = torch.randn(4, *shape), torch.randint(10, (4,))
    torch.manual_seed(9)  # same dropout masks for both
    out_ref = ref(x)
    torch.manual_seed(9)
    h = x
    for shard in shards:
        h = shard.module(h)
    assert torch.equal(h, out_ref)
    nn.functional.cross_entropy(out_ref, y).backward()
    nn.functional.cross_entropy(h, y).backward()
    grads_ref = [p.grad for p in ref.parameters()]
    grads_shards = [p.grad for s in shards for p in s.module.parameters()]
    assert len(grads_ref) == len(grads_shards)
    assert all(torch.equal(a, b) for a, b in zip(grads_ref, grads_shards, strict=True))


def test_round_robin_places_stage_i_on_server_i_mod_n_and_merges_neighbours():
    stages = build_stages(CNNConfig(), (1, 8, 8), 10, seed=0)  # 4 stages
    assert place_stages(stages, 2, "round_robin") == [[0, 2], [1, 3]]
    assert place_stages(stages, 3, "round_robin") == [[0, 3], [1], [2]]
    shards = build_shards(stages, [[0, 1], [2, 3]])
    assert [(s.server, s.stage_indices) for s in shards] == [(0, [0, 1]), (1, [2, 3])]
    shards = build_shards(stages, place_stages(stages, 2, "round_robin"))
    assert [(s.name, s.server, s.stage_indices) for s in shards] == [
        ("shard0", 0, [0]),
        ("shard1", 1, [1]),
        ("shard2", 0, [2]),
        ("shard3", 1, [3]),
    ]
    assert [s.index for s in shards_of_server(shards, 0)] == [0, 2]
    # Shards share the stage modules (no copies): servers own exactly what they host.
    assert shards[0].module[0] is stages[0]


def test_balanced_is_contiguous_nonempty_and_favours_heavy_stages():
    stages = build_stages(ResNetConfig(), (3, 32, 32), 10, seed=0)
    sizes = [stage_param_bytes(s) for s in stages]
    assert sizes[4] > sum(sizes[:4])  # layer4 outweighs everything before it
    assert place_stages(stages, 2, "balanced") == [[0, 1, 2, 3], [4, 5]]
    for n in range(1, 7):
        placement = place_stages(stages, n, "balanced")
        assert [i for g in placement for i in g] == list(range(6)) and all(placement)
        assert len(build_shards(stages, placement)) == n  # one shard per server


def test_balanced_bounds_match_brute_force():
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(1, 7)
        k = rng.randint(1, n)
        w = [rng.choice([0, 1, 5, 100, rng.randint(0, 1000)]) for _ in range(n)]
        bounds = _balanced_bounds(w, k)
        assert bounds[0] == 0 and bounds[-1] == n and len(bounds) == k + 1
        assert all(a < b for a, b in zip(bounds, bounds[1:], strict=False))
        got = max(sum(w[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))
        best = min(
            max(sum(w[a:b]) for a, b in zip((0, *cuts), (*cuts, n), strict=True))
            for cuts in itertools.combinations(range(1, n), k - 1)
        )
        assert got == best


def test_placement_errors_name_the_field():
    stages = build_stages(MLPConfig(), (1, 8, 8), 10, seed=0)  # 3 stages
    with pytest.raises(ValueError, match=r"cluster.num_servers=4 exceeds the model's 3 stages"):
        place_stages(stages, 4, "balanced")
    with pytest.raises(ValueError, match=r"cluster.num_servers=0"):
        place_stages(stages, 0, "round_robin")
    with pytest.raises(ValueError, match=r"cluster.placement='random'"):
        place_stages(stages, 2, "random")
    with pytest.raises(ValueError, match="no stage"):
        build_shards(stages, [[0, 1, 2], []])
    with pytest.raises(ValueError, match="placed twice"):
        build_shards(stages, [[0, 1], [1, 2]])
    with pytest.raises(ValueError, match=r"stages \[2\] unplaced"):
        build_shards(stages, [[0], [1]])


@pytest.mark.parametrize("placement", ["round_robin", "balanced"])
def test_shard_layout_is_model_shards_servers_and_kept_per_configs(placement):
    model, data = MLPConfig(hidden_sizes=[32, 16, 8]), SyntheticConfig(shape=[1, 8, 8], train_size=8, test_size=8)
    cluster = ClusterConfig(num_servers=2, placement=placement)
    layout = shard_layout(model, data, cluster, 3)
    assert layout == tuple((s.index, s.server) for s in model_shards(model, data, cluster, 3))
    # The same configs' values (new objects, as a forked role builds them): the kept answer.
    again = shard_layout(
        MLPConfig(hidden_sizes=[32, 16, 8]),
        SyntheticConfig(shape=[1, 8, 8], train_size=8, test_size=8),
        ClusterConfig(num_servers=2, placement=placement),
        3,
    )
    assert again is layout
    # Other servers: another layout, not the kept one.
    three = shard_layout(model, data, ClusterConfig(num_servers=3, placement=placement), 3)
    assert three == tuple(
        (s.index, s.server) for s in model_shards(model, data, ClusterConfig(num_servers=3, placement=placement), 3)
    )
    assert {server for _, server in three} == {0, 1, 2}
