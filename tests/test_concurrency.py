"""The L3 controller's worker threads (prefetch, write-back) running concurrently with the
scheduler's inserts, evictions and polling: a stress run of many small transfers under
``python -X dev`` with warnings as errors (tests/concurrency_workload.py) must end exactly
like the same workload run one operation at a time — same objects in storage, byte for
byte, the same host hit for every request (its own tenant's pages only: requests carry
cache salts), the KV it reads correct — with no leaked slot,
reservation or lock, no fault and no exception on any thread."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WORKLOAD = Path(__file__).resolve().parent / "concurrency_workload.py"
ROOT = Path(__file__).resolve().parents[1]


def _spawn(mode: str, directory: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="error", PYTHONFAULTHANDLER="1",
               OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-X", "dev", str(WORKLOAD), "--mode", mode, "--dir", str(directory)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(ROOT))


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-4000:]
    # -X dev shows ResourceWarnings, unraisable exceptions in __del__, and thread crashes
    for marker in ("Warning", "Exception ignored", "Traceback"):
        assert marker not in err, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def test_threaded_l3_traffic_matches_the_serial_run(tmp_path):
    procs = {m: _spawn(m, tmp_path / m) for m in ("threaded", "serial")}
    res = {m: _result(p) for m, p in procs.items()}
    t, s = res["threaded"], res["serial"]
    assert t["max_in_flight"] > 1, "the threaded run never had two L3 operations in flight"
    assert s["storage"] and t["storage"] == s["storage"]
    assert t["hits"] == s["hits"] and sum(s["hits"]) > 0
    # every request hit exactly what its own tenant wrote, nothing of another tenant's
    assert s["hits"] == s["own_expected"]
    assert 0 in s["hits"] and len(set(s["hits"])) > 2
    for r in (t, s):
        assert r["bad_kv"] == [] and r["thread_errors"] == []
        for k in ("storage_leaks", "prefetch_reserved_pages", "host_unaccounted", "device_unaccounted", "faults",
                  "l3_fetch_faults", "l3_write_faults", "in_flight"):
            assert r[k] == 0, (k, r[k])


def test_reads_racing_writes_of_the_same_pages_see_whole_pages_or_nothing(tmp_path):
    """Two caches over one file store (two ranks / two servers): one writes chains while
    the other keeps prefetching them. Every page the reader takes holds exactly the
    writer's KV; a page not yet published is a miss, never a torn read."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch

    from hicache.storage.base import StorageConfig
    from hicache.storage.file_store import FileStorage
    from hicache.storage_controller import StoragePolicy
    from l3_kit import PS, build, empty_tiers, expected, no_leaks, read_host

    def backend():
        return FileStorage(StorageConfig(model_name="race", extra={"file_path": str(tmp_path)}))

    policy = StoragePolicy(prefetch_policy="best_effort", prefetch_threshold=PS, io_batch_pages=1)
    writer, wdev, _ = build(backend(), policy, dev_pages=64, ratio=4.0)
    reader, _, rhost = build(backend(), policy, dev_pages=16, ratio=16.0)
    chains = [[5000 * c + t for t in range(16 * PS)] for c in range(6)]
    seen = 0
    for c, toks in enumerate(chains):
        slots = wdev.allocator.alloc(len(toks))
        kv = expected(toks)
        for layer in range(kv.shape[0]):
            wdev.set_kv(layer, slots, kv[layer, 0], kv[layer, 1])
        writer.insert(toks, device_indices=slots)
        writer.writing_check(block=True)  # backups acked: the L3 writes start in the background
        for i in range(12):  # read while those writes land, page by page
            rid = (c, i)
            m = reader.match_prefix(toks)
            reader.prefetch_from_storage(rid, m.last_backed_node, toks[m.backed_length:])
            reader.wait_prefetch(rid, 5.0)
            assert reader.check_prefetch_progress(rid)
            m = reader.match_prefix(toks)
            if m.backed_length:
                seen += 1
                assert torch.equal(read_host(rhost, m.backed_host_indices), expected(toks[:m.backed_length]))
            writer.check_storage_events()
        empty_tiers(reader)
        writer.flush_storage()
        writer.evict(10 ** 9)
    assert seen > 0
    assert reader.stats()["l3_fetch_faults"] == 0 and reader.storage_backend.stats.corrupt == 0
    no_leaks(reader)
    no_leaks(writer)
    reader.close()
    writer.close()
