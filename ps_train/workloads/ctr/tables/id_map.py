"""A dynamic table's raw id -> slot map as two flat tensors (open addressing, linear probing
over buckets).

A Python dict costs ~100 bytes and ~1 µs per id: at 1M rows per table, 100 MB beyond the
rows and a step's 4,096 ids looked up one by one. Here an entry is 12 bytes at a load of at
most one half (int64 key, int32 slot, twice the entries' room) and every operation is a few
whole-batch torch passes.

The places form buckets of ``WINDOW`` (16: 128 bytes of keys, aligned); an id hashes to a
bucket and takes the first free place of it or, when full, of the next buckets in turn.
A probe round reads one whole bucket per id (``index_select`` of rows: a copy of 128
bytes, ~30x cheaper than gathering 16 scattered places), so a batch is answered in 1-3
rounds even with many removed places about.

Keys: ``EMPTY`` (never used) ends a probe: an id never sits past a bucket with an EMPTY
place; ``GONE`` (removed) does not, and is reused by inserts. When fewer than a quarter of
the places are ``EMPTY`` (after removals or inserts), the map is rebuilt from its live
entries (amortised: after as many removals as a quarter of the places).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = ["IdSlotMap"]

EMPTY, GONE = -1, -2
WINDOW = 16  # places per bucket
_WINDOW_BITS = 4
_CHUNK = 1 << 16  # ids inserted per pass (``put``)
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: Fibonacci hashing's multiplier


class IdSlotMap:
    """Distinct int64 ids (>= 0) -> int slots, for at most ``max_entries`` entries at once."""

    def __init__(self, max_entries: int) -> None:
        self.bits = max(_WINDOW_BITS, (2 * max(max_entries, 1) - 1).bit_length())  # room: a power of two >= 2 x entries
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
        # The top bits of the product (wrapping int64 multiplication), as a bucket [n].
        shift = 64 - self.bits + _WINDOW_BITS
        return (ids * _GOLDEN >> shift) & ((1 << (self.bits - _WINDOW_BITS)) - 1)

    def _buckets(self, buckets: Tensor) -> Tensor:
        """The keys of ``buckets`` [m]: int64 [m, WINDOW] (a copy)."""
        return self.keys.view(-1, WINDOW).index_select(0, buckets)

    def _find(self, ids: Tensor) -> Tensor:
        """Each id's place, -1 where absent (int64 [n])."""
        bmask = (1 << (self.bits - _WINDOW_BITS)) - 1
        bucket = self._home(ids)
        out = torch.full_like(ids, -1)
        todo = torch.arange(len(ids))
        while len(todo):
            b = bucket[todo]
            k = self._buckets(b)  # [m, W]
            hit = k == ids[todo].unsqueeze(1)
            found = hit.any(1)
            out[todo[found]] = b[found] * WINDOW + hit[found].to(torch.uint8).argmax(1)
            todo = todo[~found & ~(k == EMPTY).any(1)]  # neither found nor ended: the next bucket
            bucket[todo] = (bucket[todo] + 1) & bmask
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
        # A chunk at a time: a round copies each id's bucket (128 bytes), so a rebuild of 1M
        # entries at once would hold 128 MB of copies beside the map.
        for lo in range(0, len(ids), _CHUNK):
            self._put(ids[lo : lo + _CHUNK], slots[lo : lo + _CHUNK])
        self.count += len(ids)
        self._rebuild_if_crowded()

    def _put(self, ids: Tensor, slots: Tensor) -> None:
        bmask = (1 << (self.bits - _WINDOW_BITS)) - 1
        bucket = self._home(ids)
        todo = torch.arange(len(ids))
        while len(todo):
            # Each id's first free place (EMPTY or GONE) in its bucket; a full one: the next.
            b = bucket[todo]
            free = self._buckets(b) < 0  # [m, W]
            has = free.any(1)
            full = todo[~has]
            bucket[full] = (bucket[full] + 1) & bmask
            cand = todo[has]
            cat = b[has] * WINDOW + free[has].to(torch.uint8).argmax(1)
            # Ids aiming at one free place: the first in the batch takes it, the rest look
            # in the same bucket again (``cand`` ascends, so a stable sort by place keeps
            # each place's first id first).
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
            todo = torch.cat([full, cand[~won]]).sort().values  # ascending: batch order settles ties

    def remove(self, ids: Tensor) -> None:
        """Remove ``ids`` (all present)."""
        where = self._find(ids)
        if bool((where < 0).any()):
            raise KeyError(f"IdSlotMap.remove: ids not present: {ids[where < 0][:5].tolist()}")
        self.keys[where] = GONE
        self.count -= len(ids)
        self._rebuild_if_crowded()

    def items(self) -> tuple[Tensor, Tensor]:
        """The live ids and their slots (int64 [count] each), in place order."""
        live = self.keys >= 0
        return self.keys[live], self.values[live].to(torch.int64)

    @property
    def capacity(self) -> int:
        return (1 << self.bits) // 2

    def _rebuild_if_crowded(self) -> None:
        # A probe for an absent id ends at a bucket with an EMPTY place: keep a quarter EMPTY.
        if self.empty < (1 << self.bits) // 4:
            self._rebuild()

    def _rebuild(self) -> None:
        ids, slots = self.items()
        self.keys.fill_(EMPTY)
        self.values.fill_(-1)
        self.count, self.empty = 0, 1 << self.bits
        self.put(ids, slots)
