"""A small SGLang serving loop on CPU for the plugin's tests, built from SGLang's real parts.

SGLang's ``ReqToTokenPool``, ``MHATokenToKVPool`` / ``MLATokenToKVPool``, its KV allocators
(``TokenToKVPoolAllocator``, ``PagedTokenToKVPoolAllocator``), ``KVIndexTranslator`` (its
plans bind each forward's write slots), ``ForwardBatch``, ``RadixAttention`` and its CPU
attention backend (``TorchNativeAttnBackend``) are used as they are. What a test supplies
is what a served model and the scheduler would: which rows share a cached prefix, the
per-layer q/k/v of each forward, and the model runner object the plugin's hooks are handed
(``Runner``: the attributes SGLang's ``ModelRunner`` has after ``alloc_memory_pool``).
``ModelRunner`` itself needs SGLang's server stack, which the test environment does not
install.

SGLang's GPU attention backends read the KV pool through the model runner's
``KVIndexTranslator`` (virtual slots -> GPU slots). The CPU backend reads
``req_to_token`` as it is, so the kit hands it the rows translated the same way
(``PhysicalRows``: ``allocator.translate_kv_loc`` of every entry, recomputed per forward).

The reference (``ReferenceHier``) is the runtime's ``sparse-hier`` decode path: the same
``SparseCoordinator`` in hierarchical mode over hicache's own device and host pools, driven
as ``sparsehi.runtime.sparse_mode`` drives it, with the same K/V, queries and budgets.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.srt.plugins import load_plugins
from sglang.srt.runtime_context import get_parallel

from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.kv_spec import KVCacheSpec
from sparsehi.adapters import create_adapter
from sparsehi.sglang_plugin.sglang_algorithm import create_plugin_algorithm
from sparsehi.config import SparseConfig
from sparsehi.coordinator import SparseCoordinator
from sparsehi.forward_batch import ForwardBatch as SparseBatch
from sparsehi.sglang_plugin import hooks

load_plugins()  # applies the plugin's hooks (RadixAttention.forward, ReqToTokenPool.free_rows, ...)

L, HQ, HKV, D, PS = 3, 4, 2, 16, 4
SCALE = D ** -0.5
LORA, ROPE = 16, 8  # MLA: latent width and rope part (a row of the latent cache is LORA + ROPE)
MAX_CTX = 128
POOL_TOKENS = 512
MAX_REQS = 4


def sparse_config(**kw) -> SparseConfig:
    base = dict(algorithm="quest", backend="triton", top_k=8, device_buffer_size=12, page_size=PS, sink_tokens=4,
                recent_tokens=4, min_sparse_prompt_len=40, dense_layers=(0,), host_to_device_ratio=2.0,
                max_sparse_requests=MAX_REQS)
    base.update(kw)
    return SparseConfig(**base)


@dataclass
class Runner:
    """What the plugin's model-runner hooks read off SGLang's ``ModelRunner``."""

    server_args: object
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool
    token_to_kv_pool_allocator: object
    kv_index_translator: object
    max_total_num_tokens: int = POOL_TOKENS
    max_running_requests: int = MAX_REQS
    device: str = "cpu"
    capture_head_hooks: list = field(default_factory=list)
    capture_tail_hooks: list = field(default_factory=list)


class PhysicalRows:
    """``req_to_token`` as SGLang's GPU backends read it: every entry translated to its GPU
    slot by the runner's allocator (identity without the plugin)."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    @property
    def req_to_token(self) -> torch.Tensor:
        rtt = self.runner.req_to_token_pool.req_to_token
        alloc = self.runner.token_to_kv_pool_allocator
        if not hasattr(alloc, "translate_kv_loc"):
            return rtt
        return alloc.translate_kv_loc(rtt.long()).to(rtt.dtype)


def _prompt_batch(rows: list[int], prompts: list[int]) -> SimpleNamespace:
    """The scheduler batch ``ForwardBatch.init_new`` is built from, as far as the plugin reads it."""
    reqs = [SimpleNamespace(origin_input_ids=[0] * n, output_ids=[]) for n in prompts]
    return SimpleNamespace(reqs=reqs, req_pool_indices_cpu=torch.tensor(rows))


@dataclass
class World:
    """SGLang's pools, allocator, translator, backend and layers, with the plugin's
    model-runner hooks applied. ``sgl_page``: SGLang's ``--page-size``; ``max_reqs``: the
    ``ReqToTokenPool``'s rows (SGLang's ``--max-running-requests``)."""

    cfg: Optional[SparseConfig]
    mla: bool = False
    sgl_page: int = 1
    pool_tokens: int = POOL_TOKENS
    max_reqs: int = MAX_REQS
    req_pool: ReqToTokenPool = field(init=False)
    kv_pool: MHATokenToKVPool = field(init=False)
    runner: Runner = field(init=False)
    backend: TorchNativeAttnBackend = field(init=False)
    layers: list = field(init=False)

    def __post_init__(self) -> None:
        self.req_pool = ReqToTokenPool(self.max_reqs, MAX_CTX, "cpu", False)
        ps = self.sgl_page
        if self.mla:
            self.kv_pool = MLATokenToKVPool(self.pool_tokens, ps, torch.float32, LORA, ROPE, L, "cpu", False)
        else:
            self.kv_pool = MHATokenToKVPool(self.pool_tokens, ps, torch.float32, HKV, D, L, "cpu", False)
        if ps == 1:
            alloc = TokenToKVPoolAllocator(self.pool_tokens, torch.float32, "cpu", self.kv_pool, False)
        else:
            alloc = PagedTokenToKVPoolAllocator(self.pool_tokens, ps, torch.float32, "cpu", self.kv_pool, False)
        translator = KVIndexTranslator(req_to_token=self.req_pool.req_to_token, token_to_kv_pool_allocator=alloc,
                                       token_to_kv_pool=self.kv_pool, page_size=ps, device="cpu")
        args = type("Args", (), {"sparsehi_config": self.cfg})()
        self.runner = Runner(args, self.req_pool, self.kv_pool, alloc, translator, max_total_num_tokens=self.pool_tokens,
                             max_running_requests=self.max_reqs)
        hooks.after_alloc_memory_pool(None, self.runner)  # what SGLang runs after alloc_memory_pool
        self.backend = TorchNativeAttnBackend(self.runner)
        self.backend.req_to_token_pool = PhysicalRows(self.runner)
        if self.mla:
            self.layers = [RadixAttention(HQ, LORA + ROPE, SCALE, 1, layer_id=i, v_head_dim=LORA) for i in range(L)]
        else:
            self.layers = [RadixAttention(HQ, D, SCALE, HKV, layer_id=i) for i in range(L)]
        self.lens: dict[int, int] = {}

    @property
    def bridge(self):
        return getattr(self.runner, hooks.BRIDGE_ATTR, None)

    @property
    def alloc(self):
        return self.runner.token_to_kv_pool_allocator

    def _model(self, qkv):
        def forward_raw(runner, fb):
            # SGLang's MLA writer reads its parallel context (one rank, no decode context parallelism)
            with forward_context(ForwardContext(attn_backend=self.backend)), get_parallel().override(dcp_enabled=False):
                self.backend.init_forward_metadata(fb)
                return [self.layers[i].forward(q, k, v, fb) for i, (q, k, v) in enumerate(qkv)]
        return forward_raw

    def run(self, fb: ForwardBatch, qkv, hooked: bool = True):
        """One forward through the plugin's ``_forward_raw`` hook (or SGLang's own path)."""
        model = self._model(qkv)
        if hooked:
            return hooks.around_forward_raw(model, self.runner, fb)
        return model(self.runner, fb)

    def _slots(self, rows: list[int], starts: list[int], ends: list[int]) -> torch.Tensor:
        """Allocate ``[start, end)`` of each row as the scheduler does (SGLang's allocator,
        page-aligned rows at --page-size > 1) and write ``req_to_token``."""
        ps = self.sgl_page
        rtt = self.req_pool.req_to_token
        if ps == 1:
            ids = self.alloc.alloc(sum(e - s for s, e in zip(starts, ends)))
            assert ids is not None, "the allocator refused"
            out, k = [], 0
            for r, s, e in zip(rows, starts, ends):
                rtt[r, s:e] = ids[k:k + e - s].to(torch.int32)
                out.append(ids[k:k + e - s])
                k += e - s
            return torch.cat(out)
        pre = torch.tensor(starts, dtype=torch.int64)
        seq = torch.tensor(ends, dtype=torch.int64)
        last = torch.tensor([int(rtt[r, s - 1]) if s > 0 else -1 for r, s in zip(rows, starts)], dtype=torch.int64)
        if all(e - s == 1 for s, e in zip(starts, ends)):
            ids = self.alloc.alloc_decode(seq, seq, last)
        else:
            ids = self.alloc.alloc_extend(pre, pre, seq, seq, last, int((seq - pre).sum()))
        assert ids is not None, "the allocator refused"
        k = 0
        for r, s, e in zip(rows, starts, ends):
            rtt[r, s:e] = ids[k:k + e - s].to(torch.int32)
            k += e - s
        return ids

    def _bind(self, fb: ForwardBatch) -> ForwardBatch:
        """What ``ForwardBatch.init_new`` does with the runner's translator: the plan of the
        forward's slots (``out_cache_loc`` becomes the GPU slots, the virtual ones kept)."""
        t = self.runner.kv_index_translator
        t.own_plan(fb).bind(fb, t)
        return fb

    def extend(self, rows: list[int], lens: list[int], prefix: Optional[list[int]] = None,
               share: Optional[dict[int, int]] = None, prompts: Optional[list[int]] = None) -> ForwardBatch:
        """An extend forward of ``rows`` up to ``lens`` tokens, ``prefix`` of them cached:
        from the row's own earlier chunks, or (``share[row] = src``) the first tokens of row
        ``src`` (a radix-tree hit). ``prompts``: each request's full prompt length."""
        prefix = prefix or [0] * len(rows)
        share = share or {}
        rtt = self.req_pool.req_to_token
        for r, p in zip(rows, prefix):
            if r in share:
                rtt[r, :p] = rtt[share[r], :p]
        locs = self._slots(rows, prefix, lens)
        ext = [n - p for n, p in zip(lens, prefix)]
        for r, n in zip(rows, lens):
            self.lens[r] = n
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=len(rows), input_ids=torch.zeros(sum(ext), dtype=torch.long),
            req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(lens), out_cache_loc=locs,
            seq_lens_sum=sum(lens), seq_lens_cpu=torch.tensor(lens), req_pool_indices_cpu=torch.tensor(rows),
            extend_prefix_lens=torch.tensor(prefix), extend_seq_lens=torch.tensor(ext),
            extend_prefix_lens_cpu=list(prefix), extend_seq_lens_cpu=ext, extend_num_tokens=sum(ext),
            positions=torch.cat([torch.arange(p, n) for n, p in zip(lens, prefix)]),
        )
        self._bind(fb)
        hooks.after_forward_batch_init_new(fb, ForwardBatch, _prompt_batch(rows, prompts or list(lens)), self.runner)
        return fb

    def forward_batch(self, batch) -> ForwardBatch:
        """The ``ForwardBatch`` SGLang's ``ForwardBatch.init_new`` makes of a scheduler's
        ``ScheduleBatch`` after ``prepare_for_extend`` / ``prepare_for_decode`` (its
        allocation and ``req_to_token`` rows are the scheduler's own), as far as the
        attention backend and the plugin read it; the plugin's hook on ``init_new`` runs."""
        rows = [int(r) for r in batch.req_pool_indices_cpu]
        lens = [int(n) for n in batch.seq_lens_cpu]
        common = dict(batch_size=len(rows), req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(lens),
                      out_cache_loc=batch.out_cache_loc.clone(), seq_lens_sum=sum(lens),
                      seq_lens_cpu=torch.tensor(lens))
        if batch.forward_mode.is_decode():
            fb = ForwardBatch(forward_mode=ForwardMode.DECODE, input_ids=torch.zeros(len(rows), dtype=torch.long),
                              positions=torch.tensor(lens) - 1, **common)
        else:
            prefix, ext = [int(p) for p in batch.prefix_lens], [int(e) for e in batch.extend_lens]
            fb = ForwardBatch(
                forward_mode=ForwardMode.EXTEND, input_ids=torch.zeros(sum(ext), dtype=torch.long),
                req_pool_indices_cpu=torch.tensor(rows), extend_prefix_lens=torch.tensor(prefix),
                extend_seq_lens=torch.tensor(ext), extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=ext,
                extend_num_tokens=sum(ext), positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, ext)]),
                **common)
        self._bind(fb)
        hooks.after_forward_batch_init_new(fb, ForwardBatch, batch, self.runner)
        return fb

    def decode(self, rows: list[int], lens: list[int]) -> ForwardBatch:
        locs = self._slots(rows, [n - 1 for n in lens], lens)
        for r, n in zip(rows, lens):
            self.lens[r] = n
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=len(rows), input_ids=torch.zeros(len(rows), dtype=torch.long),
            req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(lens), out_cache_loc=locs,
            seq_lens_sum=sum(lens), seq_lens_cpu=torch.tensor(lens), positions=torch.tensor(lens) - 1,
        )
        self._bind(fb)
        # SGLang's init_new leaves a decode batch's req_pool_indices_cpu unset; the plugin's
        # hook on it keeps the scheduler batch's copy (init_new itself needs a ModelRunner)
        scheduled = SimpleNamespace(req_pool_indices_cpu=torch.tensor(rows), reqs=None)
        hooks.after_forward_batch_init_new(fb, ForwardBatch, scheduled, self.runner)
        return fb

    def finish(self, row: int, keep: int = 0) -> None:
        """A request ends as SGLang releases it without a tree: its slots past ``keep`` (what
        a tree would keep) back to the allocator, then its row freed."""
        n = self.lens.pop(row)
        ids = self.req_pool.req_to_token[row, keep:n].long()
        if ids.numel():
            self.alloc.free(ids)
        self.req_pool.free_rows(torch.tensor([row]))


def qkv(n: int, gen: torch.Generator, mla: bool = False) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer q ``[n, HQ*D]``, k / v ``[n, HKV*D]`` (the shapes a model hands RadixAttention).
    MLA: absorbed q ``[n, HQ*(LORA+ROPE)]``, k the latent row ``[n, LORA+ROPE]``, v its latent part."""
    if mla:
        out = []
        for _ in range(L):
            k = torch.randn(n, LORA + ROPE, generator=gen)
            out.append((torch.randn(n, HQ * (LORA + ROPE), generator=gen), k, k[:, :LORA].clone()))
        return out
    return [(torch.randn(n, HQ * D, generator=gen), torch.randn(n, HKV * D, generator=gen),
             torch.randn(n, HKV * D, generator=gen)) for _ in range(L)]


class ReferenceHier:
    """The runtime's ``sparse-hier`` decode: the hierarchical coordinator over hicache's pools."""

    def __init__(self, cfg: SparseConfig, mla: bool = False, max_reqs: int = MAX_REQS) -> None:
        self.mla = mla
        if mla:
            spec = KVCacheSpec("mla", L, 1, LORA + ROPE, torch.float32, PS, kv_lora_rank=LORA)
            adapter = create_adapter("dsa", kv_lora_rank=LORA)
        else:
            spec = KVCacheSpec("mha", L, HKV, D, torch.float32, PS)
            adapter = create_adapter(cfg.backend)
        self.pool = DeviceKVPool(spec, POOL_TOKENS * 2, "cpu")
        fp8 = cfg.host_kv_dtype == "fp8_e4m3"  # FP8 pages live in the page_first layout
        self.host = HostKVPool(self.pool, hicache_ratio=4.0, pin_memory=False,
                               layout="page_first" if fp8 else "layer_first", host_kv_dtype=cfg.host_kv_dtype)
        self.coord = SparseCoordinator(cfg, create_plugin_algorithm(cfg, "cpu"), self.pool, mode="hierarchical",
                                       host_pool=self.host, adapter=adapter,
                                       max_num_reqs=max_reqs + 1, max_context_len=MAX_CTX, validate=True,
                                       dense_pool_tokens=POOL_TOKENS * 2)
        self.seq: dict[int, int] = {}

    def prefill(self, row: int, k_all: list[torch.Tensor], v_all: list[torch.Tensor]) -> None:
        """``k_all[layer]`` / ``v_all[layer]``: ``[n, HKV*D]`` of every prompt position."""
        n = k_all[0].shape[0]
        slots = self.pool.allocator.alloc(n)[:n]
        for i in range(L):
            if self.mla:
                self.pool.set_kv(i, slots, k_all[i].view(n, 1, LORA + ROPE))
            else:
                self.pool.set_kv(i, slots, k_all[i].view(n, HKV, D), v_all[i].view(n, HKV, D))
        self.coord.on_request_begin(row)
        batch = SparseBatch.prefill(torch.tensor([row]), torch.tensor([n], dtype=torch.int32), slots[None, :])
        for i in range(L):
            self.coord.attention_end(i, batch)
        self.coord.forward_end(batch)
        self.seq[row] = n

    def decode(self, rows: list[int], layers_qkv) -> list[torch.Tensor]:
        for r in rows:
            self.seq[r] += 1
        b = len(rows)
        batch = SparseBatch.decode(torch.tensor(rows), torch.tensor([self.seq[r] for r in rows], dtype=torch.int32))
        self.coord.forward_begin(batch)
        outs = []
        for i, (q, k, v) in enumerate(layers_qkv):
            if self.mla:
                q3, k3, v3 = q.view(b, HQ, LORA + ROPE), k.view(b, 1, LORA + ROPE), None
            else:
                q3, k3, v3 = q.view(b, HQ, D), k.view(b, HKV, D), v.view(b, HKV, D)
            plan = self.coord.attention_begin(i, batch, q=q3)
            plan.write_kv(k3, v3)
            outs.append(plan.attend(q3, SCALE).reshape(b, -1))
            self.coord.attention_end(i, batch, k=k3, v=v3)
        self.coord.forward_end(batch)
        return outs
