"""The oracle of a sync run: the same training in one process of plain torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ps_train.config import optimizer_spec
from ps_train.stage_sharding import build_shards, place_stages
from ps_train.workloads.vision.data import BatchIterator, load_data
from ps_train.workloads.vision.models import build_stages, reference_model


def single_process_run(cfg, steps, union_batch=False):
    """Plain torch: one model, each step adds the trainers' mean-loss gradients in rank order
    (trainer k's batches from the same BatchIterator), divides the sum by the number of
    trainers for ``mode.aggregate=mean``, and steps the optimizer once.

    ``union_batch``: instead, one backward of the mean loss over the union of the trainers'
    batches -- what averaging means (equal batches), in another summation order (see
    tests/ps_train/test_aggregation.py), so equal to the servers' result only to ~1e-6.

    Returns (losses per trainer per step, final weights keyed like ``_app.final_weights``)."""
    shape, classes = cfg.data.sample_shape(), cfg.data.class_count()
    stages = build_stages(cfg.model, shape, classes, seed=cfg.seed)
    shards = build_shards(stages, place_stages(stages, cfg.cluster.num_servers, cfg.cluster.placement))
    model = reference_model(stages)
    cls, kwargs = optimizer_spec(cfg.optim)
    opt = cls(model.parameters(), **kwargs)
    train, _ = load_data(cfg.data)
    T = cfg.cluster.num_trainers
    batches = [BatchIterator(train, k, T, cfg.train.batch_size, cfg.seed) for k in range(T)]
    losses = {f"trainer{k}": [] for k in range(T)}
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        if union_batch:
            xs, ys = zip(*(next(b) for b in batches), strict=True)
            with torch.no_grad():
                for k, (x, y) in enumerate(zip(xs, ys, strict=True)):
                    losses[f"trainer{k}"].append(F.cross_entropy(model(x), y).item())
            F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
            opt.step()
            continue
        for k in range(T):  # .grad accumulates g0 + g1 + ...: the servers' rank-order sum
            x, y = next(batches[k])
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            losses[f"trainer{k}"].append(loss.item())
        if cfg.mode.aggregate == "mean":
            for p in model.parameters():
                p.grad.div_(T)  # the servers' division of that sum, bit for bit
        opt.step()
    weights = {
        (f"ps{s.server}", s.index, key): t.detach().clone() for s in shards for key, t in s.module.state_dict().items()
    }
    return losses, weights
