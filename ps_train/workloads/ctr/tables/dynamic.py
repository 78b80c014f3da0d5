"""One server's part of a dynamic table: which raw id holds which of its row slots, when
an id gets a row (admission), and which rows give their slot up (eviction).

Monolith's collisionless tables: two ids never share a row. The server's storage holds
``max_rows`` slots for the table (``ps_train.workloads.ctr.tables.shards``); ``DynamicTable`` only decides,
and ``ps_train.workloads.ctr.tables.service.TableServer`` writes the rows it says to create.

- **Map.** ``slots``: id -> slot in two flat tensors (``id_map.IdSlotMap``: 12 bytes per
  place at a load of at most a half, a batch looked up in whole-tensor passes), and per slot its id (``slot_ids``
  int64 [max_rows], -1 when free) and the step it was last used (``last_used`` int64
  [max_rows]). The use log (``uses``: step -> the slots last used then, int32, at most
  ``2 x max_rows`` entries) finds the least recently used rows without a pass over every
  slot: a step's eviction costs the rows it evicts.
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

import numpy as np
import torch
from torch import Tensor

from ps_train.workloads.ctr.tables.id_map import IdSlotMap

__all__ = ["DynamicSpec", "Resolved", "DynamicCounts", "DynamicTable"]


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
        # The use log: step -> chunks of the slots whose ``last_used`` became that step (int32).
        # An entry is stale once its slot is used later or freed; stale entries are skipped
        # when read and dropped when the log outgrows ``2 x max_rows`` entries (``_compact``).
        self.uses: dict[int, list[np.ndarray]] = {}
        self.use_entries = 0

    # -- the clock --------------------------------------------------------------------------------
    def advance(self, step: int) -> Tensor:
        """Start step ``step`` (> ``clock``): commit the last step's sightings, evict; returns
        the evicted slots."""
        self._commit()
        self.clock = step
        victims: list[np.ndarray] = []
        if self.spec.eviction == "ttl":
            assert self.spec.ttl_steps is not None
            expired = self._oldest(None, step - self.spec.ttl_steps)
            victims.append(expired)
            self._evict(expired)
        short = self.spec.spare - len(self.free)
        if short > 0:
            lru = self._oldest(short, None)
            victims.append(lru)
            self._evict(lru)
        return torch.from_numpy(np.concatenate(victims)) if victims else torch.zeros(0, dtype=torch.int64)

    # -- least recently used rows, from the use log --------------------------------------------------
    def _used(self, step: int, slots: np.ndarray) -> None:
        """``slots`` (int64) were just given ``last_used`` = ``step``."""
        if len(slots) == 0:
            return
        self.uses.setdefault(step, []).append(slots.astype(np.int32))
        self.use_entries += len(slots)
        if self.use_entries > 2 * self.spec.max_rows:
            self._compact()

    def _compact(self) -> None:
        """The use log rebuilt from the held slots' ``last_used``: one entry per held slot."""
        held = np.flatnonzero(self.slot_ids.numpy() >= 0)
        used = self.last_used.numpy()[held]
        order = np.argsort(used, kind="stable")
        ranked = used[order]
        cuts = np.flatnonzero(ranked[1:] != ranked[:-1]) + 1
        chunks = np.split(held[order].astype(np.int32), cuts)
        steps = ranked[np.concatenate(([0], cuts))].tolist() if len(held) else []
        self.uses = {s: [c] for s, c in zip(steps, chunks, strict=True)} if len(held) else {}
        self.use_entries = len(held)

    def _live_at(self, step: int) -> np.ndarray:
        """The held slots whose ``last_used`` is ``step`` (int64, ascending), from the log."""
        # Distinct and ascending: NumPy's sort and a pass (~5x torch.unique at a step's few
        # thousand entries). A step's entries are distinct but for rare reuses of a slot.
        chunks = self.uses[step]
        ranked = np.sort(chunks[0] if len(chunks) == 1 else np.concatenate(chunks)).astype(np.int64)
        if len(ranked) > 1:
            ranked = ranked[np.concatenate(([True], ranked[1:] != ranked[:-1]))]
        return ranked[(self.last_used.numpy()[ranked] == step) & (self.slot_ids.numpy()[ranked] >= 0)]

    def _oldest(self, k: int | None, before: int | None) -> np.ndarray:
        """The ``k`` held slots least recently used (smallest ``last_used``, ties by smaller
        id) among those last used before step ``before`` (None: any); all of them if at most
        ``k`` (``k`` None: all). Order: ascending slots, except when ``k`` cuts a step's rows:
        then the rows used before that step (ascending slots), then that step's by id.

        Reads the log from its oldest step until ``k`` rows are found, so a step costs the
        rows it evicts, not a pass over ``max_rows`` (at 1M slots a full scan and top-k was
        ~10 ms per table and step). The log's steps read wholly are dropped: their live rows
        are evicted by the caller, the rest are stale."""
        none = np.zeros(0, dtype=np.int64)
        if k is not None and k <= 0:
            return none
        below: list[np.ndarray] = []
        need = k
        for step in sorted(self.uses):
            if (before is not None and step >= before) or need == 0:
                break
            live = self._live_at(step)
            self.use_entries -= sum(len(c) for c in self.uses.pop(step))
            if need is None or len(live) < need or (len(live) == need and not self._more_after(before, step)):
                below.append(live)
                need = None if need is None else need - len(live)
                continue
            # ``k`` cuts this step's rows: the smallest ids of them (ids are distinct, so the
            # order is total and any sort gives it).
            pick = np.argsort(self.slot_ids.numpy()[live])[:need]
            rest = np.ones(len(live), dtype=bool)
            rest[pick] = False
            if rest.any():
                kept = live[rest].astype(np.int32)
                self.uses[step] = [kept]
                self.use_entries += len(kept)
            first = np.sort(np.concatenate(below)) if below else none
            return np.concatenate([first, live[pick]])
        return np.sort(np.concatenate(below)) if below else none

    def _more_after(self, before: int | None, step: int) -> bool:
        """Whether a held slot was last used after ``step`` and before ``before`` (None: any later)."""
        return any(len(self._live_at(s)) > 0 for s in sorted(self.uses) if s > step and (before is None or s < before))

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

    def _evict(self, slots: np.ndarray) -> None:
        if len(slots) == 0:
            return
        slot_ids = self.slot_ids.numpy()
        self.slots.remove(torch.from_numpy(slot_ids[slots]))
        slot_ids[slots] = -1
        self.free = torch.cat([self.free, torch.from_numpy(slots[::-1].copy())])
        self.evicted += len(slots)

    # -- lookups ----------------------------------------------------------------------------------
    def lookup(self, ids: Tensor, step: int, trainer: int = 0) -> Resolved:
        """A training lookup of ``ids`` (int64 [n], repeats allowed) by ``trainer`` at
        ``step``: marks the rows used, counts sightings, creates the rows admitted."""
        if step > self.clock:
            raise RuntimeError(f"lookup at step {step} before advance({step}); the table is at step {self.clock}")
        uniq, inverse = _distinct(ids)  # sorted: creation order is the ids'
        # The per-id passes run on NumPy views of the tensors (a step's few thousand ids: a
        # call's fixed cost is most of a pass, and NumPy's is a third of torch's).
        found_t, room = self.slots.get_with_room(uniq)  # [u]
        found = found_t.numpy()
        last_used = self.last_used.numpy()
        have = found >= 0
        used = found[have]
        raised = used[last_used[used] < step]  # an async trainer may be behind: never lowered
        last_used[raised] = step
        self._used(step, raised)
        empty = torch.zeros(0, dtype=torch.int64)
        if len(used) == len(found):
            return Resolved(_spread(found_t, inverse), empty, empty)
        new = np.flatnonzero(~have)
        k = self.spec.admit_after
        bit = 1 << trainer
        uniq_np = uniq.numpy()
        if k == 1:  # every new id at its first sighting: no per-id work in Python
            chosen = new
        else:
            admit: list[int] = []
            keys = uniq_np.tolist()
            for i in new.tolist():
                x = keys[i]
                if self.counts.get(x, (0, 0))[0] + 1 >= k:
                    admit.append(i)
                else:
                    self.pending[x] = self.pending.get(x, 0) | bit
            chosen = np.array(admit, dtype=np.int64)
        self.admitted += len(chosen)
        if len(chosen) == 0:
            return Resolved(_spread(found_t, inverse), empty, empty)
        short = len(chosen) - len(self.free)
        if short > 0:  # out of free slots mid-step: rows not used this step go now
            self._evict(self._oldest(short, step))
            # The rest stay on the zero row, admitted again next time.
            for x in uniq_np[chosen[len(self.free) :]].tolist():
                self.pending[x] = self.pending.get(x, 0) | bit
            chosen = chosen[: len(self.free)]
        c = len(chosen)
        take = self.free.numpy()[len(self.free) - c :][::-1].copy()  # [c], popped in order
        self.free = self.free[: len(self.free) - c]
        new_ids = uniq_np[chosen]
        self.slots.put(torch.from_numpy(new_ids), torch.from_numpy(take), room.of(chosen))
        if self.counts:
            for x in new_ids.tolist():
                self.counts.pop(x, None)
        self.slot_ids.numpy()[take] = new_ids
        last_used[take] = step
        self._used(step, take)
        found[chosen] = take
        self.created += c
        return Resolved(_spread(found_t, inverse), torch.from_numpy(take), torch.from_numpy(new_ids))

    def read(self, ids: Tensor) -> Tensor:
        """Evaluation: each id's slot, -1 (the zero row) for ids without a row; changes nothing."""
        uniq, inverse = _distinct(ids)
        return _spread(self.slots.get(uniq), inverse)

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
        self._compact()


def _distinct(ids: Tensor) -> tuple[Tensor, Tensor | None]:
    """``torch.unique(ids, return_inverse=True)``, with the inverse None when ``ids`` are
    ascending and distinct already (a trainer's rows of a table arrive so unless the
    servers pool its bags: ``plan``), which skips the sort."""
    x = ids.numpy()
    if len(x) < 2 or bool((x[1:] > x[:-1]).all()):
        return ids, None
    return torch.unique(ids, return_inverse=True)


def _spread(values: Tensor, inverse: Tensor | None) -> Tensor:
    """``values`` [u] of the distinct ids back at every id (``_distinct``'s inverse)."""
    return values if inverse is None else values[inverse]
