"""The trainer of model=dlrm: a click-through-rate step over row-sharded embedding tables.

Per step (batch: dense [B, num_dense], ids [B, T] or ``Bags``, labels [B]), inside the
step's distributed-autograd context::

    plan = planner.plan(bags)                             # all tables at once (ps_train.workloads.ctr.tables.plan)
    every server s, at once: out[s] = ps<s>.lookup(*plan.requests[s])  # [P_s, d]: rows, partial bags
    x   = bottom shard's forward(dense)                   # [B, d], on its server
    emb = combine(plan, out)                              # [B, T, d], here
    z   = interact(x, emb)                                # here: [B, d + T(T+1)/2] (dot), [B, (T+1) d] (dcn)
    logit = top shard's forward(z)                        # [B], on its server (dcn: cross layers, then top MLP)
    loss  = binary_cross_entropy_with_logits(logit, labels)

The backward sends each server the gradient of each vector it returned, which the server
expands to its rows; the update requests, sync/async/ssp, checkpoints and the loop are the
base ``Trainer``'s. No trainer ever holds a table: only the vectors of its batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ps_train import backend
from ps_train.config import CtrDataConfig, DLRMConfig
from ps_train.roles.trainer import Trainer
from ps_train.workloads.ctr.data.bags import Bags
from ps_train.workloads.ctr.data.batches import CtrBatch, CtrBatchIterator, iter_ctr_eval_batches
from ps_train.workloads.ctr.data.jagged import KeyedJagged, to_bags
from ps_train.workloads.ctr.data.loading import load_ctr_data
from ps_train.workloads.ctr.metrics import ctr_metrics, format_ctr_metrics
from ps_train.workloads.ctr.model import cross_spec, interaction
from ps_train.workloads.ctr.tables.cache import CacheSplit, RowCache
from ps_train.workloads.ctr.tables.plan import BagPlan, BagPlanner, combine
from ps_train.workloads.ctr.tables.rows import FusedLayout

__all__ = ["CtrTrainer"]


class CtrTrainer(Trainer):
    def load(self) -> None:
        cfg = self.cfg
        if not isinstance(cfg.data, CtrDataConfig) or not isinstance(cfg.model, DLRMConfig):
            raise ValueError(
                f"CtrTrainer needs model=dlrm with CTR data, got model={cfg.model.name} data={cfg.data.name}"
            )
        data = load_ctr_data(cfg.data, raw_ids=cfg.model.dynamic_tables())
        self.train_set, self.test_set, self.best_auc = data.train, data.test, data.best_auc
        if data.skipped and self.index == 0:  # every trainer reads the same files: one says it on the console
            print(f"[{self.name}] {data.skipped}", flush=True)
        raw = set(cfg.model.dynamic_tables())  # their ids are raw: the data's sizes say nothing there
        if [n for t, n in enumerate(self.train_set.table_sizes) if t not in raw] != [
            n for t, n in enumerate(cfg.data.sizes()) if t not in raw
        ]:
            raise ValueError(
                f"data={cfg.data.name}: the data's tables {self.train_set.table_sizes} differ from the "
                f"config's {cfg.data.sizes()}"
            )
        self.batches = CtrBatchIterator(
            self.train_set, self.data_slot, cfg.cluster.num_trainers, cfg.train.batch_size, cfg.seed
        )
        sizes = cfg.data.sizes()
        dynamic = cfg.model.dynamic_tables()
        # A dynamic table's slots per server: they come before later tables' rows in the storage.
        dynamic_rows = tuple(int(cfg.model.tables[t].max_rows or 1) if t in dynamic else 0 for t in range(len(sizes)))
        layout = FusedLayout(
            cfg.model.table_sharding, tuple(sizes), cfg.cluster.num_servers, dynamic_rows if dynamic else ()
        )
        self.feature_names = cfg.model.feature_list(len(sizes))  # KeyedJagged keys, table order
        self.interact = interaction(cross_spec(cfg.model))  # between the bottom and top stages, here
        self.planner = BagPlanner(layout, cfg.model.embedding_dim, cfg.model.pooling_list(len(sizes)))
        self.cache = (  # hot rows kept here for up to model.cache_staleness steps (ps_train.workloads.ctr.tables.cache)
            RowCache(
                cfg.model.cache_rows,
                cfg.model.cache_staleness,
                [layout.row_offsets(s)[-1] for s in range(cfg.cluster.num_servers)],
                cfg.model.embedding_dim,
            )
            if cfg.model.cache_rows > 0
            else None
        )
        # A disk tier: the next batch's rows are named to the servers while this step's update
        # runs (``upcoming``), and its plan is kept for that step.
        self.prefetching = cfg.model.memory_budget_bytes() is not None
        self._planned: tuple[CtrBatch, BagPlan] | None = None
        self.rows_pulled = 0  # vectors looked up for training (distinct rows, partial bags), all servers and steps
        self.rows_pushed = 0  # vectors whose gradient went back

    # -- one step ---------------------------------------------------------------------------------
    def upcoming(self, batch: CtrBatch) -> None:
        if not self.prefetching:
            return
        plan = self.planner.plan(to_bags(batch[1], self.feature_names))
        self._planned = (batch, plan)
        for s in range(len(self.servers)):  # one-way: never waited for, a lookup needs none of it
            self.rpc.rpc_async(f"ps{s}", _prefetch, args=(plan.requests[s].rows,))

    def step_loss(self, batch: CtrBatch) -> tuple[Tensor, dict[str, float]]:
        dense, ids, labels = batch
        planned, self._planned = self._planned, None
        if planned is not None and planned[0] is batch:
            plan = planned[1]
        else:
            plan = self.planner.plan(to_bags(ids, self.feature_names))
        requests = plan.requests
        splits: list[CacheSplit] = []
        if self.cache is not None:  # cached rows are not asked for
            self.cache.begin_step(self.step)
            splits = [self.cache.split(s, req) for s, req in enumerate(plan.requests)]
            requests = [sp.request for sp in splits]
        # Every server's lookup leaves at once. The bottom MLP's server gets its lookup and
        # the bottom forward in one call: one request and one answer fewer per step (the
        # backward already sends each server one gradient call for everything it returned).
        (bottom, bottom_server), (top, top_server) = self.shard_servers
        t0 = time.perf_counter()
        futs = [
            self.rpc.rpc_async(
                f"ps{s}",
                _lookup_forward,
                args=(*requests[s], self.index, self.step, plan.ids[s], bottom, dense),
            )
            if s == bottom_server
            else self.rpc.rpc_async(f"ps{s}", _lookup, args=(*requests[s], self.index, self.step, plan.ids[s]))
            for s in range(len(self.servers))
        ]
        answers = [f.wait() for f in futs]
        for s in range(len(answers)):
            self.latency[s].record(time.perf_counter() - t0)
        rows, x = list(answers), answers[bottom_server][1]  # x: [B, d], the bottom MLP's output
        rows[bottom_server] = answers[bottom_server][0]
        # Half-precision tables answer in their dtype; the model computes in float32 (the
        # widening's backward sends the gradients back in the answers' dtype).
        rows = [r.float() for r in rows]
        pulled = sum(len(r) for r in rows)
        if self.cache is not None:
            context_id = self.dist_autograd._current_context()._context_id()
            rows = [
                self.cache.assemble(s, splits[s], rows[s], self._pusher(s, context_id, splits[s].hit_rows))
                for s in range(len(rows))
            ]
        emb = combine(plan, rows)  # [B, T, d]
        logit = self.call_server(top_server, "forward", top, self.interact(x, emb), self.index, self.step).squeeze(1)
        pushed = sum(plan.answers)  # every vector, pulled or cached, gets a gradient
        self.rows_pulled += pulled
        self.rows_pushed += pushed
        loss = F.binary_cross_entropy_with_logits(logit, labels)
        acc = ((logit.detach() > 0) == (labels > 0.5)).float().mean().item()
        return loss, {"accuracy": acc, "rows_pulled": float(pulled), "rows_pushed": float(pushed)}

    def _pusher(self, server: int, context_id: int, rows: Tensor) -> Callable[[Tensor], None]:
        """What the backward calls with the gradient [H, d] of the cached ``rows`` of
        ``server``: it sends them there for this step's update, and returns once they are in."""

        def push(grad: Tensor) -> None:
            self.rpc.rpc_sync(f"ps{server}", _push_gradients, args=(context_id, rows, grad))

        return push

    # -- evaluation -------------------------------------------------------------------------------
    def predict(self, dense: Tensor, ids: Tensor | Bags | KeyedJagged) -> Tensor:
        """Logits [B] of the current model (no autograd): what evaluation scores. ``ids``
        as a batch carries them, or a ``KeyedJagged`` / TorchRec ``KeyedJaggedTensor``."""
        plan = self.planner.plan(to_bags(ids, self.feature_names))
        futs = [server.rpc_async().read_rows(*plan.requests[s], plan.ids[s]) for s, server in enumerate(self.servers)]
        (bottom, bottom_server), (top, top_server) = self.shard_servers
        x = self.servers[bottom_server].rpc_sync().predict(bottom, dense)
        emb = combine(plan, [f.wait().float() for f in futs])
        return self.servers[top_server].rpc_sync().predict(top, self.interact(x, emb)).squeeze(1)

    def evaluate(self) -> dict[str, float]:
        logits, labels = [], []
        for dense, ids, y in iter_ctr_eval_batches(self.test_set, self.cfg.train.eval_batch_size):
            logits.append(self.predict(dense, ids))
            labels.append(y)
        z, y = torch.cat(logits), torch.cat(labels)
        m = ctr_metrics(torch.sigmoid(z.double()), y, self.best_auc)
        # accuracy and loss as for every model (loss = log loss from the logits, unclamped).
        m["accuracy"] = ((z > 0) == (y > 0.5)).float().mean().item()
        m["loss"] = F.binary_cross_entropy_with_logits(z.double(), y.double()).item()
        return m

    def describe_eval(self, ev: dict[str, float]) -> str:
        return f"test {format_ctr_metrics(ev)}"

    # -- metrics ----------------------------------------------------------------------------------
    def log_train(self, step: int, last: dict[str, float]) -> None:
        super().log_train(step, last)
        self.writer.add_scalar("train/rows_pulled", last["rows_pulled"], step)
        self.writer.add_scalar("train/rows_pushed", last["rows_pushed"], step)

    def totals(self) -> dict[str, Any]:
        hits = self.cache.hits if self.cache is not None else 0
        return {
            **super().totals(),
            "rows_pulled": self.rows_pulled,
            "rows_pushed": self.rows_pushed,
            "cache_hits": hits,
        }

    def extra_metrics(self, all_stats: list[dict[str, Any]], server_stats: list[dict[str, Any]]) -> dict[str, Any]:
        steps = self.steps_taken(all_stats)  # per trainer step
        out: dict[str, Any] = {
            **super().extra_metrics(all_stats, server_stats),  # server_bytes_per_step
            "rows_pulled_per_step": sum(s["rows_pulled"] for s in all_stats) / steps,
            "rows_pushed_per_step": sum(s["rows_pushed"] for s in all_stats) / steps,
            "cache_hits_per_step": sum(s.get("cache_hits", 0) for s in all_stats) / steps,
            "table_bytes": {f"ps{r}": s["table_bytes"] for r, s in enumerate(server_stats)},
            "table_rows_updated": {f"ps{r}": s["table_rows_updated"] for r, s in enumerate(server_stats)},
            # Dynamic tables: rows held at the end, and created, evicted, admitted over the run.
            **{
                f"dynamic_rows_{key}": {f"ps{r}": s[f"dynamic_rows_{key}"] for r, s in enumerate(server_stats)}
                for key in ("live", "created", "evicted", "admitted")
                if all(f"dynamic_rows_{key}" in s for s in server_stats)
            },
            # Lazy and tiered tables: each server's rows in RAM, hit rate, rows evicted, read back, bytes written.
            **(
                {"tier": {f"ps{r}": s["tier"] for r, s in enumerate(server_stats)}}
                if all("tier" in s for s in server_stats)
                else {}
            ),
            # Each trainer's own loop time: in sync mode the trainer that started last never
            # waits in its loop for the others' start-up (loading data), the others may.
            "trainer_wall_time_s": {f"trainer{k}": s["wall_time_s"] for k, s in enumerate(all_stats)},
        }
        return out


@backend.called_by_name
def _lookup(
    rows: Tensor, offsets: Tensor, weights: Tensor | None, trainer: int, step: int, ids: Tensor | None = None
) -> Tensor:
    """Runs on a server: the vectors of a ``ServerRequest`` (``ParameterServer.lookup``).

    Called as a function with ``rpc_async``, not through ``rref.rpc_async()``: torch's RRef
    proxy sends that call from a callback thread, outside the caller's distributed-autograd
    context, so on backend=torch the rows would come back without a way to send their
    gradients home."""
    from ps_train.roles.server import local_server

    return local_server().lookup(rows, offsets, weights, trainer, step, ids)


@backend.called_by_name
def _lookup_forward(
    rows: Tensor,
    offsets: Tensor,
    weights: Tensor | None,
    trainer: int,
    step: int,
    ids: Tensor | None,
    shard: int,
    dense: Tensor,
) -> tuple[Tensor, Tensor]:
    """Runs on the bottom MLP's server: ``_lookup``'s vectors [P, dim] and ``shard``'s
    forward of ``dense`` [B, d], both in the caller's distributed-autograd context."""
    from ps_train.roles.server import local_server

    server = local_server()
    vectors = server.lookup(rows, offsets, weights, trainer, step, ids)
    return vectors, server.forward(shard, dense, trainer, step)


@backend.called_by_name
def _prefetch(rows: Tensor) -> None:
    """Runs on a server: a trainer's next request names ``rows`` (``ParameterServer.prefetch_rows``)."""
    from ps_train.roles.server import local_server

    local_server().prefetch_rows(rows)


@backend.called_by_name
def _push_gradients(context_id: int, rows: Tensor, grad: Tensor) -> None:
    """Runs on a server: a trainer's gradients of rows it read from its cache."""
    from ps_train.roles.server import local_server

    local_server().push_gradients(context_id, rows, grad)
