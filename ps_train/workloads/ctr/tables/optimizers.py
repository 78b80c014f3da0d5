"""Embedding-table optimizers: how a server updates its rows of the tables (``model.table_optim``).

A table optimizer gets, per table, the rows a step touched and their summed gradients: a
coalesced sparse gradient ``[rows_t, dim]`` whose ``indices()[0]`` are the unique local rows
[U] and whose ``values()`` are their gradients [U, dim]. It changes those rows only -- no
momentum or weight decay, which would touch every row of a table each step -- and its
state (``state_dict``) goes into the server's checkpoint file.

- ``TableOptimizer``: the interface (``step``, ``state_dict``, ``load_state_dict``; and
  ``reset_rows``, fresh state for a dynamic table's reused slots: its rows are the slots).
- ``TorchTableOptimizer``: one of torch's optimizers that take sparse gradients
  (``TORCH_TABLE_OPTIMIZERS``: SGD, Adagrad, SparseAdam); ``sparse_adam`` runs on it.
- ``RowsSGD``, ``RowsAdagrad``: torch's SGD and Adagrad on sparse gradients, bit for bit,
  as gathers and scatters of the touched rows (``index_select`` / ``index_copy_`` /
  ``index_add_``): torch's own sparse Adagrad adds a sparse tensor into its dense state and
  masks it (``sparse_mask``), which costs ~10x more time than the rows it changes need.
- ``RowWiseAdagrad``: exact row-wise Adagrad (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``, TorchRec's
  ``RowWiseAdagrad``): one accumulator per row, 1/dim of Adagrad's state.
- ``TABLE_OPTIMIZERS``: the registry by name; ``make_table_optimizer`` builds one.

A custom optimizer (FTRL, ...) is a ``TableOptimizer`` subclass here, an entry in
``TABLE_OPTIMIZERS``, and its name in ``ps_train.config.TABLE_OPTIMIZER_NAMES`` (what
``model.table_optim`` accepts; the config imports nothing of ctr/).
"""

from __future__ import annotations

import copy
import functools
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from ps_train.config import ConfigError, OptimConfig
from ps_train.modes.aggregation import scaled_lr
from ps_train.workloads.ctr.tables.half_rows import chunk_rows

_ROW_MARK = "<rows>:"  # scalar_state's stand-in for a per-row tensor

__all__ = [
    "TableOptimizer",
    "TorchTableOptimizer",
    "RowsOptimizer",
    "RowTarget",
    "RowsSGD",
    "RowsAdagrad",
    "RowWiseAdagrad",
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

    def row_state(self) -> dict[str, Tensor]:
        """The live per-row state tensors, each [rows, ...] aligned with a table's rows (a
        checkpoint writes them row by row, with the rows: ``ps_train.workloads.ctr.tables.snapshot``)."""
        return {}

    def reset_rows(self, rows: Tensor) -> None:
        """Forget the per-row state of ``rows`` (int64 [n]), as if they were never updated: a
        dynamic table's slot reused for another id starts afresh (``ps_train.workloads.ctr.tables.dynamic``)."""
        with torch.no_grad():
            for state in self.row_state().values():
                state.index_fill_(0, rows, 0)

    def scalar_state(self) -> dict[str, Any]:
        """``state_dict`` without the per-row tensors (a copy; each such tensor is replaced by
        a marker naming it), small enough to copy while updates wait."""
        live = {id(t): name for name, t in self.row_state().items()}

        def strip(x: Any) -> Any:
            if isinstance(x, Tensor) and id(x) in live:
                return _ROW_MARK + live[id(x)]
            if isinstance(x, dict):
                return {k: strip(v) for k, v in x.items()}
            if isinstance(x, list | tuple):
                return type(x)(strip(v) for v in x)
            return copy.deepcopy(x)

        return strip(self.state_dict())

    def load_scalar_state(self, state: dict[str, Any]) -> None:
        """Load a ``scalar_state``, keeping the live per-row tensors (fill them afterwards:
        ``row_state`` names them)."""
        live = self.row_state()

        def fill(x: Any) -> Any:
            if isinstance(x, str) and x.startswith(_ROW_MARK):
                name = x.removeprefix(_ROW_MARK)
                if name not in live:
                    raise ValueError(
                        f"the checkpoint has optimizer row state {name!r}, this {type(self).__name__} has "
                        f"{sorted(live)}; resume with the same model.table_optim"
                    )
                return live[name]
            if isinstance(x, dict):
                return {k: fill(v) for k, v in x.items()}
            if isinstance(x, list | tuple):
                return type(x)(fill(v) for v in x)
            return x

        self.load_state_dict(fill(state))


class TorchTableOptimizer(TableOptimizer):
    """A ``torch.optim`` optimizer that takes sparse gradients and updates only the rows they
    name; its state dict is torch's."""

    def __init__(self, tables: Sequence[nn.Parameter], cls: type[torch.optim.Optimizer], **kwargs: Any) -> None:
        super().__init__(tables)
        self.optimizer = cls(self.tables, **kwargs)
        if cls is torch.optim.SparseAdam:
            # The state torch creates at the first step, created now, so that a checkpoint
            # taken before it has the same per-row tensors as any later one.
            for p in self.tables:
                self.optimizer.state[p].update(
                    step=0,
                    exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                    exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format),
                )

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

    def row_state(self) -> dict[str, Tensor]:
        # Torch's state dict names a parameter by its index in the optimizer.
        return {
            f"{k}.{i}": v
            for i, p in enumerate(self.tables)
            for k, v in self.optimizer.state[p].items()
            if isinstance(v, Tensor) and v.dim() >= 1 and v.shape[0] == p.shape[0]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


class RowTarget(Protocol):
    """What a rows optimizer reads and writes rows through: a table tensor [rows, dim], or a
    storage's stand-in for one (``ps_train.workloads.ctr.tables.half_rows.HalfRows``: float32 rows out,
    rounded half-precision rows back)."""

    def index_select(self, dim: int, index: Tensor) -> Tensor: ...

    def index_add_(self, dim: int, index: Tensor, source: Tensor, *, alpha: float = 1) -> Any: ...


class RowsOptimizer(TableOptimizer):
    """An optimizer that reads and writes only the rows a gradient names, with index ops:
    subclasses implement ``_update`` for one table's unique rows and their gradients."""

    def __init__(self, tables: Sequence[nn.Parameter], lr: float) -> None:
        super().__init__(tables)
        if lr <= 0:
            raise ValueError(f"table learning rate {lr} must be > 0")
        self.lr = lr
        self.steps = 0  # steps taken (every table steps together)

    def step(self, grads: Sequence[Tensor | None], lr_factor: float = 1.0) -> None:
        if len(grads) != len(self.tables):
            raise ValueError(f"{len(grads)} gradients for {len(self.tables)} tables")
        self.steps += 1
        with torch.no_grad():
            for t, (table, grad) in enumerate(zip(self.tables, grads, strict=True)):
                if grad is None:
                    continue
                if not grad.is_sparse or grad.sparse_dim() != 1 or grad.shape != table.shape:
                    raise ValueError(
                        f"table {t}: need a sparse gradient of whole rows (sparse_dim 1) shaped "
                        f"{tuple(table.shape)}, got {grad.layout} {tuple(grad.shape)}"
                    )
                if not grad.is_coalesced():
                    grad = grad.coalesce()  # one entry per row: duplicates summed
                self._update(t, table.detach(), grad.indices()[0], grad.values(), self.lr * lr_factor)

    def step_rows(self, target: RowTarget, rows: Tensor, grad: Tensor, lr_factor: float = 1.0) -> None:
        """One step of table 0 through ``target`` (its rows ``rows``, int64 [U] unique, in
        any order; ``grad`` [U, dim] their summed gradients): for a storage that keeps rows
        in its own places (``ps_train.workloads.ctr.tables.tiered_storage``), the per-row state aligned with
        those places (``resize_rows``)."""
        self.steps += 1
        with torch.no_grad():
            self._update(0, target, rows, grad, self.lr * lr_factor)

    def resize_rows(self, rows: int) -> None:
        """Make every per-row state tensor of table 0 ``rows`` rows long (new rows zero)."""

    def _update(self, t: int, weight: RowTarget, rows: Tensor, grad: Tensor, lr: float) -> None:
        """Table ``t`` (``weight`` [rows_t, dim]): update its unique ``rows`` (int64 [U],
        ascending) by their summed gradients ``grad`` [U, dim] at rate ``lr``."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])

    def _load_tensors(self, state: dict[str, Any], key: str, mine: list[Tensor]) -> None:
        saved = state.get(key)
        if saved is None or [tuple(x.shape) for x in saved] != [tuple(x.shape) for x in mine]:
            shapes = None if saved is None else [tuple(x.shape) for x in saved]
            raise ValueError(
                f"the checkpoint's {type(self).__name__} state {key!r} has shapes {shapes}, this "
                f"server's tables need {[tuple(x.shape) for x in mine]}; resume with the same tables, "
                "model.embedding_dim, model.table_optim and cluster.num_servers"
            )
        for x, y in zip(mine, saved, strict=True):
            x.copy_(y)


class RowsSGD(RowsOptimizer):
    """Plain SGD, ``w[rows] -= lr * g``: torch's SGD on a sparse gradient, bit for bit."""

    def _update(self, t: int, weight: RowTarget, rows: Tensor, grad: Tensor, lr: float) -> None:
        weight.index_add_(0, rows, grad, alpha=-lr)


class _SummedRowsOptimizer(RowsOptimizer):
    """A rows optimizer whose state is one accumulator per table (``self.sums``), kept in
    checkpoints as ``sum`` and written row by row (``row_state``)."""

    sums: list[Tensor]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "sum": self.sums}

    def row_state(self) -> dict[str, Tensor]:
        return {f"sum.{i}": s for i, s in enumerate(self.sums)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_tensors(state, "sum", self.sums)
        super().load_state_dict(state)

    def resize_rows(self, rows: int) -> None:
        s = self.sums[0]
        if rows > s.shape[0]:
            self.sums[0] = torch.cat([s, s.new_zeros(rows - s.shape[0], *s.shape[1:])])
        else:
            self.sums[0] = s[:rows].clone()


class RowsAdagrad(_SummedRowsOptimizer):
    """torch's Adagrad on sparse gradients (no lr decay or weight decay, accumulators from
    0), bit for bit: ``sum[rows] += g^2; w[rows] -= lr * g / (sqrt(sum[rows]) + eps)``.
    State: one accumulator per value, as large as the tables."""

    def __init__(self, tables: Sequence[nn.Parameter], lr: float, eps: float = 1e-10) -> None:
        super().__init__(tables, lr)
        self.eps = eps
        self.sums = [torch.zeros_like(p, memory_format=torch.contiguous_format).detach() for p in self.tables]

    def _update(self, t: int, weight: RowTarget, rows: Tensor, grad: Tensor, lr: float) -> None:
        total = self.sums[t].index_select(0, rows).add_(grad.pow(2))  # [U, dim]
        self.sums[t].index_copy_(0, rows, total)
        weight.index_add_(0, rows, grad / total.sqrt_().add_(self.eps), alpha=-lr)


class RowWiseAdagrad(_SummedRowsOptimizer):
    """Exact row-wise Adagrad, as FBGEMM's ``EXACT_ROWWISE_ADAGRAD`` (its CPU kernel) and
    TorchRec's ``RowWiseAdagrad`` define it: one accumulator per row; a step, over the
    distinct rows of the gradient (duplicate ids summed first)::

        g = grad[row] + weight_decay * w[row]         (L2; FBGEMM's weight_decay_mode 1)
        state[row] += mean(g ** 2)                     (over the row's dim values)
        w[row] -= lr / (sqrt(state[row]) + eps) * g    (eps outside the root, as FBGEMM)

    ``eps`` defaults to FBGEMM's 1e-8. State: one float per row, 1/dim of Adagrad's."""

    def __init__(self, tables: Sequence[nn.Parameter], lr: float, eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(tables, lr)
        if eps <= 0 or weight_decay < 0:
            raise ValueError(f"row-wise Adagrad needs eps > 0 and weight_decay >= 0, got {eps}, {weight_decay}")
        self.eps, self.weight_decay = eps, weight_decay
        self.sums = [torch.zeros(p.shape[0], dtype=p.dtype) for p in self.tables]  # [rows_t]

    def _update(self, t: int, weight: RowTarget, rows: Tensor, grad: Tensor, lr: float) -> None:
        # A slice of the rows at a time (each row's update is its own): a step's gradient
        # times its rates is as large as the gradient, tens of MB on a table server.
        n = chunk_rows(grad)
        for at in range(0, len(rows), n):
            self._update_rows(t, weight, rows[at : at + n], grad[at : at + n], lr)

    def _update_rows(self, t: int, weight: RowTarget, rows: Tensor, grad: Tensor, lr: float) -> None:
        if self.weight_decay:
            grad = grad + self.weight_decay * weight.index_select(0, rows)
        total = self.sums[t].index_select(0, rows).add_(grad.pow(2).mean(dim=1))  # [U]
        self.sums[t].index_copy_(0, rows, total)
        step = total.sqrt_().add_(self.eps).reciprocal_().mul_(-lr)  # [U]: -lr / (sqrt(state) + eps)
        weight.index_add_(0, rows, grad * step.unsqueeze(1))


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
    "sgd": lambda tables, cfg, lr: RowsSGD(tables, cfg.lr if lr is None else lr),
    "adagrad": lambda tables, cfg, lr: RowsAdagrad(tables, cfg.lr if lr is None else lr),
    "sparse_adam": functools.partial(_torch, "sparse_adam"),
    "rowwise_adagrad": lambda tables, cfg, lr: RowWiseAdagrad(tables, cfg.lr if lr is None else lr),
}


def make_table_optimizer(
    name: str, tables: Sequence[nn.Parameter], cfg: OptimConfig, lr: float | None = None
) -> TableOptimizer:
    """Table optimizer ``name`` (``model.table_optim``) over ``tables``, at ``lr``
    (``model.table_lr``) or else ``cfg.lr``."""
    if name not in TABLE_OPTIMIZERS:
        raise ConfigError(f"model.table_optim: unknown optimizer {name!r}; choose one of {list(TABLE_OPTIMIZERS)}")
    return TABLE_OPTIMIZERS[name](tables, cfg, lr)
