"""One server's part of a dynamic table: which raw id holds which of its row slots, when
an id gets a row (admission), and which rows give their slot up (eviction).

Monolith's collisionless tables: two ids never share a row. The server's storage holds
``max_rows`` slots for the table (``ps_train.workloads.ctr.tables.shards``); ``DynamicTable`` only decides,
and ``ps_train.workloads.ctr.tables.service.TableServer`` writes the rows it says to create.

- **Map.** ``slots``: id -> slot in two flat tensors (``id_map.IdSlotMap``: 12 bytes per
  place at a load of at most a half, a batch looked up in whole-tensor passes), and per slot its id (``slot_ids``
  int64 [max_rows], -1 when free) and the step it was last used (``last_used`` int64
  [max_rows]), tensors scanned with torch ops for eviction.
- **Clock.** Every training lookup carries its step; the first lookup of a later step calls
  ``advance``, which is where rows are evicted and sightings counted: in sync mode every
  lookup of step s comes after every update of step s - 1, so a step's lookups never see
  a row disappear, and none depends on which trainer's lookup arrives first.
- **Admission** (``admit_after`` k): an id gets its row at a sighting when the batches it was
  seen in before this step, plus this one, reach k; until then it reads the shared zero row
  and its gradient is dropped. Sightings of a step count from the next step (one per
  trainer batch, ``pending``), so the trainers of one sync step all decide alike. Counts are
  kept only for ids without a row, at most ``max_rows`` of them: when more, the half seen
  least recently (ties: smaller id) are forgotten and start again from 0 (k = 1 keeps none).
- **Eviction** at each step's start: ``ttl`` first evicts rows unused for ``ttl_steps`` steps
  (last used before ``step - ttl_steps``); then, for ``lru`` and ``ttl`` alike, the least
  recently used rows (ties: smaller id) until ``spare`` slots are free, the most new rows one
  step can bring (trainers x batch x bag size), so that no step runs out of slots. A step
  that does anyway (async trainers at different steps) evicts rows not used in the current
  step at once, or, when there are none, leaves the rest of its new ids on the zero row.
  An evicted row's slot is free for another id; its optimizer state is reset when reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ps_train.workloads.ctr.tables.id_map import IdSlotMap

__all__ = ["DynamicSpec", "Resolved", "DynamicCounts", "DynamicTable", "lru_victims"]


@dataclass(frozen=True)
class DynamicSpec:
    """A dynamic table's settings on one server."""

    max_rows: int
    admit_after: int = 1
    eviction: str = "lru"  # lru | ttl
    ttl_steps: int | None = None
    spare: int = 0  # slots kept free at each step's start


class Resolved(NamedTuple):
    """A lookup's answer: ``slots`` int64 [n] (each id's slot, -1: the zero row), and the
    slots it filled with new rows (``created_slots`` [c], ``created_ids`` [c]), which the
    caller initialises (row and optimizer state)."""

    slots: Tensor
    created_slots: Tensor
    created_ids: Tensor


class DynamicCounts(NamedTuple):
    """Cumulative counters of one table on one server (metrics)."""

    live: int  # rows held now
    created: int  # rows created (an evicted id seen again counts again)
    evicted: int
    admitted: int  # sightings of ids without a row that passed admission (created, or found no slot)


def lru_victims(eligible: Tensor, last_used: Tensor, ids: Tensor, k: int) -> Tensor:
    """The ``k`` slots of ``eligible`` (bool [max_rows]) least recently used: smallest
    ``last_used``, ties by smaller ``ids`` (both [max_rows]); all eligible slots if at most
    ``k``. Those older than the k-th come first, in slot order, then its ties by id.

    Whole-array passes (a masked copy, a partial top-k, one compare) instead of gathering
    the eligible slots and a full selection: at a full table of 1M slots ~3x less per step."""
    if k <= 0:
        return torch.zeros(0, dtype=torch.int64)
    if int(eligible.sum()) <= k:
        return torch.nonzero(eligible).squeeze(1)
    key = last_used.masked_fill(~eligible, torch.iinfo(torch.int64).max)  # [max_rows]
    kth = int(torch.topk(key, k, largest=False, sorted=False).values.max())  # the k-th smallest
    upto = torch.nonzero(key <= kth).squeeze(1)  # ascending slots: k and the k-th's ties
    at = key[upto]
    below, tied = upto[at < kth], upto[at == kth]
    # The smallest ids among the ties, ascending (ids are distinct: one order only).
    order = torch.topk(ids[tied], k - len(below), largest=False, sorted=True).indices
    return torch.cat([below, tied[order]])


class DynamicTable:
    """The slot map and policy of one dynamic table on one server (see the module docstring).
    Not thread-safe: the caller serialises calls."""

    def __init__(self, spec: DynamicSpec) -> None:
        if spec.max_rows < 1 or spec.admit_after < 1 or spec.eviction not in ("lru", "ttl"):
            raise ValueError(f"a dynamic table needs max_rows >= 1, admit_after >= 1 and lru/ttl eviction: {spec}")
        if spec.eviction == "ttl" and (spec.ttl_steps is None or spec.ttl_steps < 1):
            raise ValueError(f"eviction=ttl needs ttl_steps >= 1, got {spec.ttl_steps}")
        self.spec = spec
        n = spec.max_rows
        self.slots = IdSlotMap(n)  # id -> slot (``id_map``: tensors, not a dict)
        self.slot_ids = torch.full((n,), -1, dtype=torch.int64)
        self.last_used = torch.zeros(n, dtype=torch.int64)
        self.free = torch.arange(n - 1, -1, -1, dtype=torch.int64)  # a stack: slot 0 is handed out first
        self.clock = 0  # the step of the latest training lookup
        self.counts: dict[int, tuple[int, int]] = {}  # id without a row -> (batches seen in, last step seen)
        self.pending: dict[int, int] = {}  # this step's sightings: id -> bit mask of the trainers that saw it
        self.created = self.evicted = self.admitted = 0

    # -- the clock --------------------------------------------------------------------------------
    def advance(self, step: int) -> Tensor:
        """Start step ``step`` (> ``clock``): commit the last step's sightings, evict; returns
        the evicted slots."""
        self._commit()
        self.clock = step
        victims = []
        held = self.slot_ids >= 0
        if self.spec.eviction == "ttl":
            assert self.spec.ttl_steps is not None
            expired = torch.nonzero(held & (self.last_used < step - self.spec.ttl_steps)).squeeze(1)
            victims.append(expired)
            self._evict(expired)
            held = self.slot_ids >= 0
        short = self.spec.spare - len(self.free)
        if short > 0:
            lru = lru_victims(held, self.last_used, self.slot_ids, short)
            victims.append(lru)
            self._evict(lru)
        return torch.cat(victims) if victims else torch.zeros(0, dtype=torch.int64)

    def _commit(self) -> None:
        if not self.pending:
            return
        pending = list(self.pending.items())
        held = self.slots.contains(torch.tensor([x for x, _ in pending], dtype=torch.int64)).tolist()
        for (x, trainers), has_row in zip(pending, held, strict=True):
            if not has_row:
                seen = self.counts.get(x, (0, 0))[0]
                self.counts[x] = (seen + trainers.bit_count(), self.clock)
        self.pending = {}
        if len(self.counts) > self.spec.max_rows:  # forget the half seen least recently
            order = sorted(self.counts, key=lambda x: (self.counts[x][1], x))
            for x in order[: len(order) - self.spec.max_rows // 2]:
                del self.counts[x]

    def _evict(self, slots: Tensor) -> None:
        if len(slots) == 0:
            return
        self.slots.remove(self.slot_ids[slots])
        self.slot_ids[slots] = -1
        self.free = torch.cat([self.free, slots.flip(0)])
        self.evicted += len(slots)

    # -- lookups ----------------------------------------------------------------------------------
    def lookup(self, ids: Tensor, step: int, trainer: int = 0) -> Resolved:
        """A training lookup of ``ids`` (int64 [n], repeats allowed) by ``trainer`` at
        ``step``: marks the rows used, counts sightings, creates the rows admitted."""
        if step > self.clock:
            raise RuntimeError(f"lookup at step {step} before advance({step}); the table is at step {self.clock}")
        uniq, inverse = torch.unique(ids, return_inverse=True)  # sorted: creation order is the ids'
        found = self.slots.get(uniq)
        have = found >= 0
        used = found[have]
        self.last_used[used] = self.last_used[used].clamp(min=step)  # an async trainer may be behind
        new = torch.nonzero(~have).squeeze(1)
        empty = torch.zeros(0, dtype=torch.int64)
        if len(new) == 0:
            return Resolved(found[inverse], empty, empty)
        k = self.spec.admit_after
        keys = uniq.tolist()
        bit = 1 << trainer
        admit: list[int] = new.tolist() if k == 1 else []  # k = 1: every new id at its first sighting
        for i in new.tolist() if k > 1 else ():
            x = keys[i]
            if self.counts.get(x, (0, 0))[0] + 1 >= k:
                admit.append(i)
            else:
                self.pending[x] = self.pending.get(x, 0) | bit
        self.admitted += len(admit)
        if not admit:
            return Resolved(found[inverse], empty, empty)
        chosen = torch.tensor(admit, dtype=torch.int64)
        short = len(chosen) - len(self.free)
        if short > 0:  # out of free slots mid-step: rows not used this step go now
            idle = (self.slot_ids >= 0) & (self.last_used < step)
            self._evict(lru_victims(idle, self.last_used, self.slot_ids, short))
            chosen = chosen[: len(self.free)]  # the rest stay on the zero row, admitted again next time
            for i in admit[len(chosen) :]:
                self.pending[keys[i]] = self.pending.get(keys[i], 0) | bit
        take = self.free[len(self.free) - len(chosen) :].flip(0)  # [c], popped in order
        self.free = self.free[: len(self.free) - len(chosen)]
        new_ids = uniq[chosen]
        self.slots.put(new_ids, take)
        if self.counts:
            for x in new_ids.tolist():
                self.counts.pop(x, None)
        self.slot_ids[take] = new_ids
        self.last_used[take] = step
        found[chosen] = take
        self.created += len(chosen)
        return Resolved(found[inverse], take, new_ids)

    def read(self, ids: Tensor) -> Tensor:
        """Evaluation: each id's slot, -1 (the zero row) for ids without a row; changes nothing."""
        uniq, inverse = torch.unique(ids, return_inverse=True)
        return self.slots.get(uniq)[inverse]

    # -- metrics and checkpoints ------------------------------------------------------------------
    def counters(self) -> DynamicCounts:
        return DynamicCounts(len(self.slots), self.created, self.evicted, self.admitted)

    def state_dict(self) -> dict[str, Any]:
        """Everything but the rows (a copy): slots' ids and use, free slots, counts, clock."""
        return {
            "slot_ids": self.slot_ids.clone(),
            "last_used": self.last_used.clone(),
            "free": self.free.clone(),
            "clock": self.clock,
            "counts": dict(self.counts),
            "pending": dict(self.pending),
            "totals": [self.created, self.evicted, self.admitted],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        slot_ids = state["slot_ids"]
        if tuple(slot_ids.shape) != (self.spec.max_rows,):
            raise ValueError(
                f"the checkpoint's dynamic table has {tuple(slot_ids.shape)} slots, this server "
                f"{self.spec.max_rows}; resume with the same model.tables[*].max_rows"
            )
        self.slot_ids = slot_ids.clone()
        self.last_used = state["last_used"].clone()
        self.free = state["free"].clone()
        self.clock = int(state["clock"])
        self.counts = {int(x): (int(c), int(s)) for x, (c, s) in state["counts"].items()}
        self.pending = {int(x): int(b) for x, b in state["pending"].items()}
        self.created, self.evicted, self.admitted = (int(v) for v in state["totals"])
        held = torch.nonzero(self.slot_ids >= 0).squeeze(1)
        self.slots = IdSlotMap(self.spec.max_rows)
        self.slots.put(self.slot_ids[held], held)
