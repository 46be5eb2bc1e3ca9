"""A workload of many small L3 transfers for the concurrency test (tests/test_concurrency.py),
run in a subprocess under ``python -X dev``. Prints one JSON line: the final storage
contents (key -> CRC of the object file), the host hit of every reading request, and the
leak counters.

``--mode threaded``: the scheduler loop never waits for the controller's threads — many
prefetches and write-backs are in flight at once while it keeps inserting, evicting and
polling, with a tiny thread switch interval so the threads interleave at fine grain.
``--mode serial``: every operation is waited for before the next one starts (the
single-threaded reference). Both must end with the same storage, the same hits, and no
leaked slot or reservation.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from hicache.storage.base import StorageConfig  # noqa: E402
from hicache.storage.file_store import FileStorage  # noqa: E402
from hicache.storage_controller import StoragePolicy  # noqa: E402
from l3_kit import PS, build, empty_tiers, expected, read_host  # noqa: E402

THREAD_ERRORS: list[str] = []


def _record_thread_error(args: threading.ExceptHookArgs) -> None:
    THREAD_ERRORS.append(f"{args.thread.name if args.thread else '?'}: {args.exc_type.__name__}: {args.exc_value}")


def sequences(seed: int, n: int, base: int) -> list[list[int]]:
    """``n`` token sequences of whole pages sharing prefixes (a few roots, random depths)."""
    rnd = random.Random(seed)
    roots = [[base + 1000 * r + t for t in range(6 * PS)] for r in range(4)]
    out = []
    for i in range(n):
        root = roots[rnd.randrange(len(roots))]
        tail = [base + 100_000 + 50 * i + t for t in range(rnd.randint(1, 3) * PS)]
        out.append(root[: rnd.randint(1, 6) * PS] + tail)
    return out


def salt_of(tokens) -> "str | None":
    """Two tenants and unsalted requests, by the sequence's last token."""
    return (None, "tenant-1", "tenant-2")[tokens[-1] % 3]


def expected_hit(tokens, salt, written) -> int:
    """What L3 holds for ``tokens`` under ``salt``: the longest whole-page prefix shared
    with a sequence written under the same salt (other tenants' copies do not count)."""
    best = 0
    for w in written:
        if salt_of(w) != salt:
            continue
        n = 0
        while n + PS <= min(len(w), len(tokens)) and w[n:n + PS] == tokens[n:n + PS]:
            n += PS
        best = max(best, n)
    return best


def insert(tree, dev, tokens) -> None:
    slots = dev.allocator.alloc(len(tokens))
    if slots is None:
        tree.evict(len(tokens))
        slots = dev.allocator.alloc(len(tokens))
    if slots is None:  # device nodes stay locked until their backups are acknowledged
        tree.writing_check(block=True)
        tree.evict(len(tokens))
        slots = dev.allocator.alloc(len(tokens))
        assert slots is not None, "device pool too small for the workload"
    kv = expected(tokens)
    for layer in range(kv.shape[0]):
        dev.set_kv(layer, slots, kv[layer, 0], kv[layer, 1])
    res = tree.insert(tokens, device_indices=slots, cache_salt=salt_of(tokens))
    dev.allocator.free(res.device_unused)


def run(mode: str, directory: str, seed: int) -> dict:
    threaded = mode == "threaded"
    if threaded:
        sys.setswitchinterval(1e-6)
    threading.excepthook = _record_thread_error
    storage = FileStorage(StorageConfig(model_name="stress", extra={"file_path": directory}))
    policy = StoragePolicy(prefetch_policy="wait_complete", prefetch_threshold=PS, io_batch_pages=2)
    tree, dev, host = build(storage, policy, dev_pages=24, ratio=40.0)
    rnd = random.Random(seed + 1)

    # phase 1: writers; their backups and L3 writes race with the next inserts and evictions
    for i, toks in enumerate(sequences(seed, 40, base=10_000)):
        insert(tree, dev, toks)
        if threaded:
            tree.writing_check()
            tree.check_storage_events()
            if i % 7 == 0:
                tree.evict(rnd.randint(1, 4) * PS)
        else:
            tree.writing_check(block=True)
            tree.flush_storage()
    tree.writing_check(block=True)
    tree.flush_storage()
    empty_tiers(tree)

    # phase 2: readers prefetch phase 1's prefixes (8 in flight at a time) while new
    # writers insert disjoint sequences
    written = sequences(seed, 40, base=10_000)
    pick = random.Random(seed + 2)  # the same readers in both modes
    readers = [written[pick.randrange(len(written))] for _ in range(60)]
    # the writer's tenant, or (every fourth) another one, which must hit nothing
    salts = [salt_of(t) if i % 4 else ("tenant-9" if salt_of(t) else "tenant-1") for i, t in enumerate(readers)]
    extra = sequences(seed + 5, 30, base=500_000)
    hits: dict[int, int] = {}
    bad_kv: list[int] = []

    def finish(rid: int) -> None:
        toks = readers[rid]
        m = tree.match_prefix(toks, cache_salt=salts[rid])
        hits[rid] = m.backed_length
        if m.backed_length and not torch.equal(read_host(host, m.backed_host_indices), expected(toks[:m.backed_length])):
            bad_kv.append(rid)

    pending: list[int] = []
    max_in_flight = 0
    next_reader = 0
    step = 0
    while next_reader < len(readers) or pending:
        while next_reader < len(readers) and len(pending) < (8 if threaded else 1):
            rid = next_reader
            next_reader += 1
            m = tree.match_prefix(readers[rid], cache_salt=salts[rid])
            tree.prefetch_from_storage(rid, m.last_backed_node, readers[rid][m.backed_length:])
            pending.append(rid)
        max_in_flight = max(max_in_flight, tree.storage_ctl.in_flight())
        if not threaded:
            tree.wait_prefetch(pending[0], 30.0)
        for rid in list(pending):
            if tree.check_prefetch_progress(rid):
                pending.remove(rid)
                finish(rid)
        if extra and step % 2 == 0:
            insert(tree, dev, extra.pop())
            if threaded:
                tree.writing_check()
                tree.check_storage_events()
            else:
                tree.writing_check(block=True)
                tree.flush_storage()
        step += 1
    while extra:
        insert(tree, dev, extra.pop())
    tree.writing_check(block=True)
    tree.flush_storage()

    st = tree.stats()
    tree.check_invariants()
    held_host = tree.all_host_indices().numel()
    result = {
        "hits": [hits[i] for i in range(len(readers))],
        "own_expected": [expected_hit(readers[i], salts[i], written) for i in range(len(readers))],
        "bad_kv": bad_kv,
        "storage": {},
        "storage_leaks": tree.storage_leaks(),
        "prefetch_reserved_pages": st["prefetch_reserved_pages"],
        "host_unaccounted": host.num_slots - PS - host.available_size() - held_host,
        "device_unaccounted": dev.allocator.num_slots - PS - dev.allocator.available_size()
        - tree.all_device_indices().numel(),
        "faults": storage.stats.faults,
        "l3_fetch_faults": st["l3_fetch_faults"], "l3_write_faults": st["l3_write_faults"],
        "in_flight": st["l3_ops_in_flight"] + st["ongoing_prefetches"] + st["ongoing_storage_backups"]
        + st["storage_orphans"],
        "thread_errors": THREAD_ERRORS,
        "max_in_flight": max_in_flight,
    }
    tree.close()
    for p in sorted(Path(storage.directory).iterdir()):
        if p.name.endswith(".kv"):
            result["storage"][p.name] = zlib.crc32(p.read_bytes())
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("threaded", "serial"), required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(run(a.mode, a.dir, a.seed)))


if __name__ == "__main__":
    main()
