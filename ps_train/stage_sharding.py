"""Stage sharding: placing a model's stages on the parameter servers, grouped into shards.

``place_stages`` assigns stage indices to servers; ``build_shards`` groups consecutive stages
that share a server into ``Shard``s, the unit a server hosts and a trainer calls in forward
order. Composing the shards in order is, by construction, the same computation as the
single-process model (the stages in order). Every process computes the same shards from the
model's, the data's and the cluster's configs and the seed (``model_shards``), so the layout is never sent over RPC.
A trainer needs only which server hosts each shard (``shard_layout``): it is kept per process,
so roles forked from a process that computed it (the launcher's fork server) do not build
the model again for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from ps_train.config import ClusterConfig, DataConfig, ModelConfig
from ps_train.workload import workload_for

__all__ = [
    "stage_param_bytes",
    "place_stages",
    "Shard",
    "build_shards",
    "shards_of_server",
    "model_shards",
    "shard_layout",
]

# shard_layout's answers, by the configs' values they depend on (a forked role inherits them).
_LAYOUTS: dict[tuple[str, str, int, str, int], tuple[tuple[int, int], ...]] = {}


def stage_param_bytes(stage: nn.Module) -> int:
    """Bytes of a stage's parameters (what a server stores and updates for it)."""
    return sum(p.numel() * p.element_size() for p in stage.parameters())


def place_stages(stages: Sequence[nn.Module], num_servers: int, strategy: str = "balanced") -> list[list[int]]:
    """Assign stage indices to servers; returns ``placement[server] = [stage indices]``.

    - ``round_robin``: stage i goes to server ``i % num_servers``.
    - ``balanced``: contiguous groups, one per server in order, minimising the largest
      group's parameter bytes, so the forward visits ps0, ps1, ... once each.

    Every server gets at least one stage. Deterministic: no randomness, ties go to the
    earliest split.
    """
    n = len(stages)
    if num_servers < 1:
        raise ValueError(f"cluster.num_servers={num_servers}: need at least 1 parameter server")
    if num_servers > n:
        raise ValueError(
            f"cluster.num_servers={num_servers} exceeds the model's {n} stages (each server needs at "
            f"least one); set cluster.num_servers<={n} or use a deeper model"
        )
    if strategy == "round_robin":
        return [list(range(s, n, num_servers)) for s in range(num_servers)]
    if strategy == "balanced":
        bounds = _balanced_bounds([stage_param_bytes(s) for s in stages], num_servers)
        return [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    raise ValueError(f"cluster.placement={strategy!r} is unknown; use round_robin or balanced")


def _balanced_bounds(weights: list[int], k: int) -> list[int]:
    """Split ``weights`` into k contiguous non-empty groups minimising the max group sum.

    Returns group boundaries ``[0, b1, ..., n]``. Dynamic programming, O(k n^2); n is tiny.
    """
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[g][i]: minimal max-sum splitting the first i stages into g groups.
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for g in range(1, k + 1):
        for i in range(g, n - (k - g) + 1):
            for j in range(g - 1, i):  # last group is stages j..i-1
                cost = max(best[g - 1][j], prefix[i] - prefix[j])
                if cost < best[g][i]:
                    best[g][i], cut[g][i] = cost, j
    bounds = [n]
    for g in range(k, 0, -1):
        bounds.append(cut[g][bounds[-1]])
    return bounds[::-1]


@dataclass
class Shard:
    """Consecutive stages hosted by one server, called as one unit in the forward pass."""

    index: int  # position in the forward order
    server: int  # hosting server rank (ps<server>)
    stage_indices: list[int]
    module: nn.Sequential

    @property
    def name(self) -> str:
        return f"shard{self.index}"


def build_shards(stages: Sequence[nn.Module], placement: list[list[int]], merge: bool = True) -> list[Shard]:
    """Group stages into shards in forward order; consecutive stages on one server merge
    (unless ``merge=False``: then each stage is its own shard, for models that compute
    something between stages, as DLRM does between its bottom and top MLPs).

    With ``balanced`` placement there is exactly one shard per server; with ``round_robin``
    a server may host several (e.g. 3 stages, 2 servers: ps0 hosts shard0 and shard2).
    The shard modules share the stage modules (no copies).
    """
    owner: dict[int, int] = {}
    for server, indices in enumerate(placement):
        if not indices:
            raise ValueError(f"placement gives server {server} no stage; every server needs at least one")
        for i in indices:
            if i in owner or not 0 <= i < len(stages):
                raise ValueError(f"placement {placement}: stage {i} is out of range or placed twice")
            owner[i] = server
    if len(owner) != len(stages):
        missing = sorted(set(range(len(stages))) - set(owner))
        raise ValueError(f"placement {placement} leaves stages {missing} unplaced")
    groups: list[tuple[int, list[int]]] = []
    for i in range(len(stages)):
        if merge and groups and groups[-1][0] == owner[i]:
            groups[-1][1].append(i)
        else:
            groups.append((owner[i], [i]))
    return [Shard(k, server, idx, nn.Sequential(*(stages[i] for i in idx))) for k, (server, idx) in enumerate(groups)]


def shards_of_server(shards: Sequence[Shard], server: int) -> list[Shard]:
    """The shards a given server hosts, in forward order."""
    return [s for s in shards if s.server == server]


def model_shards(model: ModelConfig, data: DataConfig, cluster: ClusterConfig, seed: int) -> list[Shard]:
    """The run's model split into shards over ``cluster.num_servers`` servers (as
    ``cluster.placement`` says): the same list in every process of the run. The stages are the
    workload's (``ps_train.workload.StagePlan``); a plan may keep them on fewer servers than
    the run has (DLRM's two MLPs; its tables live on every server)."""
    plan = workload_for(model).stages(model, data, seed)
    servers = cluster.num_servers if plan.max_servers is None else min(cluster.num_servers, plan.max_servers)
    return build_shards(plan.stages, place_stages(plan.stages, servers, cluster.placement), merge=plan.merge)


def shard_layout(
    model: ModelConfig, data: DataConfig, cluster: ClusterConfig, seed: int
) -> tuple[tuple[int, int], ...]:
    """``(shard index, server)`` of each of ``model_shards``' shards, in forward order.
    Computed once per process for the same configs (building the model to place it costs
    tens of ms of CPU: 64 trainers each did it at start-up)."""
    key = (repr(model), repr(data), cluster.num_servers, cluster.placement, seed)
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _LAYOUTS[key] = tuple((s.index, s.server) for s in model_shards(model, data, cluster, seed))
    return layout
