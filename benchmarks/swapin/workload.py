"""What bench_swapin swaps in: the KV shapes and their sparse budgets, the Top-k traces,
the device and pinned host pools (the host pool carrying a recognisable pattern, in the
model's dtype or as FP8 page records), the requests opened over them and the per-step check
against the host data."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.kv_page_format import KVPageFormat
from hicache.kv_spec import KVCacheSpec
from sparsehi.config import SparseConfig
from sparsehi.kernels.selection_table import SelectionTable
from sparsehi.kv_manager import SparseKVCacheManager

LAYER = 0  # the one (sparse) layer of the pools


# ----------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class Shape:
    """One KV geometry (one layer) and its sparse budgets; sizes in tokens."""

    kind: str  # "mla" | "mha"
    layout: str  # host pool layout
    kv_heads: int
    head_dim: int
    page_size: int
    top_k: int
    buffer: int
    context: int  # prompt tokens (a multiple of page_size)
    sink: int
    recent: int
    kv_lora_rank: Optional[int] = None
    host_kv_dtype: str = "auto"  # "fp8_e4m3": FP8 host pages (page_first layout)

    @property
    def name(self) -> str:
        """``kind/layout``, with ``/fp8`` for FP8 host pages."""
        return f"{self.kind}/{self.layout}" + ("/fp8" if self.host_kv_dtype == "fp8_e4m3" else "")

    def spec(self) -> KVCacheSpec:
        return KVCacheSpec(self.kind, 1, self.kv_heads, self.head_dim, torch.bfloat16, self.page_size,
                           kv_lora_rank=self.kv_lora_rank)

    def sparse_config(self) -> SparseConfig:
        return SparseConfig(algorithm="oracle", backend="dsa" if self.kind == "mla" else "flashattention",
                            page_size=self.page_size, top_k=self.top_k, device_buffer_size=self.buffer,
                            sink_tokens=self.sink, recent_tokens=self.recent, min_sparse_prompt_len=0,
                            io_backend="kernel", host_kv_dtype=self.host_kv_dtype)


def mla_shape(quick: bool) -> Shape:
    """DeepSeek MLA: 576 bf16 per token (512 latent + 64 rope) = 1152 B, page size 1."""
    if quick:
        return Shape("mla", "layer_first", 1, 576, 1, 32, 64, 512, 4, 4, kv_lora_rank=512)
    return Shape("mla", "layer_first", 1, 576, 1, 2048, 4096, 32768, 64, 64, kv_lora_rank=512)


def mha_shape(layout: str, quick: bool, host_kv_dtype: str = "auto") -> Shape:
    """Llama-8B GQA: 8 kv heads x 128, bf16, page 64 (4096 B per token, k and v; FP8 host
    pages: 2048 B plus a page's scales)."""
    if quick:
        return Shape("mha", layout, 2, 16, 4, 32, 64, 256, 4, 4, host_kv_dtype=host_kv_dtype)
    return Shape("mha", layout, 8, 128, 64, 2048, 4096, 32768, 64, 64, host_kv_dtype=host_kv_dtype)


def configurations(quick: bool, only: Optional[str], fp8: bool = False) -> list[tuple[Shape, list[tuple[int, float]]]]:
    """(shape, [(batch, overlap)]) in run order; one pool pair per shape. ``fp8``: the MHA
    rows again over FP8 host pages (page_first)."""
    out = []
    if only in (None, "mla"):
        mla = [(1, 0.85), (2, 0.85), (2, 0.5)] if quick else \
            [(1, 0.85), (16, 0.85), (64, 0.85), (64, 0.95), (64, 0.5), (128, 0.85)]
        out.append((mla_shape(quick), mla))
    if only in (None, "mha"):
        mha = [(1, 0.85), (2, 0.85)] if quick else [(1, 0.85), (16, 0.85), (64, 0.85)]
        out += [(mha_shape(layout, quick), mha) for layout in ("layer_first", "page_first")]
        if fp8:
            out.append((mha_shape("page_first", quick, "fp8_e4m3"), mha))
    return out


# ----------------------------------------------------------------------------- traces
class SelectionTrace:
    """Top-k selections ``[B, K] int32`` (ascending) over ids ``[lo, hi)`` whose adjacent
    steps share exactly ``round(K * overlap)`` ids: each step keeps a random subset of the
    previous one and draws the rest uniformly from the ids the previous one did not hold."""

    def __init__(self, batch: int, k: int, lo: int, hi: int, overlap: float, seed: int) -> None:
        if hi - lo < 2 * k:
            raise ValueError(f"candidates [{lo}, {hi}) must hold at least 2 * K = {2 * k} ids")
        self.k, self.lo, self.hi = k, lo, hi
        self.keep = int(round(k * overlap))
        self.gen = torch.Generator().manual_seed(seed)
        self.prev: Optional[torch.Tensor] = None
        self.batch = batch

    def next(self) -> torch.Tensor:
        b, k, n = self.batch, self.k, self.hi - self.lo
        if self.prev is None:
            ids = torch.rand(b, n, generator=self.gen).topk(k, dim=1).indices
        else:
            kept = self.prev.gather(1, torch.rand(b, k, generator=self.gen).argsort(dim=1)[:, :self.keep])
            score = torch.rand(b, n, generator=self.gen)
            score.scatter_(1, self.prev, 2.0)  # the previous step's ids are not fresh
            fresh = score.topk(k - self.keep, dim=1, largest=False).indices
            ids = torch.cat([kept, fresh], dim=1)
        self.prev = ids.sort(dim=1).values
        return (self.prev + self.lo).to(torch.int32)


def warmup_steps(k_units: int, s_units: int, keep: int, minimum: int) -> int:
    """Steps until the LRU buffer has been full for two steps (a fresh buffer fills with
    ``K`` ids, then ``K - keep`` per step)."""
    return max(minimum, math.ceil((s_units - k_units) / max(1, k_units - keep)) + 3)


# ----------------------------------------------------------------------------- pools
def pattern_words(slots: torch.Tensor, buffers: int, heads: int) -> torch.Tensor:
    """``[..., buffers, heads] int32``: the word at the start of each head of each token row
    of host slot ``slots[...]`` (its complement ends the head)."""
    b = torch.arange(buffers, dtype=torch.int32, device=slots.device)[:, None]
    h = torch.arange(heads, dtype=torch.int32, device=slots.device)[None, :]
    return (slots.to(torch.int32)[..., None, None] * buffers + b) * heads + h


FP8_CODES = 5
"""FP8 host pages: E4M3 codes at each end of a head, 6 bits of a word each (codes 0..63 are
positive and finite), so the word's low 30 bits start the head and its complement's end it."""
FP8_WORD_MASK = (1 << 6 * FP8_CODES) - 1


def fp8_codes(words: torch.Tensor) -> torch.Tensor:
    """``[..., FP8_CODES] uint8``: the E4M3 codes of ``words`` (int32, ``< 2**30``)."""
    shifts = torch.arange(0, 6 * FP8_CODES, 6, dtype=torch.int32, device=words.device)
    return ((words[..., None] >> shifts) & 63).to(torch.uint8)


def fp8_scales(pages: torch.Tensor, buffers: int, heads: int) -> torch.Tensor:
    """``[..., buffers, heads] float32``: the power-of-two scale of host page ``pages[...]``
    (it varies with page, buffer and head, so a page read with another's scale shows)."""
    b = torch.arange(buffers, device=pages.device)[:, None] * 3
    h = torch.arange(heads, device=pages.device)[None, :]
    return torch.exp2(((pages.long()[..., None, None] + b + h) % 5 - 2).float())


class ShapePools:
    """Device pool and pinned host pool of one shape, sized for its largest batch and reused
    by its configurations (allocators cleared, device pool zeroed in between). The host
    pool carries the pattern of ``pattern_words`` in every head of every token row: the
    word and its complement at the head's ends, or with FP8 host pages their ``fp8_codes``
    under the page's ``fp8_scales``. ``ends`` gives what a device row must hold there."""

    def __init__(self, shape: Shape, max_batch: int, max_steps: int, device: torch.device) -> None:
        self.shape = shape
        self.spec = spec = shape.spec()
        ps = shape.page_size
        cfg = shape.sparse_config()
        per_row = cfg.sink_units + cfg.recent_units + cfg.buffer_units  # the request's GPU buffer
        prompt = cfg.sink_units + cfg.recent_units  # prompt pages finish_prefill copies from
        dev_slots = (max_batch * (per_row + prompt) + 2) * ps
        self.device_pool = DeviceKVPool(spec, dev_slots, device)
        host_pages = max_batch * (shape.context // ps + max_steps // ps + 2) + 2
        host_slots = max(host_pages * ps, dev_slots + ps) + 2 * ps  # margin: GB rounding below
        fmt = KVPageFormat(spec, shape.host_kv_dtype)
        self.host_page_bytes = fmt.page_bytes // spec.num_layers
        """Host bytes of one page of one layer (what a miss moves over PCIe)."""
        self.host_pool = HostKVPool(self.device_pool, hicache_size=host_slots * fmt.page_bytes / ps / 1e9,
                                    layout=shape.layout, host_kv_dtype=shape.host_kv_dtype)
        self.fp8 = fmt.quantized
        if self.fp8:
            self._write_fp8_pattern()
            rows = self.device_pool.kv_data[:, LAYER]  # [buffers, slots, heads, dim]
            self.dev_first, self.dev_last = rows[..., :FP8_CODES], rows[..., -FP8_CODES:]
        else:
            self._write_host_pattern()
            words = self.device_pool.kv_data.view(torch.int32)[:, LAYER]  # [buffers, slots, heads, dim / 2]
            self.dev_first, self.dev_last = words[..., :1], words[..., -1:]  # [buffers, slots, heads, 1]

    def _write_host_pattern(self) -> None:
        pool = self.host_pool
        words = pool.paged_view().view(torch.int32)[:, :, LAYER]  # [pages, ps, buffers, heads, dim / 2]
        slots = torch.arange(pool.num_slots, dtype=torch.int32).view(pool.num_pages, pool.page_size)
        w = pattern_words(slots, self.spec.num_buffers, self.spec.kv_heads)
        words[..., 0] = w
        words[..., -1] = ~w

    def _write_fp8_pattern(self, chunk: int = 4096) -> None:
        pool, nb, heads = self.host_pool, self.spec.num_buffers, self.spec.kv_heads
        if pattern_words(torch.tensor([pool.num_slots - 1]), nb, heads).max() > FP8_WORD_MASK:
            raise ValueError(f"the FP8 pattern holds 30 bits of a word: {pool.num_slots} host slots are too many")
        values, scales = pool.fp8_values[:, LAYER], pool.fp8_scales[:, LAYER]  # [P, buffers, ps, heads, dim]
        for p0 in range(0, pool.num_pages, chunk):
            pages = torch.arange(p0, min(p0 + chunk, pool.num_pages))
            slots = pages[:, None] * pool.page_size + torch.arange(pool.page_size)
            w = pattern_words(slots, nb, heads).transpose(1, 2)  # [P, buffers, ps, heads]
            values[p0:p0 + len(pages), ..., :FP8_CODES] = fp8_codes(w)
            values[p0:p0 + len(pages), ..., -FP8_CODES:] = fp8_codes(~w & FP8_WORD_MASK)
            scales[p0:p0 + len(pages)] = fp8_scales(pages, nb, heads)

    def ends(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the device row of host slot ``slots[...]`` holds at the start and the end of
        each head once swapped in: ``[..., buffers, heads, X]`` each, comparable with
        ``dev_first`` / ``dev_last`` (int32 words; FP8 pages: dequantised values)."""
        nb, heads = self.spec.num_buffers, self.spec.kv_heads
        w = pattern_words(slots, nb, heads)
        if not self.fp8:
            return w[..., None], (~w)[..., None]
        scale = fp8_scales(torch.div(slots, self.shape.page_size, rounding_mode="floor"), nb, heads)[..., None]

        def value(words: torch.Tensor) -> torch.Tensor:
            return (fp8_codes(words).view(torch.float8_e4m3fn).float() * scale).to(self.spec.dtype)

        return value(w), value(~w & FP8_WORD_MASK)

    def reset(self) -> None:
        self.device_pool.allocator.clear()
        self.host_pool.allocator.clear()
        self.device_pool.kv_data.zero_()


# ----------------------------------------------------------------------------- requests
def open_requests(pools: ShapePools, mgr: SparseKVCacheManager, batch: int) -> torch.Tensor:
    """Rows ``0 .. batch-1`` prefilled with a ``context``-token prompt that is a host-resident
    prefix: the host pool already holds it (the pattern), ``finish_prefill`` gets its host
    slots and ``prefix_lens == seq_lens`` (nothing to offload) and copies the sink and recent
    pages from the device pages the caller passes in; those carry the host data of their
    positions, the middle positions (never read) share one scratch page. Returns the host
    slots ``[batch, context] int64`` (on the manager's device), the truth the checks use."""
    shape, ps, dev = pools.shape, pools.shape.page_size, mgr.device
    n_pages = shape.context // ps
    fixed = list(range(mgr.sizes.sink)) + list(range(n_pages - mgr.sizes.recent, n_pages))  # pages finish_prefill copies
    alloc = pools.device_pool.allocator
    scratch = alloc.alloc_pages(1).cpu()
    host_slots, prompt_pages = [], []
    page_map = torch.empty(batch, n_pages, dtype=torch.int64)
    for r in range(batch):
        mgr.begin_request(r)
        hs = pools.host_pool.alloc(shape.context)
        if hs is None:
            raise RuntimeError("host pool too small for the prompts (sizing bug in ShapePools)")
        host_slots.append(hs)
        own = alloc.alloc_pages(len(fixed)).cpu()
        prompt_pages.append(own)
        page_map[r] = scratch
        page_map[r, fixed] = own
    off = torch.arange(ps)
    token_slots = (page_map[:, :, None] * ps + off).reshape(batch, -1)
    hs_all = torch.stack(host_slots)  # [B, context] int64
    # the fixed pages' device rows: their positions' host rows
    pos = (torch.tensor(fixed)[:, None] * ps + off).reshape(-1)
    src = hs_all[:, pos].reshape(-1)
    dst = token_slots[:, pos].reshape(-1)
    rows = torch.stack(pools.host_pool.read_tokens(LAYER, src))  # [buffers, N, heads, dim] (FP8: dequantised)
    pools.device_pool.kv_data[:, LAYER, dst.to(dev)] = rows.to(dev)
    rows_l = list(range(batch))
    mgr.finish_prefill(rows_l, [shape.context] * batch, [shape.context] * batch, token_slots,
                       host_slots=host_slots)
    # the prompt's device pages are the caller's (a prefix it holds); the buffers are built
    alloc.free_pages(torch.cat(prompt_pages + [scratch]))
    return hs_all.to(dev)


def selection_holds_host_data(pools: ShapePools, tab: SelectionTable, topk: torch.Tensor, host_slots: torch.Tensor,
                              sink: int, recent: int) -> bool:
    """The table lists sink, the trace's ids and recent pages, and every attended prompt id's
    device rows hold that id's host data (recent ids past the prompt are new tokens, which
    this benchmark does not write)."""
    b, k = topk.shape
    ps = pools.shape.page_size
    n_prompt = host_slots.shape[1] // ps
    ok = torch.equal(tab.logical[:, sink:sink + k], topk) and bool((tab.num_valid == sink + k + recent).all())
    lid, phys = tab.logical.long(), tab.physical.long()
    attended = (lid >= 0) & (lid < n_prompt)
    off = torch.arange(ps, device=lid.device)
    tok = (lid.clamp(0, n_prompt - 1)[..., None] * ps + off).view(b, -1)
    want_first, want_last = pools.ends(host_slots.gather(1, tok).view(*lid.shape, ps))  # [B, W, ps, buffers, heads, X]
    dslot = phys.clamp(min=0)[..., None] * ps + off  # [B, W, ps]
    first = pools.dev_first[:, dslot].permute(1, 2, 3, 0, 4, 5)
    last = pools.dev_last[:, dslot].permute(1, 2, 3, 0, 4, 5)
    same = (first == want_first).all(-1) & (last == want_last).all(-1)
    good = same.flatten(2).all(dim=2) & (phys >= 0)
    return ok and bool((good | ~attended).all()) and bool(attended[:, sink:sink + k].all())
