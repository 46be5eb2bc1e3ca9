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
ALL_MODES = MODES + (FP8_MODE,) + AHEAD_MODES
LOOKAHEAD_PAGES = 80
"""Pages ranked after the top-k that the ``-ahead`` modes load per layer (``--lookahead-pages``)."""


def runtime_mode_of(mode: str) -> tuple[str, str]:
    """A benchmark mode -> (the runtime's mode, its host KV dtype)."""
    base = mode[: -len(AHEAD_SUFFIX)] if mode.endswith(AHEAD_SUFFIX) else mode
    return ("sparse-hier", "fp8_e4m3") if base == FP8_MODE else (base, "auto")


def loads_ahead(mode: str) -> bool:
    return mode.endswith(AHEAD_SUFFIX)


def is_hierarchical(mode: str) -> bool:
    """A sparse-hier mode (any host KV dtype, loading ahead or not)."""
    return runtime_mode_of(mode)[0] == "sparse-hier"
