"""The parameter server's optimizer for its dense shards.

Every ``torch.optim.Optimizer`` imports ``torch._dynamo`` the first time one of its methods
runs (its constructor included): about 1.5 CPU-seconds, once per server, before it can
apply an update -- as long as importing torch itself. ``PlainSGD`` is SGD without that: the
same functional step ``torch.optim.SGD.step`` calls (``torch.optim.sgd.sgd``) with the same
arguments, so its updates are bit-identical, and ``state_dict`` in ``torch.optim.SGD``'s
format, so checkpoints move between the two. The other optimizers are torch's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.sgd import sgd

from ps_train.config import OptimConfig, optimizer_spec

__all__ = ["PlainSGD", "make_server_optimizer", "imports_dynamo"]

# torch.optim.SGD's param-group defaults besides its constructor's arguments (torch >= 2.1)
_SGD_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "momentum": 0.0,
    "dampening": 0.0,
    "weight_decay": 0.0,
    "nesterov": False,
    "maximize": False,
    "foreach": None,
    "differentiable": False,
    "fused": None,
}


class PlainSGD:
    """``torch.optim.SGD(params, lr, momentum, weight_decay, nesterov)`` on CPU tensors: the
    parts a server uses (``param_groups``, ``step``, ``state_dict``, ``load_state_dict``)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(
                f"optim: lr={lr}, momentum={momentum}, weight_decay={weight_decay} must be >= 0 "
                "(set optim.lr, optim.momentum, optim.weight_decay)"
            )
        if nesterov and momentum <= 0:
            raise ValueError("optim.nesterov=true needs optim.momentum > 0")
        self.defaults = dict(_SGD_DEFAULTS, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
        self.param_groups: list[dict[str, Any]] = [dict(self.defaults, params=list(params))]
        self.state: dict[torch.Tensor, dict[str, Any]] = {}

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            if group["momentum"] != 0:
                # By identity: a Parameter's __hash__ is a Python call per lookup.
                state = {id(p): s for p, s in self.state.items()}
                bufs = [state[id(p)].get("momentum_buffer") if id(p) in state else None for p in params]
            else:
                bufs = []
            foreach, fused = group["foreach"], group["fused"]
            if foreach is None and fused is None and all(p.device.type == "cpu" for p in params):
                # What sgd() would pick for CPU tensors (torch's foreach and fused kernels are
                # for accelerators), without its per-step look at every parameter.
                foreach = fused = False
            sgd(
                params,
                grads,
                bufs,
                weight_decay=group["weight_decay"],
                momentum=group["momentum"],
                lr=group["lr"],
                dampening=group["dampening"],
                nesterov=group["nesterov"],
                maximize=group["maximize"],
                has_sparse_grad=any(g.is_sparse for g in grads),
                foreach=foreach,
                fused=fused,
                grad_scale=None,
                found_inf=None,
            )
            if group["momentum"] != 0:  # sgd() made the first step's buffers: keep them
                for p, buf in zip(params, bufs, strict=True):
                    held = state.get(id(p))
                    if held is None:
                        self.state[p] = {"momentum_buffer": buf}
                    else:
                        held["momentum_buffer"] = buf

    def zero_grad(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def state_dict(self) -> dict[str, Any]:
        """As ``torch.optim.SGD.state_dict``: parameters by their index over the groups."""
        index: dict[int, int] = {}
        groups = []
        for group in self.param_groups:
            ids = [index.setdefault(id(p), len(index)) for p in group["params"]]
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        state = {index[id(p)]: s for p, s in self.state.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A state from ``state_dict`` here or from ``torch.optim.SGD``'s."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved, self.param_groups, strict=True)
        ):
            raise ValueError("optimizer state: its parameter groups do not match this server's shards")
        by_index: dict[int, torch.Tensor] = {}
        for s, group in zip(saved, self.param_groups, strict=True):
            by_index.update(zip(s["params"], group["params"], strict=True))
            group.update({k: v for k, v in s.items() if k != "params"})
        self.state = {}
        for i, values in state_dict["state"].items():
            p = by_index[int(i)]
            self.state[p] = {
                k: v.to(dtype=p.dtype, device=p.device) if isinstance(v, torch.Tensor) else v for k, v in values.items()
            }


def imports_dynamo(cfg: OptimConfig) -> bool:
    """Whether a server's optimizer for ``cfg`` is torch's (which imports ``torch._dynamo``)."""
    return cfg.name != "sgd"


def make_server_optimizer(cfg: OptimConfig, params: list[torch.nn.Parameter]) -> Any:
    """The optimizer of a server's dense ``params``: ``PlainSGD`` for ``optim=sgd``, else torch's."""
    cls, kwargs = optimizer_spec(cfg)
    if cfg.name == "sgd":
        return PlainSGD(params, **kwargs)
    return cls(params, **kwargs)
