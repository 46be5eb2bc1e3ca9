"""A small SGLang serving loop on CPU for the plugin's tests, built from SGLang's real parts.

SGLang's ``ReqToTokenPool``, ``MHATokenToKVPool``, ``ForwardBatch``, ``RadixAttention`` and
its CPU attention backend (``TorchNativeAttnBackend``) are used as they are; what a test
supplies is what a served model and the scheduler would: the page allocation of SGLang's
slots (``SlotPages``), the per-layer q/k/v of each forward, and the model runner object
the plugin's hooks are handed (``Runner``: the attributes SGLang's ``ModelRunner`` has
after ``alloc_memory_pool``). ``ModelRunner`` itself needs SGLang's server stack, which
the test environment does not install.

The reference (``ReferenceHier``) is the runtime's ``sparse-hier`` decode path: the same
``SparseCoordinator`` in hierarchical mode over hicache's own device and host pools, driven
as ``sparsehi.runtime.sparse_backend`` drives it, with the same K/V, queries and budgets.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.srt.plugins import load_plugins
from sglang.srt.runtime_context import get_parallel

from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.kv_spec import KVCacheSpec
from sparsehi.adapters import create_adaptor
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
                recent_tokens=4, min_sparse_prompt_len=40, dense_layers=(0,), host_to_device_ratio=2.0)
    base.update(kw)
    return SparseConfig(**base)


@dataclass
class Runner:
    """What the plugin's model-runner hooks read off SGLang's ``ModelRunner``."""

    server_args: object
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool
    max_running_requests: int = MAX_REQS
    device: str = "cpu"
    capture_head_hooks: list = field(default_factory=list)
    capture_tail_hooks: list = field(default_factory=list)


class SlotPages:
    """The scheduler's side: page-aligned slots of SGLang's KV pool per request row."""

    def __init__(self) -> None:
        self.next_page = 1  # page 0 is SGLang's padding page
        self.slots: dict[int, list[int]] = {}

    def grow(self, row: int, n: int) -> list[int]:
        have = self.slots.setdefault(row, [])
        new = []
        for _ in range(n):
            if len(have) % PS == 0:  # the row opens a new page
                slot = self.next_page * PS
                self.next_page += 1
            else:
                slot = have[-1] + 1
            new.append(slot)
            have.append(slot)
        return new

    def share(self, row: int, src: int, n: int) -> None:
        """Row ``row`` reuses the first ``n`` slots (whole pages) of ``src`` (a radix-cache hit)."""
        assert n % PS == 0
        self.slots[row] = list(self.slots[src][:n])


@dataclass
class World:
    """SGLang's pools, backend and layers, with the plugin's model-runner hooks applied."""

    cfg: Optional[SparseConfig]
    mla: bool = False
    req_pool: ReqToTokenPool = field(init=False)
    kv_pool: MHATokenToKVPool = field(init=False)
    runner: Runner = field(init=False)
    backend: TorchNativeAttnBackend = field(init=False)
    layers: list = field(init=False)
    pages: SlotPages = field(init=False)

    def __post_init__(self) -> None:
        self.req_pool = ReqToTokenPool(MAX_REQS, MAX_CTX, "cpu", False)
        if self.mla:
            self.kv_pool = MLATokenToKVPool(POOL_TOKENS, PS, torch.float32, LORA, ROPE, L, "cpu", False)
        else:
            self.kv_pool = MHATokenToKVPool(POOL_TOKENS, PS, torch.float32, HKV, D, L, "cpu", False)
        args = type("Args", (), {"sparsehi_config": self.cfg})()
        self.runner = Runner(args, self.req_pool, self.kv_pool)
        hooks.after_alloc_memory_pool(None, self.runner)  # what SGLang runs after alloc_memory_pool
        self.backend = TorchNativeAttnBackend(self.runner)
        if self.mla:
            self.layers = [RadixAttention(HQ, LORA + ROPE, SCALE, 1, layer_id=i, v_head_dim=LORA) for i in range(L)]
        else:
            self.layers = [RadixAttention(HQ, D, SCALE, HKV, layer_id=i) for i in range(L)]
        self.pages = SlotPages()

    @property
    def bridge(self):
        return getattr(self.runner, hooks.BRIDGE_ATTR, None)

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

    def extend(self, rows: list[int], lens: list[int], prefix: Optional[list[int]] = None) -> ForwardBatch:
        prefix = prefix or [0] * len(rows)
        locs = []
        for r, n, p in zip(rows, lens, prefix):
            if p == 0:
                self.pages.slots.pop(r, None)
            locs += self.pages.grow(r, n - p)
            self.req_pool.req_to_token[r, :n] = torch.tensor(self.pages.slots[r][:n], dtype=torch.int32)
        ext = [n - p for n, p in zip(lens, prefix)]
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=len(rows), input_ids=torch.zeros(sum(ext), dtype=torch.long),
            req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(lens), out_cache_loc=torch.tensor(locs),
            seq_lens_sum=sum(lens), seq_lens_cpu=torch.tensor(lens), req_pool_indices_cpu=torch.tensor(rows),
            extend_prefix_lens=torch.tensor(prefix), extend_seq_lens=torch.tensor(ext),
            extend_prefix_lens_cpu=list(prefix), extend_seq_lens_cpu=ext, extend_num_tokens=sum(ext),
            positions=torch.cat([torch.arange(p, n) for n, p in zip(lens, prefix)]),
        )

    def decode(self, rows: list[int], lens: list[int]) -> ForwardBatch:
        locs = []
        for r, n in zip(rows, lens):
            locs += self.pages.grow(r, 1)
            self.req_pool.req_to_token[r, n - 1] = locs[-1]
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=len(rows), input_ids=torch.zeros(len(rows), dtype=torch.long),
            req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(lens), out_cache_loc=torch.tensor(locs),
            seq_lens_sum=sum(lens), seq_lens_cpu=torch.tensor(lens), positions=torch.tensor(lens) - 1,
        )
        # SGLang's init_new leaves a decode batch's req_pool_indices_cpu unset; the plugin's
        # hook on it keeps the scheduler batch's copy (init_new itself needs a ModelRunner)
        scheduled = SimpleNamespace(req_pool_indices_cpu=torch.tensor(rows))
        hooks.after_forward_batch_init_new(fb, ForwardBatch, scheduled, self.runner)
        return fb


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

    def __init__(self, cfg: SparseConfig, mla: bool = False) -> None:
        self.mla = mla
        if mla:
            spec = KVCacheSpec("mla", L, 1, LORA + ROPE, torch.float32, PS, kv_lora_rank=LORA)
            adaptor = create_adaptor("dsa", kv_lora_rank=LORA)
        else:
            spec = KVCacheSpec("mha", L, HKV, D, torch.float32, PS)
            adaptor = create_adaptor(cfg.backend)
        self.pool = DeviceKVPool(spec, POOL_TOKENS * 2, "cpu")
        self.host = HostKVPool(self.pool, hicache_ratio=4.0, pin_memory=False)
        self.coord = SparseCoordinator(cfg, create_plugin_algorithm(cfg, "cpu"), self.pool, mode="hierarchical",
                                       host_pool=self.host, adaptor=adaptor,
                                       max_num_reqs=MAX_REQS + 1, max_context_len=MAX_CTX, validate=True,
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
