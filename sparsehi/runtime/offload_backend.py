"""``offload-full``: the baseline that offloading without sparsity gives. The KV lives in
the host pool; each decode step, per layer, every token of every request is gathered
host -> device (the zero-copy Triton kv_copy on CUDA) into a one-layer staging pool and
attended densely. Its cost is the whole context over PCIe per layer and step.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from hicache.device_pool import DeviceKVPool
from hicache.kernels.kv_copy import kv_copy
from hicache.transfer import KVTransferEngine
from sparsehi.runtime.backends import ModeBackend, Request
from sparsehi.runtime.model_config import ModelConfig
from sparsehi.runtime.modes import RuntimeConfig, round_up


class OffloadFullBackend(ModeBackend):
    def __init__(self, cfg: ModelConfig, rt: RuntimeConfig) -> None:
        super().__init__(cfg, rt)
        ps = rt.page_size
        n_host = round_up(rt.host_kv_tokens or rt.auto_host_tokens(), ps)
        self.host = self._host_pool(n_host)
        self.transfer = KVTransferEngine(self.pool, self.host, rt.sparse.io_backend, validate=rt.validate)
        self.ctx_pages = round_up(rt.max_context_len, ps) // ps
        # one layer's KV of every request's whole context: row r owns pages [1 + r*P, 1 + (r+1)*P)
        stage_spec = replace(self.spec, num_layers=1)
        self.stage = DeviceKVPool(stage_spec, (1 + rt.max_num_reqs * self.ctx_pages) * ps, self.device)
        self._host_view = self.host.paged_view()
        self._stage_view = self.stage.paged_view()
        self.peak_host_tokens = 0
        self.step_bytes: list[int] = []

    def stats(self) -> dict:
        """Host->device bytes of every decode step (the whole context, all layers)."""
        return {"steps": len(self.step_bytes), "bytes_loaded": sum(self.step_bytes),
                "per_step_bytes": list(self.step_bytes)}

    def extra_gpu_bytes(self) -> int:
        return self.stage.nbytes()

    def memory(self) -> dict[str, float]:
        a = self.host.allocator
        used = (a.num_pages - 1 - a.num_free_pages()) * a.page_size
        self.peak_host_tokens = max(self.peak_host_tokens, used)
        return {"gpu_kv_bytes": float(self.stage.nbytes()),
                "host_kv_bytes": float(self.peak_host_tokens * self.spec.token_bytes)}

    def end_prefill(self, req: Request, prefix_len: int) -> None:
        n = len(req.prompt)
        host = self.host.alloc(n)
        if host is None:
            raise ValueError(f"host KV pool is full ({self.host.num_slots} slots): raise host_kv_tokens")
        self.transfer.backup(req.device_slots, host.to(req.device_slots.device)).wait()
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        self.pool.allocator.free(req.device_slots)
        req.device_slots = None
        req.host_slots = host
        req.seq_len = n
        self.memory()

    def _stage_slots(self, req: Request, n: int) -> torch.Tensor:
        ps = self.rt.page_size
        base = (1 + req.req_pool_idx * self.ctx_pages) * ps
        return torch.arange(base, base + n, dtype=torch.int64)

    def decode_attention(self, reqs: list[Request]) -> Callable:
        from sparsehi.kernels.paged_decode import paged_decode
        from sparsehi.kernels.sparse_mla_decode import sparse_mla_decode

        ps = self.rt.page_size
        for r in reqs:
            if r.seq_len >= self.rt.max_context_len:
                raise ValueError(f"request {r.rid} exceeds max_context_len={self.rt.max_context_len}")
            if r.seq_len % ps == 0:
                page = self.host.alloc(ps)
                if page is None:
                    raise ValueError("host KV pool is full: raise host_kv_tokens")
                r.host_slots = torch.cat([r.host_slots, page])
        dev = self.device
        self.step_bytes.append(sum(r.seq_len for r in reqs) * self.spec.token_bytes)
        host_old = torch.cat([r.host_slots[: r.seq_len] for r in reqs]).to(dev)
        stage_old = torch.cat([self._stage_slots(r, r.seq_len) for r in reqs]).to(dev)
        host_new = torch.stack([r.host_slots[r.seq_len] for r in reqs]).to(dev)
        stage_new = torch.tensor([int(self._stage_slots(r, r.seq_len + 1)[-1]) for r in reqs], device=dev)
        lens = torch.tensor([r.seq_len + 1 for r in reqs], dtype=torch.int32, device=dev)
        max_pages = -(-int(lens.max()) // ps)
        first = torch.tensor([1 + r.req_pool_idx * self.ctx_pages for r in reqs], device=dev)
        table = (first[:, None] + torch.arange(max_pages, device=dev)[None, :]).to(torch.int32)
        if self.cfg.family == "mla":
            cols = torch.arange(max_pages * ps, device=dev)
            tok = (first[:, None] * ps + cols[None, :])
            tok = torch.where(cols[None, :] < lens[:, None], tok, torch.full_like(tok, -1)).to(torch.int32)
        scale = self.cfg.sm_scale
        mla = self.cfg.family == "mla"

        def attn(layer: int, q, k, v, extra):
            q = self._hook(layer, q, extra)
            hv = self._host_view[:, :, layer:layer + 1]
            with self.timer.section("io"):
                kv_copy(hv, self._stage_view, host_old, stage_old, 0, 1)
            bufs = self.stage.layer_buffers(0)
            bufs[0].index_copy_(0, stage_new, k.to(bufs[0].dtype))
            if not mla:
                bufs[1].index_copy_(0, stage_new, v.to(bufs[1].dtype))
            with self.timer.section("io"):
                kv_copy(self._stage_view, hv, stage_new, host_new, 0, 1)  # back the new token up
            with self.timer.section("attention"):
                if mla:
                    return sparse_mla_decode(q, bufs[0], tok, kv_lora_rank=self.cfg.kv_lora_rank, sm_scale=scale)
                return paged_decode(q, bufs[0], bufs[1], table, lens, page_size=ps, sm_scale=scale)

        return attn

    def end_request(self, req: Request) -> None:
        if req.host_slots is not None:
            self.host.free(req.host_slots)
            req.host_slots = None
        super().end_request(req)
