"""The benchmark's modes: the runtime's four, and sparse-hier variants (FP8 host KV,
loading ahead) swept only when asked."""
from __future__ import annotations

MODES = ("dense", "sparse-gpu", "sparse-hier", "offload-full")
FP8_MODE = "sparse-hier-fp8"
"""sparse-hier with FP8 host KV (``--host-kv-dtype fp8_e4m3``)."""
AHEAD_SUFFIX = "-ahead"
AHEAD_MODES = ("sparse-hier" + AHEAD_SUFFIX, FP8_MODE + AHEAD_SUFFIX)
"""sparse-hier (bf16, FP8) loading ``LOOKAHEAD_PAGES`` pages ahead per layer
(``SparseConfig.lookahead_tokens``)."""
FP8_LATENTS_SUFFIX = "-fp8-latents"
FP8_LATENT_MODES = ("dense" + FP8_LATENTS_SUFFIX, "sparse-hier" + FP8_LATENTS_SUFFIX,
                    "sparse-hier" + FP8_LATENTS_SUFFIX + AHEAD_SUFFIX)
"""MLA models only: the KV cache itself in FP8 latent rows (``--kv-cache-dtype fp8_e4m3``,
the DeepSeek-V3.2 656-byte layout) on the GPU, in host memory and in the GPU buffers; the
sparse MLA decode kernel reads those bytes."""
ALL_MODES = MODES + (FP8_MODE,) + AHEAD_MODES + FP8_LATENT_MODES
LOOKAHEAD_PAGES = 80
"""Pages ranked after the top-k that the ``-ahead`` modes load per layer (``--lookahead-pages``)."""


def _without_ahead(mode: str) -> str:
    return mode[: -len(AHEAD_SUFFIX)] if mode.endswith(AHEAD_SUFFIX) else mode


def runtime_mode_of(mode: str) -> tuple[str, str]:
    """A benchmark mode -> (the runtime's mode, its host KV dtype)."""
    base = _without_ahead(mode)
    if base.endswith(FP8_LATENTS_SUFFIX):
        return base[: -len(FP8_LATENTS_SUFFIX)], "auto"
    return ("sparse-hier", "fp8_e4m3") if base == FP8_MODE else (base, "auto")


def kv_cache_dtype_of(mode: str) -> str:
    """A benchmark mode -> ``SparseConfig.kv_cache_dtype``."""
    return "fp8_e4m3" if _without_ahead(mode).endswith(FP8_LATENTS_SUFFIX) else "auto"


def without_fp8_latents(mode: str) -> str:
    """An ``-fp8-latents`` mode -> its runtime mode (``dense``, ``sparse-hier``), any other
    mode unchanged: sizing takes the KV bytes from ``kv_cache_dtype_of`` and the rest by this."""
    return runtime_mode_of(mode)[0] if kv_cache_dtype_of(mode) != "auto" else mode


def loads_ahead(mode: str) -> bool:
    return mode.endswith(AHEAD_SUFFIX)


def is_hierarchical(mode: str) -> bool:
    """A sparse-hier mode (any host KV dtype, loading ahead or not)."""
    return runtime_mode_of(mode)[0] == "sparse-hier"
