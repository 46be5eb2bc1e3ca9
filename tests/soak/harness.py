"""One soak run: requests with shared prefixes, random prompt and decode lengths and Poisson
arrivals, scheduled continuously (admitted while a batch decodes, ended when done) through
``ModelRunner`` in ``sparse-hier`` mode with the HiRadixTree and an L3 backend, optionally
wrapped in ``FaultInjectingStorage``.

Invariants, checked while it runs:

- every generated token equals the token a reference run of the same prompt alone
  generates at that position: the same mode and settings with no prefix cache and no L3
  (``RuntimeConfig.prefix_cache=False``), cached per distinct prompt;
- at every quiescent moment (no request running) and at the end: no device or dense-pool
  page and no request row is held, every host page in use belongs to a tree node or to an
  orphaned prefetch tail, prefetch reservations balance, the tree's invariants hold; after
  the run and a full host eviction, every pool is back to its starting free count;
- resident memory stays bounded (sampled; growth after warm-up is reported).
"""
from __future__ import annotations

import logging
import os
import random
import resource
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch

from hicache.storage.base import HiCacheStorage, StorageConfig
from hicache.storage.fault_injection import FaultInjectingStorage, FaultPlan, register_fault_injection
from hicache.storage.registry import create_storage_backend, storage_backend_names, unregister_storage_backend
from hicache.storage_controller import StoragePolicy
from sparsehi.config import SparseConfig
from sparsehi.runtime.backends import Request
from sparsehi.runtime.model_config import get_model_config
from sparsehi.runtime.modes import RuntimeConfig
from sparsehi.runtime.runner import ModelRunner
from sparsehi.runtime.weights import build_model

logger = logging.getLogger("soak")


@dataclass
class SoakConfig:
    """One soak run's workload, runtime and storage settings."""

    requests: int = 2000
    seed: int = 0
    device: str = "cpu"
    cuda_graph: bool = True
    model: str = "tiny-gqa"
    num_layers: int = 2
    page_size: int = 4
    max_batch: int = 8
    """Requests decoding together at most (``max_num_reqs``)."""
    num_prefixes: int = 6
    prefix_pages: tuple[int, int] = (1, 4)
    """Shared-prefix length range, in pages."""
    suffixes_per_prefix: int = 16
    suffix_tokens: tuple[int, int] = (1, 9)
    decode_steps: tuple[int, int] = (0, 4)
    arrival_rate: float = 3.0
    """Mean arrivals per scheduler step (Poisson); a step is one decode step of the batch."""
    host_pages: int = 96
    """Host pool pages: small, so the tree evicts and prompts come back from L3."""
    storage: Optional[str] = "file"
    """Registry name of the L3 backend (None: no L3)."""
    storage_extra: dict[str, Any] = field(default_factory=dict)
    faults: Optional[FaultPlan] = None
    prefetch_policy: str = "timeout"
    prefetch_timeout_s: float = 0.05
    check_every: int = 200
    """Requests between full invariant checks (tree walk) besides the quiescent ones."""
    max_seconds: Optional[float] = None
    """Stop admitting requests after this long (the result records how many ran)."""
    events: dict[int, Callable[[], None]] = field(default_factory=dict)
    """Callbacks run before request ``i`` is admitted (e.g. kill / restart a storage master)."""

    @property
    def max_prompt(self) -> int:
        return self.prefix_pages[1] * self.page_size + self.suffix_tokens[1]


@dataclass
class SoakResult:
    """What a run measured (the first fields are ``benchmarks/results/soak.json``'s)."""

    requests: int = 0
    mismatched_tokens: int = 0
    leaked_slots: int = 0
    faults_injected: int = 0
    faults_served_as_miss: int = 0
    faults_reaching_read: int = 0
    peak_host_mib: float = 0.0
    elapsed_s: float = 0.0
    tokens_checked: int = 0
    distinct_prompts: int = 0
    reference_s: float = 0.0
    prefix_hit_tokens: int = 0
    l3_hit_tokens: int = 0
    l3_pages_written: int = 0
    quiescent_checks: int = 0
    rss_growth_mib: float = 0.0
    fault_counts: dict[str, int] = field(default_factory=dict)
    storage_counters: dict[str, int] = field(default_factory=dict)
    first_mismatch: Optional[dict[str, Any]] = None
    leaks: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def rss_mib() -> float:
    """Resident set size of this process now (MiB)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Workload:
    """Prompts (shared prefix + suffix variant), decode lengths and arrival times, seeded."""

    def __init__(self, cfg: SoakConfig, vocab: int) -> None:
        rng = random.Random(cfg.seed)
        ps = cfg.page_size
        self.prefixes = [[rng.randrange(vocab) for _ in range(ps * rng.randint(*cfg.prefix_pages))]
                         for _ in range(cfg.num_prefixes)]
        self.suffixes = [[[rng.randrange(vocab) for _ in range(rng.randint(*cfg.suffix_tokens))]
                          for _ in range(cfg.suffixes_per_prefix)] for _ in range(cfg.num_prefixes)]
        # hot prefixes: weight 1/(i+1), as a few system prompts dominate real traffic
        weights = [1.0 / (i + 1) for i in range(cfg.num_prefixes)]
        self.specs: list[tuple[float, tuple[int, int], int]] = []
        t = 0.0
        for _ in range(cfg.requests):
            t += rng.expovariate(cfg.arrival_rate)
            p = rng.choices(range(cfg.num_prefixes), weights)[0]
            self.specs.append((t, (p, rng.randrange(cfg.suffixes_per_prefix)), rng.randint(*cfg.decode_steps)))

    def prompt(self, pid: tuple[int, int]) -> list[int]:
        return self.prefixes[pid[0]] + self.suffixes[pid[0]][pid[1]]


def sparse_config(cfg: SoakConfig) -> SparseConfig:
    """Sparse decode that really selects at these short lengths: Top-k of two pages, one sink
    and one recent page, layer 0 dense. CUDA uses the kernel io backend (graph-capturable)."""
    ps = cfg.page_size
    return SparseConfig(algorithm="quest", page_size=ps, top_k=2 * ps, device_buffer_size=4 * ps, sink_tokens=ps,
                        recent_tokens=ps, min_sparse_prompt_len=0, dense_layers=(0,),
                        io_backend="kernel" if torch.device(cfg.device).type == "cuda" else "direct")


def runtime_config(cfg: SoakConfig, *, cached: bool, storage: Optional[HiCacheStorage] = None) -> RuntimeConfig:
    ps = cfg.page_size
    max_ctx = cfg.max_prompt + cfg.decode_steps[1] + 2
    return RuntimeConfig(
        mode="sparse-hier", sparse=sparse_config(cfg), device=cfg.device, max_num_reqs=cfg.max_batch if cached else 1,
        max_context_len=max_ctx, host_kv_tokens=cfg.host_pages * ps if cached else None,
        # page layouts (the L3 page forms read and write host pages in place); CUDA's kernel io
        # backend takes page_first, the direct one page_first_direct
        host_layout="page_first" if torch.device(cfg.device).type == "cuda" else "page_first_direct",
        prefix_cache=cached, validate=True, cuda_graph=cfg.cuda_graph,
        storage=storage if cached else None,
        storage_policy=StoragePolicy(prefetch_policy=cfg.prefetch_policy, prefetch_threshold=ps,
                                     prefetch_timeout_base=cfg.prefetch_timeout_s, prefetch_timeout_per_ki_token=0.0,
                                     io_batch_pages=2) if cached and storage is not None else None)


def build_storage(cfg: SoakConfig, model_name: str) -> Optional[HiCacheStorage]:
    """The run's backend, through the registry (wrapped by the fault injector when
    ``cfg.faults`` is set)."""
    if cfg.storage is None:
        return None
    extra = dict(cfg.storage_extra)
    name = cfg.storage
    if cfg.faults is None:
        return create_storage_backend(name, StorageConfig(model_name=model_name, extra=extra))
    extra["fault_injection"] = {"backend": name, **cfg.faults.as_dict()}
    added = "fault-injection" not in storage_backend_names()
    name = register_fault_injection()
    try:
        return create_storage_backend(name, StorageConfig(model_name=model_name, extra=extra))
    finally:
        if added:  # leave the registry as it was: other code lists its names
            unregister_storage_backend(name)


class ReferenceCache:
    """Tokens a prompt generates alone in a run without prefix cache or L3, computed once per
    distinct prompt for the longest decode any request asks of it (greedy decode: a shorter
    request's tokens are a prefix)."""

    def __init__(self, model, cfg: SoakConfig, workload: Workload) -> None:
        self.runner = ModelRunner(model, runtime_config(cfg, cached=False))
        self.workload = workload
        self.steps: dict[tuple[int, int], int] = {}
        for _, pid, d in workload.specs:
            self.steps[pid] = max(self.steps.get(pid, 0), d)
        self.tokens: dict[tuple[int, int], list[int]] = {}
        self.seconds = 0.0

    def get(self, pid: tuple[int, int]) -> list[int]:
        if pid not in self.tokens:
            t0 = time.perf_counter()
            r = self.runner
            req = r.new_requests([self.workload.prompt(pid)])[0]
            r.prefill(req)
            for _ in range(self.steps[pid]):
                r.decode_step([req])
            r.backend.end_request(req)
            self.tokens[pid] = req.output
            self.seconds += time.perf_counter() - t0
        return self.tokens[pid]


class Soak:
    """Drives one run (``run()``) and keeps the counters of ``SoakResult``."""

    def __init__(self, cfg: SoakConfig, model=None) -> None:
        self.cfg = cfg
        self.model = model or build_model(config=get_model_config(cfg.model, num_layers=cfg.num_layers),
                                          device=cfg.device)
        self.workload = Workload(cfg, self.model.cfg.vocab_size)
        self.refs = ReferenceCache(self.model, cfg, self.workload)
        self.storage = build_storage(cfg, f"soak-{cfg.model}-{cfg.num_layers}l-seed{cfg.seed}")
        self.runner = ModelRunner(self.model, runtime_config(cfg, cached=True, storage=self.storage))
        be = self.runner.backend
        self.backend = be
        self.tree = be.tree
        self.res = SoakResult()
        self._start = self._free_counts()

    # ------------------------------------------------------------------ accounting
    def _allocators(self) -> dict[str, Any]:
        be = self.backend
        out = {"device": be.pool.allocator, "host": be.host.allocator}
        dp = be.coord.manager.dense_pool
        if dp is not None:
            out["dense"] = dp.allocator
        return out

    def _free_counts(self) -> dict[str, int]:
        out = {k: a.num_free_pages() for k, a in self._allocators().items()}
        out["req_rows"] = self.backend.req_pool.available_size()
        return out

    def quiescent_leaks(self) -> dict[str, int]:
        """Pages / rows not accounted for while no request runs (0 each when nothing leaks):
        device, dense-pool pages and request rows are all free; host pages in use are the
        tree's nodes, orphaned prefetch tails and live reservations."""
        tree, ps = self.tree, self.cfg.page_size
        now = self._free_counts()
        leaks = {k: self._start[k] - now[k] for k in ("device", "dense", "req_rows") if k in now}
        used_host = self._start["host"] - now["host"]
        owned = tree.host_tokens() // ps
        if tree.storage_ctl is not None:
            st = tree.stats()
            owned += st["prefetch_reserved_pages"]  # live fetches and orphaned tails hold these
            leaks["prefetch_reservations"] = tree.storage_leaks()
            leaks["issued_vs_settled"] = st["prefetch_issued_pages"] - st["prefetch_adopted_pages"] \
                - st["prefetch_released_pages"] - st["prefetch_reserved_pages"]
        leaks["host"] = used_host - owned
        leaks["tree_device_tokens"] = tree.device_tokens()
        leaks["stray_locks"] = self._stray_locks()
        tree.check_invariants()
        return leaks

    def _stray_locks(self) -> int:
        """Lock references no live holder explains: with no request running, a node's host
        locks come only from L3 writes in flight, unsettled prefetches and orphaned tails
        (each locks its node's whole path), and no node is device-locked."""
        tree = self.tree
        holders = [op.lock_node for op in tree.ongoing_backup.values()]
        holders += [op.start_node for op in tree.ongoing_prefetch.values()]
        holders += [lock for _, _, lock in tree._orphans if lock is not None]
        expected: Counter = Counter()
        for h in holders:
            for x in tree._path(h):
                expected[x] += 1
        return sum(abs(x.host_lock_ref - expected[x]) + x.lock_ref for x in tree.nodes())

    def _backend_leaks(self) -> dict[str, int]:
        """The backend's own in-flight state after the drain: no half-written temp file (file
        backend), no call still running in the client (Mooncake's bounded calls)."""
        out: dict[str, int] = {}
        inner = getattr(self.storage, "inner", self.storage)
        directory = getattr(inner, "directory", None)
        if directory is not None and os.path.isdir(directory):
            out["storage_temp_files"] = sum(1 for n in os.listdir(directory) if n.endswith(".tmp"))
        caller = getattr(inner, "_caller", None)
        if caller is not None:
            caller.wait_idle(10.0)
            out["storage_calls_in_flight"] = caller.inflight
        return out

    def _sample_memory(self) -> None:
        self.res.peak_host_mib = max(self.res.peak_host_mib, rss_mib())

    # ------------------------------------------------------------------ the run
    def _check_token(self, req: Request, pid: tuple[int, int], i: int) -> None:
        ref = self.refs.get(pid)
        self.res.tokens_checked += 1
        if req.output[i] != ref[i]:
            self.res.mismatched_tokens += 1
            if self.res.first_mismatch is None:
                self.res.first_mismatch = {"rid": req.rid, "prompt": list(pid), "position": i,
                                           "prefix_hit": req.prefix_hit, "got": req.output[i], "want": ref[i]}
                logger.error("soak: token mismatch %s", self.res.first_mismatch)

    def _end(self, req: Request) -> None:
        self.backend.end_request(req)
        self.res.requests += 1
        if self.res.requests % self.cfg.check_every == 0:
            self.tree.check_invariants()
            assert self.tree.storage_leaks() == 0 if self.tree.storage_ctl is not None else True
            self._sample_memory()

    def _quiescent(self) -> None:
        leaks = self.quiescent_leaks()
        self.res.quiescent_checks += 1
        bad = {k: v for k, v in leaks.items() if v}
        if bad:
            self.res.leaks = bad
            raise AssertionError(f"soak: slots unaccounted for after {self.res.requests} requests: {bad}")

    def run(self) -> SoakResult:
        cfg, runner, wl = self.cfg, self.runner, self.workload
        t0 = time.perf_counter()
        pending = deque(enumerate(wl.specs))
        active: list[tuple[Request, tuple[int, int], int]] = []
        tick = 0.0
        warm_rss = None
        deadline = None if cfg.max_seconds is None else t0 + cfg.max_seconds
        while pending or active:
            if deadline is not None and pending and time.perf_counter() > deadline:
                logger.warning("soak: time budget of %.0f s spent after %d requests; draining", cfg.max_seconds,
                               self.res.requests)
                pending.clear()
            if not active and pending and pending[0][1][0] > tick:
                tick = pending[0][1][0]  # idle: jump to the next arrival
            while pending and pending[0][1][0] <= tick and len(active) < cfg.max_batch:
                i, (_, pid, steps) = pending.popleft()
                if i in cfg.events:
                    cfg.events[i]()
                req = runner.new_requests([wl.prompt(pid)])[0]
                runner.prefill(req)
                self.res.prefix_hit_tokens += req.prefix_hit
                self._check_token(req, pid, 0)
                if steps == 0:
                    self._end(req)
                else:
                    active.append((req, pid, steps))
                if warm_rss is None and self.res.requests >= max(1, cfg.requests // 5):
                    warm_rss = rss_mib()
            if active:
                runner.decode_step([r for r, _, _ in active])
                still = []
                for r, pid, steps in active:
                    self._check_token(r, pid, len(r.output) - 1)
                    if len(r.output) == steps + 1:
                        self._end(r)
                    else:
                        still.append((r, pid, steps))
                active = still
                if not active:
                    self._quiescent()
            tick += 1.0
        self._finish(t0, warm_rss)
        return self.res

    def _finish(self, t0: float, warm_rss: Optional[float]) -> None:
        tree, res = self.tree, self.res
        if tree.storage_ctl is not None:
            fi = self.storage if isinstance(self.storage, FaultInjectingStorage) else None
            if fi is not None:
                fi.enabled = False  # drain without new faults; the counts are final
            tree.flush_storage()
            for _ in range(100):  # orphaned tails go once their (delayed) reads return
                tree.check_storage_events()
                if not tree._orphans:
                    break
                time.sleep(0.02)
            st = tree.stats()
            res.l3_hit_tokens = st["l3_hit_tokens"]
            res.l3_pages_written = st["l3_pages_written"]
            res.storage_counters = {k: v for k, v in st.items() if k.startswith(("l3_", "prefetch_", "storage_"))}
            served = st["l3_fetch_faults"] + st["l3_fetch_miss_pages"]
            res.faults_served_as_miss = served
            if fi is not None:
                res.fault_counts = fi.counts.as_dict()
                res.faults_injected = fi.counts.total
                res.faults_reaching_read = fi.counts.reads_failed
            else:
                res.faults_injected = self.storage.stats.faults
                res.faults_reaching_read = served
        self._sample_memory()
        leaks = self.quiescent_leaks()
        leaks.update(self._backend_leaks())
        # a full host eviction must give every page back
        tree.evict_host(10 ** 9)
        now = self._free_counts()
        leaks.update({f"{k}_after_eviction": self._start[k] - now[k] for k in self._start})
        res.leaks = {k: v for k, v in leaks.items() if v}
        res.leaked_slots = sum(abs(v) for v in leaks.values() if v)
        res.distinct_prompts = len(self.refs.tokens)
        res.reference_s = round(self.refs.seconds, 3)
        res.elapsed_s = round(time.perf_counter() - t0, 3)
        res.peak_host_mib = round(res.peak_host_mib, 1)
        res.rss_growth_mib = round(res.peak_host_mib - warm_rss, 1) if warm_rss is not None else 0.0

    def close(self) -> None:
        self.backend.close()
        if self.storage is not None:
            self.storage.close()


def run_soak(cfg: SoakConfig, model=None) -> SoakResult:
    """Build, run and close one soak (see the module docstring)."""
    s = Soak(cfg, model)
    try:
        return s.run()
    finally:
        s.close()
