"""The four runtime modes and the settings one run of a mode needs.

| mode           | KV lives                  | decode attends                     |
|----------------|---------------------------|------------------------------------|
| ``dense``      | device pool (all of it)   | every token (paged decode)         |
| ``sparse-gpu`` | device pool (all of it)   | sink + Top-k + recent (coordinator ``gpu_only``) |
| ``sparse-hier``| host pool; GPU LRU buffer | same selection, misses loaded host->device (coordinator ``hierarchical``) |
| ``offload-full``| host pool                | every token, all of it loaded host->device each step |
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from sparsehi.config import SparseConfig

RUNTIME_MODES = ("dense", "sparse-gpu", "sparse-hier", "offload-full")
SPARSE_MODES = ("sparse-gpu", "sparse-hier")
HOST_MODES = ("sparse-hier", "offload-full")
ADAPTERS = ("none", "auto", "flashattention", "triton", "dsa")

MODE_HELP = {
    "dense": "all KV on the GPU, full attention",
    "sparse-gpu": "all KV on the GPU, Top-k attention (coordinator gpu_only)",
    "sparse-hier": "KV in host memory, per-request LRU buffer of Top-k pages on the GPU",
    "offload-full": "KV in host memory, every page loaded host->device each step",
}


def parse_modes(text: str) -> list[str]:
    """``"all"`` or a comma list of RUNTIME_MODES -> ordered unique list."""
    if text.strip() == "all":
        return list(RUNTIME_MODES)
    out: list[str] = []
    for m in (x.strip() for x in text.split(",")):
        if m not in RUNTIME_MODES:
            raise ValueError(f"mode {m!r} is unknown: allowed {RUNTIME_MODES} or 'all'")
        if m not in out:
            out.append(m)
    if not out:
        raise ValueError(f"modes must name at least one of {RUNTIME_MODES}")
    return out


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass
class RuntimeConfig:
    """One runtime instance (one mode) of the model runner."""

    mode: str
    sparse: SparseConfig = field(default_factory=SparseConfig)
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    max_num_reqs: int = 4
    max_context_len: int = 8192
    """Prompt + generated tokens of any request."""
    device_kv_tokens: Optional[int] = None
    """Device pool slots; None: sized for the mode (all requests' KV, or buffers + one
    prompt's prefill staging for the host modes)."""
    host_kv_tokens: Optional[int] = None
    """Host pool slots (host modes); None: room for twice the live requests' KV so the
    radix tree can keep finished requests for prefix reuse."""
    host_kv_gb: float = 0.0
    """Host modes: host pool size in GB (1e9 bytes), SGLang's ``--hicache-size``; when > 0
    it overrides ``host_kv_tokens`` and ``sparse.host_to_device_ratio`` (``--hicache-ratio``)
    and must hold at least the live requests' KV (``min_host_tokens``)."""
    host_layout: str = "layer_first"
    adapter: str = "none"
    """Backend adapter for sparse decode: ``none`` = the coordinator's torch fallback,
    ``auto`` = ``sparse.backend`` for GQA (flashattention / triton), dsa for MLA, or a name
    for create_adapter."""
    prefix_cache: bool = True
    """sparse-hier: match prompts in the HiRadixTree and reuse host-resident prefixes."""
    validate: bool = True
    """Coordinator host-side selection checks (sync per layer; off for benchmarks)."""
    cuda_graph: bool = True
    """Decode steps replay CUDA graphs, one per batch bucket (CUDA devices only; False runs
    the very same step eagerly, for debugging, as SGLang's ``--disable-cuda-graph``)."""
    overlap_schedule: bool = True
    """``generate`` issues decode step ``t + 1`` before reading step ``t``'s tokens (SGLang's
    overlap scheduler): the host part of a step runs while the device works on the previous
    one, and the tokens feed the next step on the device. False (SGLang's
    ``--disable-overlap-schedule``) waits for every step before preparing the next; the
    tokens are the same either way."""
    batch_invariant: bool = False
    """Prefill and decode with kernels whose rows do not depend on the other rows of the
    call (projections, norms, prefill attention: ``sparsehi/kernels/row_invariant_matmul.py``,
    ``prefill_attention.py``): a token's KV is then bitwise the same whether its prompt was
    prefilled whole or after a reused prefix, so reuse cannot change a token even at a
    near-tie (what SGLang's deterministic inference gives). Slower prefill; the model must
    offer ``use_batch_invariant_ops``."""
    storage: Optional[Any] = None
    """sparse-hier: an L3 backend (``hicache.storage.base.HiCacheStorage``) the prefix tree
    attaches: prompts are prefetched from it and finished requests written to it. The
    caller owns it (closes it); the host layout must be a page layout."""
    storage_policy: Optional[Any] = None
    """``hicache.storage_controller.StoragePolicy`` for ``storage`` (None: its defaults)."""
    host_pool: Optional[Any] = None
    """Host modes: an existing ``HostKVPool`` of the same KV spec to use instead of
    allocating one (benchmarks: pinning tens of GiB per run point is slow). Its allocator
    is cleared: whatever it held is forgotten."""

    def __post_init__(self) -> None:
        if self.mode not in RUNTIME_MODES:
            raise ValueError(f"RuntimeConfig.mode={self.mode!r}: allowed {RUNTIME_MODES}")
        if self.adapter not in ADAPTERS:
            raise ValueError(f"RuntimeConfig.adapter={self.adapter!r}: allowed {ADAPTERS}")

        def is_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        for name, low in (("max_num_reqs", 1), ("max_context_len", 2)):
            v = getattr(self, name)
            if not is_int(v) or v < low:
                raise ValueError(f"RuntimeConfig.{name}={v!r} is invalid: an int >= {low}")
        for name in ("device_kv_tokens", "host_kv_tokens"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 1):
                raise ValueError(f"RuntimeConfig.{name}={v!r} is invalid: None (sized for the mode) or an int >= 1")
        if not isinstance(self.sparse, SparseConfig):
            raise ValueError(f"RuntimeConfig.sparse must be a sparsehi.config.SparseConfig, got {type(self.sparse).__name__}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"RuntimeConfig.dtype={self.dtype!r} is invalid: a floating torch.dtype "
                             "(torch.float32, torch.bfloat16, torch.float16)")
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError, ValueError) as e:
            raise ValueError(f"RuntimeConfig.device={self.device!r} is invalid: 'cpu', 'cuda' or 'cuda:N' ({e})") from e
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"RuntimeConfig.device={self.device!r} is invalid: 'cpu', 'cuda' or 'cuda:N'")
        from hicache.config import HOST_LAYOUTS

        if self.host_layout not in HOST_LAYOUTS:
            raise ValueError(f"RuntimeConfig.host_layout={self.host_layout!r} is invalid: one of {HOST_LAYOUTS}")
        # FP8 host KV is sparse-hier's (sparse-gpu rounds its pages the same way; other modes
        # keep the model's dtype everywhere)
        if self.sparse.host_kv_dtype == "fp8_e4m3" and self.mode == "sparse-hier" and self.host_layout != "page_first":
            raise ValueError(f"--host-kv-dtype fp8_e4m3 needs host_layout='page_first' (FP8 page records), got "
                             f"{self.host_layout!r}")
        if not isinstance(self.host_kv_gb, (int, float)) or isinstance(self.host_kv_gb, bool) or self.host_kv_gb < 0:
            raise ValueError(f"RuntimeConfig.host_kv_gb (--hicache-size) must be a number of GB >= 0, "
                             f"got {self.host_kv_gb!r}")

    @property
    def page_size(self) -> int:
        return self.sparse.page_size

    @property
    def uses_cuda_graph(self) -> bool:
        """Whether decode steps run as graph replays: asked for, on a CUDA device, and the
        host modes load with the ``kernel`` io backend (``direct`` reads indices on the host)."""
        if not self.cuda_graph or torch.device(self.device).type != "cuda":
            return False
        return not (self.mode in HOST_MODES and self.sparse.io_backend == "direct")

    @property
    def value_checks(self) -> bool:
        """Host-side value checks of the decode path (reads back to the host): with
        ``validate`` and only on the eager path (a replayed graph cannot run them)."""
        return self.validate and not self.uses_cuda_graph

    def buffer_tokens_per_request(self) -> int:
        """Device slots one request's sparse-hier buffer takes (sink + recent ring + LRU
        region, plus a page of slack for the page being written)."""
        s = self.sparse
        return (s.sink_units + s.recent_units + s.buffer_units + 1) * s.page_size

    def auto_device_tokens(self) -> int:
        ps = self.page_size
        ctx = round_up(self.max_context_len, ps)
        if self.mode in ("dense", "sparse-gpu"):
            need = self.max_num_reqs * (ctx + ps)
        elif self.mode == "sparse-hier":
            per_req = self.buffer_tokens_per_request()
            if self.sparse.min_sparse_prompt_len > 0:
                # a request with a short prompt decodes densely from its own pages, up to
                # the whole context (SparseConfig.min_sparse_prompt_len)
                per_req = max(per_req, ctx + ps)
            need = ctx + self.max_num_reqs * per_req
        else:  # offload-full: one prompt's prefill staging
            need = ctx + ps
        return round_up(need, ps) + 2 * ps  # page 0 is reserved as padding

    def min_host_tokens(self) -> int:
        """Host slots the live requests' KV can take at most (every row at full context)."""
        return self.max_num_reqs * round_up(self.max_context_len, self.page_size)

    def host_tokens(self, token_bytes: int, model: str = "the model") -> int:
        """Host pool slots of a host mode: ``host_kv_gb`` GB of ``token_bytes``-byte tokens
        (whole pages) when set, else ``host_kv_tokens``, else ``auto_host_tokens``. A size
        below ``min_host_tokens`` -> ValueError naming ``--hicache-size``."""
        ps = self.page_size
        if self.host_kv_gb > 0:
            n = int(self.host_kv_gb * 1e9 // token_bytes) // ps * ps
            need = self.min_host_tokens()
            if n < need:
                raise ValueError(
                    f"--hicache-size {self.host_kv_gb:g} GB holds {n} tokens of {model}'s host KV ({token_bytes} "
                    f"bytes a token); {self.mode} needs at least {need} ({self.max_num_reqs} requests x "
                    f"{round_up(self.max_context_len, ps)} tokens, {need * token_bytes / 1e9:.3g} GB): raise it, or "
                    f"leave it 0 to size the host pool with --hicache-ratio")
            return n + 2 * ps  # page 0 is reserved as padding
        return round_up(self.host_kv_tokens or self.auto_host_tokens(), ps)

    def auto_host_tokens(self) -> int:
        """Host pool slots: ``sparse.host_to_device_ratio`` times the KV the live requests
        hold at most (``max_num_reqs * max_context_len``, what a device pool would need for
        them): the spare part keeps finished requests' prefixes for reuse (HiCache's ratio,
        taken against the logical KV because the sparse modes' device pool holds buffers only)."""
        need = self.sparse.host_to_device_ratio * self.max_num_reqs * round_up(self.max_context_len, self.page_size)
        return round_up(max(int(math.ceil(need)), self.max_num_reqs * self.max_context_len), self.page_size) + 2 * self.page_size
