"""The LRU policy of sparsehi/kernels/lru_diff.py as plain Python on lists: the model the
kernel tests and the manager tests both check against."""
from __future__ import annotations


def naive_lru_step(resident: list[int], last_used: list[int], ids: list[int], step: int):
    """Exact LRU on python lists, one row: the misses evict the non-selected slots with the
    smallest (last_used, slot), the j-th miss taking the j-th victim in slot order.
    Returns (device_slots, load_ids, load_slots); updates resident and last_used."""
    where = {x: i for i, x in enumerate(resident) if x >= 0}
    hits = {where[x] for x in ids if x in where}
    misses = [x for x in ids if x not in where]
    coldest = sorted((last_used[sl], sl) for sl in range(len(resident)) if sl not in hits)
    victims = sorted(sl for _, sl in coldest[: len(misses)])
    dev, j = [], 0
    for x in ids:
        if x in where:
            dev.append(where[x])
        else:
            dev.append(victims[j])
            j += 1
    for x, sl in zip(misses, victims):
        resident[sl] = x
    for sl in dev:
        last_used[sl] = step
    return dev, misses, victims
