"""KV management + attention of one runtime mode, behind one small interface the runner
drives (see :class:`RuntimeMode`). Prefill is dense in every mode: the prompt's KV is
written to the device pool and attended with plain causal attention; the modes differ in
where that KV goes afterwards and what decode attends.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional

import numpy as np
import torch

from hicache.device_pool import DeviceKVPool
from hicache.kv_page_format import KVPageFormat
from hicache.kv_spec import KVCacheSpec
from hicache.req_to_token import ReqToTokenPool
from sparsehi.kernels.store_kv import store_kv
from sparsehi.runtime.attention import causal_attention
from sparsehi.runtime.kv_cache_format import check_runtime_kv_cache_dtype, kv_cache_spec, readable_kv, stored_kv
from sparsehi.runtime.model_config import ModelConfig
from sparsehi.runtime.runtime_config import RuntimeConfig, round_up
from sparsehi.runtime.profiling import SectionTimer

logger = logging.getLogger(__name__)

QueryHook = Callable[[int, torch.Tensor, dict], torch.Tensor]
"""``hook(layer, q, extra) -> q``: replaces a decode step's queries (benchmarks drive
selection with a calibrated query trace); it may also replace ``extra["index_q"]`` (DSA)."""


@dataclass
class Request:
    """One generation request."""

    rid: int
    prompt: list[int]
    req_pool_idx: int = -1
    output: list[int] = field(default_factory=list)
    """Predicted tokens (greedy argmax): the first from prefill, then one per decode step."""
    consumed: list[int] = field(default_factory=list)
    """Tokens consumed by decode steps (= output[:-1] unless teacher-forced)."""
    seq_len: int = 0
    """Tokens whose KV is cached (the prompt, then +1 per decode step)."""
    prefix_hit: int = 0
    """Prompt tokens whose KV came from the host tier (HiRadixTree match)."""
    device_slots: Optional[torch.Tensor] = None
    host_slots: Optional[torch.Tensor] = None
    tree_node: Any = None
    prefix_load: Optional[int] = None
    """While the reused prefix is loading back: its producer id in the mode's LayerLoadCounter."""
    aborted: bool = False
    """Ended after a failure: only KV known complete (the prefilled prompt) may be kept."""
    cache_salt: Optional[str] = None
    """Tenant isolation (vLLM's ``cache_salt``): the request shares cached KV (device, host,
    L3) only with requests of the same salt; None shares with unsalted requests."""
    prefix_state: Optional[torch.Tensor] = None
    """During the prefill of a reused prefix: the algorithm's per-token state of the prefix
    (``uint8 [prefix, layers, bytes]`` on the device, from the host pool), restored layer by
    layer (``BaseSparseAlgorithm.import_token_state``)."""

    def all_tokens(self) -> list[int]:
        """Prompt + the tokens whose KV was computed by decode steps."""
        return self.prompt + self.consumed


def kv_spec_for(cfg: ModelConfig, rt: RuntimeConfig) -> KVCacheSpec:
    return kv_cache_spec(cfg, rt.dtype, rt.page_size, rt.sparse.kv_cache_dtype)


def host_token_bytes(cfg: ModelConfig, dtype: torch.dtype, host_kv_dtype: str = "auto", page_size: int = 1,
                     kv_cache_dtype: str = "auto") -> int:
    """Host pool bytes of one token of ``cfg`` (all layers; FP8 pages: values and the page's
    scales over its ``page_size`` tokens, rounded up; FP8 latent rows: their bytes): what
    ``--hicache-size`` GB are divided by to size the host pool of a host mode."""
    spec = kv_cache_spec(cfg, dtype, page_size, kv_cache_dtype)
    return -(-KVPageFormat(spec, host_kv_dtype).page_bytes // page_size)


def free_page_row(allocator, row: np.ndarray) -> None:
    """Give ``allocator`` back the pages one row of a page table names (entries >= 0) and
    clear the row to -1. ``row``: ``[max_pages] int`` (numpy, host)."""
    pages = row[row >= 0]
    if pages.size:
        allocator.free_pages(torch.from_numpy(pages.copy()))
    row[:] = -1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class RuntimeMode:
    """Base: owns the device pool and the request slots; subclasses add the mode."""

    reads_index_inputs = False
    """The attention reads the model's indexer outputs (``extra``; DSA selection): an MLA
    model computes its indexer only then (``MLAModel.forward(with_indexer=...)``)."""

    def __init__(self, cfg: ModelConfig, rt: RuntimeConfig) -> None:
        self.cfg = cfg
        self.rt = rt
        self.device = torch.device(rt.device)
        self._page_entries: Optional[np.ndarray] = None  # prepare_decode -> take_page_entries
        check_runtime_kv_cache_dtype(rt.sparse.kv_cache_dtype, rt.mode, rt.adapter)
        self.spec = kv_spec_for(cfg, rt)
        n_dev = rt.device_kv_tokens or rt.auto_device_tokens()
        self.pool = DeviceKVPool(self.spec, round_up(n_dev, rt.page_size), self.device)
        self.req_pool = ReqToTokenPool(rt.max_num_reqs, round_up(rt.max_context_len, rt.page_size) + rt.page_size,
                                       self.device)
        self.peak_device_tokens = 0
        self.query_hook: Optional[QueryHook] = None
        """Benchmarks set it (``sparsehi/runtime/traces.py``): each layer's attention function
        replaces its query by ``query_hook(layer, q, extra)`` first."""
        self.timer = SectionTimer(self.device)
        """Benchmarks enable it to split a decode step into attention / io / ... sections."""

    def host_token_bytes(self) -> int:
        """Host pool bytes of one token (all layers), what ``--hicache-size`` is divided by."""
        return host_token_bytes(self.cfg, self.rt.dtype, kv_cache_dtype=self.rt.sparse.kv_cache_dtype)

    # -- accounting ---------------------------------------------------------------------
    def device_tokens_in_use(self) -> int:
        a = self.pool.allocator
        return (a.num_pages - 1 - a.num_free_pages()) * a.page_size

    def sample_memory(self) -> None:
        self.peak_device_tokens = max(self.peak_device_tokens, self.device_tokens_in_use())

    def memory(self) -> dict[str, float]:
        """Peak KV bytes held during decode: ``gpu_kv_bytes`` (device pool pages in use +
        extra pools; the transient prefill staging of the host modes is not counted),
        ``host_kv_bytes`` (host pool pages in use)."""
        return {"gpu_kv_bytes": self.peak_device_tokens * self.spec.token_bytes + self.extra_gpu_bytes(),
                "host_kv_bytes": 0.0}

    def extra_gpu_bytes(self) -> int:
        return 0

    def stats(self) -> dict[str, Any]:
        return {}

    # -- request lifecycle ------------------------------------------------------------
    def begin_request(self, req: Request) -> int:
        """Take a request row; returns the prompt prefix length whose KV is reused."""
        n = len(req.prompt)
        if n + 1 > self.rt.max_context_len:  # checked before the row is taken: a rejected request holds nothing
            raise ValueError(f"prompt of {n} tokens does not fit max_context_len={self.rt.max_context_len}")
        idx = self.req_pool.alloc()
        if idx is None:
            raise ValueError(f"max_num_reqs={self.rt.max_num_reqs} requests are already running")
        req.req_pool_idx = idx
        return 0

    def _alloc_device(self, n: int) -> torch.Tensor:
        slots = self.pool.allocator.alloc(n)
        if slots is None:
            raise ValueError(f"device KV pool is full ({self.pool.num_slots} slots): raise device_kv_tokens "
                             f"or lower the batch / context")
        return slots.to(self.device)

    def prefill_slots(self, req: Request, prefix_len: int) -> torch.Tensor:
        """Device slots for the whole prompt: whole pages, so ``[round_up(n, ps)] int64``
        (position ``p`` at index ``p``); kept in ``req.device_slots``."""
        slots = self._alloc_device(len(req.prompt))
        req.device_slots = slots
        return slots

    def prefill_attention(self, req: Request, prefix_len: int) -> Callable:
        """The model's AttentionFn for one request's prefill (tokens [prefix_len, n))."""
        n = len(req.prompt)
        slots = req.device_slots[:n]
        new = slots[prefix_len:n]
        scale = self.cfg.sm_scale
        spec = self.spec

        def attn(layer: int, q, k, v, extra):
            self.before_prefill_layer(req, layer)
            self.pool.set_kv(layer, new, stored_kv(spec, k), v)
            # FP8 latent rows: attend the stored values, dequantised here (decode reads the bytes)
            kb = readable_kv(spec, self.pool.get_key_buffer(layer)[slots], k.dtype)
            vb = kb[..., :spec.value_dim] if spec.fp8_latent_rows else self.pool.get_value_buffer(layer)[slots]
            o = causal_attention(q, kb, vb, scale, prefix_len, self.rt.batch_invariant)
            self.after_prefill_layer(req, layer, k, v, extra, prefix_len)
            return o

        return attn

    def before_prefill_layer(self, req: Request, layer: int) -> None:
        """Called before a prefill layer reads the cache (a mode that loads a reused prefix
        layer by layer makes the stream wait for that layer here)."""

    def after_prefill_layer(self, req, layer, k, v, extra, prefix_len) -> None:
        pass

    def end_prefill(self, req: Request, prefix_len: int) -> None:
        req.seq_len = len(req.prompt)

    # -- decode step: host part (outside CUDA graphs), device part (captured) ------------
    def prepare_decode(self, reqs: list[Request]) -> Hashable:
        """Host part of a decode step, before the device part runs: checks and new pages
        for rows that open a page (vectorised over the batch). Returns the step's graph
        graph_key: a hashable fact the device part's shapes depend on (None for most modes)."""
        raise NotImplementedError

    def decode_graph_key(self, reqs: list[Request]) -> Hashable:
        """What ``prepare_decode`` would return for ``reqs``, without doing anything (the
        runner captures the step's graph before it times decode steps)."""
        return None

    def page_entry_tables(self) -> Optional[tuple[list[torch.Tensor], int]]:
        """The device tables ``(tables, span)`` the decode step writes the new pages' entries
        into (``table_scatter``), or None when the mode keeps none."""
        return None

    def take_page_entries(self) -> Optional[np.ndarray]:
        """``[E, 4] int64`` entries of the pages ``prepare_decode`` just opened (None: none),
        handed to the decode step's inputs; cleared by the call."""
        ents, self._page_entries = self._page_entries, None
        return ents

    def decode_device(self, rows: torch.Tensor, seq_lens: torch.Tensor,
                      graph_key: Hashable) -> tuple[Callable, Callable[[], dict]]:
        """Device part (CUDA-graph safe: no host sync, fixed shapes): from ``rows [B] int64``
        (``-1`` padding) and ``seq_lens [B] int32`` (new token included; padding rows 1),
        the model's AttentionFn for the step and a closer run after the model (returns
        static outputs, e.g. a recorded selection)."""
        raise NotImplementedError

    def end_decode(self, reqs: list[Request], outputs: Optional[dict] = None) -> None:
        """Host part after the step: lengths, memory sampling."""
        for r in reqs:
            r.seq_len += 1
        self.sample_memory()

    def _pages_opened(self, reqs: list[Request]) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, logical pages)`` ``int64`` of the requests whose next token opens a page."""
        ps = self.rt.page_size
        pos = np.fromiter((r.seq_len for r in reqs), dtype=np.int64, count=len(reqs))
        opens = pos % ps == 0
        rows = np.fromiter((r.req_pool_idx for r in reqs), dtype=np.int64, count=len(reqs))
        return rows[opens], pos[opens] // ps

    def _check_decode_lengths(self, reqs: list[Request]) -> None:
        long = [r for r in reqs if r.seq_len >= self.rt.max_context_len]
        if long:
            raise ValueError(f"request {long[0].rid} exceeds max_context_len={self.rt.max_context_len}")

    def end_request(self, req: Request) -> None:
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx = -1

    def close(self) -> None:
        pass

    def _host_pool(self, n_tokens: int, extra: Optional[dict] = None, host_kv_dtype: str = "auto"):
        """The mode's HostKVPool: ``rt.host_pool`` reused (allocator cleared) or a new one
        of at least ``n_tokens`` slots (and more than the device pool, as HiCache requires)
        with the extra per-token buffers ``extra`` (``HostKVPool(extra_token_buffers=...)``;
        a reused pool may lack them: the caller checks ``pool.extra``)."""
        from hicache.host_pool import HostKVPool

        hp = self.rt.host_pool
        if hp is not None:
            if hp.spec != self.spec:
                raise ValueError(f"RuntimeConfig.host_pool has spec {hp.spec}, this model needs {self.spec}")
            if hp.kv_format.host_kv_dtype != self.rt.sparse.host_kv_dtype:
                raise ValueError(f"RuntimeConfig.host_pool holds {hp.kv_format.host_kv_dtype} pages, --host-kv-dtype "
                                 f"is {self.rt.sparse.host_kv_dtype}")
            if hp.num_slots < n_tokens:
                raise ValueError(f"RuntimeConfig.host_pool holds {hp.num_slots} slots < {n_tokens} needed")
            hp.allocator.clear()
            return hp
        ratio = max(n_tokens / self.pool.num_slots, 1.0) + 1e-6
        return HostKVPool(self.pool, hicache_ratio=ratio, layout=self.rt.host_layout, extra_token_buffers=extra,
                          host_kv_dtype=host_kv_dtype)


# ============================================================================== dense
class DenseMode(RuntimeMode):
    """All KV in the device pool; decode attends every token with the paged decode kernel
    (Triton on CUDA, its torch reference on CPU)."""

    def __init__(self, cfg: ModelConfig, rt: RuntimeConfig) -> None:
        super().__init__(cfg, rt)
        ps = rt.page_size
        self.max_pages = -(-self.req_pool.max_context_len // ps)
        # pages each request row took at decode page boundaries (freed at request end)
        self._decode_pages = np.full((rt.max_num_reqs, self.max_pages), -1, dtype=np.int64)

    def prefill_slots(self, req: Request, prefix_len: int) -> torch.Tensor:
        slots = super().prefill_slots(req, prefix_len)
        self.req_pool.write(req.req_pool_idx, slice(0, slots.numel()), slots)
        return slots

    def prepare_decode(self, reqs: list[Request]) -> Hashable:
        """A page for every row whose new token opens one (one allocation for the batch)."""
        self._check_decode_lengths(reqs)
        ps = self.rt.page_size
        r, p = self._pages_opened(reqs)
        if r.size:
            pages = self.pool.allocator.alloc_pages(int(r.size), on_host=True)
            if pages is None:
                raise ValueError(f"device KV pool is full ({self.pool.num_slots} slots): raise device_kv_tokens "
                                 f"or lower the batch / context")
            self._decode_pages[r, p] = pages.numpy()
            # req_to_token[r, p * ps + j] = page * ps + j: one staged copy, one launch
            # req_to_token[r, p * ps + j] = page * ps + j, written by the step itself
            self._page_entries = np.stack([np.zeros_like(r), r, p, pages.numpy() * ps], 1)
        return None

    def page_entry_tables(self) -> Optional[tuple[list[torch.Tensor], int]]:
        return [self.req_pool.req_to_token], self.rt.page_size

    def decode_device(self, rows: torch.Tensor, seq_lens: torch.Tensor, graph_key: Hashable):
        from sparsehi.kernels.paged_decode import paged_decode
        from sparsehi.kernels.sparse_mla_decode import sparse_mla_decode

        ps = self.rt.page_size
        live = rows >= 0
        safe = rows.clamp(min=0)
        r2t = self.req_pool.req_to_token
        new_slots = torch.where(live, r2t[safe, (seq_lens.long() - 1).clamp(min=0)], 0)
        lens = torch.where(live, seq_lens, 0).to(torch.int32)
        scale = self.cfg.sm_scale
        mla = self.cfg.family == "mla"
        if mla:
            width = self.req_pool.max_context_len
            cols = torch.arange(width, device=self.device)
            idx = torch.where(cols[None, :] < lens[:, None], r2t[safe, :width], -1).to(torch.int32)
        else:
            table = (r2t[:, ::ps][safe] // ps).to(torch.int32)  # [B, max_pages]

        def attn(layer: int, q, k, v, extra):
            if self.query_hook is not None:
                q = self.query_hook(layer, q, extra)
            bufs = self.pool.layer_buffers(layer)
            # one launch for k and v (set_kv validates slot ranges with a host sync per layer)
            store_kv(bufs, new_slots, (stored_kv(self.spec, k),) if mla else (k, v))
            if not mla:
                with self.timer.section("attention"):
                    return paged_decode(q, bufs[0], bufs[1], table, lens, page_size=ps, sm_scale=scale)
            with self.timer.section("attention"):
                return sparse_mla_decode(q, bufs[0], idx, kv_lora_rank=self.cfg.kv_lora_rank, sm_scale=scale)

        return attn, dict

    def end_request(self, req: Request) -> None:
        if req.device_slots is not None:
            self.pool.allocator.free(req.device_slots)
            req.device_slots = None
        free_page_row(self.pool.allocator, self._decode_pages[req.req_pool_idx])
        super().end_request(req)
