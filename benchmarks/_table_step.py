"""The embedding tables' part of a DLRM step, measured alone: lookup + backward + update.

``ctr_bench --tables`` runs each variant in a child process of its own on the same batches
(``preset=dlrm_large``'s 26 tables of 384,616 rows, dim 64, batch 512, Zipf ids, or bags of
``bag`` ids) and reports milliseconds per step (median after a warm-up):

- ``embedding_bag``: one process, 26 ``nn.EmbeddingBag(sparse=True)`` + ``torch.optim.Adagrad``;
- ``fbgemm``: FBGEMM's CPU ``SplitTableBatchedEmbeddingBagsCodegen`` with its fused
  ``EXACT_ROWWISE_ADAGRAD`` (``pip install fbgemm-gpu-cpu --no-deps``, matched to torch);
- ``per_table``: ps_train's table path before fused storage, one server of ``servers``: per
  table the distinct rows with ``F.embedding(sparse=True)``, a coalesce and torch's Adagrad;
- ``ps_train``: the fused path of one server of ``servers`` with as many trainers: the
  trainers' plan and ``combine``, the server's ``lookup``, its backward (``rows_gradient``),
  the gradients summed and one optimizer step (``adagrad`` or ``rowwise_adagrad``). No RPC.

The tables are filled with ``torch.rand`` (their values do not matter here). Bytes touched per
step, FBGEMM's formula: ``3 * 4 * B * sum(D) * L`` (fp32), L the mean bag length.
"""

from __future__ import annotations

import functools
import json
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

TABLES, ROWS, DIM, BATCH = 26, 384_616, 64, 512
LR = 0.05
FBGEMM_EPS = 1e-8


def fbgemm_bytes(batch: int, tables: int, dim: int, mean_bag: float) -> float:
    """FBGEMM's forward-backward bytes per step, fp32 tables and output."""
    return 3 * 4 * batch * tables * dim * mean_bag


def _batches(steps: int, bag: int) -> list[Any]:
    from ps_train.workloads.ctr.data.bags import Bags
    from ps_train.workloads.ctr.data.synthetic import SyntheticCtr
    from ps_train.workloads.ctr.data.synthetic_bags import BagShape

    shape = BagShape((bag,) * TABLES) if bag > 1 else None
    gen = SyntheticCtr(13, [ROWS] * TABLES, 1.05, seed=0, bag_shape=shape)
    _, ids, _, _, cols = gen.generate_with_bags(steps * BATCH)
    if cols is None:
        return [Bags.one_hot(torch.from_numpy(ids[i * BATCH : (i + 1) * BATCH])) for i in range(steps)]
    return [cols.batch(slice(i * BATCH, (i + 1) * BATCH)) for i in range(steps)]


def _fast_init(seed: int, table: int, num_rows: int, dim: int, ids: torch.Tensor) -> torch.Tensor:
    return torch.rand(len(ids), dim).mul_(2 * (1.0 / num_rows) ** 0.5).sub_((1.0 / num_rows) ** 0.5)


def _time(steps: list[Callable[[], None]], warmup: int) -> list[float]:
    out = []
    for i, step in enumerate(steps):
        t0 = time.perf_counter()
        step()
        if i >= warmup:
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def run_embedding_bag(batches: list[Any], warmup: int) -> dict[str, Any]:
    bags = [torch.nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True) for _ in range(TABLES)]
    opt = torch.optim.Adagrad([b.weight for b in bags], lr=LR)
    g = torch.randn(BATCH, DIM)

    def step(b: Any) -> None:
        opt.zero_grad(set_to_none=True)
        out = torch.stack([bag(*b.table(t)) for t, bag in enumerate(bags)], dim=1)  # [B, T, d]
        out.backward(g.unsqueeze(1).expand(BATCH, TABLES, DIM))
        opt.step()

    return {"total_ms": _time([functools.partial(step, b) for b in batches], warmup)}


def run_fbgemm(batches: list[Any], warmup: int) -> dict[str, Any]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    emb = SplitTableBatchedEmbeddingBagsCodegen(
        [(ROWS, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)] * TABLES,
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=LR,
        eps=FBGEMM_EPS,
    )
    g = torch.randn(BATCH, TABLES * DIM)

    def step(b: Any) -> None:
        w = b.weights
        emb(b.values, b.offsets, per_sample_weights=w).backward(g)  # the update is fused into the backward

    return {"total_ms": _time([functools.partial(step, b) for b in batches], warmup)}


def run_per_table(batches: list[Any], warmup: int, servers: int) -> dict[str, Any]:
    """Server 0's work in ps_train before fused tables, ``servers`` trainers' batches per step."""
    from ps_train.workloads.ctr.tables.rows import RowSharding

    shardings = [RowSharding("mod", ROWS, servers) for _ in range(TABLES)]
    tables = [torch.nn.Parameter(torch.rand(sh.rows_of(0), DIM)) for sh in shardings]
    opt = torch.optim.Adagrad(tables, lr=LR)
    rounds = [batches[i : i + servers] for i in range(0, len(batches) - servers + 1, servers)]
    lookup_ms: list[float] = []
    update_ms: list[float] = []

    def step(group: list[Any]) -> None:
        grads: list[torch.Tensor | None] = [None] * TABLES
        t0 = time.perf_counter()
        for b in group:
            for t, (sh, p) in enumerate(zip(shardings, tables, strict=True)):
                ids = b.table(t)[0]
                unique = torch.unique(ids)
                mine = unique[sh.owner(unique) == 0]
                rows = F.embedding(sh.local(mine), p, sparse=True)
                (grad,) = torch.autograd.grad(rows, [p], torch.ones_like(rows))
                prev = grads[t]
                grads[t] = grad if prev is None else prev + grad
        t1 = time.perf_counter()
        for p, summed in zip(tables, grads, strict=True):
            p.grad = summed.coalesce() if summed is not None else None
        opt.step()
        lookup_ms.append((t1 - t0) * 1e3)
        update_ms.append((time.perf_counter() - t1) * 1e3)

    total = _time([functools.partial(step, r) for r in rounds], warmup)
    return {"total_ms": total, "lookup_backward_ms": lookup_ms[warmup:], "update_ms": update_ms[warmup:]}


def run_ps_train(batches: list[Any], warmup: int, servers: int, optim: str) -> dict[str, Any]:
    """Server 0 of ``servers`` and ``servers`` trainers (sync: their gradients summed, one step)."""
    import ps_train.workloads.ctr.tables.shards as shards_mod
    from ps_train.config import OptimConfig
    from ps_train.workloads.ctr.tables.optimizers import make_table_optimizer
    from ps_train.workloads.ctr.tables.plan import BagPlanner, combine
    from ps_train.workloads.ctr.tables.rows import FusedLayout

    shards_mod.init_rows = _fast_init  # type: ignore[attr-defined]  # values do not matter here (docstring)
    server = shards_mod.TableShards([ROWS] * TABLES, DIM, "mod", 0, servers, seed=0)
    opt = make_table_optimizer(optim, [server.weight], OptimConfig(lr=LR, momentum=0.0))
    planner = BagPlanner(FusedLayout("mod", (ROWS,) * TABLES, servers), DIM, ["sum"] * TABLES)
    rounds = [batches[i : i + servers] for i in range(0, len(batches) - servers + 1, servers)]
    g = torch.randn(BATCH, TABLES, DIM)
    parts: dict[str, list[float]] = {
        "trainer_ms": [],
        "server_lookup_ms": [],
        "server_backward_ms": [],
        "update_ms": [],
        "rows_updated": [],
    }

    def step(group: list[Any]) -> None:
        total: torch.Tensor | None = None
        trainer = lookup = backward = 0.0
        for b in group:
            t0 = time.perf_counter()
            plan = planner.plan(b)
            t1 = time.perf_counter()
            answer = server.lookup(*plan.requests[0])
            t2 = time.perf_counter()
            others = [torch.zeros(n, DIM) for n in plan.answers[1:]]  # the other servers' answers
            emb = combine(plan, [answer, *others])
            (d_answer,) = torch.autograd.grad(emb, [answer], g)  # the trainer's backward
            t3 = time.perf_counter()
            (grad,) = torch.autograd.grad(answer, [server.weight], d_answer)  # the server's: rows_gradient
            t4 = time.perf_counter()
            total = grad if total is None else total + grad
            trainer += (t1 - t0) + (t3 - t2)
            lookup += t2 - t1
            backward += t4 - t3
        t5 = time.perf_counter()
        assert total is not None
        total = total.coalesce()
        opt.step([total])
        parts["update_ms"].append((time.perf_counter() - t5) * 1e3)
        parts["trainer_ms"].append(trainer * 1e3)
        parts["server_lookup_ms"].append(lookup * 1e3)
        parts["server_backward_ms"].append(backward * 1e3)
        parts["rows_updated"].append(float(total._nnz()))

    total_ms = _time([functools.partial(step, r) for r in rounds], warmup)
    return {"total_ms": total_ms, **{k: v[warmup:] for k, v in parts.items()}}


def worker(variant: str, steps: int, bag: int, out_path: str) -> None:
    """Child process: one variant (``name`` or ``name:servers:optim``); writes its figures as JSON."""
    torch.set_num_threads(1)  # as every ps_train process
    warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
    name, *args = variant.split(":")
    warmup = 3
    batches = _batches(steps + warmup, bag)
    if name == "embedding_bag":
        res = run_embedding_bag(batches, warmup)
    elif name == "fbgemm":
        res = run_fbgemm(batches, warmup)
    elif name == "per_table":
        res = run_per_table(batches * int(args[0]), warmup, int(args[0]))
    elif name == "ps_train":
        res = run_ps_train(batches * int(args[0]), warmup, int(args[0]), args[1])
    else:
        raise ValueError(f"unknown table variant {variant!r}")
    lengths = torch.cat([b.lengths() for b in batches]).float()
    res["mean_bag"] = float(lengths.mean())
    res["median"] = {k: statistics.median(v) for k, v in res.items() if isinstance(v, list) and v}
    with open(out_path, "w") as f:
        json.dump(res, f)


VARIANTS = [
    "embedding_bag",
    "fbgemm",
    "per_table:1",
    "per_table:2",
    "ps_train:1:adagrad",
    "ps_train:1:rowwise_adagrad",
    "ps_train:2:adagrad",
    "ps_train:2:rowwise_adagrad",
]
LABELS = {
    "embedding_bag": "one process: 26 nn.EmbeddingBag + torch Adagrad",
    "fbgemm": "one process: FBGEMM CPU TBE, fused row-wise Adagrad",
    "per_table:1": "ps_train 1+1 before: per-table lookups, torch Adagrad",
    "per_table:2": "ps_train 2+2 before: one server, per-table, torch Adagrad",
    "ps_train:1:adagrad": "ps_train 1+1: fused, adagrad",
    "ps_train:1:rowwise_adagrad": "ps_train 1+1: fused, rowwise_adagrad",
    "ps_train:2:adagrad": "ps_train 2+2: one server, fused, adagrad",
    "ps_train:2:rowwise_adagrad": "ps_train 2+2: one server, fused, rowwise_adagrad",
}


def fbgemm_missing() -> str | None:
    """Why FBGEMM's CPU TBE cannot run here, or None."""
    try:
        import fbgemm_gpu  # noqa: F401
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: F401
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except Exception as e:  # noqa: BLE001 - any import failure means the row is skipped, with its reason
        return (
            f"fbgemm_gpu not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            "pip install fbgemm-gpu-cpu --no-deps, the release built for this torch"
        )
    return None


def render_tables(results: dict[str, dict[str, Any]], memcpy_gbs: float, bag: int) -> tuple[str, dict[str, Any]]:
    """The table section's text and figures. ``results[variant]``: a worker's JSON, or
    ``{"error": ...}`` / ``{"skipped": ...}``."""
    lines = [
        f"Tables alone, preset=dlrm_large shape ({TABLES} tables x {ROWS:,} rows, dim {DIM}), batch {BATCH}, "
        f"{'one id per table' if bag == 1 else f'bags of {bag}'}, Zipf ids; lookup + backward + update per step "
        "(median); memcpy floor measured in this run: "
        f"{memcpy_gbs:.2f} GB/s.",
        "ps_train rows: one server's work (its lookup, backward, update; trainers' plan + combine separate).",
        f"{'variant':<56} {'ms/step':>8} {'update':>7} {'trainer':>8} {'MB':>6} {'GB/s':>6} {'x floor':>8}",
    ]
    doc: dict[str, Any] = {"memcpy_gbs": memcpy_gbs, "bag": bag, "variants": {}}
    for v, res in results.items():
        label = LABELS.get(v, v)
        if "median" not in res:
            status = "skipped" if "skipped" in res else "error"
            lines.append(f"{label:<56} {status:>8}  {res.get('skipped') or res.get('error')}")
            doc["variants"][v] = res
            continue
        med = res["median"]
        if v.startswith("ps_train"):
            ms = med["server_lookup_ms"] + med["server_backward_ms"] + med["update_ms"]
            trainer = med["trainer_ms"] / int(v.split(":")[1])
        else:
            ms, trainer = med["total_ms"], float("nan")
        update = med.get("update_ms", float("nan"))
        nbytes = fbgemm_bytes(BATCH, TABLES, DIM, res["mean_bag"])
        gbs = nbytes / (ms / 1e3) / 1e9
        floor_ms = nbytes / (memcpy_gbs * 1e9) * 1e3
        lines.append(
            f"{label:<56} {ms:8.2f} {update:7.2f} {trainer:8.2f} {nbytes / 1e6:6.1f} {gbs:6.2f} {ms / floor_ms:8.1f}"
        )
        doc["variants"][v] = {
            "ms": ms,
            "update_ms": update,
            "trainer_ms": trainer,
            "bytes": nbytes,
            "gbs": gbs,
            "x_floor": ms / floor_ms,
            "median": med,
            "mean_bag": res["mean_bag"],
        }
    before, after = doc["variants"].get("per_table:2", {}), doc["variants"].get("ps_train:2:adagrad", {})
    if "update_ms" in before and "update_ms" in after:
        lines.append(
            f"one server's update (2+2, adagrad): {before['update_ms']:.2f} ms before, "
            f"{after['update_ms']:.2f} ms fused: {before['update_ms'] / after['update_ms']:.1f}x faster "
            "(target >= 5x)"
        )
    return "\n".join(lines), doc
