"""The dynamic tables' id -> slot map against a dict: the same answers through inserts,
removals and the rebuilds that clear removed places."""

from __future__ import annotations

import random

import pytest
import torch

from ps_train.workloads.ctr.tables.id_map import IdSlotMap


@pytest.mark.parametrize("room", [1, 40, 500])
def test_the_map_answers_as_a_dict_through_inserts_removals_and_rebuilds(room: int) -> None:
    rng = random.Random(room)
    ids_map, ref = IdSlotMap(room), dict[int, int]()
    for _ in range(400):
        if ref and rng.random() < 0.5:
            gone = rng.sample(sorted(ref), rng.randint(1, len(ref)))
            ids_map.remove(torch.tensor(gone, dtype=torch.int64))
            for x in gone:
                del ref[x]
        # Small ids collide in batches and with held ones; large ones spread over the hash.
        fresh = {rng.randrange(1 << 40) if rng.random() < 0.5 else rng.randrange(3 * room) for _ in range(room)}
        new = sorted(fresh - set(ref))[: room - len(ref)]
        slots = [rng.randrange(room) for _ in new]
        ids_map.put(torch.tensor(new, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64))
        ref.update(zip(new, slots, strict=True))
        asked = sorted(ref)[:50] + [rng.randrange(1 << 41) for _ in range(20)]
        assert ids_map.get(torch.tensor(asked, dtype=torch.int64)).tolist() == [ref.get(x, -1) for x in asked]
        assert len(ids_map) == len(ref) and set(ids_map) == set(ref)


def test_more_entries_than_its_room_is_refused_naming_the_room() -> None:
    ids_map = IdSlotMap(2)
    with pytest.raises(ValueError, match="room"):
        ids_map.put(torch.arange(10), torch.arange(10))


@pytest.mark.parametrize("room", [1, 40, 500])
def test_inserts_into_the_places_a_lookup_read_answer_as_a_dict(room: int) -> None:
    # A lookup's ``Room`` (the first free place of each absent id's bucket) placing the
    # inserts that follow it; other inserts in between make it stale, and the insert looks again.
    rng = random.Random(room)
    ids_map, ref = IdSlotMap(room), dict[int, int]()
    for _ in range(400):
        batch = sorted(
            set(rng.sample(sorted(ref), min(len(ref), 5)))
            | {rng.randrange(1 << 40) if rng.random() < 0.5 else rng.randrange(3 * room) for _ in range(room)}
        )
        found, places = ids_map.get_with_room(torch.tensor(batch, dtype=torch.int64))
        assert found.tolist() == [ref.get(x, -1) for x in batch]
        if rng.random() < 0.3:  # the room goes stale: other ids take places, others leave
            gone = rng.sample(sorted(ref), len(ref) // 2)
            ids_map.remove(torch.tensor(gone, dtype=torch.int64))
            for x in gone:
                del ref[x]
            other = sorted({rng.randrange(3 * room) for _ in range(room)} - set(ref) - set(batch))
            other = other[: (room - len(ref)) // 2]
            ids_map.put(torch.tensor(other, dtype=torch.int64), torch.tensor(other, dtype=torch.int64))
            ref.update((x, x) for x in other)
        absent = (found < 0).numpy()
        picked = absent.nonzero()[0][: room - len(ref)]
        new = [batch[i] for i in picked.tolist()]
        slots = [rng.randrange(room) for _ in new]
        ids_map.put(torch.tensor(new, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64), places.of(picked))
        ref.update(zip(new, slots, strict=True))
        asked = sorted(ref) + [rng.randrange(1 << 41) for _ in range(20)]
        assert ids_map.get(torch.tensor(asked, dtype=torch.int64)).tolist() == [ref.get(x, -1) for x in asked]
        assert len(ids_map) == len(ref)
