"""The ideal bytes on the wire per trainer step of ps_train's DLRM scheme, from the exact batches.

The scheme (``ps_train/workloads/ctr/tables/plan.py``): per step a trainer asks every server, for all tables
at once, either for each distinct row of a table the batch uses (one-hot tables: a row is
fetched once however many samples use it) or, where that costs fewer bytes (multi-hot bags),
for one partial pooled vector per bag and server (the server sums its rows of the bag); it
runs the bottom MLP on the server that hosts it and the top MLP on the server that hosts it;
the backward sends each server the gradient of every vector it returned and of every
activation it produced. Per trainer step and server ``s``, with ``U_s`` the distinct rows it
returns, ``M_s`` the ids of the bags it pools and ``P_s`` those bags, ``B`` the batch size,
``d`` the embedding width, ``T`` the number of tables and ``Z = d + T (T + 1) / 2`` the
interaction's width, the payload that must cross the wire is::

    ideal_s = U_s * (8 + 4 d + 4 d)                  a row's id (int64) out, the row (float32)
                                                     back, its gradient in the backward
            + M_s * (8 [+ 4 with id weights])        a pooled id out (and its weight)
            + P_s * (8 + 4 d + 4 d)                  where the bag starts out, its partial
                                                     vector back, the vector's gradient in
            + [s hosts the bottom MLP] * B * (4 n_dense + 4 d + 4 d)   dense in, x out, dx in
            + [s hosts the top MLP]    * B * (4 Z + 4 + 4 + 4 Z)       z in, logit out,
                                                                       dlogit in, dz out

Sent plus received, as ps_train's ``server_bytes_per_step`` counts them. Gradients travel as
the vectors' values only: the server kept the ids in its autograd graph, so it builds the
sparse gradient of its rows itself; a scheme that sends the indices back would add 8 bytes
per row. The dense MLPs' parameters never travel (they live on their servers), only their
activations. Framing, pickled call metadata, the update requests and the periodic status
calls are the overhead a measured figure has over this one. One-hot data has no pooled
bags: the formula is then the rows term alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ps_train.config import ClusterConfig, DataConfig, ModelConfig

__all__ = ["INDEX_BYTES", "FLOAT_BYTES", "step_ideal_bytes", "TrafficReplay", "replay_ideal_bytes"]

INDEX_BYTES = 8  # an int64 row id
FLOAT_BYTES = 4  # a float32 value


def step_ideal_bytes(
    unique_rows: Sequence[int],
    dim: int,
    batch: int,
    num_dense: int,
    num_tables: int,
    hosts_bottom: bool,
    hosts_top: bool,
    pooled_ids: int = 0,
    pooled_bags: int = 0,
    id_weights: bool = False,
) -> int:
    """``ideal_s`` of the module docstring for one server and one trainer step;
    ``unique_rows[t]``: the distinct rows of table t this server sends for the batch (its
    share of ``U_s``); ``pooled_ids`` = M_s, ``pooled_bags`` = P_s."""
    if dim < 1 or batch < 1 or num_dense < 0 or num_tables < 1:
        raise ValueError(
            f"need dim >= 1, batch >= 1, num_dense >= 0, num_tables >= 1; got dim={dim}, "
            f"batch={batch}, num_dense={num_dense}, num_tables={num_tables}"
        )
    if len(unique_rows) != num_tables:
        raise ValueError(f"unique_rows lists {len(unique_rows)} tables, expected num_tables={num_tables}")
    per_row = INDEX_BYTES + 2 * dim * FLOAT_BYTES
    total = (sum(unique_rows) + pooled_bags) * per_row
    total += pooled_ids * (INDEX_BYTES + (FLOAT_BYTES if id_weights else 0))
    if hosts_bottom:
        total += batch * FLOAT_BYTES * (num_dense + 2 * dim)
    if hosts_top:
        z = dim + num_tables * (num_tables + 1) // 2
        total += batch * FLOAT_BYTES * (2 * z + 2)
    return total


@dataclass
class TrafficReplay:
    """The ideal over a run's exact batches: per server, bytes per trainer step (averaged over
    every trainer's steps), and the vectors (distinct rows and partial bags) pulled per
    trainer step over all servers (what the run's ``rows_pulled_per_step`` must equal)."""

    ideal_per_step: dict[str, float]
    rows_per_step: float
    trainer_steps: int


def replay_ideal_bytes(
    model: ModelConfig, data: DataConfig, cluster: ClusterConfig, batch_size: int, seed: int, steps: int
) -> TrafficReplay:
    """Replay the batches every trainer of a run (model=dlrm, its ``data``, ``cluster``,
    ``train.batch_size`` and ``seed``) takes in ``steps`` steps, plan each as the trainers do,
    and sum ``step_ideal_bytes`` per server."""
    from ps_train.config import CtrDataConfig, DLRMConfig
    from ps_train.stage_sharding import model_shards

    # model_shards asks the workload registry for the stage plan: register the CTR workload
    # here, so that a tool calling this outside ``python -m ps_train`` (ctr_bench) needs no set-up.
    from ps_train.workloads.ctr import workload as _registers  # noqa: F401
    from ps_train.workloads.ctr.data.bags import as_bags
    from ps_train.workloads.ctr.data.batches import CtrBatchIterator
    from ps_train.workloads.ctr.data.loading import load_ctr_data
    from ps_train.workloads.ctr.tables.plan import BagPlanner
    from ps_train.workloads.ctr.tables.rows import FusedLayout

    if not isinstance(model, DLRMConfig) or not isinstance(data, CtrDataConfig):
        raise ValueError(
            f"replay_ideal_bytes needs model=dlrm with CTR data (data=synthetic_ctr or data=criteo), "
            f"not model={type(model).__name__} data={type(data).__name__}: set both in the run's overrides"
        )
    S, K = cluster.num_servers, cluster.num_trainers
    d, B = model.embedding_dim, batch_size
    sizes = data.sizes()
    planner = BagPlanner(FusedLayout(model.table_sharding, tuple(sizes), S), d, model.pooling_list(len(sizes)))
    (_, bottom_server), (_, top_server) = [(sh.index, sh.server) for sh in model_shards(model, data, cluster, seed)]
    train = load_ctr_data(data).train
    totals = [0] * S
    vectors = 0
    for k in range(K):
        batches = CtrBatchIterator(train, k, K, B, seed)
        for _ in range(steps):
            _, ids, _ = next(batches)
            bags = as_bags(ids)
            plan = planner.plan(bags)
            vectors += sum(plan.answers)
            for s, req in enumerate(plan.requests):
                pooled_bags = len(req.offsets)
                singles = plan.answers[s] - pooled_bags
                totals[s] += step_ideal_bytes(
                    [singles] + [0] * (len(sizes) - 1),
                    d,
                    B,
                    data.dense_count(),
                    len(sizes),
                    s == bottom_server,
                    s == top_server,
                    pooled_ids=plan.pooled_rows[s],
                    pooled_bags=pooled_bags,
                    id_weights=bags.weights is not None,
                )
    n = K * steps
    return TrafficReplay({f"ps{s}": totals[s] / n for s in range(S)}, vectors / n, n)
