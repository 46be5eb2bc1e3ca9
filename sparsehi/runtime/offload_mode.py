"""``offload-full``: the baseline that offloading without sparsity gives. The KV lives in
the host pool; each decode step, per layer, every token of every request is gathered
host -> device (the zero-copy Triton kv_copy on CUDA) into a one-layer staging pool and
attended densely. Its cost is the whole context over PCIe per layer and step.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Hashable, Optional

import numpy as np
import torch

from hicache.device_pool import DeviceKVPool
from hicache.kernels.kv_copy import kv_copy
from hicache.transfer import KVTransferEngine
from sparsehi.runtime.runtime_mode import Request, RuntimeMode, free_page_row
from sparsehi.runtime.model_config import ModelConfig
from sparsehi.runtime.runtime_config import RuntimeConfig, round_up


class OffloadFullMode(RuntimeMode):
    def __init__(self, cfg: ModelConfig, rt: RuntimeConfig) -> None:
        super().__init__(cfg, rt)
        ps = rt.page_size
        n_host = rt.host_tokens(self.host_token_bytes(), cfg.name)
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
        # host page of every logical page of every request row (host: NumPy, device: the
        # copy the graph-captured step reads)
        self._host_pages = np.full((rt.max_num_reqs, self.ctx_pages), -1, dtype=np.int64)
        self.host_page_table = torch.zeros(rt.max_num_reqs, self.ctx_pages, dtype=torch.int64, device=self.device)

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
        self.set_host_slots(req, host)
        req.seq_len = n
        self.memory()

    def set_host_slots(self, req: Request, host_slots: torch.Tensor) -> None:
        """Record ``host_slots`` (``[n] int64``, whole pages) as the request's KV on host
        (the request then owns those pages: ``end_request`` frees them)."""
        pages = host_slots[:: self.rt.page_size].cpu() // self.rt.page_size
        self._host_pages[req.req_pool_idx, : pages.numel()] = pages.numpy()
        self.host_page_table[req.req_pool_idx, : pages.numel()] = pages.to(self.device)

    def prepare_decode(self, reqs: list[Request]) -> Hashable:
        """A host page for every row whose new token opens one (one allocation)."""
        self._check_decode_lengths(reqs)
        rows, p = self._pages_opened(reqs)
        if rows.size:
            pages = self.host.allocator.alloc_pages(int(rows.size), on_host=True)
            if pages is None:
                raise ValueError("host KV pool is full: raise host_kv_tokens")
            self._host_pages[rows, p] = pages.numpy()
            self._page_entries = np.stack([np.zeros_like(rows), rows, p, pages.numpy()], 1)  # applied by the step
        self.step_bytes.append(sum(r.seq_len for r in reqs) * self.spec.token_bytes)
        return None

    def page_entry_tables(self) -> Optional[tuple[list[torch.Tensor], int]]:
        return [self.host_page_table], 1

    def decode_device(self, rows: torch.Tensor, seq_lens: torch.Tensor, graph_key: Hashable):
        from sparsehi.kernels.paged_decode import paged_decode
        from sparsehi.kernels.sparse_mla_decode import sparse_mla_decode

        ps = self.rt.page_size
        dev = self.device
        live = rows >= 0
        safe = rows.clamp(min=0)
        lens = torch.where(live, seq_lens, 0).to(torch.int32)
        T = self.ctx_pages * ps
        t = torch.arange(T, device=dev)
        # every cached token of every row, host slot -> the row's stage slot (-1: skipped)
        hslot = self.host_page_table[safe][:, t // ps] * ps + (t % ps)[None, :]
        first = 1 + safe * self.ctx_pages  # the row's first stage page
        sslot = first[:, None] * ps + t[None, :]
        old = t[None, :] < (lens - 1).long()[:, None]
        host_old = torch.where(old, hslot, -1).reshape(-1)
        stage_old = torch.where(old, sslot, -1).reshape(-1)
        cur = (lens.long() - 1).clamp(min=0)
        host_new = torch.where(live, hslot.gather(1, cur[:, None])[:, 0], -1)
        stage_new = torch.where(live, sslot.gather(1, cur[:, None])[:, 0], 0)  # padding: the stage's page 0
        table = (first[:, None] + torch.arange(self.ctx_pages, device=dev)[None, :]).to(torch.int32)
        mla = self.cfg.family == "mla"
        if mla:
            tok = torch.where(t[None, :] < lens[:, None], sslot, -1).to(torch.int32)
        scale = self.cfg.sm_scale

        def attn(layer: int, q, k, v, extra):
            if self.query_hook is not None:
                q = self.query_hook(layer, q, extra)
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

        return attn, dict

    def end_request(self, req: Request) -> None:
        free_page_row(self.host.allocator, self._host_pages[req.req_pool_idx])
        super().end_request(req)
