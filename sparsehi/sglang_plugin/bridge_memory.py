"""How the SGLang bridge sizes its memory: the share of SGLang's KV memory that goes to
the sparse requests' buffers and representations, and the pinned host pool (one slot per
virtual KV slot)."""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from sparsehi.config import SparseConfig
from sparsehi.sglang_plugin.sglang_algorithm import create_plugin_algorithm

logger = logging.getLogger(__name__)

BUFFER_SHARE = 0.5
"""Default share of SGLang's KV memory the sparse requests' buffers and representations
may take (``--sparsehi-max-sparse-requests`` sets the count instead)."""

HOST_SHARE = 0.6
"""At most this share of the machine's memory (over the TP ranks) becomes pinned host KV."""


def host_memory_bytes() -> Optional[int]:
    """The machine's physical memory (the same on every rank of a host), or None."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def sparse_request_count(config: SparseConfig, budget: int, per_req: int, token_bytes: int, rep_per_req: int,
                         max_running: int) -> int:
    """How many requests decode sparsely at once: ``--sparsehi-max-sparse-requests``, else
    as many as BUFFER_SHARE of SGLang's KV bytes ``budget`` holds (buffers of ``per_req``
    tokens and ``rep_per_req`` bytes of representations each), at most ``max_running``."""
    max_sparse = config.max_sparse_requests
    if max_sparse is None:
        max_sparse = int(BUFFER_SHARE * budget // (per_req * token_bytes + rep_per_req))
        max_sparse = max(1, min(max_running, max_sparse))
    return int(max_sparse)


def host_kv_tokens(config: SparseConfig, sgl_tokens: int, unit: int, token_bytes: float, tp: int) -> int:
    """Tokens of the pinned host pool: SGLang's ``sgl_tokens`` times the host-to-device
    ratio, at most HOST_SHARE of the machine's memory per TP rank (the same on every rank:
    their schedulers must decide alike), in whole ``unit`` s. ``token_bytes``: host bytes of
    a token in the host pool's format (``bridge_host_kv.host_token_bytes``)."""
    host_tokens = round_up(int(sgl_tokens * config.host_to_device_ratio), unit)
    total = host_memory_bytes()
    if total is not None:
        cap = int(HOST_SHARE * total / tp // token_bytes) // unit * unit
        if cap < host_tokens:
            logger.warning("sparsehi: --sparsehi-host-to-device-ratio %.3g asks for %.1f GB of pinned host KV; "
                           "%.0f%% of this machine's %.1f GB over %d rank(s) holds %d tokens: using that",
                           config.host_to_device_ratio, host_tokens * token_bytes / 1e9, 100 * HOST_SHARE,
                           total / 1e9, tp, cap)
            host_tokens = max(cap, 2 * unit)
    return host_tokens


def representation_bytes(config: SparseConfig, device: Any, spec: Any, max_ctx: int) -> int:
    """GPU bytes of one request's representations (measured by asking the algorithm for
    a pool of one request)."""
    algo = create_plugin_algorithm(config, device)
    before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    algo.initialize_representation_pool(0, spec.num_layers, 1, max_ctx, kv_heads=spec.kv_heads,
                                        head_dim=spec.head_dim, dtype=spec.dtype)
    got = sum(t.numel() * t.element_size() for t in _tensors_of(algo))
    if torch.cuda.is_available():
        got = max(got, torch.cuda.memory_allocated() - before)
    del algo
    return int(got)


def table_bytes(config: SparseConfig, max_sparse: int, sgl_tokens: int, max_ctx: int, num_layers: int) -> int:
    """GPU bytes of the coordinator's and the residency's own tables (an upper estimate)."""
    ps, n = config.page_size, max_sparse
    m = max_ctx // ps
    s = config.buffer_units
    lru = num_layers * n * (2 * s + m) * 4  # per sparse layer: resident, last_used (S) and slot_of (M)
    tables = (n + 1) * max_ctx * 4 + n * m * 16 + n * (s + 16) * 8
    v = int(sgl_tokens * config.host_to_device_ratio) + 1
    return lru + tables + v * 24


def _tensors_of(obj: Any) -> list[torch.Tensor]:
    """Tensors an object holds in its attributes (dicts of tensors included)."""
    out = []
    for v in vars(obj).values():
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            out += [x for x in v.values() if isinstance(x, torch.Tensor)]
    seen, uniq = set(), []
    for t in out:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            uniq.append(t)
    return uniq
