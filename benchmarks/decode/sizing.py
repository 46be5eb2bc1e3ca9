"""bench_decode's sizing: the bytes one request holds per mode (so how many a budget
holds), the bytes one decode step must move and the roofline time they give."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import torch

from benchmarks.decode.modes import without_fp8_latents, is_hierarchical, kv_cache_dtype_of, runtime_mode_of
from sparsehi.config import SparseConfig
from sparsehi.runtime.kv_cache_format import kv_cache_spec
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


def kv_bytes_per_token_layer(model, dtype, kv_cache_dtype: str = "auto") -> int:
    """Device KV bytes of one token in one layer (K and V for GQA, the latent for MLA; an
    FP8 latent row with ``kv_cache_dtype="fp8_e4m3"``)."""
    return kv_cache_spec(model.cfg, dtype, 1, kv_cache_dtype).token_bytes_per_layer


def per_request_parts(model, mode: str, ctx: int, sc: SparseConfig, steps: int, rep_bytes: int,
                      n_dense_layers: int, dtype) -> dict[str, dict[str, int]]:
    """What one request of ``ctx`` tokens holds in ``mode``: ``{"gpu": {part: bytes},
    "host": {part: bytes}}``. GPU parts: ``kv`` (the whole context, every layer),
    ``buffer`` (sink + recent ring + LRU region, every layer), ``dense_layer_pool`` (the
    dense layers' whole context), ``representations`` (the selection's pools: Quest page
    bounds, DSA index keys), ``staging`` (offload-full's one layer); host part: ``kv`` in
    the host pool's page format."""
    cfg = model.cfg
    per_layer = kv_bytes_per_token_layer(model, dtype, kv_cache_dtype_of(mode))
    tb = per_layer * cfg.num_layers
    ps = sc.page_size
    tokens = round_up(ctx + steps + 1, ps) + ps
    buffer = (sc.sink_units + sc.recent_units + sc.buffer_units + 1) * ps * tb
    mode = without_fp8_latents(mode)
    if is_hierarchical(mode):
        # FP8 host pages: one byte a value, plus a page's scales
        fp8 = runtime_mode_of(mode)[1] == "fp8_e4m3"
        host = tokens * (host_token_bytes(cfg, dtype, "fp8_e4m3", ps) if fp8 else tb)
        return {"gpu": {"buffer": buffer, "dense_layer_pool": n_dense_layers * per_layer * tokens,
                        "representations": rep_bytes}, "host": {"kv": host}}
    if mode == "dense":
        return {"gpu": {"kv": tokens * tb}, "host": {}}
    if mode == "sparse-gpu":
        return {"gpu": {"kv": tokens * tb, "representations": rep_bytes}, "host": {}}
    return {"gpu": {"staging": tokens * per_layer}, "host": {"kv": tokens * tb}}  # offload-full


def per_request_bytes(model, mode: str, ctx: int, sc: SparseConfig, steps: int, rep_bytes: int,
                      n_dense_layers: int, dtype) -> tuple[int, int]:
    """(GPU bytes, host bytes) one request of ``ctx`` tokens holds in ``mode``."""
    parts = per_request_parts(model, mode, ctx, sc, steps, rep_bytes, n_dense_layers, dtype)
    return sum(parts["gpu"].values()), sum(parts["host"].values())


def gib_parts(parts: dict[str, int]) -> dict[str, float]:
    """``per_request_parts``' bytes as GiB (6 decimals), the form rows report them in."""
    return {k: round(v / GIB, 6) for k, v in parts.items()}


def capacity(gpu_bytes: int, host_bytes: int, gpu_budget: float, host_budget: float) -> int:
    """Requests of these per-request bytes the budgets hold."""
    c = int(gpu_budget // gpu_bytes)
    return min(c, int(host_budget // host_bytes)) if host_bytes else c


def device_room(device) -> Optional[int]:
    """Device bytes free now, less a 4 GiB working margin (None off CUDA: no limit known)."""
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0] - 4 * GIB


def admits_one_over_budget(gpu_bytes: int, host_bytes: int, host_budget: float, room: Optional[int]) -> bool:
    """A single request that the GPU budget cannot hold is still measured (batch 1, its row
    marked ``over_gpu_budget``) when the host budget holds it and the device has room for
    it (``room``: free device bytes, None: unknown, taken as enough)."""
    return host_bytes <= host_budget and (room is None or gpu_bytes <= room)


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
    per_tok = kv_bytes_per_token_layer(model, dtype, kv_cache_dtype_of(mode))  # one layer
    mode = without_fp8_latents(mode)
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
    if is_hierarchical(mode):
        # the critical path's misses (pages loaded ahead overlap the step)
        page = ps * per_tok
        fp8 = runtime_mode_of(mode)[1] == "fp8_e4m3"
        wire = host_token_bytes(cfg, dtype, "fp8_e4m3", ps) / L * ps if fp8 else page  # a layer's page
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
