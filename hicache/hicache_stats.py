"""Counters of the L1/L2 cache: hits per tier, tokens moved, evictions (bytes per
direction and queue depths come from the controller).

Plain integers updated by the scheduler thread (tree) and read through ``stats()``;
the transfer worker never touches them, so no locking is needed.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class HiCacheStats:
    match_queries: int = 0
    query_tokens: int = 0
    """Page-aligned tokens asked for by ``match_prefix``."""
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    """Matched tokens found only on host (loadable)."""
    miss_tokens: int = 0
    inserted_tokens: int = 0
    """Tokens added to the tree as new nodes."""
    backup_tokens: int = 0
    """Device -> host writes issued (tokens)."""
    loadback_tokens: int = 0
    """Host -> device loads issued (tokens)."""
    device_evicted_tokens: int = 0
    """Device tokens freed by eviction: demoted (kept on host) + deleted."""
    device_demoted_tokens: int = 0
    device_deleted_tokens: int = 0
    host_evicted_tokens: int = 0
    write_alloc_failures: int = 0
    load_alloc_failures: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def reset(self) -> None:
        for k in asdict(self):
            setattr(self, k, 0)
