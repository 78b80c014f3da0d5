"""Embedding-table optimizers (``ps_train.ctr.optimizers``): the registry and torch's, row by row."""

from __future__ import annotations

import copy

import pytest
import torch

from ps_train.config import TABLE_OPTIMIZER_NAMES, ConfigError, OptimConfig
from ps_train.ctr.optimizers import TABLE_OPTIMIZERS, TorchTableOptimizer, make_table_optimizer, table_optimizer_spec


def test_the_registry_has_every_name_the_config_accepts():
    assert set(TABLE_OPTIMIZERS) == set(TABLE_OPTIMIZER_NAMES) == {"sgd", "adagrad", "sparse_adam"}
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
    assert isinstance(opt, TorchTableOptimizer)
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
