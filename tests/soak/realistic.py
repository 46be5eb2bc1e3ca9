"""The ``gpu-realistic`` soak: requests at the sizes users run, as sub-runs of the harness.

At ``scale=1`` (the GPU run), in run order:

| sub-run       | model (8 layers)        | page | Top-k                | LRU buffer   | requests |
|---------------|-------------------------|------|----------------------|--------------|----------|
| ``quest-p16`` | tiny-gqa                | 16   | 64 pages (1,024 tok) | 128 pages    | 2,430    |
| ``dsa``       | tiny-dsa (MLA + indexer)| 1    | 2,048 tokens         | 2,048 tokens | 1,620    |
| ``quest-p64`` | tiny-gqa                | 64   | 64 pages (4,096 tok) | 64 pages     | 1,350    |

DSA selects tokens (``SparseMode.TOKEN_WISE``: the runtime runs it at ``page_size == 1``
only), so its sub-run moves single-token pages through every tier, L3 included; Quest
covers page sizes 16 and 64.

Each sub-run: shared prefixes whose prompts span 1k-32k tokens evenly (shuffled), 2
suffixes of 32-256 tokens each, 64-512 decode steps (uniform), 64 requests decoding
together, arrivals eight times as fast as a full batch finishes them (a queue keeps the
batch full), every decode step padded to 64 rows (``SoakConfig.single_bucket``). The host pool is
as small as HiCache allows (larger than the device pool, which holds the requests' Top-k
buffers and one prompt's prefill staging); the prefixes hold ``CONTENT_OVER_HOST`` times
its KV, so their number follows from it (16, 16 and 28 prefixes: 120 distinct prompts,
each asked for 24-76 times, so the cold reference runs stay few). Three prefixes are hot at
a time and that window sweeps twice over all of them: a prefix goes cold, is evicted, and is
asked for again, from L3. Requests come in ``BURSTS`` bursts, each drained to a quiescent
moment where the accounting is checked. The L3 file store runs under injected faults: the
CI plan's per-call rates, and per-page rates of about half a fault of each kind per longest
prompt (the CI plan's 2% a page would cut every long fetch after a few pages).

``scale < 1`` multiplies every token count (prompt, suffix and decode lengths, Top-k and
buffer sizes, L3 batch) and the batch by ``sqrt(scale)``, so that the same plan runs on a
CPU; page sizes stay.
"""
from __future__ import annotations

import datetime
import gc
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Optional

import torch

from hicache.storage.fault_injection import FaultPlan
from soak.harness import Soak, SoakConfig, SoakResult, runtime_config

MODE = "gpu-realistic"
DEFAULT_BUDGET_S = 520.0
"""Seconds from the process start to the record (Triton JIT and graph capture included):
under a 600 s limit this leaves a minute for what the budget cannot see coming (a slow
drain of L3 writes at a sub-run's end)."""
REQUESTS = 5_400
"""Asked for at scale 1: at least 5,000 run even if a sub-run's budget cuts it short."""
PROMPT_TOKENS = (1024, 32768)
SUFFIX_TOKENS = (32, 256)
DECODE_STEPS = (64, 512)
MAX_BATCH = 64
SUFFIXES_PER_PREFIX = 2
HOT_PREFIXES = 3
PREFIX_SWEEPS = 2.0
BURSTS = 4
"""Quiescent moments per sub-run (at least)."""
CONTENT_OVER_HOST = 1.5
"""The prefixes' KV over the host pool: each sweep of the hot window evicts what it left."""
FAULTS_PER_PROMPT = 0.5
"""Expected faults of each per-page kind over a fetch or write of the longest prompt."""


@dataclass(frozen=True)
class SubRunShape:
    """What differs between the sub-runs (scale 1)."""

    name: str
    model: str
    algorithm: str
    page_size: int
    top_k_pages: int
    buffer_pages: int
    weight: float
    """Share of the requests and of the time budget."""


SHAPES = (
    SubRunShape("quest-p16", "tiny-gqa", "quest", 16, 64, 128, 0.45),
    SubRunShape("dsa", "tiny-dsa", "dsa", 1, 2048, 2048, 0.30),
    SubRunShape("quest-p64", "tiny-gqa", "quest", 64, 64, 64, 0.25),
)
"""In run order; the last sub-run inherits the time the others left. The weights follow the
host -> device bytes a decoded token costs (CPU, 2026-11-27, 16k-token contexts: 1.8 MB a
row and step at page 16, 6.8 at page 64, 4.5 for DSA's single-token pages)."""


@dataclass
class SubRun:
    name: str
    cfg: SoakConfig
    weight: float


def _scaled(n: int, scale: float, low: int = 1) -> int:
    return max(low, int(round(n * scale)))


def prefix_lengths(count: int, page_size: int, scale: float, seed: int) -> tuple[int, ...]:
    """``count`` prefix lengths (tokens, page multiples) whose prompts span
    ``PROMPT_TOKENS`` x ``scale`` evenly, in a seeded shuffled order (hot windows mix long
    and short prompts)."""
    lo = -(-_scaled(PROMPT_TOKENS[0] - SUFFIX_TOKENS[0], scale) // page_size) * page_size
    hi = max(lo, _scaled(PROMPT_TOKENS[1] - SUFFIX_TOKENS[1], scale) // page_size * page_size)
    out = [lo + int((hi - lo) // page_size * i / max(1, count - 1)) * page_size for i in range(count)]
    random.Random(seed).shuffle(out)
    return tuple(out)


def fault_plan(seed: int, page_size: int, max_prompt: int) -> FaultPlan:
    """The CI plan's per-call rates; per-page rates of ``FAULTS_PER_PROMPT`` faults per kind
    over the longest prompt's pages (at most the CI plan's 2%)."""
    per_page = min(0.02, FAULTS_PER_PROMPT * page_size / max_prompt)
    return FaultPlan(seed=seed, raise_rate=0.02, delay_rate=0.02, delay_s=0.12, drop_write_rate=per_page,
                     truncate_rate=per_page, corrupt_rate=per_page)


def subrun_config(shape: SubRunShape, requests: int, scale: float, device: str, seed: int, faults: bool,
                  l3_dir: str, max_batch: Optional[int] = None) -> SoakConfig:
    """One sub-run's ``SoakConfig`` (see the module docstring). The host pool is as small as
    HiCache allows (it must exceed the device pool, here the requests' Top-k buffers and one
    prompt's prefill staging) and at least what the longest request needs beside a prefetch
    of its prompt; the prefixes hold ``CONTENT_OVER_HOST`` times its KV."""
    ps = shape.page_size
    batch = max_batch or max(4, min(MAX_BATCH, int(round(MAX_BATCH * math.sqrt(scale)))))
    suffix = (_scaled(SUFFIX_TOKENS[0], scale), _scaled(SUFFIX_TOKENS[1], scale))
    decode = (_scaled(DECODE_STEPS[0], scale), _scaled(DECODE_STEPS[1], scale, 2))
    cfg = SoakConfig(
        requests=requests, seed=seed, device=device, cuda_graph=True, model=shape.model, num_layers=8,
        page_size=ps, max_batch=batch, algorithm=shape.algorithm,
        top_k_pages=_scaled(shape.top_k_pages, scale, 2), buffer_pages=_scaled(shape.buffer_pages, scale, 2),
        sink_pages=-(-_scaled(64, scale) // ps), recent_pages=-(-_scaled(64, scale) // ps), dense_layers=None,
        adapter="auto", single_bucket=True, prefix_lengths=prefix_lengths(2, ps, scale, seed),
        suffixes_per_prefix=SUFFIXES_PER_PREFIX, suffix_tokens=suffix, decode_steps=decode,
        hot_prefixes=HOT_PREFIXES, prefix_sweeps=PREFIX_SWEEPS, batch_invariant=True,
        arrival_rate=8.0 * batch / (sum(decode) / 2),  # 8x what a full batch finishes: a queue at once
        burst=max(2 * batch, -(-requests // BURSTS)), storage="file",
        storage_extra={"file_path": l3_dir}, prefetch_policy="timeout", prefetch_timeout_s=0.2,
        prefetch_timeout_per_ki_token=0.05, io_batch_pages=max(1, _scaled(1024, scale) // ps), check_every=500)
    device_tokens = runtime_config(cfg, cached=True).auto_device_tokens()
    host_tokens = max(device_tokens + ps, 2 * (cfg.max_prompt + decode[1]) + 8 * ps)
    mean_prefix = sum(cfg.prefix_lengths) / len(cfg.prefix_lengths)
    count = max(HOT_PREFIXES + 1, math.ceil(CONTENT_OVER_HOST * host_tokens / mean_prefix))
    lengths = prefix_lengths(count, ps, scale, seed)
    max_prompt = max(lengths) + suffix[1]
    return replace(cfg, prefix_lengths=lengths, host_pages=-(-host_tokens // ps),
                   faults=fault_plan(seed, ps, max_prompt) if faults else None)


def plan(requests: int = REQUESTS, scale: float = 1.0, device: str = "cuda", seed: int = 1, faults: bool = True,
         l3_root: str = "/tmp/soak-l3", max_batch: Optional[int] = None, copies: int = 1) -> list[SubRun]:
    """The sub-runs of ``requests`` requests in all (split by the shapes' weights). With
    ``copies > 1`` each shape runs as that many sub-runs (``name#i``), each with its own
    seed (other prompts), L3 directory and share of the shape's requests: more processes
    for ``run_plan_concurrently`` to keep the device busy with."""
    if not 0 < scale <= 1:
        raise ValueError(f"scale must be in (0, 1], got {scale!r}")
    if not isinstance(copies, int) or copies < 1:
        raise ValueError(f"copies must be an int >= 1, got {copies!r}")
    if requests < len(SHAPES) * copies:
        raise ValueError(f"requests must be >= {len(SHAPES) * copies} (one per sub-run), got {requests}")
    total_w = sum(s.weight for s in SHAPES)
    counts = [max(copies, int(requests * s.weight / total_w)) for s in SHAPES]
    counts[0] += requests - sum(counts)  # the split adds up to ``requests``
    out = []
    for s, n in zip(SHAPES, counts):
        for i in range(copies):
            name = s.name if copies == 1 else f"{s.name}#{i + 1}"
            share = n // copies + (1 if i < n % copies else 0)
            cfg = subrun_config(s, share, scale, device, seed + i, faults,
                                os.path.join(l3_root, name.replace("#", "-")), max_batch)
            out.append(SubRun(name, cfg, s.weight / copies))
    return out


# ---------------------------------------------------------------------------- running
CONFIG_FIELDS = ("model", "num_layers", "algorithm", "page_size", "top_k_pages", "buffer_pages", "sink_pages",
                 "recent_pages", "max_batch", "prefix_lengths", "suffixes_per_prefix", "suffix_tokens",
                 "decode_steps", "hot_prefixes", "prefix_sweeps", "burst", "host_pages", "io_batch_pages",
                 "prefetch_timeout_s", "prefetch_timeout_per_ki_token", "requests", "seed")
RESULT_FIELDS = ("requests", "mismatched_tokens", "leaked_slots", "faults_injected", "faults_served_as_miss",
                 "faults_reaching_read", "l3_hit_tokens", "l3_pages_written", "prefix_hit_tokens", "prompt_tokens",
                 "tokens_checked", "decode_steps", "decode_tokens", "mean_batch", "distinct_prompts",
                 "reference_tokens", "quiescent_checks", "admission_waits", "host_evicted_tokens",
                 "decode_hit_rate", "decode_h2d_bytes",
                 "min_reference_gap", "peak_host_mib", "rss_growth_mib", "fault_counts", "storage_counters",
                 "first_mismatch", "mismatches", "leaks")
TIME_FIELDS = ("prefill_s", "decode_s", "reference_s", "check_s", "finish_s")


@dataclass
class SubRunRecord:
    name: str
    config: dict[str, Any]
    result: dict[str, Any]
    timings: dict[str, float]
    budget_s: float


def describe(cfg: SoakConfig) -> dict[str, Any]:
    d = {k: getattr(cfg, k) for k in CONFIG_FIELDS}
    d["prefixes"] = len(cfg.prefix_lengths)
    d = {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
    d["max_prompt"] = cfg.max_prompt
    d["top_k_tokens"] = cfg.top_k_pages * cfg.page_size
    d["faults"] = cfg.faults.as_dict() if cfg.faults is not None else None
    return d


def default_l3_parent() -> Optional[str]:
    """/dev/shm where writable (DSA's single-token pages make hundreds of thousands of small
    files: on tmpfs the run measures the runtime, not the disk), else None (the system's
    temporary directory)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _release_device(device: str) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_subrun(sub: SubRun, budget_s: float, finish_reserve_s: float) -> SubRunRecord:
    """Build, run (admitting until ``budget_s`` minus setup and ``finish_reserve_s``) and
    close one sub-run; timings cover every part."""
    t0 = time.perf_counter()
    soak = Soak(sub.cfg)
    setup = time.perf_counter() - t0
    soak.cfg = replace(sub.cfg, max_seconds=max(1.0, budget_s - setup - finish_reserve_s))
    try:
        res: SoakResult = soak.run()
    finally:
        t1 = time.perf_counter()
        soak.close()
        del soak
        _release_device(sub.cfg.device)
        shutil.rmtree(sub.cfg.storage_extra["file_path"], ignore_errors=True)  # its L3 is no one's now
        close = time.perf_counter() - t1
    d = res.as_dict()
    timings = {"setup_s": round(setup, 3), "run_s": d["elapsed_s"], "close_s": round(close, 3),
               **{k: d[k] for k in TIME_FIELDS}, "setup_capture_s": d["setup_capture_s"],
               "graph_captures": d["graph_captures"], "capture_s": d["capture_s"],
               "wall_s": round(time.perf_counter() - t0, 3)}
    return SubRunRecord(sub.name, describe(sub.cfg), {k: d[k] for k in RESULT_FIELDS}, timings, round(budget_s, 1))


def run_plan(subruns: list[SubRun], budget_s: float, started: Optional[float] = None,
             progress=print) -> list[SubRunRecord]:
    """Every sub-run in turn, the time left split by the remaining sub-runs' weights (a
    sub-run that ends early leaves its time to the next), so the plan ends by ``budget_s``
    after ``started`` (``time.perf_counter()``; default now)."""
    started = time.perf_counter() if started is None else started
    out = []
    for i, sub in enumerate(subruns):
        left = budget_s - (time.perf_counter() - started)
        share = left * sub.weight / sum(s.weight for s in subruns[i:])
        rec = run_subrun(sub, share, finish_reserve_s=max(3.0, 0.05 * share))
        out.append(rec)
        if progress is not None:
            r, t = rec.result, rec.timings
            progress(f"{sub.name}: {r['requests']}/{sub.cfg.requests} requests in {t['wall_s']:.1f} s "
                     f"(budget {share:.0f} s; setup {t['setup_s']:.1f}, prefill {t['prefill_s']:.1f}, decode "
                     f"{t['decode_s']:.1f} over {r['decode_steps']} steps, mean batch {r['mean_batch']}, references "
                     f"{t['reference_s']:.1f}, finish {t['finish_s']:.1f}); mismatched {r['mismatched_tokens']}, "
                     f"leaked {r['leaked_slots']}, L3 hit tokens {r['l3_hit_tokens']}")
    return out


def _run_subrun_in_child(sub: SubRun, budget_s: float, finish_reserve_s: float, threads: int) -> SubRunRecord:
    torch.set_num_threads(threads)
    return run_subrun(sub, budget_s, finish_reserve_s)


def run_plan_concurrently(subruns: list[SubRun], budget_s: float, threads: int = 1,
                          progress=print, on_started: Optional[Callable[[], Any]] = None) -> list[SubRunRecord]:
    """Every sub-run at once, each in a process of its own (``spawn``: CUDA in each) sharing
    the device, each with the whole ``budget_s``; records in plan order. The sub-runs share
    nothing but the device (each has its own pools, tree and L3 directory), so one's
    requests are checked and accounted exactly as when it runs alone. ``on_started`` is
    called once, a minute into the run (or at its end if sooner), while the processes hold
    their CUDA contexts."""
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=len(subruns), mp_context=ctx) as pool:
        futures = [pool.submit(_run_subrun_in_child, sub, budget_s, max(3.0, 0.05 * budget_s), threads)
                   for sub in subruns]
        if on_started is not None:
            concurrent.futures.wait(futures, timeout=min(60.0, budget_s / 2))
            on_started()
        out = [f.result() for f in futures]
    if progress is not None:
        for sub, rec in zip(subruns, out):
            r, t = rec.result, rec.timings
            progress(f"{sub.name}: {r['requests']}/{sub.cfg.requests} requests in {t['wall_s']:.1f} s (concurrent; "
                     f"setup {t['setup_s']:.1f}, prefill {t['prefill_s']:.1f}, decode {t['decode_s']:.1f} over "
                     f"{r['decode_steps']} steps, mean batch {r['mean_batch']}, references {t['reference_s']:.1f}); "
                     f"mismatched {r['mismatched_tokens']}, leaked {r['leaked_slots']}, "
                     f"L3 hit tokens {r['l3_hit_tokens']}")
    return out


def summary(records: list[SubRunRecord], device: str, budget_s: float, wall_s: float, asked: int) -> dict[str, Any]:
    """The ``benchmarks/results/soak.json`` record of a plan (``device``: its description)."""
    def total(k: str) -> int:
        return sum(int(r.result[k]) for r in records)

    gaps = [r.result["min_reference_gap"] for r in records if r.result["min_reference_gap"] is not None]
    return {
        "mode": MODE, "device": device, "date": datetime.date.today().isoformat(),
        **{k: total(k) for k in ("requests", "mismatched_tokens", "leaked_slots", "faults_injected",
                                 "faults_served_as_miss", "faults_reaching_read", "l3_hit_tokens",
                                 "l3_pages_written", "tokens_checked", "decode_tokens", "quiescent_checks")},
        "requests_asked": asked, "elapsed_s": round(wall_s, 3), "budget_s": budget_s,
        "peak_host_mib": max((r.result["peak_host_mib"] for r in records), default=0.0),
        "min_reference_gap": min(gaps) if gaps else None,
        "subruns": [asdict(r) for r in records],
    }
