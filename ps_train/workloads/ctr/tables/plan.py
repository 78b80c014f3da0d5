"""How a trainer asks the servers for a batch's embeddings, and puts the answers together.

A batch's ``Bags`` (``ps_train.workloads.ctr.data.bags``: every table's bags of ids, table-major) become one
request per server, built for all tables at once -- no loop over tables:

- each id's owner and its row in the owner's storage (``FusedLayout``: range or mod
  sharding, tables one after another);
- per table, the cheaper of two ways to fetch it (bytes on the wire, both directions):
  **rows**: every distinct row the batch uses, once (bags of one id, as Criteo's: a batch
  of 512 uses a few hundred distinct rows of a table), the trainer pooling the bags from
  them; or **bags**: each server pools, for every bag, the ids it owns into one partial
  vector (``sum`` of the rows, times their weights), and the trainer adds the servers'
  partials (a bag of 20 ids costs one vector per server instead of up to 20 rows).
- the request to server ``s`` (``ServerRequest``): its storage rows, single rows first,
  then the ids of every bag it pools; where each pooled bag starts; their weights.

A dynamic table's ids (``ps_train.workloads.ctr.tables.dynamic``) have no row a trainer could name: each goes
to server ``dynamic_owner(id)`` as the marker ``-(1 + t)`` in ``rows`` and its raw id in
``BagPlan.ids[s]`` (the request's negative rows' ids, in order), which the server turns into
its slot; deduplication then keys rows by (server, row or marker, id).

The server answers one vector per single row and per pooled bag (``TableShards.lookup``,
one ``embedding_bag`` over its whole storage), and ``combine`` turns the answers into
``[B, T, d]`` with one ``embedding_bag`` per server: each final bag sums its single rows
(times their weights) and its partials, and a ``mean`` table's bag is divided by its whole
length once. Differentiable: the backward hands each server the gradient of each vector it
returned, which the server expands to its rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ps_train.workloads.ctr.data.bags import Bags
from ps_train.workloads.ctr.tables.rows import FusedLayout, dynamic_owner

__all__ = ["ServerRequest", "BagPlan", "BagPlanner", "combine", "INDEX_BYTES", "FLOAT_BYTES"]

INDEX_BYTES = 8  # an int64 row id or offset on the wire
FLOAT_BYTES = 4  # a float32 value or weight


class ServerRequest(NamedTuple):
    """What one server is asked for (``ParameterServer.lookup``'s arguments).

    ``rows``: int64 [N], rows of the server's storage: ``offsets[0]`` single rows (all of
    them if ``offsets`` is empty), each its own bag, then the rows of the pooled bags.
    ``offsets``: int64 [P], where each pooled bag starts in ``rows`` (nondecreasing).
    ``weights``: float32 [N - singles], the pooled rows' weights, or None.
    """

    rows: Tensor
    offsets: Tensor
    weights: Tensor | None


@dataclass
class BagPlan:
    """One batch's requests (``requests[s]`` to server s) and how to combine the answers:
    per server, ``entries[s]`` (int64 [E_s], which of its answer's vectors), grouped by
    final bag by ``entry_offsets[s]`` (int64 [T * B]), times ``entry_weights[s]`` ([E_s] or
    None); ``divisor`` (float32 [T * B, 1]) for mean tables, else None."""

    requests: list[ServerRequest]
    answers: list[int]  # vectors server s returns: its single rows plus its pooled bags
    pooled_rows: list[int]  # of a server's rows, how many belong to pooled bags
    entries: list[Tensor]
    entry_offsets: list[Tensor]
    entry_weights: list[Tensor | None]
    divisor: Tensor | None
    num_tables: int
    batch_size: int
    ids: list[Tensor | None] = field(default_factory=list)  # per server: raw ids of its dynamic rows, or None


def _exclusive_cumsum(counts: Tensor) -> Tensor:
    out = torch.zeros_like(counts)
    if len(counts) > 1:
        torch.cumsum(counts[:-1], 0, out=out[1:])
    return out


def _unique_pairs(a: Tensor, b: Tensor, a_end: int) -> tuple[Tensor, Tensor]:
    """The distinct pairs (``a[i]``, ``b[i]``) in ascending order, as the index of one
    element of each (int64 [U]), and each element's pair (int64 [N]). ``a`` in 0 ..
    ``a_end`` - 1. When the pairs fit one int64 (``b`` >= 0, small enough), one ``unique``
    of ``a * (max(b) + 1) + b``; else two 1-D sorts, several times faster than ``unique``
    over the rows of a stacked [N, 2] tensor."""
    if len(b) and int(b.min()) >= 0:
        span = int(b.max()) + 1
        if a_end * span < 1 << 62:
            # NumPy's argsort (~4x torch's sort of int64), then each sorted key's rank among
            # the distinct ones; any element of a pair serves as its own (all have its (a, b)).
            keys = (a * span + b).numpy()
            by_key = np.argsort(keys)
            ranked = keys[by_key]
            new = np.empty(len(keys), dtype=bool)
            new[:1] = True
            np.not_equal(ranked[1:], ranked[:-1], out=new[1:])
            rank = np.empty(len(keys), dtype=np.int64)
            rank[by_key] = np.cumsum(new) - 1
            return torch.from_numpy(by_key[new]), torch.from_numpy(rank)
    order = torch.argsort(b)  # any order among equal b: they are the same pair when a ties too
    order = order[torch.argsort(a[order], stable=True)]
    sa, sb = a[order], b[order]
    first = torch.ones(len(a), dtype=torch.bool)  # [N]: a sorted pair unlike the one before
    first[1:] = (sa[1:] != sa[:-1]) | (sb[1:] != sb[:-1])
    inverse = torch.empty_like(order)
    inverse[order] = torch.cumsum(first, 0) - 1
    return order[first], inverse


class BagPlanner:
    """Plans every step of one run: the layout's per-table constants as tensors, built once."""

    def __init__(self, layout: FusedLayout, dim: int, pooling: Sequence[str]) -> None:
        T, S = len(layout.table_sizes), layout.num_servers
        if len(pooling) != T:
            raise ValueError(f"pooling lists {len(pooling)} tables, the layout has {T}")
        self.layout, self.dim, self.num_servers = layout, dim, S
        self.mod = layout.kind == "mod"
        self.per = torch.tensor([-(-n // S) for n in layout.table_sizes], dtype=torch.int64)  # range: rows per server
        offsets = [layout.row_offsets(s) for s in range(S)]
        self.base = torch.tensor([o[:-1] for o in offsets], dtype=torch.int64)  # [S, T]: table t's first row on s
        # Rows of every server laid end to end: one key per (server, row) for deduplication.
        self.server_start = torch.tensor([0] + [o[-1] for o in offsets], dtype=torch.int64).cumsum(0)  # [S + 1]
        # Where server s's (row + T) values start when every server's rows and T markers are
        # laid end to end ([S]: the dynamic path's dedup key).
        self.pair_start = self.server_start[:-1] + T * torch.arange(1, S + 1)
        self.place_end = int(self.server_start[-1]) + T * S  # those values are below this
        self.mean = torch.tensor([p == "mean" for p in pooling])  # [T]
        self.dynamic = torch.tensor([layout.is_dynamic(t) for t in range(T)])  # [T]
        self.any_dynamic = bool(self.dynamic.any())
        self.all_dynamic = bool(self.dynamic.all())

    def plan(self, bags: Bags) -> BagPlan:
        T, B, S = bags.num_tables, bags.batch_size, self.num_servers
        if T != len(self.mean):
            raise ValueError(f"a batch with {T} tables; the model has {len(self.mean)}")
        lengths = bags.lengths()  # [T * B]
        bag_of = torch.repeat_interleave(torch.arange(T * B), lengths)  # [N]: each id's bag
        table = torch.div(bag_of, B, rounding_mode="floor")  # [N]
        v = bags.values
        dyn = self.dynamic[table] if self.any_dynamic else None  # [N] bool: ids of dynamic tables
        if self.all_dynamic:  # no fixed table's row to compute: every id is a marker and its id
            owner = dynamic_owner(v, S) if S > 1 else torch.zeros(len(v), dtype=torch.int64)
            row = -1 - table
        else:
            fixed_v = v if dyn is None else torch.where(dyn, 0, v)
            if self.mod:
                owner, local = torch.remainder(fixed_v, S), torch.div(fixed_v, S, rounding_mode="floor")
            else:
                per = self.per[table]
                owner = torch.div(fixed_v, per, rounding_mode="floor")
                local = fixed_v - owner * per
            row = self.base[owner, table] + local  # [N]: the id's row in its owner's storage
        if dyn is None:
            key = self.server_start[owner] + row  # [N]: unique across servers, grouped by server
            key_start = self.server_start  # [S + 1]: server s's keys are key_start[s] .. key_start[s + 1] - 1
            key_row, key_id = None, None
        else:
            # A dynamic id: its owner by hash, the marker -(1 + t) for a row, and the id itself.
            if self.all_dynamic:
                ident = v
            else:
                if S > 1:  # one server owns every id
                    owner = torch.where(dyn, dynamic_owner(v, S), owner)
                row = torch.where(dyn, -1 - table, row)
                ident = torch.where(dyn, v, 0)
            # Keys: the rank of (owner, row, id) among the batch's distinct triples (sorted),
            # (owner, row) packed into one ascending int64: owner s's rows -T .. rows_s - 1
            # (markers included) after server s - 1's.
            place = self.pair_start[owner] + row
            first, key = _unique_pairs(place, ident, self.place_end)
            key_start = torch.searchsorted(owner[first], torch.arange(S + 1))
            key_row, key_id = row[first], ident[first]
        pooled = self._pooled_tables(bags, lengths, bag_of, table, owner, key)[table]  # [N] bool

        single = ~pooled
        if key_row is not None and not bool(pooled.any()):
            # Every key is a single row's and the keys are ranks: their distinct values are 0 .. U - 1.
            skeys, sinv = torch.arange(len(first)), key
        else:
            skeys, sinv = torch.unique(key[single], return_inverse=True)  # sorted, so grouped by server
        bounds = torch.searchsorted(skeys, key_start).tolist()  # [S + 1]
        s_owner, s_bag = owner[single], bag_of[single]
        s_weight = bags.weights[single] if bags.weights is not None else None
        p_where = torch.nonzero(pooled, as_tuple=True)[0]
        p_owner = owner[p_where]

        plan = BagPlan([], [], [], [], [], [], self._divisor(lengths), T, B)
        for s in range(S):
            lo, hi = bounds[s], bounds[s + 1]
            mine = p_where[p_owner == s]  # [M_s], in bag order
            p_bag = bag_of[mine]
            pbags, counts = torch.unique_consecutive(p_bag, return_counts=True)  # [P_s]
            offsets = (hi - lo) + _exclusive_cumsum(counts)
            weights = bags.weights[mine] if bags.weights is not None and len(mine) else None
            if key_row is None or key_id is None:
                singles = skeys[lo:hi] - int(key_start[s])  # [U_s]
                plan.requests.append(ServerRequest(torch.cat([singles, row[mine]]), offsets, weights))
                plan.ids.append(None)
            else:
                rows_s = torch.cat([key_row[skeys[lo:hi]], row[mine]])
                ids_s = torch.cat([key_id[skeys[lo:hi]], v[mine]])
                plan.requests.append(ServerRequest(rows_s, offsets, weights))
                plan.ids.append(ids_s if self.all_dynamic else ids_s[rows_s < 0])
            plan.answers.append((hi - lo) + len(pbags))
            plan.pooled_rows.append(len(mine))
            # Final bags' entries from server s: its single rows, once per id using them, and
            # its partial of each pooled bag; grouped by final bag.
            s_mine = s_owner == s
            # The single rows' bags ascend already (bag_of does, masks keep order): only the
            # partials of pooled bags need merging in, so without any the stable sort is the
            # identity and is skipped (the plan is the same).
            if len(pbags):
                bag_ids = torch.cat([s_bag[s_mine], pbags])
                items = torch.cat([sinv[s_mine] - lo, (hi - lo) + torch.arange(len(pbags))])
                order: Tensor | None = torch.argsort(bag_ids, stable=True)
            else:
                bag_ids, items, order = s_bag[s_mine], sinv[s_mine] - lo, None
            plan.entries.append(items if order is None else items[order])
            plan.entry_offsets.append(_exclusive_cumsum(torch.bincount(bag_ids, minlength=T * B)))
            if s_weight is None:
                plan.entry_weights.append(None)
            else:
                w = torch.cat([s_weight[s_mine], torch.ones(len(pbags))])
                plan.entry_weights.append(w if order is None else w[order])
        return plan

    def _pooled_tables(
        self, bags: Bags, lengths: Tensor, bag_of: Tensor, table: Tensor, owner: Tensor, key: Tensor
    ) -> Tensor:
        """Which tables the servers pool (bool [T]): those where sending one partial per bag
        and server costs fewer bytes than sending each distinct row once."""
        T, B, S = bags.num_tables, bags.batch_size, self.num_servers
        if len(lengths) == 0 or int(lengths.max()) <= 1:
            return torch.zeros(T, dtype=torch.bool)  # bags of one: a bag's partial is a row
        vec = 2 * self.dim * FLOAT_BYTES  # a vector out, its gradient back
        ukeys, inv = torch.unique(key, return_inverse=True)
        utable = torch.zeros(len(ukeys), dtype=torch.int64).scatter_(0, inv, table)
        rows_bytes = torch.bincount(utable, minlength=T) * (INDEX_BYTES + vec)
        pairs = torch.unique(bag_of * S + owner)  # (bag, server) pairs with at least one id
        ptable = torch.div(pairs, S * B, rounding_mode="floor")
        per_id = INDEX_BYTES + (FLOAT_BYTES if bags.weights is not None else 0)
        pooled_bytes = torch.bincount(table, minlength=T) * per_id + torch.bincount(ptable, minlength=T) * (
            INDEX_BYTES + vec
        )
        return pooled_bytes < rows_bytes

    def _divisor(self, lengths: Tensor) -> Tensor | None:
        """[T * B, 1]: each bag's length in mean tables (at least 1), 1 elsewhere; None without mean tables."""
        if not bool(self.mean.any()):
            return None
        B = len(lengths) // len(self.mean)
        mean = self.mean.repeat_interleave(B)
        return torch.where(mean, lengths.clamp(min=1), 1).to(torch.float32).unsqueeze(1)


def combine(plan: BagPlan, answers: Sequence[Tensor]) -> Tensor:
    """The batch's pooled embeddings ``[B, T, d]`` from ``answers[s]`` ([answers_s, d], what
    server s returned for ``plan.requests[s]``). Differentiable: each answer's gradient is
    the sum over the bags that used each of its vectors (times the ids' weights)."""
    T, B = plan.num_tables, plan.batch_size
    total: Tensor | None = None
    for s, out in enumerate(answers):
        if len(plan.entries[s]) == 0:
            continue
        part = F.embedding_bag(
            plan.entries[s], out, plan.entry_offsets[s], mode="sum", per_sample_weights=plan.entry_weights[s]
        )  # [T * B, d]
        total = part if total is None else total + part
    if total is None:
        total = answers[0].new_zeros(T * B, answers[0].shape[1])
    if plan.divisor is not None:
        total = total / plan.divisor
    return total.view(T, B, -1).transpose(0, 1)
