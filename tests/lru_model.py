"""The LRU policy of sparsehi/kernels/lru_diff.py as plain Python on lists: the model the
kernel tests and the manager tests both check against."""
from __future__ import annotations


def naive_lru_step(resident: list[int], last_used: list[int], ids: list[int], step: int):
    """Exact LRU on python lists, one row: the misses evict the non-selected slots with the
    smallest (last_used, slot), the j-th miss taking the j-th victim in slot order. A
    repeated id is served by its first column (it is no second miss and takes no slot).
    Returns (device_slots, load_ids, load_slots); updates resident and last_used."""
    where = {x: i for i, x in enumerate(resident) if x >= 0}
    distinct = list(dict.fromkeys(ids))  # first occurrences, in column order
    hits = {where[x] for x in distinct if x in where}
    misses = [x for x in distinct if x not in where]
    coldest = sorted((last_used[sl], sl) for sl in range(len(resident)) if sl not in hits)
    victims = sorted(sl for _, sl in coldest[: len(misses)])
    slot = {x: where[x] for x in distinct if x in where}
    slot.update(zip(misses, victims))
    dev = [slot[x] for x in ids]
    for x, sl in zip(misses, victims):
        resident[sl] = x
    for sl in dev:
        last_used[sl] = step
    return dev, misses, victims
