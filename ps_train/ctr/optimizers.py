"""Embedding-table optimizers: how a server updates its rows of the tables (``model.table_optim``).

A table optimizer gets, per table, the rows a step touched and their summed gradients: a
coalesced sparse gradient ``[rows_t, dim]`` whose ``indices()[0]`` are the unique local rows
[U] and whose ``values()`` are their gradients [U, dim]. It changes those rows only -- no
momentum or weight decay, which would touch every row of a table each step -- and its
state (``state_dict``) goes into the server's checkpoint file.

- ``TableOptimizer``: the interface (``step``, ``state_dict``, ``load_state_dict``).
- ``TorchTableOptimizer``: one of torch's optimizers that take sparse gradients (SGD,
  Adagrad, SparseAdam), today's choices (``TORCH_TABLE_OPTIMIZERS``).
- ``TABLE_OPTIMIZERS``: the registry by name; ``make_table_optimizer`` builds one.

A custom optimizer (row-wise Adagrad, FTRL) is a ``TableOptimizer`` subclass here, an entry
in ``TABLE_OPTIMIZERS``, and its name in ``ps_train.config.TABLE_OPTIMIZER_NAMES`` (what
``model.table_optim`` accepts; the config imports nothing of ctr/).
"""

from __future__ import annotations

import functools
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ps_train.config import ConfigError, OptimConfig
from ps_train.modes.aggregation import scaled_lr

__all__ = [
    "TableOptimizer",
    "TorchTableOptimizer",
    "TORCH_TABLE_OPTIMIZERS",
    "TABLE_OPTIMIZERS",
    "table_optimizer_spec",
    "make_table_optimizer",
]


class TableOptimizer(ABC):
    """Updates the rows of a server's tables (``tables``: [rows_t, dim] each) from sparse
    gradients."""

    def __init__(self, tables: Sequence[nn.Parameter]) -> None:
        self.tables = list(tables)

    @abstractmethod
    def step(self, grads: Sequence[Tensor | None], lr_factor: float = 1.0) -> None:
        """``grads[t]``: table t's coalesced sparse gradient [rows_t, dim] (its indices the
        unique rows a step used, its values their summed gradients [U_t, dim]), or None if
        no row of it was used. ``lr_factor``: the rate is the configured one times this
        (async's staleness rule, ``ps_train.modes.aggregation``)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state (a dict of tensors and plain values: it is checkpointed)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TorchTableOptimizer(TableOptimizer):
    """A ``torch.optim`` optimizer that takes sparse gradients and updates only the rows they
    name; its state dict is torch's."""

    def __init__(self, tables: Sequence[nn.Parameter], cls: type[torch.optim.Optimizer], **kwargs: Any) -> None:
        super().__init__(tables)
        self.optimizer = cls(self.tables, **kwargs)

    def step(self, grads: Sequence[Tensor | None], lr_factor: float = 1.0) -> None:
        for p, g in zip(self.tables, grads, strict=True):
            p.grad = g
        try:
            with scaled_lr(self.optimizer, lr_factor), warnings.catch_warnings():
                # Adagrad builds its sparse update from the coalesced gradient's own indices,
                # which are valid; torch warns that it does not re-check them.
                warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
                self.optimizer.step()
        finally:
            for p in self.tables:
                p.grad = None

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


# model.table_optim -> (torch class, OptimConfig fields it takes).
TORCH_TABLE_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], tuple[str, ...]]] = {
    "sgd": (torch.optim.SGD, ()),
    "adagrad": (torch.optim.Adagrad, ()),
    "sparse_adam": (torch.optim.SparseAdam, ("betas",)),
}


def table_optimizer_spec(
    name: str, cfg: OptimConfig, lr: float | None = None
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The class and kwargs of torch's table optimizer ``name`` (``model.table_optim``);
    ``lr`` (``model.table_lr``) or else ``cfg.lr``, and ``cfg.betas`` for sparse_adam. Also
    what the single-process references (tests, ``benchmarks/ctr_bench.py``) train with."""
    if name not in TORCH_TABLE_OPTIMIZERS:
        raise ConfigError(
            f"model.table_optim: unknown optimizer {name!r}; choose one of {list(TORCH_TABLE_OPTIMIZERS)}"
        )
    cls, takes = TORCH_TABLE_OPTIMIZERS[name]
    kwargs: dict[str, Any] = {"lr": cfg.lr if lr is None else lr}
    if "betas" in takes:
        kwargs["betas"] = tuple(cfg.betas)
    return cls, kwargs


# (tables, optim config, model.table_lr) -> the optimizer
TableOptimizerFactory = Callable[[Sequence[nn.Parameter], OptimConfig, float | None], TableOptimizer]


def _torch(name: str, tables: Sequence[nn.Parameter], cfg: OptimConfig, lr: float | None) -> TableOptimizer:
    cls, kwargs = table_optimizer_spec(name, cfg, lr)
    return TorchTableOptimizer(tables, cls, **kwargs)


TABLE_OPTIMIZERS: dict[str, TableOptimizerFactory] = {
    name: functools.partial(_torch, name) for name in TORCH_TABLE_OPTIMIZERS
}


def make_table_optimizer(
    name: str, tables: Sequence[nn.Parameter], cfg: OptimConfig, lr: float | None = None
) -> TableOptimizer:
    """Table optimizer ``name`` (``model.table_optim``) over ``tables``, at ``lr``
    (``model.table_lr``) or else ``cfg.lr``."""
    if name not in TABLE_OPTIMIZERS:
        raise ConfigError(f"model.table_optim: unknown optimizer {name!r}; choose one of {list(TABLE_OPTIMIZERS)}")
    return TABLE_OPTIMIZERS[name](tables, cfg, lr)
