"""bench_decode's sizing: the bytes one request holds per mode (so how many a budget
holds), the bytes one decode step must move and the roofline time they give."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import torch

from sparsehi.config import SparseConfig
from sparsehi.runtime.runtime_config import round_up
from sparsehi.runtime.runtime_mode import host_token_bytes

GIB = 1 << 30


def representation_bytes_per_request(model, sc: SparseConfig, ctx: int, device) -> int:
    from sparsehi.algorithms.registry import create_algorithm

    algo = create_algorithm(replace(sc, sparse_extra_config=sparse_extra_config(model, sc)), device)
    spec_heads, spec_dim = model.cfg.cache_heads, model.cfg.cache_head_dim
    algo.initialize_representation_pool(0, model.cfg.num_layers, 1, ctx, kv_heads=spec_heads, head_dim=spec_dim,
                                        dtype=next(model.parameters()).dtype)
    n = algo.representation_bytes()
    del algo
    return n


def sparse_extra_config(model, sc: SparseConfig) -> dict:
    extra = dict(sc.sparse_extra_config)
    if model.cfg.family == "mla":
        extra.setdefault("index_head_dim", model.cfg.index_head_dim)
    extra["validate"] = False  # no host read-backs on the decode path
    return extra


def per_request_bytes(model, mode: str, ctx: int, sc: SparseConfig, steps: int, rep_bytes: int,
                      n_dense_layers: int, dtype) -> tuple[int, int]:
    """(GPU bytes, host bytes) one request of ``ctx`` tokens holds in ``mode``."""
    cfg = model.cfg
    es = torch.empty((), dtype=dtype).element_size()
    per_layer = cfg.cache_heads * cfg.cache_head_dim * es * (2 if cfg.family == "gqa" else 1)
    tb = per_layer * cfg.num_layers
    ps = sc.page_size
    tokens = round_up(ctx + steps + 1, ps) + ps
    if mode == "sparse-hier-fp8":  # FP8 host pages: one byte a value, plus a page's scales
        buf = (sc.sink_units + sc.recent_units + sc.buffer_units + 1) * ps * tb
        return buf + n_dense_layers * per_layer * tokens + rep_bytes, tokens * host_token_bytes(cfg, dtype, "fp8_e4m3", ps)
    if mode == "dense":
        return tokens * tb, 0
    if mode == "sparse-gpu":
        return tokens * tb + rep_bytes, 0
    if mode == "sparse-hier":
        buf = (sc.sink_units + sc.recent_units + sc.buffer_units + 1) * ps * tb
        return buf + n_dense_layers * per_layer * tokens + rep_bytes, tokens * tb
    return tokens * per_layer, tokens * tb  # offload-full: one-layer staging on GPU


LIMITS: dict[str, Optional[float]] = {"hbm_gbps": None, "h2d_gbps": None}
"""This run's measured limits (GB/s): device->device copy (bytes read + written) and one
large pinned host->device copy; the roofline of every row is taken against them."""


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter except the embedding table
    (a step reads B of its rows) unless the LM head shares it."""
    emb = model.embed_tokens.weight
    tied = model.lm_head.weight is emb
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb or tied)


def step_traffic(model, mode: str, ctx: int, batch: int, sc: SparseConfig, n_dense_layers: int, rep_bytes: int,
                 misses_per_step: Optional[float], dtype) -> dict[str, float]:
    """Bytes one decode step must move: ``hbm`` (weights, the KV the mode reads, the
    selection's representations) and ``h2d`` (host->device: sparse-hier's missed pages,
    offload-full's whole context)."""
    cfg = model.cfg
    es = torch.empty((), dtype=dtype).element_size()
    per_tok = cfg.cache_heads * cfg.cache_head_dim * es * (2 if cfg.family == "gqa" else 1)  # one layer
    L = cfg.num_layers
    ps = sc.page_size
    sel_tokens = (sc.sink_units + sc.top_k_units + sc.recent_units) * ps
    w = weight_bytes(model)
    if mode == "dense":
        return {"hbm": w + batch * ctx * L * per_tok, "h2d": 0.0}
    if mode == "offload-full":
        # staged (written) and attended (read) on the device, loaded over PCIe
        return {"hbm": w + 2 * batch * ctx * L * per_tok, "h2d": batch * ctx * L * per_tok}
    kv = batch * (n_dense_layers * ctx + (L - n_dense_layers) * min(ctx, sel_tokens)) * per_tok
    hbm = w + kv + batch * rep_bytes
    h2d = 0.0
    if mode in ("sparse-hier", "sparse-hier-fp8"):
        page = ps * per_tok
        wire = page if mode == "sparse-hier" else host_token_bytes(cfg, dtype, "fp8_e4m3", ps) / L * ps  # a layer's page
        h2d = (misses_per_step or 0.0) * wire
        hbm += (misses_per_step or 0.0) * page  # written into the buffer in the model's dtype
    return {"hbm": hbm, "h2d": h2d}


def roofline_ms(traffic: dict[str, float]) -> Optional[float]:
    hbm, h2d = LIMITS["hbm_gbps"], LIMITS["h2d_gbps"]
    if not hbm or not h2d:
        return None
    return 1e3 * (traffic["hbm"] / (hbm * 1e9) + traffic["h2d"] / (h2d * 1e9))


def batches_up_to(cap: int, limit: Optional[int] = None) -> list[int]:
    if cap < 1:
        return []
    out = [1 << i for i in range(int(math.log2(cap)) + 1)]
    if out[-1] != cap:
        out.append(cap)
    if limit is not None:
        out = [b for b in out if b <= limit]
    return out
