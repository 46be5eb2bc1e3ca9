"""SparseConfig: what the hierarchical sparse framework is asked to do.

Field names follow SGLang's sparse framework where it has them (``algorithm``,
``backend``, ``top_k``, ``device_buffer_size``, ``host_to_device_ratio``, ``page_size``,
``min_sparse_prompt_len``, ``sparse_extra_config``). Budgets are in **tokens**; page-wise
algorithms select ``top_k // page_size`` pages and keep ``device_buffer_size // page_size``
pages per request and layer in the GPU LRU buffer.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Optional

SPARSE_BACKENDS = ("flashattention", "triton", "dsa")
from hicache.config import IO_BACKENDS  # noqa: E402  (defined once, in hicache)
from hicache.host_kv_dtype import HOST_KV_DTYPES, KV_CACHE_DTYPES  # noqa: E402
from sparsehi.kernels.lru_diff import MAX_SLOTS  # noqa: E402  (the kernel's limit)


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def _is_int(x: Any) -> bool:
    """An integer that is not a bool (``True`` is an ``int`` to Python, never a size here)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass
class SparseConfig:
    algorithm: str = "quest"
    """Registered algorithm name (``quest``, ``dsa``, ``oracle``, ...) or an import path
    ``package.module:ClassName`` of a third-party ``BaseSparseAlgorithm`` subclass."""
    backend: str = "flashattention"
    """Backend adapter the runtime builds (``RuntimeConfig.adapter="auto"``): one of
    SPARSE_BACKENDS; an MHA cache takes ``flashattention`` or ``triton``, the MLA latent
    cache always goes through ``dsa``."""
    top_k: int = 2048
    """Tokens selected per step and layer (sink and recent window not counted)."""
    device_buffer_size: int = 4096
    """Tokens of LRU buffer per request and layer on the GPU; must be >= top_k."""
    host_to_device_ratio: float = 2.0
    """Host pool size over the KV the live requests can hold (the runtime's
    ``RuntimeConfig.auto_host_tokens``): the spare part keeps finished requests' prefixes
    for reuse, as HiCache's ratio does."""
    page_size: int = 64
    min_sparse_prompt_len: int = 2048
    """Requests whose prompt is shorter decode densely in every layer (their KV stays on
    the GPU; hierarchical mode still backs it up to host), as in SGLang's sparse
    framework. Longer ones attend all candidates while they fit in ``top_k`` and sparsely
    after that."""
    sink_tokens: int = 64
    """Leading tokens always attended (rounded up to whole pages)."""
    recent_tokens: int = 64
    """Trailing tokens always attended (rounded up to whole pages; includes the page
    being written)."""
    dense_layers: Optional[tuple[int, ...]] = None
    """Layers that always attend densely; None: the algorithm's default (Quest: 0, 1)."""
    max_sparse_requests: Optional[int] = None
    """SGLang plugin: requests that decode sparsely at once (their GPU buffers and
    representations are carved out of SGLang's KV memory); None: as many as half of that
    memory holds, at most ``--max-running-requests``. Longer prompts beyond it decode on
    SGLang's own path."""
    io_backend: str = "kernel"
    """Host->device loads of missed pages: ``kernel`` (Triton zero-copy gather) or
    ``direct`` (torch indexing + copies on a side stream)."""
    host_kv_dtype: str = "auto"
    """KV outside the GPU (host pool, L3): ``auto`` (the model's dtype) or ``fp8_e4m3``
    (E4M3 pages with one power-of-two scale per layer, buffer and head; half the bytes).
    Complete pages are quantised once, and their GPU copies rounded to the stored values;
    ``sparse-gpu`` with ``fp8_e4m3`` rounds its pages the same way (the exact reference)."""
    kv_cache_dtype: str = "auto"
    """The KV cache's own format, on the GPU, in host memory and in L3 (SGLang's
    ``--kv-cache-dtype``): ``auto`` (the model's dtype) or ``fp8_e4m3`` (MLA models with the
    ``dsa`` algorithm: each token's latent row quantised once, when it is stored, to the
    DeepSeek-V3.2 / FlashMLA FP8 layout, 656 bytes for 512 + 64; the sparse MLA decode
    kernel reads those bytes, and offload and swap-in move them unchanged). Not with
    ``host_kv_dtype="fp8_e4m3"`` (the rows are FP8 already). docs/fp8_host_kv.md."""
    lookahead_tokens: int = 0
    """Hierarchical mode: after each sparse layer's selection, the pages ranked just after
    ``top_k`` (this many tokens of them, whole pages) that are not in the layer's GPU buffer
    are copied in on a side stream, off the step's critical path, for the next step to find
    resident (docs/load_ahead.md). 0: off. ``top_k + lookahead_tokens`` must fit in
    ``device_buffer_size``. gpu_only mode has no host tier and ignores it."""
    sparse_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # -- derived sizes in selection units (pages, or tokens when page_size == 1) --------
    @property
    def top_k_units(self) -> int:
        return max(1, self.top_k // self.page_size)

    @property
    def buffer_units(self) -> int:
        return max(1, self.device_buffer_size // self.page_size)

    @property
    def lookahead_units(self) -> int:
        return self.lookahead_tokens // self.page_size

    @property
    def sink_units(self) -> int:
        return -(-self.sink_tokens // self.page_size)

    @property
    def recent_units(self) -> int:
        return max(1, -(-self.recent_tokens // self.page_size))

    def validate(self) -> None:
        def bad(name: str, allowed: str) -> None:
            raise ValueError(f"SparseConfig.{name}={getattr(self, name)!r} is invalid: {allowed}")

        if not isinstance(self.algorithm, str) or not self.algorithm:
            bad("algorithm", "a registered algorithm name or 'module.path:ClassName'")
        if not isinstance(self.backend, str) or self.backend not in SPARSE_BACKENDS:
            bad("backend", f"one of {SPARSE_BACKENDS}")
        if not _is_int(self.page_size) or not _is_pow2(self.page_size) or self.page_size > 256:
            bad("page_size", "a power of two in [1, 256] (an int, not a bool)")
        if not _is_int(self.top_k) or self.top_k <= 0:
            bad("top_k", "an integer > 0 (tokens; not a bool)")
        if self.top_k % self.page_size:
            bad("top_k", f"a multiple of page_size={self.page_size}")
        if not _is_int(self.device_buffer_size) or self.device_buffer_size < self.top_k:
            bad("device_buffer_size", f"an integer >= top_k={self.top_k} (tokens; not a bool)")
        if self.device_buffer_size % self.page_size:
            bad("device_buffer_size", f"a multiple of page_size={self.page_size}")
        if self.device_buffer_size // self.page_size > MAX_SLOTS:
            bad("device_buffer_size", f"at most {MAX_SLOTS} pages of page_size={self.page_size} (LRU diff kernel limit)")
        if (not _is_real(self.host_to_device_ratio) or not math.isfinite(self.host_to_device_ratio)
                or not self.host_to_device_ratio > 1):
            bad("host_to_device_ratio", "a finite number > 1 (int or float, not a bool or string)")
        if not _is_int(self.min_sparse_prompt_len) or self.min_sparse_prompt_len < 0:
            bad("min_sparse_prompt_len", "an integer >= 0 (tokens; not a bool)")
        if not _is_int(self.sink_tokens) or self.sink_tokens < 0:
            bad("sink_tokens", "an integer >= 0 (not a bool)")
        if not _is_int(self.recent_tokens) or self.recent_tokens < 1:
            bad("recent_tokens", "an integer >= 1 (not a bool)")
        if self.dense_layers is not None:
            if not isinstance(self.dense_layers, (tuple, list)):
                bad("dense_layers", "None or a tuple/list of integer layer ids >= 0")
            if any(not _is_int(x) or x < 0 for x in self.dense_layers):
                bad("dense_layers", "None or a tuple/list of integer layer ids >= 0 (not bools)")
            self.dense_layers = tuple(int(x) for x in self.dense_layers)
        if self.max_sparse_requests is not None and (not _is_int(self.max_sparse_requests)
                                                     or self.max_sparse_requests < 1):
            bad("max_sparse_requests", "None or an integer >= 1 (not a bool)")
        if not isinstance(self.io_backend, str) or self.io_backend not in IO_BACKENDS:
            bad("io_backend", f"one of {IO_BACKENDS}")
        if self.host_kv_dtype not in HOST_KV_DTYPES:
            bad("host_kv_dtype", f"one of {HOST_KV_DTYPES}")
        if self.host_kv_dtype == "fp8_e4m3" and self.io_backend != "kernel":
            bad("host_kv_dtype", "'auto' with io_backend='direct' (FP8 pages are read and written by the kernel "
                                 "io backend's copy kernels)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad("kv_cache_dtype", f"one of {KV_CACHE_DTYPES}")
        if self.kv_cache_dtype == "fp8_e4m3" and self.host_kv_dtype != "auto":
            bad("kv_cache_dtype", "'auto' with host_kv_dtype='fp8_e4m3' (FP8 latent rows are FP8 already and go to "
                                  "host as they are: keep host_kv_dtype='auto')")
        if self.kv_cache_dtype == "fp8_e4m3" and self.algorithm != "dsa":
            bad("kv_cache_dtype", f"'auto' with algorithm={self.algorithm!r}: FP8 latent rows are for the 'dsa' "
                                  "algorithm (it selects by its index keys; other algorithms read the stored keys)")
        if not _is_int(self.lookahead_tokens) or self.lookahead_tokens < 0 or self.lookahead_tokens % self.page_size:
            bad("lookahead_tokens", f"an integer >= 0, a multiple of page_size={self.page_size} (tokens; not a bool)")
        if self.lookahead_tokens and self.top_k + self.lookahead_tokens > self.device_buffer_size:
            bad("lookahead_tokens", f"at most device_buffer_size - top_k = {self.device_buffer_size - self.top_k} "
                                    "(the pages loaded ahead share the LRU buffer with the selection)")
        if self.lookahead_tokens and self.io_backend != "kernel":
            bad("lookahead_tokens", "0 with io_backend='direct' (pages are loaded ahead by the kernel io backend's "
                                    "copy kernel, inside the step's CUDA graph)")
        if not isinstance(self.sparse_extra_config, dict):
            bad("sparse_extra_config", "a dict")
