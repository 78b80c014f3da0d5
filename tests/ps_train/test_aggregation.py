"""The update arithmetic on its own: sync averaging (``combine``) and the staleness-aware
learning rate of async/ssp updates (``lr_scale``, ``scaled_lr``)."""

import pytest
import torch
import torch.nn.functional as F

from ps_train.modes.aggregation import combine, lr_scale, scaled_lr


def _grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)}


def test_sum_adds_in_trainer_rank_order_and_mean_divides_that_sum_by_the_trainers():
    per = {r: _grads(r) for r in (2, 0, 1)}  # handed in out of rank order
    total = combine(per, "sum")
    mean = combine(per, "mean")
    for key in ("w", "b"):
        in_rank_order = (per[0][key] + per[1][key]) + per[2][key]
        assert torch.equal(total[key], in_rank_order)
        assert torch.equal(mean[key], in_rank_order / 3)  # a true division, as a single process does it


def test_mean_of_equal_batches_mean_gradients_is_the_union_batch_mean_loss_gradient():
    # What averaging means: 4 trainers with 16 samples each step like one process on the
    # 64-sample union batch. Not bit for bit: the union's loss adds all 64 per-sample terms in
    # one reduction and divides by 64, the trainers add 16 each, divide by 16, then the server
    # adds the 4 results and divides by 4 -- float addition is not associative, so the two
    # differ in the last bits (~1e-8 here); 1e-6 bounds it.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    xs = [torch.randn(16, 8) for _ in range(4)]  # [16, 8] per trainer
    ys = [torch.randint(0, 5, (16,)) for _ in range(4)]
    per = {}
    for rank, (x, y) in enumerate(zip(xs, ys, strict=True)):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        per[rank] = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
    mean = combine(per, "mean")
    for name, p in model.named_parameters():
        torch.testing.assert_close(mean[name], p.grad, rtol=0, atol=1e-6)
        torch.testing.assert_close(combine(per, "sum")[name], 4 * p.grad, rtol=0, atol=4e-6)


def test_a_trainer_without_a_gradient_for_a_parameter_contributes_zero_to_the_mean():
    a, b = _grads(0), _grads(1)
    del b["b"]  # trainer1's loss did not use that parameter
    mean = combine({0: a, 1: b}, "mean")
    assert torch.equal(mean["w"], (a["w"] + b["w"]) / 2)
    assert torch.equal(mean["b"], a["b"] / 2)  # as DDP: divided by every trainer of the round


def test_sparse_gradients_average_like_their_dense_values():
    # Embedding rows touched by each trainer: COO gradients [rows, dim] = [6, 3].
    g0 = torch.sparse_coo_tensor([[0, 2]], torch.ones(2, 3), (6, 3), check_invariants=True)
    g1 = torch.sparse_coo_tensor([[2, 5]], 3 * torch.ones(2, 3), (6, 3), check_invariants=True)
    mean = combine({0: {"e": g0}, 1: {"e": g1}}, "mean")
    assert mean["e"].is_sparse
    assert torch.equal(mean["e"].to_dense(), (g0.to_dense() + g1.to_dense()) / 2)


def test_combine_leaves_the_trainers_gradients_as_they_were():
    per = {r: _grads(r) for r in range(3)}
    before = {r: {k: v.clone() for k, v in g.items()} for r, g in per.items()}
    combine(per, "mean")
    combine(per, "sum")
    for r, g in per.items():
        for k, v in g.items():
            assert torch.equal(v, before[r][k])


@pytest.mark.parametrize("how", ["mean", "sum"])
def test_owned_gradients_sum_in_the_first_trainers_dense_tensor_to_the_same_floats(how):
    per = {
        r: {k: torch.randn(257, 129, generator=torch.Generator().manual_seed(10 * r + i)) for i, k in enumerate("ab")}
        for r in range(3)
    }
    per[1]["c"] = torch.randn(7)  # only trainer 1 has it: divided in place (mean) in its own tensor
    per[0]["e"] = torch.sparse_coo_tensor([[0, 2]], torch.ones(2, 3), (6, 3))
    per[2]["e"] = torch.sparse_coo_tensor([[2, 5]], 3 * torch.ones(2, 3), (6, 3))
    want = combine(per, how)
    firsts = {"a": per[0]["a"], "b": per[0]["b"], "c": per[1]["c"], "e": per[0]["e"]}
    sparse_before = per[0]["e"].clone()
    got = combine(per, how, owned=True)
    for k in want:
        assert torch.equal(got[k].to_dense(), want[k].to_dense()), k
    for k in "abc":  # no new tensor: the first trainer's holds the result
        assert got[k] is firsts[k]
    assert torch.equal(per[0]["e"].to_dense(), sparse_before.to_dense())  # sparse sums out of place


def test_one_trainer_is_its_own_mean_and_sum():
    g = _grads(0)
    for how in ("mean", "sum"):
        out = combine({0: g}, how)
        assert all(torch.equal(out[k], g[k]) for k in g)


def test_an_unknown_aggregate_is_a_clear_error():
    with pytest.raises(ValueError, match=r"mode.aggregate: unknown rule 'avg'; choose one of \['mean', 'sum'\]"):
        combine({0: _grads(0)}, "avg")


@pytest.mark.parametrize(("staleness", "factor"), [(0, 1.0), (1, 1.0), (2, 0.5), (4, 0.25), (7, 1 / 7), (100, 0.01)])
def test_the_scale_rule_divides_the_learning_rate_by_the_staleness(staleness, factor):
    # Zhang et al. 2016: lr / tau, and the full rate for a gradient nobody else's update
    # overtook (tau 0) or just one did (tau 1).
    assert lr_scale(staleness, "scale") == factor


@pytest.mark.parametrize("staleness", [0, 1, 5, 1000])
def test_the_none_rule_keeps_the_full_learning_rate(staleness):
    assert lr_scale(staleness, "none") == 1.0


def test_bad_staleness_or_rule_is_a_clear_error():
    with pytest.raises(ValueError, match="staleness must be >= 0, got -1"):
        lr_scale(-1, "scale")
    with pytest.raises(ValueError, match=r"mode.staleness_rule: unknown rule 'inverse'; choose one of"):
        lr_scale(3, "inverse")


@pytest.mark.parametrize(
    "make",
    [
        lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
        lambda params, lr: torch.optim.Adam(params, lr=lr),
    ],
    ids=["sgd_momentum", "adam"],
)
def test_a_step_under_scaled_lr_is_a_step_at_the_scaled_rate_and_the_rate_comes_back(make):
    lr, factors = 0.1, [1.0, 0.25, 0.5, 1 / 3]
    scaled = torch.nn.Parameter(torch.ones(5))
    plain = torch.nn.Parameter(torch.ones(5))
    opt = make([scaled], lr)
    ref_state = None
    for i, f in enumerate(factors):
        grad = torch.full((5,), float(i + 1))
        scaled.grad = grad.clone()
        with scaled_lr(opt, f):
            opt.step()
        assert opt.param_groups[0]["lr"] == lr  # checkpoints and logs see the configured rate
        # The same step by an optimizer whose rate is lr * f at that step (state carried over).
        ref = make([plain], lr * f)
        if ref_state is not None:
            ref.load_state_dict({**ref_state, "param_groups": ref.state_dict()["param_groups"]})
        plain.grad = grad.clone()
        ref.step()
        ref_state = ref.state_dict()
        assert torch.equal(scaled.detach(), plain.detach()), f"step {i}"


def test_scaled_lr_restores_the_rate_when_the_step_fails():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.05)
    with pytest.raises(RuntimeError, match="boom"), scaled_lr(opt, 0.5):
        assert opt.param_groups[0]["lr"] == 0.025
        raise RuntimeError("boom")
    assert opt.param_groups[0]["lr"] == 0.05
