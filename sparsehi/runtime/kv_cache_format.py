"""The runtime's KV cache format (``SparseConfig.kv_cache_dtype``): the model's dtype, or
FP8 latent rows for an MLA model.

With ``kv_cache_dtype="fp8_e4m3"`` the device pool holds each token's latent row in the
DeepSeek-V3.2 / FlashMLA FP8 layout (``sparsehi.kernels.mla_fp8_latents``: E4M3 latent, one
float32 power-of-two scale per 128 values, bf16 rope; ``KVCacheSpec.mla_fp8``), quantised
once when the token is stored (:func:`stored_kv`; per-token scales need no page, so decode
and prefill store the same bytes for the same values). Those bytes go to host pages, to L3
and back into GPU buffers unchanged; who reads them:

- decode attention (``dense``, ``sparse-gpu``, ``sparse-hier``, dense layers and dense rows
  included): the sparse MLA decode kernel, directly from the uint8 rows (the ``dsa``
  adapter; the runner's ``adapter='none'`` torch fallback cannot read them and is refused);
- prefill attention (a prompt's earlier chunks and reused prefixes too): the rows it attends
  are dequantised where they are read (:func:`readable_kv`), so prefill sees what decode sees;
- the ``dsa`` algorithm builds its representations from its own index keys, never from the
  stored rows; algorithms that read stored keys are refused (``SparseConfig``).

Refused: float32 models (the kernel's dots run in bf16 / fp16), GQA (MHA) models (FP8 host pages there: ``host_kv_dtype``), ``offload-full``,
``host_kv_dtype='fp8_e4m3'`` together with it, the LMCache interop, and the SGLang plugin.
Synthetic random prefill (``runtime.synth``) writes the rows ``stored_kv`` makes of its
bf16 values.
"""
from __future__ import annotations

import torch

from hicache.host_kv_dtype import KV_CACHE_DTYPES, check_kv_cache_dtype
from hicache.kv_spec import FP8_LATENT_TILE, KVCacheSpec
from sparsehi.kernels.mla_fp8_latents import dequantize_mla_latents
from sparsehi.kernels.mla_fp8_quantize import mla_fp8_quantize
from sparsehi.runtime.model_config import ModelConfig

__all__ = ["check_runtime_kv_cache_dtype", "kv_cache_spec", "readable_kv", "stored_kv"]


def kv_cache_spec(cfg: ModelConfig, dtype: torch.dtype, page_size: int, kv_cache_dtype: str = "auto") -> KVCacheSpec:
    """The KV pools' spec of ``cfg``: its dtype's rows, or (``fp8_e4m3``, MLA) FP8 latent rows.
    Raises ValueError naming ``kv_cache_dtype`` for a GQA model, a latent width that is not
    a multiple of 128 or a model dtype other than bfloat16 / float16."""
    if check_kv_cache_dtype(kv_cache_dtype) == "auto":
        kw = {"kv_lora_rank": cfg.kv_lora_rank} if cfg.family == "mla" else {}
        return KVCacheSpec(attention=cfg.attention, num_layers=cfg.num_layers, kv_heads=cfg.cache_heads,
                           head_dim=cfg.cache_head_dim, dtype=dtype, page_size=page_size, **kw)
    if cfg.family != "mla":
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is for MLA models (allowed: {KV_CACHE_DTYPES}; "
                         f"'fp8_e4m3' stores MLA latent rows); {cfg.name} has an MHA (GQA) cache: keep "
                         f"kv_cache_dtype='auto' and use host_kv_dtype='fp8_e4m3' for FP8 host KV")
    if cfg.kv_lora_rank % FP8_LATENT_TILE:
        raise ValueError(f"kv_cache_dtype='fp8_e4m3' needs kv_lora_rank a multiple of {FP8_LATENT_TILE} (one scale per "
                         f"{FP8_LATENT_TILE} latent values); {cfg.name} has kv_lora_rank={cfg.kv_lora_rank}")
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"kv_cache_dtype='fp8_e4m3' needs a bfloat16 or float16 model (the FP8 decode kernel's "
                         f"dots run in the query's dtype), got dtype={dtype}")
    return KVCacheSpec.mla_fp8(cfg.num_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, page_size)


def check_runtime_kv_cache_dtype(kv_cache_dtype: str, mode: str, adapter: str) -> None:
    """Refuse the runtime settings that cannot carry FP8 latent rows (module docstring)."""
    if kv_cache_dtype != "fp8_e4m3":
        return
    if mode == "offload-full":
        raise ValueError("kv_cache_dtype='fp8_e4m3' is not supported by mode 'offload-full' (its staging copies "
                         "are not wired for FP8 latent rows): use 'dense', 'sparse-gpu' or 'sparse-hier', or "
                         "kv_cache_dtype='auto'")
    if mode != "dense" and adapter == "none":
        raise ValueError("kv_cache_dtype='fp8_e4m3' needs RuntimeConfig.adapter 'auto' or 'dsa' (the sparse MLA "
                         "decode kernel reads the FP8 rows; the 'none' torch fallback reads values in the "
                         "model's dtype)")


def stored_kv(spec: KVCacheSpec, kv: torch.Tensor) -> torch.Tensor:
    """What the pool stores for ``kv [N, 1, kv_lora_rank + rope_dim]`` (the model's dtype):
    ``kv`` itself, or its FP8 latent rows ``[N, 1, row_bytes]`` uint8. Fixed shapes, no host
    sync (runs inside decode graphs; one launch: ``mla_fp8_quantize``)."""
    if not spec.fp8_latent_rows:
        return kv
    return mla_fp8_quantize(kv, spec.kv_lora_rank)


def readable_kv(spec: KVCacheSpec, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from the pool as values: ``rows`` itself, or FP8 latent rows ``[N, 1,
    row_bytes]`` uint8 dequantised to ``[N, 1, kv_lora_rank + rope_dim]`` in ``dtype``
    (exact: power-of-two scales)."""
    if not spec.fp8_latent_rows:
        return rows
    return dequantize_mla_latents(rows, spec.kv_lora_rank).to(dtype)
