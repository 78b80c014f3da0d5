"""A dynamic table's raw id -> slot map as two flat tensors (open addressing, linear probing
over buckets).

A Python dict costs ~100 bytes and ~1 µs per id: at 1M rows per table, 100 MB beyond the
rows and a step's 4,096 ids looked up one by one. Here an entry is 12 bytes at a load of at
most one half (int64 key, int32 slot, twice the entries' room) and every operation is a few
whole-batch torch passes.

The places form buckets of ``WINDOW`` (16: 128 bytes of keys, aligned); an id hashes to a
bucket and takes the first free place of it or, when full, of the next buckets in turn.
A probe round reads one whole bucket per id (a gather of rows: a copy of 128 bytes, ~30x
cheaper than gathering 16 scattered places), so a batch is answered in 1-3 rounds even
with many removed places about. The passes run on NumPy views of the tensors: a step's
few thousand ids make arrays small enough that a call's fixed cost is most of an
operation's (NumPy's is a third of torch's), and the id map is most of a dynamic table's
work on the server.

An insert round writes every id into its bucket's first free place at once and reads the
places back: where several ids of the batch aimed at one place, the one read back holds
it and the others look again (which one does is immaterial: an id's place is never seen
outside the map). A lookup can also note, from the same copy of the buckets, each absent
id's first free place in its home bucket (``get_with_room``): the inserts of those ids that
follow it (a dynamic table's new rows) start there instead of copying the buckets again, unless
the map changed in between (``version``).

Keys: ``EMPTY`` (never used) ends a probe: an id never sits past a bucket with an EMPTY
place; ``GONE`` (removed) does not, and is reused by inserts. When fewer than a quarter of
the places are ``EMPTY`` (after removals or inserts), the map is rebuilt from its live
entries (amortised: after as many removals as a quarter of the places).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

__all__ = ["IdSlotMap", "Room"]

EMPTY, GONE = -1, -2
WINDOW = 16  # places per bucket
_WINDOW_BITS = 4
_CHUNK = 1 << 16  # ids inserted per pass (``put``)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing's multiplier
# ``_first_true``: a word 1 << 8j times this has j in its top byte (byte k of it is 7 - k).
_BYTE_INDEX, _TOP_BYTE, _ONE = np.uint64(0x0001020304050607), np.uint64(56), np.uint64(1)
assert np.little_endian, "IdSlotMap reads a bucket's marks as little-endian words"


class Room(NamedTuple):
    """Where ids absent from the map would go first: per id, the first free place of its home
    bucket (-1: none there), read by ``get_with_room`` in the same pass as the lookup; good
    for a ``put`` of those ids while the map's ``version`` is still ``version``."""

    places: np.ndarray  # int64 [n]
    version: int

    def of(self, which: np.ndarray) -> Room:
        """The rooms of the ids ``which`` (indices or a mask into this one's)."""
        return Room(self.places[which], self.version)


class IdSlotMap:
    """Distinct int64 ids (>= 0) -> int slots, for at most ``max_entries`` entries at once."""

    def __init__(self, max_entries: int) -> None:
        self.bits = max(_WINDOW_BITS, (2 * max(max_entries, 1) - 1).bit_length())  # room: a power of two >= 2 x entries
        size = 1 << self.bits
        self.keys = torch.full((size,), EMPTY, dtype=torch.int64)
        self.values = torch.full((size,), -1, dtype=torch.int32)
        # NumPy views of the same memory (the passes run on them).
        self._keys = self.keys.numpy()
        self._values = self.values.numpy()
        self._rows = self._keys.reshape(-1, WINDOW)  # [buckets, WINDOW]
        self._shift = np.uint64(64 - self.bits + _WINDOW_BITS)
        self._bmask = (1 << (self.bits - _WINDOW_BITS)) - 1
        self.count = 0
        self.empty = size  # places still EMPTY
        self.version = 0  # changes whenever a place does: tells a ``Room`` still holds

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

    def _home(self, ids: np.ndarray) -> np.ndarray:
        # The top bits of the product (wrapping uint64 multiplication), as a bucket [n] (int64).
        return ((ids.view(np.uint64) * _GOLDEN) >> self._shift).astype(np.int64)

    def _find(self, ids: np.ndarray, room: list[np.ndarray] | None = None) -> np.ndarray:
        """Each id's place, -1 where absent (int64 [n]); with ``room`` (a list), appends to it
        each id's first free place in its home bucket (-1: none), from the same copy of the
        buckets."""
        # The first round covers every id and nearly always answers all of them: its answer is
        # the output, and only the few ids that go on to a next bucket are tracked by index.
        bucket = self._home(ids)
        k = self._bucket_rows(bucket)  # [n, W]
        found, first = _first_true(k == ids[:, None])
        out = np.where(found, bucket * WINDOW + first, -1)
        if room is not None:
            has, free = _first_true(k < 0)
            room.append(np.where(has, bucket * WINDOW + free, -1))
        # Neither found nor ended at an EMPTY place: the next bucket. A bucket's EMPTY
        # places are its last ones (an insert takes the first free place; a removal
        # leaves GONE), so its last place says whether it has any.
        go_on = ~found & (k[:, WINDOW - 1] != EMPTY)
        if not go_on.any():
            return out
        todo = np.flatnonzero(go_on)
        bucket, want = (bucket[todo] + 1) & self._bmask, ids[todo]
        while len(todo):
            k = self._bucket_rows(bucket)
            found, first = _first_true(k == want[:, None])
            if found.any():
                out[todo[found]] = bucket[found] * WINDOW + first[found]
            go_on = ~found & (k[:, WINDOW - 1] != EMPTY)
            todo, bucket, want = todo[go_on], (bucket[go_on] + 1) & self._bmask, want[go_on]
        return out

    def _bucket_rows(self, buckets: np.ndarray) -> np.ndarray:
        """The keys of buckets ``buckets`` [m]: a copy, [m, WINDOW]. ``np.take`` copies each
        128-byte row whole, about half the time of indexing ``_rows[buckets]``."""
        return np.take(self._rows, buckets, axis=0)

    def get(self, ids: Tensor) -> Tensor:
        """Each id's slot, -1 where absent (int64 [n])."""
        where = self._find(_as_array(ids))
        # One gather and a select (place -1 reads the last place, then is masked): cheaper
        # than boolean indexing.
        return torch.from_numpy(np.where(where >= 0, self._values[where], -1).astype(np.int64))

    def get_with_room(self, ids: Tensor) -> tuple[Tensor, Room]:
        """``get``, and where the absent ones would go (``Room``, for ``put``): a ``put`` of
        ids just found absent then skips its first copy of their buckets."""
        room: list[np.ndarray] = []
        where = self._find(_as_array(ids), room)
        slots = torch.from_numpy(np.where(where >= 0, self._values[where], -1).astype(np.int64))
        return slots, Room(room[0], self.version)

    def contains(self, ids: Tensor) -> Tensor:
        return torch.from_numpy(self._find(_as_array(ids)) >= 0)

    def put(self, ids: Tensor, slots: Tensor, room: Room | None = None) -> None:
        """Add ``ids`` (distinct, none present) at ``slots``; ``room``: theirs, from
        ``get_with_room`` (ignored once the map changed since)."""
        if len(ids) == 0:
            return
        if self.count + len(ids) > (1 << self.bits) // 2:
            raise ValueError(f"IdSlotMap: {self.count + len(ids)} entries exceed the room made for {self.capacity}")
        keys, values = _as_array(ids), _as_array(slots).astype(np.int32)
        # A chunk at a time: a round copies each id's bucket (128 bytes), so a rebuild of 1M
        # entries at once would hold 128 MB of copies beside the map.
        places = room.places if room is not None and room.version == self.version else None
        for lo in range(0, len(keys), _CHUNK):
            near = None if places is None else places[lo : lo + _CHUNK]
            self._put(keys[lo : lo + _CHUNK], values[lo : lo + _CHUNK], near)
        self.count += len(ids)
        self.version += 1
        self._rebuild_if_crowded()

    def _put(self, ids: np.ndarray, slots: np.ndarray, near: np.ndarray | None) -> None:
        bucket = self._home(ids)
        while len(ids):
            # Each id's first free place (EMPTY or GONE) in its bucket; a full one: the next.
            # ``near``: the first round's, read with the lookup (the map unchanged since).
            if near is None:
                has, first = _first_true(self._bucket_rows(bucket) < 0)  # [m] each
                place = bucket[has] * WINDOW + first[has]
            else:
                has = near >= 0
                place, near = near[has], None
            want = ids[has]
            was = self._keys[place]  # EMPTY or GONE
            self._keys[place] = want  # ids aiming at one place: one of them is read back
            won = self._keys[place] == want
            self._values[place[won]] = slots[has][won]
            self.empty -= int((was[won] == EMPTY).sum())
            # Left: the losers (same bucket again) and the ids of full buckets (the next one).
            left = ~has
            left[has] = ~won
            step = (~has).astype(np.int64)
            ids, slots, bucket = ids[left], slots[left], (bucket[left] + step[left]) & self._bmask

    def remove(self, ids: Tensor) -> None:
        """Remove ``ids`` (all present)."""
        where = self._find(_as_array(ids))
        if bool((where < 0).any()):
            raise KeyError(f"IdSlotMap.remove: ids not present: {ids[torch.from_numpy(where < 0)][:5].tolist()}")
        self._keys[where] = GONE
        self.count -= len(ids)
        self.version += 1
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


def _first_true(marks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Of each row of ``marks`` (bool [m, WINDOW], C-contiguous): whether any is true, and
    the first true column (meaningless where none is). Read as two uint64 words a row
    (byte j of a word is column j: little-endian), the lowest set byte isolated by
    ``w & -w`` and its index read by one multiplication: ``bool.any(1)`` and ``argmax(1)``
    over 16-byte rows cost ~10x these few [m] passes."""
    words = marks.view(np.uint64)  # [m, 2]
    lo, hi = words[:, 0], words[:, 1]
    lo_idx = ((lo & (~lo + _ONE)) * _BYTE_INDEX) >> _TOP_BYTE
    hi_idx = ((hi & (~hi + _ONE)) * _BYTE_INDEX) >> _TOP_BYTE
    nonzero = lo != 0
    first = np.where(nonzero, lo_idx, hi_idx + np.uint64(8)).astype(np.int64)
    return nonzero | (hi != 0), first


def _as_array(x: Tensor) -> np.ndarray:
    """An int64 tensor's values as a NumPy array (the same memory when it is contiguous)."""
    return x.detach().to(torch.int64).contiguous().numpy()
