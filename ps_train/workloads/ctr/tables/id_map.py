"""A dynamic table's raw id -> slot map as two flat tensors (open addressing, linear probing).

A Python dict costs ~100 bytes and ~1 µs per id: at 1M rows per table, 100 MB beyond the
rows and a step's 4,096 ids looked up one by one. Here an entry is 12 bytes at a load of at
most one half (int64 key, int32 slot, twice the entries' room) and every operation is a few
whole-batch torch passes, one per probe (about 1.5 probes per id at that load).

Keys: ``EMPTY`` (never used) ends a probe; ``GONE`` (removed) does not, and is reused by
inserts. When fewer than a quarter of the places are ``EMPTY``, the map is rebuilt from
its live entries (amortised: after as many removals as a quarter of the places).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = ["IdSlotMap"]

EMPTY, GONE = -1, -2
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: Fibonacci hashing's multiplier


class IdSlotMap:
    """Distinct int64 ids (>= 0) -> int slots, for at most ``max_entries`` entries at once."""

    def __init__(self, max_entries: int) -> None:
        self.bits = max(4, (2 * max(max_entries, 1) - 1).bit_length())  # room: a power of two >= 2 x entries
        size = 1 << self.bits
        self.keys = torch.full((size,), EMPTY, dtype=torch.int64)
        self.values = torch.full((size,), -1, dtype=torch.int32)
        self.count = 0
        self.empty = size  # places still EMPTY

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[int]:
        return iter(self.items()[0].tolist())

    def __contains__(self, x: object) -> bool:
        return isinstance(x, int) and x >= 0 and bool(self.contains(torch.tensor([x]))[0])

    def __getitem__(self, x: int) -> int:
        slot = int(self.get(torch.tensor([x]))[0]) if x >= 0 else -1
        if slot < 0:
            raise KeyError(x)
        return slot

    def _home(self, ids: Tensor) -> Tensor:
        # The top bits of the product (wrapping int64 multiplication), as a place [n].
        return (ids * _GOLDEN >> (64 - self.bits)) & ((1 << self.bits) - 1)

    def _find(self, ids: Tensor) -> Tensor:
        """Each id's place, -1 where absent (int64 [n])."""
        mask = (1 << self.bits) - 1
        place = self._home(ids)
        out = torch.full_like(ids, -1)
        todo = torch.arange(len(ids))
        while len(todo):
            at = place[todo]
            k = self.keys[at]
            hit = k == ids[todo]
            out[todo[hit]] = at[hit]
            todo = todo[~hit & (k != EMPTY)]
            place[todo] = (place[todo] + 1) & mask
        return out

    def get(self, ids: Tensor) -> Tensor:
        """Each id's slot, -1 where absent (int64 [n])."""
        where = self._find(ids)
        out = torch.full_like(ids, -1)
        found = where >= 0
        out[found] = self.values[where[found]].to(torch.int64)
        return out

    def contains(self, ids: Tensor) -> Tensor:
        return self._find(ids) >= 0

    def put(self, ids: Tensor, slots: Tensor) -> None:
        """Add ``ids`` (distinct, none present) at ``slots``."""
        if len(ids) == 0:
            return
        if self.count + len(ids) > (1 << self.bits) // 2:
            raise ValueError(f"IdSlotMap: {self.count + len(ids)} entries exceed the room made for {self.capacity}")
        mask = (1 << self.bits) - 1
        place = self._home(ids)
        todo = torch.arange(len(ids))
        while len(todo):
            at = place[todo]
            free = self.keys[at] < 0  # EMPTY or GONE
            cand, cat = todo[free], at[free]
            # Ids aiming at one free place: the first in the batch takes it, the rest probe on
            # (``cand`` ascends, so a stable sort by place keeps each place's first id first).
            order = torch.argsort(cat, stable=True)
            by_place = cat[order]
            lead = torch.ones(len(order), dtype=torch.bool)
            lead[1:] = by_place[1:] != by_place[:-1]
            won = torch.zeros(len(cand), dtype=torch.bool)
            won[order[lead]] = True
            wins, wat = cand[won], cat[won]
            self.empty -= int((self.keys[wat] == EMPTY).sum())
            self.keys[wat] = ids[wins]
            self.values[wat] = slots[wins].to(torch.int32)
            taken = torch.ones(len(todo), dtype=torch.bool)
            taken[free.nonzero().squeeze(1)[won]] = False
            todo = todo[taken]
            place[todo] = (place[todo] + 1) & mask
        self.count += len(ids)

    def remove(self, ids: Tensor) -> None:
        """Remove ``ids`` (all present)."""
        where = self._find(ids)
        if bool((where < 0).any()):
            raise KeyError(f"IdSlotMap.remove: ids not present: {ids[where < 0][:5].tolist()}")
        self.keys[where] = GONE
        self.count -= len(ids)
        if self.empty < (1 << self.bits) // 4:
            self._rebuild()

    def items(self) -> tuple[Tensor, Tensor]:
        """The live ids and their slots (int64 [count] each), in place order."""
        live = self.keys >= 0
        return self.keys[live], self.values[live].to(torch.int64)

    @property
    def capacity(self) -> int:
        return (1 << self.bits) // 2

    def _rebuild(self) -> None:
        ids, slots = self.items()
        self.keys.fill_(EMPTY)
        self.values.fill_(-1)
        self.count, self.empty = 0, 1 << self.bits
        self.put(ids, slots)
