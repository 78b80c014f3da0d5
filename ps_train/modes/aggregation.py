"""The update arithmetic of a parameter server: how trainers' gradients become optimizer steps.

Sync mode (``mode.aggregate``)
------------------------------
Each step, every trainer hands in the gradient of its own batch-mean loss. ``combine`` adds
them in trainer-rank order (the same float operations every run, so sync mode stays
bit-reproducible) and, for ``mean`` (the default, as ``DistributedDataParallel`` does),
divides the sum by the number of trainers in the round. With equal batches that is the
gradient of the mean loss over the union of the trainers' batches, so ``optim.lr`` means
the same for any ``cluster.num_trainers``. ``sum`` keeps the learning rate growing with
the number of trainers (the behaviour before averaging was the default).

Async and ssp modes (``mode.staleness_rule``)
---------------------------------------------
Each trainer's gradient is applied on its own, by an optimizer step whose learning rate is
scaled by ``lr_scale``: ``scale`` (the default) divides it by the gradient's staleness,
``lr / max(1, tau)``, the staleness-dependent learning rate of Zhang, Gupta, Lian and Liu,
"Staleness-aware Async-SGD for Distributed Deep Learning", IJCAI 2016. ``tau`` counts the
updates the server applied between the step's first read of its parameters (a forward) and
this update, so a fresh gradient (``tau`` 0 or 1) keeps the full rate and one computed
``tau`` updates ago moves the weights ``tau`` times less. ``none`` applies every gradient at
the full rate.

Why it is needed: with N trainers, a server applies about N - 1 other updates between a
trainer's read and its update (mean staleness ~5 with 8 trainers on the default
experiment, at most ~12). Every one of those gradients is then a step computed on weights
several steps old, and with the default SGD momentum of 0.9 each of them moves the weights
by ``lr / (1 - momentum)`` over the following steps -- 10x ``lr`` -- through a momentum
buffer all trainers share. Delayed feedback that strong oscillates and diverges: 8 async
trainers ended at chance accuracy (0.10) while 2 (staleness <= 2) reached 0.97, and the
same 8 trainers converged with momentum 0 or with ``lr / 8``. Dividing by the staleness
brings the rate down by about N - 1 exactly when updates are that stale, and leaves it
alone when they are not (few trainers, or a trainer that runs alone).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TypeVar

import torch

__all__ = ["AGGREGATES", "STALENESS_RULES", "combine", "lr_scale", "scaled_lr"]

AGGREGATES = ("mean", "sum")  # sync: how a step's gradients combine (mode.aggregate)
STALENESS_RULES = ("scale", "none")  # async/ssp: the learning rate of a stale gradient (mode.staleness_rule)

K = TypeVar("K")  # whatever keys a gradient: a Parameter on the server, a name in tests


def combine(
    round_grads: Mapping[int, Mapping[K, torch.Tensor]], aggregate: str, owned: bool = False
) -> dict[K, torch.Tensor]:
    """One sync step's gradient from ``{trainer rank: {key: grad}}`` (each grad shaped like
    its parameter; dense or sparse).

    Adds in ascending trainer rank, then for ``mean`` divides by the number of trainers in
    the round -- also for a key some trainer sent no gradient for (it contributed zero), as
    DDP does. New tensors are returned; the trainers' gradients are not changed, unless
    ``owned`` (they are the caller's alone, e.g. taken from their autograd contexts): then a
    dense sum accumulates in place in the first trainer's tensor, the same floats without a
    further copy of the gradient (64 MB on a DLRM-DCNv2 server).
    """
    if aggregate not in AGGREGATES:
        raise ValueError(f"mode.aggregate: unknown rule {aggregate!r}; choose one of {list(AGGREGATES)}")
    if len(round_grads) == 1:  # one trainer: its gradients as they are (saves hashing each Parameter twice)
        [only] = round_grads.values()
        return dict(only)
    total: dict[K, torch.Tensor] = {}
    # The sums made here, changed in place from then on: one copy of each at a time (a
    # DLRM-DCNv2 server's dense gradient alone is 64 MB). A trainer's own tensor only if owned.
    ours: set[K] = set()
    for rank in sorted(round_grads):  # rank order: the same float sums every run
        for key, grad in round_grads[rank].items():
            if key not in total:
                total[key] = grad
                if owned and grad.layout == torch.strided:  # sparse sums stay out of place: their layout
                    ours.add(key)
            elif key in ours:
                total[key].add_(grad)
            else:
                total[key] = total[key] + grad
                ours.add(key)
    n = len(round_grads)
    if aggregate == "mean" and n > 1:
        # A true division (not a multiplication by 1/n): what a single process computes
        # when it divides its accumulated gradient by n, bit for bit.
        total = {key: grad.div_(n) if key in ours else torch.div(grad, n) for key, grad in total.items()}
    return total


def lr_scale(staleness: int, rule: str) -> float:
    """The factor on ``optim.lr`` for one async/ssp update whose gradient is ``staleness``
    updates old: ``1 / max(1, staleness)`` for ``scale``, 1 for ``none``."""
    if rule not in STALENESS_RULES:
        raise ValueError(f"mode.staleness_rule: unknown rule {rule!r}; choose one of {list(STALENESS_RULES)}")
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if rule == "none":
        return 1.0
    return 1.0 / max(1, staleness)


@contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, factor: float) -> Iterator[None]:
    """Within the block, every parameter group's learning rate is multiplied by ``factor``;
    the configured rates are back afterwards (so checkpoints and logs see ``optim.lr``).

    Scaling the rate rather than the gradient works for every optimizer: Adam's step does
    not change when all of its gradients are scaled by the same factor, its rate does.
    """
    if factor == 1.0:
        yield
        return
    saved = [group["lr"] for group in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, saved, strict=True):
        group["lr"] = lr * factor
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr
