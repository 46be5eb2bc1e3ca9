"""Llama/Qwen2-style decoder with grouped-query attention.

Module names follow the HF checkpoints (``embed_tokens``, ``layers.{i}.self_attn.q_proj``,
``mlp.gate_proj``, ``input_layernorm``, ``norm``, ``lm_head``) so safetensors load by name.
Attention itself is not computed here: each layer hands post-RoPE ``q, k, v`` to the
runner's :class:`~sparsehi.runtime.layers.AttentionFn`, which owns the KV cache.
"""
from __future__ import annotations


from typing import Optional

import torch
from torch import nn

from sparsehi.kernels.add_rms_norm import add_rms_norm
from sparsehi.kernels.rope import rope_inplace
from sparsehi.runtime.layers import (AttentionFn, RMSNorm, SwiGLU, fused_weight, init_linear, project, rope_cos_sin,
                                    seeded_normal_, tie_rows)
from sparsehi.runtime.model_config import ModelConfig


class GQAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, bias: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def qkv_weight(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """q/k/v projections as one matrix (one GEMM launch per layer instead of three)."""
        w = fused_weight(self, "_qkv_w", [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        b = None
        if self.q_proj.bias is not None:
            b = fused_weight(self, "_qkv_b", [self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
        return w, b


class GQALayer(nn.Module):
    def __init__(self, cfg: ModelConfig, bias: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GQAAttention(cfg, bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)


class GQAModel(nn.Module):
    """Decoder-only GQA transformer; ``forward`` returns the final hidden states."""

    def __init__(self, cfg: ModelConfig, qkv_bias: bool = False) -> None:
        super().__init__()
        if cfg.family != "gqa":
            raise ValueError(f"GQAModel needs a 'gqa' config, got family={cfg.family!r}")
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GQALayer(cfg, qkv_bias) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.batch_invariant = False
        """Row-invariant projections and norms (``use_batch_invariant_ops``)."""

    def use_batch_invariant_ops(self) -> None:
        """From now on compute every projection and norm with row-invariant kernels
        (``sparsehi.runtime.layers``): each token's hidden states, hence its KV, depend on
        its own inputs only, not on the other tokens of the call."""
        self.batch_invariant = True

    @torch.no_grad()
    def random_init(self) -> None:
        """Fixed-seed init (``cfg.seed``); see model_config for the q/k tie that makes
        attention peaky."""
        cfg = self.cfg
        gen = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(cfg.seed)
        seeded_normal_(self.embed_tokens.weight, gen, 1.0)
        group = cfg.num_heads // cfg.num_kv_heads
        d = cfg.head_dim
        for layer in self.layers:
            a = layer.self_attn
            init_linear(a.q_proj, gen, cfg.qk_gain)
            init_linear(a.k_proj, gen, cfg.qk_gain)
            if cfg.qk_tie > 0:
                for j in range(cfg.num_kv_heads):
                    src = a.q_proj.weight[j * group * d:(j * group + 1) * d]
                    tie_rows(a.k_proj.weight[j * d:(j + 1) * d], src, cfg.qk_tie, gen)
            init_linear(a.v_proj, gen)
            init_linear(a.o_proj, gen, cfg.mix_gain)
            init_linear(layer.mlp.gate_proj, gen)
            init_linear(layer.mlp.up_proj, gen)
            init_linear(layer.mlp.down_proj, gen, cfg.mix_gain)
        init_linear(self.lm_head, gen)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        """input_ids, positions: ``[T] int64`` (one decode token per request, or the
        concatenated prefill tokens). Returns hidden ``[T, hidden]`` after the final norm."""
        cfg, inv = self.cfg, self.batch_invariant
        T = input_ids.shape[0]
        h = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        # residual add and the next norm are one launch: x is the normed input of the next block
        x = self.layers[0].input_layernorm(h, inv) if len(self.layers) else h
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            w, b = a.qkv_weight()
            qkv = project(x, w, b, inv).view(T, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
            nqk = cfg.num_heads + cfg.num_kv_heads
            rope_inplace(qkv[:, :nqk], cos, sin)  # q and k rotated in one pass
            q, k, v = qkv[:, : cfg.num_heads], qkv[:, cfg.num_heads:nqk], qkv[:, nqk:]
            o = attn(i, q, k, v, {})
            post = layer.post_attention_layernorm
            h, x = add_rms_norm(h, project(o.reshape(T, -1).to(h.dtype), a.o_proj.weight, None, inv), post.weight,
                                post.eps)
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            h, x = add_rms_norm(h, layer.mlp(x, inv), nxt.weight, nxt.eps)
        return x if len(self.layers) else self.norm(h, inv)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` float32."""
        return project(hidden, self.lm_head.weight, None, self.batch_invariant).float()
