"""Model configurations of the compact runtime: two attention families and the built-in
fixed-seed random-weight models.

``gqa``: Llama/Qwen2-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP).
``mla``: DeepSeek-V3.2-style decoder (multi-head latent attention with the weight-absorbed
decode form, plus the lightning indexer that feeds DSA token selection).

Random-init models attend almost uniformly, which would make any Top-k selection look
arbitrary. The built-in tiny configs therefore tie each key projection to its query
projection (``qk_tie``) and scale them up (``qk_gain``): a query then matches the keys of
earlier tokens with the same id strongly (a copy/induction-like head), so attention is
peaky and a sparse selection can capture most of its mass. ``mix_gain`` keeps the
residual stream dominated by token identity so this holds in every layer.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

FAMILIES = ("gqa", "mla")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and init of one decoder-only model."""

    name: str
    family: str  # "gqa" | "mla"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    # GQA
    num_kv_heads: int = 1
    head_dim: int = 64
    rope_theta: float = 10000.0
    rope_scaling: Optional[tuple[float, float, float, int]] = None
    """Llama-3.1 ``rope_type: llama3`` as (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings); None = plain RoPE."""
    rms_norm_eps: float = 1e-6
    # MLA (DeepSeek-V3.2 names)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    # random init (ignored when weights are loaded)
    seed: int = 0
    qk_tie: float = 0.0
    """0: independent q/k projections; t in (0, 1]: k = t * q-projection + (1-t) * noise."""
    qk_gain: float = 1.0
    """Multiplies q and k projections at init (attention logit scale ~ qk_gain**2)."""
    mix_gain: float = 1.0
    """Multiplies output and MLP-down projections at init."""
    tie_word_embeddings: bool = False
    note: str = ""
    """What differs from the real model this shape stands for (stated in outputs)."""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"ModelConfig.family={self.family!r}: allowed {FAMILIES}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.family == "gqa":
            if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
                raise ValueError(
                    f"ModelConfig.num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
                )
            if self.head_dim <= 0 or self.head_dim % 2:
                raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even and > 0")
        else:
            for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                         "v_head_dim", "index_n_heads", "index_head_dim"):
                if int(getattr(self, name)) <= 0:
                    raise ValueError(f"ModelConfig.{name} must be > 0 for family 'mla'")
            if self.qk_rope_head_dim % 2 or self.index_head_dim < self.qk_rope_head_dim:
                raise ValueError("ModelConfig.qk_rope_head_dim must be even and <= index_head_dim")

    # -- KV cache shape -----------------------------------------------------------------
    @property
    def attention(self) -> str:
        """KVCacheSpec.attention: 'mha' for GQA, 'mla' for MLA."""
        return "mha" if self.family == "gqa" else "mla"

    @property
    def cache_heads(self) -> int:
        return self.num_kv_heads if self.family == "gqa" else 1

    @property
    def cache_head_dim(self) -> int:
        """GQA: head_dim; MLA: kv_lora_rank + qk_rope_head_dim (576 for DeepSeek)."""
        return self.head_dim if self.family == "gqa" else self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def sm_scale(self) -> float:
        d = self.head_dim if self.family == "gqa" else self.qk_nope_head_dim + self.qk_rope_head_dim
        return d ** -0.5

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of KV cache one token takes across all layers."""
        per = self.cache_heads * self.cache_head_dim * (2 if self.family == "gqa" else 1)
        return per * self.num_layers * torch.empty((), dtype=dtype).element_size()

    def with_layers(self, num_layers: int) -> "ModelConfig":
        return replace(self, num_layers=num_layers)


_TINY_PEAKY = dict(qk_tie=0.9, qk_gain=2.5, mix_gain=0.5)

_TINY_DSA = ModelConfig(
    name="tiny-dsa", family="mla", vocab_size=512, hidden_size=128, num_layers=3,
    num_heads=4, intermediate_size=256, q_lora_rank=64, kv_lora_rank=64,
    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, index_n_heads=4,
    index_head_dim=32, rope_theta=1e6, **_TINY_PEAKY,
    note="CPU-sized DeepSeek-V3.2-style MLA + lightning indexer (3 layers, 4 heads, "
         "kv_lora_rank 64, rope 16), fixed-seed random weights",
)

BUILTIN_CONFIGS: dict[str, ModelConfig] = {
    "tiny-gqa": ModelConfig(
        name="tiny-gqa", family="gqa", vocab_size=512, hidden_size=128, num_layers=8,
        num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256, rope_theta=1e6,
        **_TINY_PEAKY,
        note="CPU-sized GQA (8 layers, 4 q / 2 kv heads, d=32), fixed-seed random weights with "
             "tied, scaled q/k projections so attention is peaky",
    ),
    "tiny-dsa": _TINY_DSA,
    "tiny-dsa-fp8": replace(
        _TINY_DSA, name="tiny-dsa-fp8", q_lora_rank=128, kv_lora_rank=128,
        note="tiny-dsa with kv_lora_rank 128 (and q_lora_rank 128), the smallest latent the FP8 "
             "latent rows take (one scale per 128 values; --kv-cache-dtype fp8_e4m3)",
    ),
    "llama-8b-shape": ModelConfig(
        name="llama-8b-shape", family="gqa", vocab_size=32000, hidden_size=4096, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=4096, rope_theta=500000.0,
        note="Llama-3-8B attention shapes (32 layers, 32 q / 8 kv heads, d=128); MLP 4096 wide "
             "instead of 14336 and vocab 32000 instead of 128256; random weights",
    ),
    "dsv32-shape": ModelConfig(
        name="dsv32-shape", family="mla", vocab_size=32000, hidden_size=7168, num_layers=8,
        num_heads=128, intermediate_size=2048, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64,
        index_head_dim=128,
        note="DeepSeek-V3.2 attention shapes (128 heads, kv_lora_rank 512, rope 64, index "
             "64 heads x 128); 8 of 61 layers, dense 2048-wide MLP instead of MoE, vocab "
             "32000; random weights",
    ),
}


def get_model_config(name: str, num_layers: Optional[int] = None) -> ModelConfig:
    """A built-in config by name (optionally with fewer/more layers)."""
    if name not in BUILTIN_CONFIGS:
        raise ValueError(f"model={name!r} is not a built-in config: allowed {sorted(BUILTIN_CONFIGS)}")
    cfg = BUILTIN_CONFIGS[name]
    if num_layers is not None:
        if num_layers <= 0:
            raise ValueError(f"num_layers must be > 0, got {num_layers}")
        cfg = cfg.with_layers(num_layers)
    return cfg
