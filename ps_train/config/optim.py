"""The ``optim`` group: which torch optimizer the servers run, and its settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ps_train.config.base import ConfigError, Problems

__all__ = ["OptimConfig", "OPTIMIZERS", "optimizer_spec", "TABLE_OPTIMIZER_NAMES"]

# name -> (optimizer class, OptimConfig fields it takes)
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], tuple[str, ...]]] = {
    "sgd": (torch.optim.SGD, ("momentum", "weight_decay", "nesterov")),
    "adam": (torch.optim.Adam, ("betas", "weight_decay")),
    "adamw": (torch.optim.AdamW, ("betas", "weight_decay")),
    "rmsprop": (torch.optim.RMSprop, ("momentum", "weight_decay")),
    "adagrad": (torch.optim.Adagrad, ("weight_decay",)),
}

# model.table_optim: the embedding-table optimizers (ps_train.workloads.ctr.tables.optimizers, which holds them;
# the config, below ctr/, knows their names only).
TABLE_OPTIMIZER_NAMES = ("sgd", "adagrad", "sparse_adam", "rowwise_adagrad")


@dataclass
class OptimConfig:
    # The servers' torch.optim optimizer: sgd | adam | adamw | rmsprop | adagrad (the choices
    # optim=sgd|adam|adamw|adagrad set their fields; the others: optim.name=... with optim.momentum=0).
    name: str = "sgd"
    lr: float = 0.05  # learning rate (async/ssp: divided by the staleness, mode.staleness_rule)
    momentum: float = 0.9  # optimizers without momentum (adam, ...) need 0 here
    weight_decay: float = 0.0  # L2 penalty, as the optimizer's weight_decay
    nesterov: bool = False  # sgd only: Nesterov momentum
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adam/adamw: the moving averages' decay

    def problems(self) -> Problems:
        p = Problems()
        if self.name not in OPTIMIZERS:
            p.append(f"optim.name: unknown optimizer {self.name!r}; choose one of {list(OPTIMIZERS)}")
        else:
            takes = OPTIMIZERS[self.name][1]
            p.need(
                "momentum" in takes or self.momentum == 0,
                f"optim.momentum: {self.name} has no momentum; remove the override or use optim=sgd",
            )
            p.need("nesterov" in takes or not self.nesterov, "optim.nesterov: only sgd supports nesterov")
        p.need(self.lr > 0, f"optim.lr: {self.lr} must be > 0")
        p.need(self.momentum >= 0, f"optim.momentum: {self.momentum} must be >= 0")
        p.need(not self.nesterov or self.momentum > 0, "optim.nesterov: needs optim.momentum > 0")
        p.need(self.weight_decay >= 0, f"optim.weight_decay: {self.weight_decay} must be >= 0")
        p.need(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"optim.betas: {self.betas} must be two values in [0, 1)",
        )
        return p


def optimizer_spec(cfg: OptimConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The optimizer class and its kwargs, e.g. for ``DistributedOptimizer(cls, rrefs, **kw)``."""
    if cfg.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name: unknown optimizer {cfg.name!r}; choose one of {list(OPTIMIZERS)}")
    cls, takes = OPTIMIZERS[cfg.name]
    kwargs: dict[str, Any] = {"lr": cfg.lr}
    for name in takes:
        value = getattr(cfg, name)
        kwargs[name] = tuple(value) if name == "betas" else value
    return cls, kwargs
