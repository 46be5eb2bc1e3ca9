"""Radix tree nodes and the results of ``HiRadixTree.match_prefix`` / ``insert``."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

_EMPTY = torch.empty((0,), dtype=torch.int64)


class TreeNode:
    """One span of tokens (a whole number of pages) and where its KV lives."""

    __slots__ = (
        "id", "key", "parent", "children", "device_indices", "host_indices", "hash_keys",
        "lock_ref", "host_lock_ref", "hit_count", "last_access", "loading", "write_ack",
        "in_storage", "storage_op", "salt",
    )
    _ids = itertools.count()

    def __init__(self, key: tuple[int, ...] = (), parent: Optional["TreeNode"] = None,
                 salt: Optional[str] = None) -> None:
        self.id: int = next(TreeNode._ids)
        self.key: tuple[int, ...] = key
        self.parent: Optional[TreeNode] = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.device_indices: Optional[torch.Tensor] = None  # int64 [len(key)] device slots
        self.host_indices: Optional[torch.Tensor] = None  # int64 [len(key)] host slots
        self.hash_keys: Optional[list[str]] = None  # one per page, computed on demand
        self.lock_ref = 0
        self.host_lock_ref = 0
        self.hit_count = 0
        self.last_access = 0
        self.loading = False
        self.write_ack: Optional[int] = None  # ack id of the in-flight backup covering this node
        self.in_storage = False  # its pages are known to be in L3 (written, or read from there)
        self.storage_op: Optional[int] = None  # id of the in-flight L3 write covering this node
        self.salt: Optional[str] = salt  # roots only: the cache salt of the subtree below

    @property
    def is_root(self) -> bool:
        """The unsalted root or a cache salt's root (no parent, no key, no KV)."""
        return self.parent is None

    @property
    def on_device(self) -> bool:
        return self.device_indices is not None

    @property
    def evicted(self) -> bool:
        """SGLang's name: not on the device."""
        return self.device_indices is None

    @property
    def backed_up(self) -> bool:
        """Host slots assigned (the write may still be in flight, see ``write_ack``)."""
        return self.host_indices is not None

    def __lt__(self, other: "TreeNode") -> bool:  # heap order: least recently used first
        return (self.last_access, self.id) < (other.last_access, other.id)

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, len={len(self.key)}, dev={self.on_device}, host={self.backed_up}, "
                f"lock={self.lock_ref}, hlock={self.host_lock_ref})")


@dataclass
class MatchResult:
    """Longest cached prefix of a query, split by tier.

    ``device_indices`` int64 [device_hit_length]: device slots of the device-resident
    prefix (ends at ``last_device_node``). ``host_indices`` int64 [host_hit_length]: host
    slots of the following tokens that are on host only (ends at ``last_host_node``; load
    them back with ``init_load_back``). ``backed_host_indices`` int64 [backed_length]: host
    slots of the longest backed-up prefix of the match (both tiers), ending at
    ``last_backed_node`` — what a sparse request reads from host.
    """

    device_indices: torch.Tensor
    last_device_node: TreeNode
    host_indices: torch.Tensor
    last_host_node: TreeNode
    backed_host_indices: torch.Tensor
    last_backed_node: TreeNode

    @property
    def device_hit_length(self) -> int:
        return int(self.device_indices.numel())

    @property
    def host_hit_length(self) -> int:
        return int(self.host_indices.numel())

    @property
    def backed_length(self) -> int:
        return int(self.backed_host_indices.numel())

    @property
    def total_hit_length(self) -> int:
        return self.device_hit_length + self.host_hit_length


@dataclass
class InsertResult:
    """``prefix_len``: leading tokens that were already on the device (SGLang's return
    value). ``device_unused`` / ``host_unused`` int64: the caller's slots the tree did not
    take (the tree already held other slots for those tokens); the caller frees them once it
    stops reading them. ``last_node``: node ending the inserted sequence."""

    prefix_len: int
    last_node: TreeNode
    device_unused: torch.Tensor = field(default_factory=lambda: _EMPTY)
    host_unused: torch.Tensor = field(default_factory=lambda: _EMPTY)


def _as_tokens(token_ids: Sequence[int] | torch.Tensor) -> tuple[int, ...]:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
        return tuple(int(t) for t in token_ids.tolist())
    try:
        return tuple(int(t) for t in token_ids)
    except (TypeError, ValueError) as e:
        raise ValueError(f"token_ids must be a sequence of ints ({e})") from e


def check_salt(cache_salt: object) -> Optional[str]:
    """``cache_salt`` normalised: None for no salt (None or ""), else the str itself."""
    if cache_salt is None or cache_salt == "":
        return None
    if not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
    return cache_salt
