"""SGLang HiSparse's fused MLA swap-in for bench_swapin, on the same traces and the same
pinned host pool, when it is importable."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from benchmarks.swapin.steps import capture
from benchmarks.swapin.workload import ShapePools

HISPARSE_BLOCK = 960  # SGLang's default swap_in_block_size (as its anchor script)


def load_hisparse() -> tuple[Optional[Callable], Optional[str]]:
    """SGLang's fused MLA swap-in if importable (the anchor), else the reason."""
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    try:
        from sglang.kernels.ops.kvcache.hisparse import load_cache_to_device_buffer_mla
    except Exception as e:  # ImportError or a missing dependency of the JIT loader
        return None, f"sglang.kernels.ops.kvcache.hisparse not importable ({type(e).__name__}: {e})"
    return load_cache_to_device_buffer_mla, None


class HiSparsePeer:
    """SGLang HiSparse's per-layer swap-in (LRU diff + copy + device locations, one kernel)
    over the same pinned host pool, its own device buffer ``[B * (S + 1), 1152] uint8``
    (``S`` LRU slots + the newest token's slot per request), laid out as its anchor script
    does. ``out`` ``[B, K] int32`` is the attention's token indices."""

    def __init__(self, fn: Callable, pools: ShapePools, host_slots: torch.Tensor, k: int, s: int) -> None:
        dev = host_slots.device
        b, ctx = host_slots.shape
        item = pools.spec.token_bytes_per_layer
        self.fn, self.k, self.s, self.item = fn, k, s, item
        self.host = pools.host_pool.kv_data.view(-1, pools.spec.head_dim).view(torch.uint8)  # [slots, 1152]
        self.host_locs = host_slots.contiguous()  # [B, context] int64 host slot of each token
        self.dbuf = torch.zeros(b * (s + 1), item, dtype=torch.uint8, device=dev)
        self.dbuf_locs = torch.arange(b * (s + 1), dtype=torch.int32, device=dev).view(b, s + 1)
        first = torch.arange(s, dtype=torch.int32, device=dev)[None].repeat(b, 1)
        self.dbuf_tokens = torch.cat([first, torch.full((b, 1), ctx - 1, dtype=torch.int32, device=dev)], 1)
        # resident from the start: the first S tokens and the newest one, with their data
        held = torch.cat([host_slots[:, :s], host_slots[:, ctx - 1:]], 1).cpu()
        self.dbuf.copy_(self.host[held.reshape(-1)].to(dev))
        self.lru = torch.arange(s, dtype=torch.int16, device=dev)[None].repeat(b, 1).contiguous()
        self.req = torch.arange(b, dtype=torch.int64, device=dev)
        self.lens = torch.full((b,), ctx, dtype=torch.int64, device=dev)
        self.out = torch.empty(b, k, dtype=torch.int32, device=dev)
        self.nreal = torch.tensor([b], dtype=torch.int32, device=dev)
        self.topk = torch.empty(b, k, dtype=torch.int32, device=dev)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.timing = "eager"

    def call(self) -> None:
        self.fn(self.topk, self.dbuf_tokens, self.host_locs, self.dbuf_locs, self.host, self.dbuf, self.out,
                self.req, self.lens, self.lru, item_size_bytes=self.item, num_top_k=self.k, hot_buffer_size=self.s,
                block_size=HISPARSE_BLOCK, num_real_reqs=self.nreal)

    def try_capture(self) -> None:
        try:
            self.graph, _ = capture(self.call)
            self.timing = "graph"
        except Exception as e:  # noqa: BLE001 - keep the eager path, say why
            self.graph = None
            self.timing = f"eager (capture failed: {type(e).__name__})"
            torch.cuda.synchronize()

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.call()

    def holds_host_data(self, topk: torch.Tensor, host_slots: torch.Tensor) -> bool:
        words = self.dbuf.view(torch.int32)
        loc = self.out.long()
        want = host_slots.gather(1, topk.long()).to(torch.int32)
        got_first, got_last = words[loc.clamp(min=0), 0], words[loc.clamp(min=0), -1]
        return bool(((loc >= 0) & (got_first == want) & (got_last == ~want)).all())
