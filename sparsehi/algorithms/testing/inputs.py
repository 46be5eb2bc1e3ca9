"""How the algorithm's inputs derive from the attention queries and keys: as they are
(:class:`AttentionInputs`), or DSA-style index keys/queries by a fixed random projection
(:class:`ProjectedIndexerInputs`)."""
from __future__ import annotations

import math
from typing import Any, Optional

import torch


class AttentionInputs:
    """The algorithm sees the attention queries and keys themselves (Quest, oracle, most
    training-free algorithms)."""

    def prefill_kwargs(self, layer_id: int, keys: torch.Tensor) -> dict[str, Any]:
        """Extra ``construct_representations`` kwargs for prefill keys ``[B, T, Hkv, D]``."""
        return {}

    def decode_kwargs(self, layer_id: int, new_keys: torch.Tensor) -> dict[str, Any]:
        """Extra ``update_representations`` kwargs for one new key per row ``[B, Hkv, D]``."""
        return {}

    def queries(self, layer_id: int, q: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """``retrieve_topk`` queries and extra kwargs for attention queries ``[B, Hq, D]``."""
        return q, {}


class ProjectedIndexerInputs(AttentionInputs):
    """DSA-style inputs from attention q/k by a fixed random projection (Johnson–Lindenstrauss):
    ``index_key_t = P · concat_g(k_{t,g})`` ``[index_head_dim]``, one index query per
    attention head ``P · (q_h placed in its group's block)``, weights all one. So
    ``index_q_h · index_k_t ≈ q_h · k_{t, g(h)}`` and the indexer score is
    ``Σ_h ReLU(≈ q_h · k_t)``.
    """

    def __init__(self, index_head_dim: int = 128, seed: int = 1234) -> None:
        if not isinstance(index_head_dim, int) or index_head_dim <= 0:
            raise ValueError(f"index_head_dim={index_head_dim!r} is invalid: an integer > 0")
        self.index_head_dim = index_head_dim
        self.seed = seed
        self._proj: Optional[torch.Tensor] = None

    def projection(self, kv_heads: int, head_dim: int, device: torch.device) -> torch.Tensor:
        """``P [index_head_dim, kv_heads * head_dim] float32``, N(0, 1/index_head_dim)."""
        n = kv_heads * head_dim
        if self._proj is None or self._proj.shape[1] != n or self._proj.device != torch.device(device):
            g = torch.Generator().manual_seed(self.seed)
            self._proj = (torch.randn(self.index_head_dim, n, generator=g) / math.sqrt(self.index_head_dim)).to(device)
        return self._proj

    def index_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """``[..., Hkv, D]`` → ``[..., index_head_dim] float32``."""
        p = self.projection(keys.shape[-2], keys.shape[-1], keys.device)
        return keys.float().flatten(-2) @ p.T

    def index_queries(self, q: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """``[B, Hq, D]`` → ``[B, Hq, index_head_dim] float32``."""
        b, hq, d = q.shape
        p = self.projection(kv_heads, d, q.device).view(self.index_head_dim, kv_heads, d)
        group = hq // kv_heads
        blocks = p[:, torch.arange(hq, device=q.device) // group, :]  # [Didx, Hq, D]
        return torch.einsum("bhd,ihd->bhi", q.float(), blocks)

    def prefill_kwargs(self, layer_id: int, keys: torch.Tensor) -> dict[str, Any]:
        self._kv_heads = keys.shape[-2]
        return {"index_keys": self.index_keys(keys)}

    def decode_kwargs(self, layer_id: int, new_keys: torch.Tensor) -> dict[str, Any]:
        return {"index_keys": self.index_keys(new_keys)}

    def queries(self, layer_id: int, q: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        kv_heads = getattr(self, "_kv_heads", None)
        if kv_heads is None:
            raise ValueError("ProjectedIndexerInputs.queries needs prefill_kwargs first (it learns kv_heads there)")
        iq = self.index_queries(q, kv_heads)
        return iq, {"weights": torch.ones(q.shape[0], q.shape[1], device=q.device)}
