"""One soak run: requests with shared prefixes, random prompt and decode lengths and Poisson
arrivals, scheduled continuously (admitted while a batch decodes, ended when done) through
``ModelRunner`` in ``sparse-hier`` mode with the HiRadixTree and an L3 backend, optionally
wrapped in ``FaultInjectingStorage``. A request starts only while the host pool can hold it
next to what the running requests will still write (``admission.HostAdmission``), so the
pool may be smaller than the running requests' worst case: the tree evicts, and prompts come
back from L3.

Invariants, checked while it runs:

- every generated token equals the token a reference run of the same prompt alone
  generates at that position: the same mode and settings with no prefix cache and no L3
  (``RuntimeConfig.prefix_cache=False``), run once per distinct prompt for the longest
  decode any request asks of it (greedy decode: a shorter request's tokens are a prefix).
  The reference keeps each token's top-1 minus top-2 logit gap, so that a mismatch can be
  told apart from a near-tie that rounding flipped;
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
from sparsehi.runtime.runtime_mode import Request
from sparsehi.runtime.model_config import get_model_config
from sparsehi.runtime.runtime_config import RuntimeConfig
from sparsehi.runtime.runner import ModelRunner
from sparsehi.runtime.weights import build_model
from soak.admission import HostAdmission

logger = logging.getLogger("soak")

BURST_GAP = 1e7
"""Arrival-time gap between bursts (scheduler steps): longer than any burst takes to drain."""
MAX_MISMATCH_RECORDS = 20


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
    algorithm: str = "quest"
    top_k_pages: int = 2
    """Selected pages (tokens for a token-wise algorithm) per step and sparse layer."""
    buffer_pages: int = 4
    """GPU LRU buffer per request and sparse layer, in pages."""
    sink_pages: int = 1
    recent_pages: int = 1
    dense_layers: Optional[tuple[int, ...]] = (0,)
    """Layers that attend densely; None: the algorithm's default."""
    adapter: str = "none"
    """``RuntimeConfig.adapter``: ``none`` (the coordinator's torch attention) or ``auto``."""
    single_bucket: bool = False
    """Pad every decode step, the references' too, to ``max_batch`` rows (one CUDA-graph
    bucket). GPU kernels pick their split-K and GEMM tiles by batch size, so a row alone
    rounds differently from the same row in a batch of 64; with one shape the comparison
    stays exact at any batch. The references then take ``max_batch`` request rows (one used)."""
    batch_invariant: bool = False
    """Row-invariant prefill and decode kernels (``RuntimeConfig.batch_invariant``): a reused
    prefix's KV is bitwise what a cold prefill of the whole prompt computes, so the tokens
    can be compared exactly at any prompt length."""
    num_prefixes: int = 6
    prefix_pages: tuple[int, int] = (1, 4)
    """Shared-prefix length range, in pages (drawn per prefix)."""
    prefix_lengths: tuple[int, ...] = ()
    """Shared-prefix lengths in tokens, one per prefix (page multiples); when given they
    replace ``num_prefixes`` and ``prefix_pages``."""
    suffixes_per_prefix: int = 16
    suffix_tokens: tuple[int, int] = (1, 9)
    decode_steps: tuple[int, int] = (0, 4)
    hot_prefixes: int = 0
    """Prefixes requests draw from at any one time (weight ``1/(rank+1)``); 0: all of them.
    A window smaller than all sweeps over the prefixes ``prefix_sweeps`` times during the
    run, so a prefix goes cold, leaves the host pool and is asked for again later."""
    prefix_sweeps: float = 1.0
    arrival_rate: float = 3.0
    """Mean arrivals per scheduler step (Poisson); a step is one decode step of the batch."""
    burst: int = 0
    """Requests per burst (0: one stream). Arrivals pause after each burst until every
    request finished, so the run is quiescent (and its accounting checked) once per burst."""
    host_pages: int = 96
    """Host pool pages: small, so the tree evicts and prompts come back from L3."""
    storage: Optional[str] = "file"
    """Registry name of the L3 backend (None: no L3)."""
    storage_extra: dict[str, Any] = field(default_factory=dict)
    faults: Optional[FaultPlan] = None
    prefetch_policy: str = "timeout"
    prefetch_timeout_s: float = 0.05
    prefetch_timeout_per_ki_token: float = 0.0
    io_batch_pages: int = 2
    """Pages per L3 backend call of a prefetch."""
    check_every: int = 200
    """Requests between full invariant checks (tree walk) besides the quiescent ones."""
    max_seconds: Optional[float] = None
    """Wall-time budget of ``run()``: no request is admitted once the running ones' remaining
    decode steps, at the step time measured so far, would end past it (the result records
    how many ran)."""
    events: dict[int, Callable[[], None]] = field(default_factory=dict)
    """Callbacks run before request ``i`` is admitted (e.g. kill / restart a storage master)."""

    @property
    def max_prompt(self) -> int:
        longest = max(self.prefix_lengths) if self.prefix_lengths else self.prefix_pages[1] * self.page_size
        return longest + self.suffix_tokens[1]


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
    reference_tokens: int = 0
    prefix_hit_tokens: int = 0
    l3_hit_tokens: int = 0
    l3_pages_written: int = 0
    quiescent_checks: int = 0
    rss_growth_mib: float = 0.0
    prompts: int = 0
    """Requests prefilled (``requests`` counts the finished ones)."""
    prompt_tokens: int = 0
    prefill_s: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    check_s: float = 0.0
    finish_s: float = 0.0
    setup_capture_s: float = 0.0
    """CUDA-graph capture of every batch bucket before the run (``Soak.__init__``)."""
    graph_captures: int = 0
    capture_s: float = 0.0
    """Decode steps that captured a CUDA graph during the run (a variant not captured at
    start-up) and their time (part of ``decode_s``)."""
    admission_waits: int = 0
    """Scheduler steps at which an arrived request waited for host room."""
    host_evicted_tokens: int = 0
    decode_hit_rate: float = 0.0
    """Share of the selected pages already in the requests' GPU buffers, over every decode step."""
    decode_h2d_bytes: int = 0
    """Bytes decode steps loaded host -> device (the missed pages)."""
    min_reference_gap: Optional[float] = None
    """Smallest top-1 minus top-2 logit gap of any reference token."""
    fault_counts: dict[str, int] = field(default_factory=dict)
    storage_counters: dict[str, int] = field(default_factory=dict)
    first_mismatch: Optional[dict[str, Any]] = None
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    """The first mismatch of each mismatched request (up to 20), with the reference's gap."""
    leaks: dict[str, int] = field(default_factory=dict)

    @property
    def mean_batch(self) -> float:
        return self.decode_tokens / self.decode_steps if self.decode_steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["mean_batch"] = round(self.mean_batch, 2)
        return out


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
        if cfg.prefix_lengths:
            bad = [n for n in cfg.prefix_lengths if n <= 0 or n % ps]
            if bad:
                raise ValueError(f"SoakConfig.prefix_lengths {bad} are not positive multiples of page_size={ps}")
            self.prefixes = [[rng.randrange(vocab) for _ in range(n)] for n in cfg.prefix_lengths]
        else:
            self.prefixes = [[rng.randrange(vocab) for _ in range(ps * rng.randint(*cfg.prefix_pages))]
                             for _ in range(cfg.num_prefixes)]
        n_pre = len(self.prefixes)
        self.suffixes = [[[rng.randrange(vocab) for _ in range(rng.randint(*cfg.suffix_tokens))]
                          for _ in range(cfg.suffixes_per_prefix)] for _ in range(n_pre)]
        # hot prefixes: weight 1/(i+1), as a few system prompts dominate real traffic
        window = cfg.hot_prefixes or n_pre
        weights = [1.0 / (i + 1) for i in range(window)]
        self.specs: list[tuple[float, tuple[int, int], int]] = []
        t = 0.0
        for i in range(cfg.requests):
            if cfg.burst and i and i % cfg.burst == 0:
                t += BURST_GAP
            t += rng.expovariate(cfg.arrival_rate)
            first = 0 if window == n_pre else int(i * cfg.prefix_sweeps * n_pre / cfg.requests)
            p = (first + rng.choices(range(window), weights)[0]) % n_pre
            self.specs.append((t, (p, rng.randrange(cfg.suffixes_per_prefix)), rng.randint(*cfg.decode_steps)))

    def prompt(self, pid: tuple[int, int]) -> list[int]:
        return self.prefixes[pid[0]] + self.suffixes[pid[0]][pid[1]]


def sparse_config(cfg: SoakConfig) -> SparseConfig:
    """Sparse decode that really selects: ``top_k_pages`` of the prompt's pages besides the
    sink and recent pages, from the first prompt length on. CUDA uses the kernel io backend
    (graph-capturable)."""
    ps = cfg.page_size
    return SparseConfig(algorithm=cfg.algorithm, page_size=ps, top_k=cfg.top_k_pages * ps,
                        device_buffer_size=cfg.buffer_pages * ps, sink_tokens=cfg.sink_pages * ps,
                        recent_tokens=cfg.recent_pages * ps, min_sparse_prompt_len=0, dense_layers=cfg.dense_layers,
                        io_backend="kernel" if torch.device(cfg.device).type == "cuda" else "direct")


def runtime_config(cfg: SoakConfig, *, cached: bool, storage: Optional[HiCacheStorage] = None) -> RuntimeConfig:
    """The soak's runtime (``cached``) or the references' (no prefix cache, no L3; one
    request row, or ``max_batch`` with ``single_bucket`` and then a host pool for one
    request, which HiCache makes larger than the device pool)."""
    ps = cfg.page_size
    max_ctx = cfg.max_prompt + cfg.decode_steps[1] + 2
    rows = cfg.max_batch if cached or cfg.single_bucket else 1
    host = cfg.host_pages * ps if cached else 2 * max_ctx if cfg.single_bucket else None
    return RuntimeConfig(
        mode="sparse-hier", sparse=sparse_config(cfg), device=cfg.device, max_num_reqs=rows,
        max_context_len=max_ctx, host_kv_tokens=host, adapter=cfg.adapter,
        # page layouts (the L3 page forms read and write host pages in place); CUDA's kernel io
        # backend takes page_first, the direct one page_first_direct
        host_layout="page_first" if torch.device(cfg.device).type == "cuda" else "page_first_direct",
        prefix_cache=cached, validate=True, cuda_graph=cfg.cuda_graph, batch_invariant=cfg.batch_invariant,
        storage=storage if cached else None,
        storage_policy=StoragePolicy(prefetch_policy=cfg.prefetch_policy, prefetch_threshold=ps,
                                     prefetch_timeout_base=cfg.prefetch_timeout_s,
                                     prefetch_timeout_per_ki_token=cfg.prefetch_timeout_per_ki_token,
                                     io_batch_pages=cfg.io_batch_pages) if cached and storage is not None else None)


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


class GapRecordingModel:
    """``model`` that also writes the top-1 minus top-2 logit gap of row 0 of each ``logits``
    call to ``gaps[pos]`` and advances ``pos`` (device tensors, so that graph-captured,
    overlapped decode steps record theirs without a host sync)."""

    def __init__(self, model, max_calls: int) -> None:
        self.model = model
        self.cfg = model.cfg
        dev = next(model.parameters()).device
        self.gaps = torch.zeros(max_calls + 1, dtype=torch.float32, device=dev)
        self.pos = torch.zeros(1, dtype=torch.int64, device=dev)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn, **kwargs) -> torch.Tensor:
        return self.model(input_ids, positions, attn, **kwargs)  # with_indexer for an MLA model

    def use_batch_invariant_ops(self) -> None:
        self.model.use_batch_invariant_ops()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.model.logits(hidden)
        top = out[:1].topk(2, dim=-1).values
        self.gaps.index_copy_(0, self.pos.clamp(max=self.gaps.numel() - 1), top[:, 0] - top[:, 1])
        self.pos.add_(1)
        return out


class ReferenceCache:
    """Tokens a prompt generates alone in a run without prefix cache or L3, computed once per
    distinct prompt for the longest decode any request asks of it (greedy decode: a shorter
    request's tokens are a prefix), with each token's logit gap (``GapRecordingModel``).
    Its decode steps overlap (``ModelRunner.decode_steps``): the tokens are the same."""

    def __init__(self, model, cfg: SoakConfig, workload: Workload) -> None:
        self.workload = workload
        self.steps: dict[tuple[int, int], int] = {}
        for _, pid, d in workload.specs:
            self.steps[pid] = max(self.steps.get(pid, 0), d)
        self.model = GapRecordingModel(model, max(self.steps.values(), default=0) + 1)
        self.runner = ModelRunner(self.model, runtime_config(cfg, cached=False))
        if cfg.single_bucket:
            self.runner.graphs.buckets = [cfg.max_batch]
        # capture the step's graph now: capture runs the step eagerly, which would record gaps
        self.runner.graphs.warm(1, self.runner.mode.decode_graph_key([]))
        self.tokens: dict[tuple[int, int], list[int]] = {}
        self.gaps: dict[tuple[int, int], list[float]] = {}
        self.seconds = 0.0

    def get(self, pid: tuple[int, int]) -> list[int]:
        if pid not in self.tokens:
            t0 = time.perf_counter()
            r, steps = self.runner, self.steps[pid]
            self.model.pos.zero_()
            req = r.new_requests([self.workload.prompt(pid)])[0]
            r.prefill(req)
            r.decode_steps([req], steps)
            r.mode.end_request(req)
            self.tokens[pid] = req.output
            self.gaps[pid] = self.model.gaps[: steps + 1].tolist()
            self.seconds += time.perf_counter() - t0
        return self.tokens[pid]

    def mean_seconds(self) -> float:
        return self.seconds / len(self.tokens) if self.tokens else 0.0

    def min_gap(self) -> Optional[float]:
        return min((min(g) for g in self.gaps.values()), default=None)


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
        if cfg.single_bucket:
            self.runner.graphs.buckets = [cfg.max_batch]
        mode = self.runner.mode
        self.mode = mode
        self.tree = mode.tree
        self.admission = HostAdmission(mode)
        self.res = SoakResult()
        t0 = time.perf_counter()
        for b in self.runner.graphs.buckets:  # as a server captures at start-up (no-op without graphs)
            self.runner.graphs.warm(b, mode.decode_graph_key([]))
        self.res.setup_capture_s = round(time.perf_counter() - t0, 3)
        self._start = self._free_counts()
        self._step_s = 0.0  # moving average of one decode step's wall time (the drain estimate)
        self._mismatched: set[int] = set()  # request ids whose first mismatch is recorded

    # ------------------------------------------------------------------ accounting
    def _allocators(self) -> dict[str, Any]:
        mode = self.mode
        out = {"device": mode.pool.allocator, "host": mode.host.allocator}
        dp = mode.coord.dense_pool
        if dp is not None:
            out["dense"] = dp.allocator
        return out

    def _free_counts(self) -> dict[str, int]:
        out = {k: a.num_free_pages() for k, a in self._allocators().items()}
        out["req_rows"] = self.mode.req_pool.available_size()
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
            if req.rid not in self._mismatched:
                self._mismatched.add(req.rid)
                self._record_mismatch(req, pid, i, ref)

    def _record_mismatch(self, req: Request, pid: tuple[int, int], i: int, ref: list[int]) -> None:
        rec = {"rid": req.rid, "prompt": list(pid), "prompt_len": len(req.prompt), "position": i,
               "prefix_hit": req.prefix_hit, "got": req.output[i], "want": ref[i],
               "reference_gap": round(self.refs.gaps[pid][i], 6)}
        if self.res.first_mismatch is None:
            self.res.first_mismatch = rec
            logger.error("soak: token mismatch %s", rec)
        if len(self.res.mismatches) < MAX_MISMATCH_RECORDS:
            self.res.mismatches.append(rec)

    def _end(self, req: Request) -> None:
        self.mode.end_request(req)
        self.res.requests += 1
        if self.res.requests % self.cfg.check_every == 0:
            t0 = time.perf_counter()
            self.tree.check_invariants()
            assert self.tree.storage_leaks() == 0 if self.tree.storage_ctl is not None else True
            self._sample_memory()
            self.res.check_s += time.perf_counter() - t0

    def _quiescent(self) -> None:
        t0 = time.perf_counter()
        leaks = self.quiescent_leaks()
        self.res.quiescent_checks += 1
        self.res.check_s += time.perf_counter() - t0
        bad = {k: v for k, v in leaks.items() if v}
        if bad:
            self.res.leaks = bad
            raise AssertionError(f"soak: slots unaccounted for after {self.res.requests} requests: {bad}")

    def _over_budget(self, deadline: Optional[float], active: list, pid: tuple[int, int], steps: int) -> bool:
        """Whether admitting the next request (prompt ``pid``, ``steps`` decode steps) could
        end the run past ``deadline``: its prefill and a reference run when the prompt has
        none yet, then the longest of its and the running requests' remaining steps, at the
        times measured so far."""
        if deadline is None:
            return False
        left = max([steps] + [s + 1 - len(r.output) for r, _, s in active])
        drain = left * self._step_s + self.res.prefill_s / max(1, self.res.prompts)
        if pid not in self.refs.tokens:
            drain += self.refs.mean_seconds()
        return time.perf_counter() + drain > deadline

    def _admit(self, pending: deque, active: list, tick: float, deadline: Optional[float]) -> None:
        """Start the arrived requests while the batch and the host pool have room."""
        cfg, runner, wl = self.cfg, self.runner, self.workload
        while pending and pending[0][1][0] <= tick and len(active) < cfg.max_batch:
            i, (_, pid, steps) = pending[0]
            if self._over_budget(deadline, active, pid, steps):
                logger.warning("soak: time budget of %.0f s reached after %d requests; draining", cfg.max_seconds,
                               self.res.requests)
                pending.clear()
                return
            prompt = wl.prompt(pid)
            remaining = [s + 1 - len(r.output) for r, _, s in active]
            if not self.admission.fits(prompt, steps, remaining):
                if active:
                    self.res.admission_waits += 1
                    return
                self.admission.settle()
                if not self.admission.fits(prompt, steps, remaining):
                    raise ValueError(f"soak: the host pool ({cfg.host_pages} pages of {cfg.page_size}) cannot hold a "
                                     f"{len(prompt)}-token prompt and {steps} decode steps with nothing running: "
                                     f"raise SoakConfig.host_pages")
            pending.popleft()
            if i in cfg.events:
                cfg.events[i]()
            self.refs.get(pid)  # the reference first: its time is not the request's
            t0 = time.perf_counter()
            req = runner.new_requests([prompt])[0]
            runner.prefill(req)
            self.res.prefill_s += time.perf_counter() - t0
            self.res.prompts += 1
            self.res.prefix_hit_tokens += req.prefix_hit
            self.res.prompt_tokens += len(prompt)
            self._check_token(req, pid, 0)
            if steps == 0:
                self._end(req)
            else:
                active.append((req, pid, steps))

    def _decode(self, active: list) -> list:
        """One decode step of the batch; returns the requests still running."""
        t0 = time.perf_counter()
        graphs = len(self.runner.graphs.captured)
        self.runner.decode_step([r for r, _, _ in active])
        captured = len(self.runner.graphs.captured) > graphs
        still = []
        for r, pid, steps in active:
            self._check_token(r, pid, len(r.output) - 1)
            if len(r.output) == steps + 1:
                self._end(r)
            else:
                still.append((r, pid, steps))
        dt = time.perf_counter() - t0
        if captured:  # not a step's usual time
            self.res.graph_captures += 1
            self.res.capture_s += dt
        else:
            self._step_s = dt if self._step_s == 0.0 else 0.9 * self._step_s + 0.1 * dt
        self.res.decode_s += dt
        self.res.decode_steps += 1
        self.res.decode_tokens += len(active)
        return still

    def run(self) -> SoakResult:
        cfg, wl = self.cfg, self.workload
        t0 = time.perf_counter()
        pending = deque(enumerate(wl.specs))
        active: list[tuple[Request, tuple[int, int], int]] = []
        tick = 0.0
        warm_rss = None
        deadline = None if cfg.max_seconds is None else t0 + cfg.max_seconds
        while pending or active:
            if not active and pending and pending[0][1][0] > tick:
                tick = pending[0][1][0]  # idle: jump to the next arrival
            self._admit(pending, active, tick, deadline)
            if warm_rss is None and self.res.requests >= max(1, cfg.requests // 5):
                warm_rss = rss_mib()
            if active:
                active = self._decode(active)
                if not active:
                    self._quiescent()
            tick += 1.0
        self._finish(t0, warm_rss)
        return self.res

    def _finish(self, t0: float, warm_rss: Optional[float]) -> None:
        t_fin = time.perf_counter()
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
        res.host_evicted_tokens = tree.stats()["host_evicted_tokens"]
        st = self.mode.stats()
        res.decode_hit_rate, res.decode_h2d_bytes = round(st["hit_rate"], 4), int(st["bytes_loaded"])
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
        res.reference_tokens = sum(len(t) for t in self.refs.tokens.values())
        gap = self.refs.min_gap()
        res.min_reference_gap = None if gap is None else round(gap, 6)
        for k in ("prefill_s", "decode_s", "check_s", "capture_s"):
            setattr(res, k, round(getattr(res, k), 3))
        res.finish_s = round(time.perf_counter() - t_fin, 3)
        res.elapsed_s = round(time.perf_counter() - t0, 3)
        res.peak_host_mib = round(res.peak_host_mib, 1)
        res.rss_growth_mib = round(res.peak_host_mib - warm_rss, 1) if warm_rss is not None else 0.0

    def close(self) -> None:
        self.mode.close()
        if self.storage is not None:
            self.storage.close()


def run_soak(cfg: SoakConfig, model=None) -> SoakResult:
    """Build, run and close one soak (see the module docstring)."""
    s = Soak(cfg, model)
    try:
        return s.run()
    finally:
        s.close()
