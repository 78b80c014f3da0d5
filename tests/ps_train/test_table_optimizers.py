"""Embedding-table optimizers (``ps_train.workloads.ctr.tables.optimizers``): the registry; sgd, adagrad and
sparse_adam equal torch's, bit for bit; row-wise Adagrad equals a plain-torch reference."""

from __future__ import annotations

import copy

import pytest
import torch

from ps_train.config import TABLE_OPTIMIZER_NAMES, ConfigError, OptimConfig
from ps_train.workloads.ctr.tables.optimizers import (
    TABLE_OPTIMIZERS,
    RowsOptimizer,
    RowWiseAdagrad,
    TorchTableOptimizer,
    make_table_optimizer,
    table_optimizer_spec,
)


def test_the_registry_has_every_name_the_config_accepts():
    assert set(TABLE_OPTIMIZERS) == set(TABLE_OPTIMIZER_NAMES) == {"sgd", "adagrad", "sparse_adam", "rowwise_adagrad"}
    with pytest.raises(ConfigError, match="model.table_optim: unknown optimizer 'ftrl'"):
        make_table_optimizer("ftrl", [], OptimConfig())


def _sparse(rows: list[int], values: torch.Tensor, num_rows: int) -> torch.Tensor:
    """A coalesced sparse gradient [num_rows, dim] of ``rows`` (unique, ascending)."""
    return torch.sparse_coo_tensor(torch.tensor([rows]), values, (num_rows, values.shape[1])).coalesce()


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # torch's Adagrad, as in the reference
@pytest.mark.parametrize("name", ["sgd", "adagrad", "sparse_adam"])
def test_a_torch_table_optimizer_steps_the_named_rows_as_torch_does(name):
    cfg = OptimConfig(lr=0.1, momentum=0.0)
    g = torch.Generator().manual_seed(0)
    tables = [torch.nn.Parameter(torch.randn(6, 3, generator=g)), torch.nn.Parameter(torch.randn(4, 3, generator=g))]
    reference = [torch.nn.Parameter(t.detach().clone()) for t in tables]
    cls, kwargs = table_optimizer_spec(name, cfg, lr=0.05)
    torch_opt = cls(reference, **kwargs)
    opt = make_table_optimizer(name, tables, cfg, lr=0.05)
    # sgd and adagrad update the rows with index ops (torch's sparse kernels are ~10x slower).
    assert isinstance(opt, TorchTableOptimizer if name == "sparse_adam" else RowsOptimizer)
    for step in range(3):
        grads = [
            _sparse([1, 4], torch.randn(2, 3, generator=g), 6),
            None if step == 1 else _sparse([0], torch.randn(1, 3, generator=g), 4),
        ]
        opt.step(grads)
        for p, grad in zip(reference, grads, strict=True):
            p.grad = grad
        torch_opt.step()
        torch_opt.zero_grad(set_to_none=True)
    for p, q in zip(tables, reference, strict=True):
        assert torch.equal(p.detach(), q.detach())
        assert p.grad is None  # nothing left behind for the next step
    untouched = [2, 3, 5]
    assert torch.equal(tables[0].detach()[untouched], reference[0].detach()[untouched])

    # The state survives a checkpoint: a copy restored from it steps as the original does.
    restored_tables = [torch.nn.Parameter(t.detach().clone()) for t in tables]
    restored = make_table_optimizer(name, restored_tables, cfg, lr=0.05)
    restored.load_state_dict(copy.deepcopy(opt.state_dict()))
    grads = [_sparse([2], torch.ones(1, 3), 6), _sparse([3], torch.ones(1, 3), 4)]
    opt.step(grads)
    restored.step(grads)
    for p, q in zip(tables, restored_tables, strict=True):
        assert torch.equal(p.detach(), q.detach())


def test_the_learning_rate_factor_scales_a_step_and_then_is_gone():
    table = torch.nn.Parameter(torch.zeros(3, 2))
    opt = make_table_optimizer("sgd", [table], OptimConfig(lr=0.5, momentum=0.0))
    opt.step([_sparse([1], torch.ones(1, 2), 3)], lr_factor=0.25)
    assert torch.equal(table.detach()[1], torch.full((2,), -0.125))
    opt.step([_sparse([1], torch.ones(1, 2), 3)])
    assert torch.equal(table.detach()[1], torch.full((2,), -0.625))


def _rowwise_reference(
    weight: torch.Tensor,
    state: torch.Tensor,
    ids: torch.Tensor,
    grads: torch.Tensor,
    lr: float,
    eps: float,
    weight_decay: float,
) -> None:
    """Row-wise Adagrad as FBGEMM's CPU kernel writes it, one id at a time in plain torch:
    duplicate ids' gradients summed first, then per distinct row ``g += wd * w``,
    ``state += mean(g^2)``, ``w = (1 - m * wd) * w - m * grad`` with ``m = lr / (sqrt(state) + eps)``."""
    summed: dict[int, torch.Tensor] = {}
    for i, g in zip(ids.tolist(), grads, strict=True):
        summed[i] = summed[i] + g if i in summed else g.clone()
    for row, grad in summed.items():
        g = grad + weight_decay * weight[row]
        state[row] += (g * g).sum() / g.numel()
        m = lr / (torch.sqrt(state[row]) + eps)
        weight[row] = (1 - m * weight_decay) * weight[row] - grad * m


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_rowwise_adagrad_equals_a_plain_reference_over_several_steps(weight_decay: float) -> None:
    g = torch.Generator().manual_seed(3)
    rows, dim, lr, eps = 12, 5, 0.3, 1e-8
    tables = [
        torch.nn.Parameter(torch.randn(rows, dim, generator=g)),
        torch.nn.Parameter(torch.randn(4, dim, generator=g)),
    ]
    ref_w = [t.detach().clone() for t in tables]
    ref_state = [torch.zeros(t.shape[0]) for t in tables]
    opt = RowWiseAdagrad(tables, lr=lr, eps=eps, weight_decay=weight_decay)
    for step in range(6):
        grads: list[torch.Tensor | None] = []
        for t, table in enumerate(tables):
            if step == 2 and t == 1:
                grads.append(None)  # a table no id of the batch used
                continue
            ids = torch.randint(0, table.shape[0], (7,), generator=g)
            ids[3] = ids[0]  # a duplicate id: its gradients are summed before the update
            vals = torch.randn(7, dim, generator=g)
            _rowwise_reference(ref_w[t], ref_state[t], ids, vals, lr, eps, weight_decay)
            # What a server hands the optimizer: uncoalesced here, one entry per id.
            grads.append(torch.sparse_coo_tensor(ids.unsqueeze(0), vals, table.shape))
        opt.step(grads)
        for t, table in enumerate(tables):
            torch.testing.assert_close(table.detach(), ref_w[t], rtol=0, atol=1e-6, msg=f"step {step} table {t}")
            torch.testing.assert_close(opt.sums[t], ref_state[t], rtol=0, atol=1e-6)
    # One float per row: 1/dim of Adagrad's state.
    assert [s.shape for s in opt.state_dict()["sum"]] == [torch.Size([rows]), torch.Size([4])]
    restored_tables = [torch.nn.Parameter(t.detach().clone()) for t in tables]
    restored = RowWiseAdagrad(restored_tables, lr=lr, eps=eps, weight_decay=weight_decay)
    restored.load_state_dict(copy.deepcopy(opt.state_dict()))
    step_grads = [torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1, dim), t.shape) for t in tables]
    opt.step(step_grads)
    restored.step(step_grads)
    for p, q in zip(tables, restored_tables, strict=True):
        assert torch.equal(p.detach(), q.detach())
    with pytest.raises(ValueError, match="resume with the same tables"):
        RowWiseAdagrad([torch.nn.Parameter(torch.zeros(3, dim))], lr=lr).load_state_dict(opt.state_dict())


def test_rowwise_adagrad_scales_by_the_learning_rate_factor() -> None:
    table = torch.nn.Parameter(torch.zeros(2, 4))
    opt = RowWiseAdagrad([table], lr=1.0, eps=1e-8)
    grad = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.full((1, 4), 2.0), (2, 4))
    opt.step([grad], lr_factor=0.5)
    # state = mean(4) = 4; step = 0.5 * 2 / (2 + 1e-8)
    torch.testing.assert_close(table.detach()[0], torch.full((4,), -0.5), rtol=0, atol=1e-7)
    assert not table.detach()[1].any()
