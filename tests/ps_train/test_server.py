"""ParameterServer and its update modes without RPC: the parts of sync mode that threads could make
nondeterministic, and the async update rule."""

import copy
import threading

import pytest
import torch

from ps_train.config import (
    ClusterConfig,
    Config,
    DLRMConfig,
    ModeConfig,
    OptimConfig,
    ResNetConfig,
    SyntheticConfig,
    TrainConfig,
    validate,
)
from ps_train.launch.rank import BUDGETED_SERVER_MALLOC, malloc_thresholds, server_settings
from ps_train.roles.server import ParameterServer
from rpc_core.memory import MMAP_THRESHOLD, TRIM_THRESHOLD


@pytest.mark.timeout(60)
def test_sync_forwards_with_batchnorm_run_in_trainer_order_whatever_order_requests_arrive():
    cfg = validate(
        Config(
            model=ResNetConfig(),
            data=SyntheticConfig(shape=[3, 8, 8]),
            cluster=ClusterConfig(num_servers=1, num_trainers=2),
            train=TrainConfig(steps=1),
        )
    )
    ps = ParameterServer(server_settings(cfg), rank=0)
    assert ps.has_running_stats  # so sync mode runs its forwards in trainer order
    module = ps.shards[0]
    reference = copy.deepcopy(module)
    x0, x1 = torch.randn(4, 3, 8, 8), torch.randn(4, 3, 8, 8)

    late = threading.Thread(target=ps.forward, args=(0, x1, 1, 0))  # trainer1's request comes first
    late.start()
    late.join(timeout=0.5)
    assert late.is_alive(), "trainer1's step-0 forward ran before trainer0's"
    ps.forward(0, x0, 0, 0)
    late.join(timeout=30)
    assert not late.is_alive()

    reference(x0), reference(x1)  # running statistics updated in trainer order
    for (name, a), (_, b) in zip(module.named_buffers(), reference.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    assert ps.mode._forwards_done == {}  # the step's bookkeeping is dropped once every trainer ran


@pytest.mark.timeout(60)
def test_a_sync_forward_runs_only_once_the_previous_steps_update_is_applied(monkeypatch):
    # A pipelined trainer sends its step-1 forward before it knows its step-0 update landed.
    cfg = validate(Config(cluster=ClusterConfig(num_servers=1, num_trainers=2), train=TrainConfig(steps=2)))
    ps = ParameterServer(server_settings(cfg), rank=0)
    monkeypatch.setattr(ps, "gradients", lambda context_id: {})  # no RPC here: an update without gradients
    x = torch.randn(4, *cfg.data.sample_shape())
    first = ps.shards[0]

    early = threading.Thread(target=ps.forward, args=(0, x, 0, 1))
    early.start()
    early.join(timeout=0.5)
    assert early.is_alive(), "the step-1 forward ran before any step-0 update"
    pending = ps.update(0, 0, 0)  # trainer0's half of round 0 waits...
    assert not pending.done() and ps.mode.rounds == 0
    early.join(timeout=0.5)
    assert early.is_alive(), "the step-1 forward ran before trainer1's step-0 update"
    done = ps.update(0, 1, 0)  # ...until trainer1's completes it
    early.join(timeout=30)
    assert not early.is_alive() and pending.done() and done.done() and ps.mode.rounds == 1
    torch.testing.assert_close(ps.forward(0, x, 1, 1), first(x))  # step 1 itself does not wait

    restored = ParameterServer(server_settings(cfg), rank=0)
    restored.load_state_dict(ps.state_dict())
    assert restored.mode.rounds == 1


@pytest.mark.timeout(60)
def test_a_failed_sync_update_fails_its_round_and_what_waits_for_it_naming_it(monkeypatch):
    cfg = validate(Config(cluster=ClusterConfig(num_servers=1, num_trainers=2), train=TrainConfig(steps=2)))
    ps = ParameterServer(server_settings(cfg), rank=0)

    def grads(context_id):
        if context_id == 7:
            raise RuntimeError(f"Could not find autograd context with id: {context_id}")
        return {}

    monkeypatch.setattr(ps, "gradients", grads)
    waiting = ps.update(1, 1, 0)  # trainer1's half of round 0
    assert not waiting.done()
    with pytest.raises(RuntimeError, match="Could not find autograd context"):
        ps.update(7, 0, 0)  # trainer0's half fails
    failed = "the step-0 update failed.*autograd context with id: 7"
    with pytest.raises(RuntimeError, match=f"cannot run the step-0 update: {failed}"):
        waiting.wait()  # trainer1 learns it instead of waiting forever
    with pytest.raises(RuntimeError, match=f"cannot run the step-1 forward: {failed}"):
        ps.forward(0, torch.randn(4, *cfg.data.sample_shape()), 0, 1)
    with pytest.raises(RuntimeError, match=f"cannot run the step-1 update: {failed}"):
        ps.update(1, 1, 1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("aggregate", "divisor"), [("mean", 3), ("sum", 1)])
def test_a_sync_round_steps_once_with_the_mean_or_the_sum_of_the_trainers_gradients(monkeypatch, aggregate, divisor):
    # Plain SGD: a step with gradient g moves each weight by -lr * g.
    cfg = validate(
        Config(
            cluster=ClusterConfig(num_servers=1, num_trainers=3),
            optim=OptimConfig(momentum=0.0),
            mode=ModeConfig(name="sync", aggregate=aggregate),
            train=TrainConfig(steps=1),
        )
    )
    ps = ParameterServer(server_settings(cfg), rank=0)
    before = [p.detach().clone() for p in ps.params]
    # Trainer k's gradient (context k) is k + 1 everywhere.
    monkeypatch.setattr(
        ps, "gradients", lambda context_id: {p: torch.full_like(p, context_id + 1.0) for p in ps.params}
    )
    rounds = [ps.update(k, k, 0) for k in (2, 0, 1)]
    assert all(r.done() for r in rounds) and ps.version == 1
    for p, w in zip(ps.params, before, strict=True):
        assert torch.equal(p.detach(), w.add(torch.full_like(w, 1.0 + 2.0 + 3.0) / divisor, alpha=-cfg.optim.lr))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("rule", "factors"), [("scale", [1, 1, 1 / 2, 1 / 3, 1 / 3]), ("none", [1, 1, 1, 1, 1])])
def test_an_async_update_steps_at_the_learning_rate_its_staleness_gives(monkeypatch, rule, factors):
    # Plain SGD with a gradient of ones: an update at rate r moves each weight by -r.
    cfg = validate(
        Config(
            cluster=ClusterConfig(num_servers=2, num_trainers=4, placement="round_robin"),
            optim=OptimConfig(momentum=0.0),
            mode=ModeConfig(name="async", staleness_rule=rule),
            train=TrainConfig(steps=2),
        )
    )
    ps = ParameterServer(server_settings(cfg), rank=0)  # the MLP's shards 0 (input [B, 64]) and 2 (input [B, 64])
    assert sorted(ps.shards) == [0, 2]
    before = [p.detach().clone() for p in ps.params]
    monkeypatch.setattr(ps, "gradients", lambda context_id: {p: torch.ones_like(p) for p in ps.params})
    x = torch.randn(4, *cfg.data.sample_shape())  # [4, 64]
    for t in range(4):
        ps.forward(0, x, t, 0)  # every trainer's step 0 reads version 0
    staleness = [ps.update(0, 0, 0).wait()]  # nobody overtook trainer0: 0
    ps.forward(0, x, 0, 1)  # trainer0's step 1 reads version 1
    ps.forward(2, torch.randn(4, 64), 1, 0)  # trainer1's last shard at version 1: its step first read version 0
    staleness += [ps.update(0, t, 0).wait() for t in (1, 2, 3)]  # 1, 2, 3 updates since version 0
    staleness.append(ps.update(0, 0, 1).wait())  # trainer0's step 1: versions 2, 3, 4 since its read
    assert staleness == [0, 1, 2, 3, 3]
    assert ps.mode.max_staleness_seen == 3 and ps.version == 5
    assert ps.mode._read_version == {}  # every step's read is forgotten once its update is in
    assert ps.optimizer.param_groups[0]["lr"] == cfg.optim.lr  # the configured rate is back
    for p, w in zip(ps.params, before, strict=True):
        for f in factors:
            w = w.add(torch.ones_like(w), alpha=-cfg.optim.lr * f)
        assert torch.equal(p.detach(), w)


def test_only_servers_holding_tables_under_a_ram_budget_take_the_lower_malloc_thresholds():
    cluster = ClusterConfig(num_servers=2, num_trainers=2)
    budgeted = Config(model=DLRMConfig(table_memory_budget="1GB"), cluster=cluster)
    in_ram = Config(model=DLRMConfig(lazy_rows=True), cluster=cluster)
    default = (MMAP_THRESHOLD, TRIM_THRESHOLD)
    assert [tuple(malloc_thresholds(budgeted, r)) for r in range(4)] == [tuple(BUDGETED_SERVER_MALLOC)] * 2 + [
        default
    ] * 2
    assert BUDGETED_SERVER_MALLOC.mmap_threshold < MMAP_THRESHOLD
    assert [tuple(malloc_thresholds(in_ram, r)) for r in range(4)] == [default] * 4
