"""L3 prefetch throughput and latency of the ``file`` and ``mooncake`` storage backends (CPU).

Pages of 64 tokens of a Llama-8B-shaped layer stack (32 layers, 8 KV heads, head dim 128,
bf16, K and V: 8 MiB per page) are written once from a ``page_first`` host pool, then read
back ``--repeats`` times through the path a prefetch takes: a ``PrefetchOp`` submitted to
the ``StorageController``, whose prefetch thread asks ``batch_exists`` once, then calls
the backend's ``batch_get`` on batches of ``io_batch_pages`` keys into its staging buffer
(each page verified: length and CRC-32) and copies each batch into reserved host-pool pages.
Reported per backend:

- ``gbps``: page bytes / wall time from submitting the op until its thread is done (GB/s,
  1e9), the staging copies included;
- ``p50_ms`` / ``p99_ms``: latency of one ``batch_get`` call of the prefetch thread, i.e. per
  batch of ``io_batch_pages`` pages (``latency_unit`` says so; with ``--io-batch-pages 1``
  it is per page);
- ``write_gbps``: the one ``set_pages`` of all pages (indicative).

The ``file`` backend is measured twice: ``warm`` (its files still in the OS page cache, as
right after they were written) and ``cold`` (the files' cached pages dropped with
``posix_fadvise(DONTNEED)`` before every repeat, so reads go to the disk). ``mooncake`` runs
a real ``mooncake_master`` with its HTTP metadata server on 127.0.0.1 (TCP transport, the
client contributing the memory segment); it is skipped, saying why, when the Mooncake client
cannot be imported.

    PYTHONPATH=. python benchmarks/bench_storage.py             # 64 pages x 5 repeats (~30 s)
    PYTHONPATH=. python benchmarks/bench_storage.py --quick     # tiny shapes (smoke test)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from benchmarks.common import cpu_model, write_result
from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.kv_spec import KVCacheSpec
from hicache.storage.base import HiCacheStorage, StorageConfig
from hicache.storage.keys import page_hash_chain, storage_key
from hicache.storage.registry import create_storage_backend
from hicache.storage_controller import PrefetchOp, StorageController, StoragePolicy

MODEL_NAME = "bench-llama-8b-shape"
RUN_DATE = "2026-11-25"


class _TimedReads:
    """The backend as the prefetch thread sees it, with the duration of every ``batch_get``
    call recorded (a collaborator: every call goes to the real backend)."""

    def __init__(self, storage: HiCacheStorage) -> None:
        self._storage = storage
        self.read_call_s: list[float] = []

    def batch_get(self, keys: Sequence[str],
                  targets: Optional[Sequence[torch.Tensor]] = None) -> list[Optional[torch.Tensor]]:
        t = time.perf_counter()
        out = self._storage.batch_get(keys, targets)
        self.read_call_s.append(time.perf_counter() - t)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._storage, name)


def cpu_info() -> dict[str, Any]:
    """CPU model and core count of this machine (``/proc/cpuinfo`` where there is one)."""
    return {"cpu_model": cpu_model(), "cpu_cores": os.cpu_count(), "cpu_cores_usable": len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity") else os.cpu_count()}


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated ``q``-quantile (0..1) of ``xs``."""
    s = sorted(xs)
    if not s:
        raise ValueError("percentile of no samples")
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def make_host_pool(spec: KVCacheSpec, pages: int) -> HostKVPool:
    """A ``page_first`` host pool of at least ``2 * pages + 1`` pages (sources, targets and
    the allocator's reserved page 0) over a two-page device pool (CPU, not pinned)."""
    dev = DeviceKVPool(spec, 2 * spec.page_size, "cpu")
    page_bytes = spec.token_bytes * spec.page_size
    size_gb = ((2 * pages + 2) * page_bytes + 1) / 1e9
    return HostKVPool(dev, hicache_size=size_gb, layout="page_first", pin_memory=False)


def drop_file_cache(root: str) -> int:
    """Drop the OS page cache of every file under ``root`` (``POSIX_FADV_DONTNEED``; clean
    pages only, no privileges needed). Returns files advised."""
    n = 0
    for d, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def measure(storage: HiCacheStorage, host: HostKVPool, pages: int, repeats: int, io_batch_pages: int,
            before_repeat=None) -> dict[str, Any]:
    """Write ``pages`` random pages, then prefetch them ``repeats`` times (see the module
    docstring); every repeat's pages are checked against the written ones."""
    ps = host.page_size
    page_bytes = host.spec.token_bytes * ps
    src = list(range(1, pages + 1))
    dst = list(range(pages + 1, 2 * pages + 1))
    gen = torch.Generator().manual_seed(0)
    raw = host.kv_data.view(torch.uint8).view(host.num_pages, -1)
    for p in src:
        # random bytes, but finite bf16 values: clear each element's top exponent bit
        page = torch.randint(0, 1 << 15, (raw.shape[1] // 2,), dtype=torch.int16, generator=gen) & 0x3FFF
        raw[p] = page.view(torch.uint8)
    tokens = list(range(pages * ps))
    keys = [storage_key(h, 0, False) for h in page_hash_chain(tokens, ps)]

    storage.register_host_pool(host)
    storage.clear()
    t = time.perf_counter()
    wrote = storage.set_pages(keys, src)
    write_s = time.perf_counter() - t
    if not all(wrote):
        raise RuntimeError(f"{type(storage).__name__}: {wrote.count(False)} of {pages} pages not stored "
                           "(for mooncake, raise global_segment_size)")

    timed = _TimedReads(storage)
    # threshold 0: every stored page is read, whatever the page count
    ctl = StorageController(storage, host, StoragePolicy(io_batch_pages=io_batch_pages, prefetch_threshold=0))
    ctl.storage = timed  # the prefetch thread reads through the timing wrapper
    host_idx = torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in dst])
    walls: list[float] = []
    try:
        for r in range(repeats + 1):  # repeat 0 warms up (connections, first-touch of the targets)
            raw[dst] = 0
            if before_repeat is not None:
                before_repeat()
            n_calls = len(timed.read_call_s)
            op = PrefetchOp(req_id=r, keys=keys, host_indices=host_idx, start_node=None, tokens=tuple(tokens),
                            hash_keys=[], timeout_s=0.0)
            t = time.perf_counter()
            ctl.submit_prefetch(op)
            if not ctl.wait_op(op, 120.0):
                raise RuntimeError(f"prefetch of {pages} pages not done within 120 s")
            wall = time.perf_counter() - t
            if op.completed_pages != pages:
                raise RuntimeError(f"prefetch read {op.completed_pages} of {pages} pages ({op.error})")
            if not torch.equal(raw[dst], raw[src]):
                raise RuntimeError("prefetched pages differ from the written ones")
            if r == 0:
                del timed.read_call_s[n_calls:]
            else:
                walls.append(wall)
    finally:
        ctl.shutdown(join_timeout=5.0)
    lat_ms = [s * 1e3 for s in timed.read_call_s]
    wall = statistics.median(walls)
    return {
        "pages": pages, "page_bytes": page_bytes, "io_batch_pages": io_batch_pages, "repeats": repeats,
        "gbps": _three_figures(pages * page_bytes / wall / 1e9),
        "p50_ms": round(percentile(lat_ms, 0.50), 3), "p99_ms": round(percentile(lat_ms, 0.99), 3),
        "latency_unit": f"per batch_get call of {io_batch_pages} page(s)",
        "latency_samples": len(lat_ms),
        "prefetch_wall_ms": {"median": round(wall * 1e3, 2), "min": round(min(walls) * 1e3, 2),
                             "max": round(max(walls) * 1e3, 2)},
        "write_gbps": _three_figures(pages * page_bytes / write_s / 1e9),
        "faults": storage.stats.faults,
    }


def _three_figures(x: float) -> float:
    """``x`` to three significant figures: a rate of a few kB in tens of ms (the --quick
    sizes on a busy machine) stays above zero, where three decimals of GB/s round it away."""
    return float(f"{x:.3g}")


def run_file(spec: KVCacheSpec, args) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_storage_", dir=args.file_dir) as d:
        for cache in ("warm", "cold"):
            host = make_host_pool(spec, args.pages)
            st = create_storage_backend("file", StorageConfig(model_name=MODEL_NAME, extra={"file_path": d}))
            try:
                hook = (lambda: drop_file_cache(d)) if cache == "cold" else None
                row = measure(st, host, args.pages, args.repeats, args.io_batch_pages, hook)
            finally:
                st.close()
            rows.append({"backend": "file", "cache": cache, **row,
                         "note": "page cache dropped before each repeat (disk reads)" if cache == "cold"
                         else "files in the OS page cache (memory reads)"})
            del host
    return rows


def mooncake_missing() -> Optional[str]:
    """None when the Mooncake client imports and ships its ``mooncake_master``; else why not."""
    try:
        import mooncake.store  # noqa: F401
    except Exception as e:  # ImportError, or OSError for a missing libibverbs
        return f"Mooncake client not importable ({e}); install the 'mooncake' extra and libibverbs1"
    if _master_binary() is None:
        return "mooncake_master binary not found (in the mooncake package or on PATH)"
    return None


def _master_binary() -> Optional[str]:
    import importlib.util
    import shutil

    spec = importlib.util.find_spec("mooncake")
    for d in (spec.submodule_search_locations or []) if spec is not None else []:
        p = Path(d, "mooncake_master")
        if p.is_file():
            return str(p)
    return shutil.which("mooncake_master")


def run_mooncake(spec: KVCacheSpec, args) -> list[dict[str, Any]]:
    # the test helper that owns a master process on free loopback ports
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from mooncake_server import MooncakeMaster

    page_bytes = spec.token_bytes * spec.page_size
    segment = max(64 << 20, 2 * args.pages * (page_bytes + 4096))
    with MooncakeMaster(lease_ttl_ms=5000) as master:
        host = make_host_pool(spec, args.pages)
        extra = master.extra_config(global_segment_size=segment, local_buffer_size=16 << 20, op_timeout_s=30)
        st = create_storage_backend("mooncake", StorageConfig(model_name=MODEL_NAME, extra=extra))
        try:
            row = measure(st, host, args.pages, args.repeats, args.io_batch_pages)
        finally:
            st.close()
    return [{"backend": "mooncake", "cache": "memory", **row,
             "note": "TCP on 127.0.0.1, one client contributing the memory segment"}]


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--io-batch-pages", type=int, default=8)
    p.add_argument("--backends", default="file,mooncake")
    p.add_argument("--file-dir", default=None, help="parent of the file backend's temp directory (default: $TMPDIR)")
    p.add_argument("--quick", action="store_true", help="tiny pages (smoke test)")
    p.add_argument("--out", default=None, help="result directory (default benchmarks/results)")
    args = p.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    bad = [b for b in backends if b not in ("file", "mooncake")]
    if bad or not backends:
        p.error(f"--backends must list file and/or mooncake, got {args.backends!r}")
    for name in ("pages", "repeats", "io_batch_pages"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.quick:
        shape = {"layers": 2, "kv_heads": 2, "head_dim": 16, "page_size": 16}
    else:
        shape = {"layers": 32, "kv_heads": 8, "head_dim": 128, "page_size": 64}
    spec = KVCacheSpec("mha", shape["layers"], shape["kv_heads"], shape["head_dim"], torch.bfloat16,
                       shape["page_size"])
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for b in backends:
        if b == "file":
            rows += run_file(spec, args)
            continue
        why = mooncake_missing()
        if why is not None:
            print(f"bench_storage: skipping mooncake: {why}", file=sys.stderr)
            skipped["mooncake"] = why
            continue
        rows += run_mooncake(spec, args)
    for r in rows:
        print(json.dumps(r))
    payload = {
        "date": RUN_DATE,
        "hardware": {**cpu_info(), "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                                                         / 2**30, 1)},
        "shape": {**shape, "dtype": "bf16", "buffers": "k,v", "page_bytes": spec.token_bytes * spec.page_size},
        "path": "StorageController prefetch thread -> HiCacheStorage.batch_get into a staging buffer -> "
                "page_first host pages",
        "results": rows,
        "skipped": skipped,
    }
    path = write_result("storage.json", payload, args.out)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
    sys.exit(0)
