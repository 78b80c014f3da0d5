"""A trainer's cache of hot table rows (``model.cache_rows``, ``model.cache_staleness``).

Click logs are skewed (Zipf): a few rows of every table are in most batches, and a trainer
pulls them from their servers step after step although they change little between two
steps. HET (Miao et al., VLDB 2022) keeps such rows on the worker and bounds how stale they
may get. Here:

- **Which rows**: each server's rows are scored by how often the trainer's batches used
  them, exponentially decayed (half-life ``HALF_LIFE`` steps: recent use counts, old use
  fades). Every ``cache_staleness`` steps (s) the cache is emptied and the hot set becomes
  the ``cache_rows`` best-scored rows over all servers (rows never used are never hot).
- **Bounded staleness**: a hot row is pulled, as usual, the first time a batch uses it after
  the refresh, and its pulled value serves every later lookup of it until the next refresh:
  a cached value is used for at most s steps before the row is pulled again.
- **Gradients** of cached rows go to their server as usual, every step, with the step's
  other gradients (``ParameterServer.push_gradients``, before the update request), so the
  server's optimizer state and every other trainer see each update at once, sync mode still
  sums every trainer's gradient of a row in its round, and only the trainer's own reads are
  stale. Accumulating them locally for s steps would save the pushes too, but would apply
  s steps of a hot row's gradients as one (a different optimizer trajectory: Adagrad's sum
  of squares sees one large gradient instead of s small ones) and hide them from the
  other trainers for s steps.

Only rows fetched one by one (``ServerRequest``'s single rows) are cached; partial bags the
servers pool are pulled every step. Memory: a float32 score per row of every server (the
trainer's view of the tables' size) and ``cache_rows`` x d values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ps_train.workloads.ctr.tables.plan import ServerRequest

__all__ = ["RowCache", "CacheSplit", "HALF_LIFE"]

HALF_LIFE = 100  # steps after which a use counts half as much as a use now
_RESCALE = 1e30  # scores are kept times a growing weight; divided back before they overflow


class CacheSplit(NamedTuple):
    """One server's request with its cached single rows taken out.

    ``request``: what still goes to the server (the missing single rows, then the pooled
    bags as before). ``hit_pos`` / ``miss_pos``: int64 [H] / [M], where the cached and the
    pulled single rows sit among the original request's singles; ``hit_rows`` [H] and
    ``hit_values`` [H, d]: the cached rows and their values; ``miss_rows`` [M]: the rows
    pulled; ``singles``: U = H + M."""

    request: ServerRequest
    hit_pos: Tensor
    miss_pos: Tensor
    hit_rows: Tensor
    hit_values: Tensor
    miss_rows: Tensor
    singles: int


class _PushOnBackward(torch.autograd.Function):
    """Identity on the cached values [H, d]; its backward hands their gradient to ``push``
    (which sends it to the rows' server) and stops there."""

    @staticmethod
    def forward(ctx: Any, values: Tensor, push: Callable[[Tensor], None]) -> Tensor:
        ctx.push = push
        return values.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None]:
        ctx.push(grad.contiguous())
        return None, None


class RowCache:
    """One trainer's hot rows of every server: ``server_rows[s]`` rows on server s."""

    def __init__(self, capacity: int, staleness: int, server_rows: Sequence[int], dim: int) -> None:
        if capacity < 1 or staleness < 1:
            raise ValueError(f"a row cache needs capacity >= 1 and staleness >= 1, got {capacity}, {staleness}")
        self.capacity, self.staleness, self.dim = capacity, staleness, dim
        self.scores = [torch.zeros(n) for n in server_rows]  # [rows_s] each: decayed use counts x weight
        self._weight = 1.0  # the current step's increment (grows instead of decaying every score)
        self._growth = 2.0 ** (1.0 / HALF_LIFE)
        self.hot = [torch.empty(0, dtype=torch.int64) for _ in server_rows]  # sorted hot rows per server
        self.rows = [torch.empty(0, dtype=torch.int64) for _ in server_rows]  # sorted cached rows per server
        self.values = [torch.empty(0, dim) for _ in server_rows]  # [C_s, d], in ``rows`` order
        self.hits = 0  # single rows served from the cache so far

    def begin_step(self, step: int) -> None:
        """Before step ``step``'s lookups: every s steps the hot set is chosen again and
        the cache emptied."""
        self._weight *= self._growth
        if self._weight > _RESCALE:
            for sc in self.scores:
                sc.div_(self._weight)
            self._weight = 1.0
        if step % self.staleness == 0:
            self._refresh()

    def _refresh(self) -> None:
        flat = torch.cat(self.scores)
        k = min(self.capacity, int((flat > 0).sum()))
        top = torch.topk(flat, k).indices if k else torch.empty(0, dtype=torch.int64)
        starts = [0, *torch.tensor([len(sc) for sc in self.scores]).cumsum(0).tolist()]
        for s in range(len(self.scores)):
            mine = top[(top >= starts[s]) & (top < starts[s + 1])] - starts[s]
            self.hot[s] = torch.sort(mine).values
            self.rows[s] = torch.empty(0, dtype=torch.int64)
            self.values[s] = torch.empty(0, self.dim)

    def split(self, server: int, req: ServerRequest) -> CacheSplit:
        """Score the request's single rows and take out those cached."""
        singles = int(req.offsets[0]) if len(req.offsets) else len(req.rows)
        rows = req.rows[:singles]  # distinct, sorted (ps_train.workloads.ctr.tables.plan)
        self.scores[server].index_add_(0, rows, torch.full((singles,), self._weight))
        cached = self.rows[server]
        if len(cached) == 0 or singles == 0:
            hit = torch.zeros(singles, dtype=torch.bool)
        else:
            at = torch.searchsorted(cached, rows).clamp(max=len(cached) - 1)
            hit = cached[at] == rows
        hit_pos, miss_pos = torch.nonzero(hit, as_tuple=True)[0], torch.nonzero(~hit, as_tuple=True)[0]
        hit_rows = rows[hit_pos]
        values = self.values[server][torch.searchsorted(cached, hit_rows)] if len(hit_rows) else self.values[server][:0]
        self.hits += len(hit_rows)
        request = ServerRequest(
            torch.cat([rows[miss_pos], req.rows[singles:]]), req.offsets - len(hit_pos), req.weights
        )
        return CacheSplit(request, hit_pos, miss_pos, hit_rows, values, rows[miss_pos], singles)

    def assemble(self, server: int, sp: CacheSplit, pulled: Tensor, push: Callable[[Tensor], None]) -> Tensor:
        """The answer the original request would have had ([U + P, d]) from the server's
        ``pulled`` ([M + P, d]) and the cached values; hot rows pulled now are cached.
        ``push(grad [H, d])`` sends the cached rows' gradient in the backward."""
        m = len(sp.miss_pos)
        self._admit(server, sp.miss_rows, pulled[:m].detach())
        if len(sp.hit_pos) == 0:
            return pulled
        cached = _PushOnBackward.apply(sp.hit_values.detach().requires_grad_(True), push)
        h, p = len(sp.hit_pos), pulled.shape[0] - m
        order = torch.empty(sp.singles + p, dtype=torch.int64)
        order[sp.miss_pos] = torch.arange(m)
        order[sp.hit_pos] = m + torch.arange(h)
        order[sp.singles :] = m + h + torch.arange(p)
        return torch.cat([pulled[:m], cached, pulled[m:]]).index_select(0, order)

    def _admit(self, server: int, rows: Tensor, values: Tensor) -> None:
        hot = self.hot[server]
        if len(hot) == 0 or len(rows) == 0:
            return
        at = torch.searchsorted(hot, rows).clamp(max=len(hot) - 1)
        new = hot[at] == rows
        if not bool(new.any()):
            return
        all_rows = torch.cat([self.rows[server], rows[new]])
        order = torch.argsort(all_rows)
        self.rows[server] = all_rows[order]
        self.values[server] = torch.cat([self.values[server], values[new]])[order]

    def cached_rows(self) -> int:
        return sum(len(r) for r in self.rows)
