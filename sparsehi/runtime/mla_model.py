"""DeepSeek-V3.2-style decoder: multi-head latent attention (MLA) plus the lightning
indexer that scores tokens for DSA Top-k selection.

Attention runs in the weight-absorbed form for prefill and decode alike, so every mode
reads the same latent cache entry per token: ``kv = [rmsnorm(c_kv) (kv_lora_rank) ;
rope(k_pe) (qk_rope_head_dim)]`` (576 wide for DeepSeek). The query handed to attention
is ``[q_nope @ W_UK ; rope(q_pe)]``, keys are the whole entry, values its first
``kv_lora_rank`` columns; the latent output is mapped back through ``W_UV``.

Indexer (per token): ``index_q [Hi, Di]`` from the query latent, ``index_k [Di]`` from
the hidden state (LayerNorm), RoPE on their first ``qk_rope_head_dim`` dims, and
``index_w [Hi]`` = ``weights_proj(x) * Hi^-0.5 * Di^-0.5``; the DSA score of token t is
``sum_h index_w[h] * relu(index_q[h] . index_k[t])``.
"""
from __future__ import annotations

import torch
from torch import nn

from sparsehi.kernels.add_rms_norm import add_rms_norm
from sparsehi.kernels.dsa_index_inputs import dsa_index_inputs
from sparsehi.kernels.rope import rope_inplace
from sparsehi.kernels.row_invariant_matmul import row_invariant_matmul
from sparsehi.runtime.layers import (AttentionFn, RMSNorm, SwiGLU, fused_weight, init_linear, project, rope_cos_sin,
                                    seeded_normal_, tie_rows)
from sparsehi.runtime.model_config import ModelConfig


def column_blocks(y: torch.Tensor, widths: list[int]) -> list[torch.Tensor]:
    """``y [T, sum(widths)]`` cut into column blocks, each a plain slice of ``y`` (RoPE
    rotates some of them in place, which autograd refuses on ``split``'s views)."""
    out, c = [], 0
    for w in widths:
        out.append(y[:, c:c + w])
        c += w
    return out


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H = cfg.num_heads
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * cfg.v_head_dim, cfg.hidden_size, bias=False)


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, cfg.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(cfg.index_head_dim)
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)


class MLALayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg)
        self.indexer = Indexer(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def x_projection_weight(self) -> torch.Tensor:
        """``[q_lora_rank + kv_lora_rank + rope + Di + Hi, hidden]``: the four projections of
        the normed hidden state (query and KV down-projections, index key, index weights)
        stacked, one GEMM for all four."""
        a, ix = self.self_attn, self.indexer
        return fused_weight(self, "_x_proj", [a.q_a_proj.weight, a.kv_a_proj_with_mqa.weight, ix.wk.weight,
                                              ix.weights_proj.weight])

    def latent_projection_weight(self) -> torch.Tensor:
        """``[H * (nope + rope) + Hi * Di, q_lora_rank]``: the query up-projection and the
        index query projection of the normed query latent stacked."""
        return fused_weight(self, "_latent_proj", [self.self_attn.q_b_proj.weight, self.indexer.wq_b.weight])


class MLAModel(nn.Module):
    """Decoder-only MLA transformer with a lightning indexer per layer."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.family != "mla":
            raise ValueError(f"MLAModel needs an 'mla' config, got family={cfg.family!r}")
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MLALayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.batch_invariant = False
        """Row-invariant projections and norms (``use_batch_invariant_ops``)."""

    def use_batch_invariant_ops(self) -> None:
        """From now on compute every projection, per-head product and RMSNorm with
        row-invariant kernels (``sparsehi.runtime.layers``); the indexer's inputs
        (``dsa_index_inputs``) are one program per token either way."""
        self.batch_invariant = True

    @torch.no_grad()
    def random_init(self) -> None:
        """Fixed-seed init. With ``qk_tie`` the query path mirrors the latent key path
        (same down-projection, ``W_q_nope = W_UK`` per head) so a token's absorbed query
        scores ``|W_UK c|^2 > 0`` against earlier keys of the same token id; the indexer's
        key projection is tied to its head-0 query path the same way."""
        cfg = self.cfg
        gen = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(cfg.seed)
        seeded_normal_(self.embed_tokens.weight, gen, 1.0)
        H, dn, dr, dv, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        for layer in self.layers:
            a = layer.self_attn
            init_linear(a.q_a_proj, gen)
            init_linear(a.q_b_proj, gen)
            init_linear(a.kv_a_proj_with_mqa, gen)
            init_linear(a.kv_b_proj, gen)
            init_linear(a.o_proj, gen, cfg.mix_gain)
            ix = layer.indexer
            init_linear(ix.wq_b, gen)
            init_linear(ix.wk, gen)
            init_linear(ix.weights_proj, gen)
            if cfg.qk_tie > 0 and cfg.q_lora_rank == r:
                tie_rows(a.q_a_proj.weight, a.kv_a_proj_with_mqa.weight[:r], cfg.qk_tie, gen)
                wkv = a.kv_b_proj.weight.view(H, dn + dv, r)
                wkv[:, :dn].mul_(cfg.qk_gain)
                wq = a.q_b_proj.weight.view(H, dn + dr, cfg.q_lora_rank)
                wq[:, :dn].copy_(wkv[:, :dn])
                wq[:, dn:].mul_(cfg.qk_gain)
                wqi = ix.wq_b.weight.view(cfg.index_n_heads, cfg.index_head_dim, cfg.q_lora_rank)
                for h in range(1, cfg.index_n_heads):
                    tie_rows(wqi[h], wqi[0], cfg.qk_tie, gen)
                ix.wk.weight.copy_(wqi[0] @ a.q_a_proj.weight * cfg.q_lora_rank ** 0.5)
            init_linear(layer.mlp.gate_proj, gen)
            init_linear(layer.mlp.up_proj, gen)
            init_linear(layer.mlp.down_proj, gen, cfg.mix_gain)
        init_linear(self.lm_head, gen)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn,
                with_indexer: bool = True) -> torch.Tensor:
        """input_ids, positions ``[T] int64``; returns hidden ``[T, hidden]`` after the final norm.
        ``with_indexer=False`` leaves the indexer out (its projections, norm and RoPE): for an
        attention that reads no index inputs (dense decode), which then gets an empty
        ``extra``; the attention's inputs and the output are those of ``with_indexer=True``."""
        cfg, inv = self.cfg, self.batch_invariant
        grad = torch.is_grad_enabled()  # autograd refuses the out= GEMMs of the inference path
        T = input_ids.shape[0]
        H, dn, dr, dv, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        Hi, Di = cfg.index_n_heads, cfg.index_head_dim
        h = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, dr, cfg.rope_theta)
        w_scale = (Hi ** -0.5) * (Di ** -0.5)
        # the residual add and the next norm are one launch (x: the next block's normed input);
        # RoPE rotates the projections' rope columns in place, one launch each
        x = self.layers[0].input_layernorm(h, inv) if len(self.layers) else h
        for i, layer in enumerate(self.layers):
            a, ix = layer.self_attn, layer.indexer
            # the projections of x in one GEMM, and those of the query latent in another
            q_a, kv_a, ik, iw = column_blocks(project(x, layer.x_projection_weight(), None, inv),
                                              [cfg.q_lora_rank, r + dr, Di, Hi])
            cq = a.q_a_layernorm(q_a, inv)
            if with_indexer:
                q, iq = column_blocks(project(cq, layer.latent_projection_weight(), None, inv),
                                      [H * (dn + dr), Hi * Di])
            else:  # the query up-projection alone: the index queries are a quarter of that GEMM's columns
                q = project(cq, a.q_b_proj.weight, None, inv)
            q = q.view(T, H, dn + dr)
            q_nope, q_pe = q[..., :dn], rope_inplace(q[..., dn:], cos, sin)
            c_kv = a.kv_a_layernorm(kv_a[:, :r], inv)
            k_pe = rope_inplace(kv_a[:, None, r:], cos, sin)
            w_kv = a.kv_b_proj.weight.view(H, dn + dv, r)
            if inv or grad:  # per head: [H, T, dn] x [H, r, dn]
                q_lat = (row_invariant_matmul(q_nope.transpose(0, 1), w_kv[:, :dn].transpose(1, 2)).transpose(0, 1)
                         if inv else torch.einsum("thn,hnc->thc", q_nope, w_kv[:, :dn]))
                q_full = torch.cat([q_lat, q_pe], dim=-1)
            else:
                # per head [H, T, dn] x [H, dn, r], written straight into the latent columns of
                # the attention's query (its [T, H, r + dr] view, heads outermost in memory; the
                # kernels read q by its strides), and RoPE's columns after them: no cat
                q_heads = torch.empty(H, T, r + dr, dtype=q.dtype, device=q.device)
                torch.bmm(q_nope.transpose(0, 1), w_kv[:, :dn], out=q_heads[..., :r])
                q_heads[..., r:].copy_(q_pe.transpose(0, 1))
                q_full = q_heads.transpose(0, 1)
            kv = torch.cat([c_kv[:, None, :], k_pe], dim=-1)
            extra = {}
            if with_indexer:  # RoPE on the queries, the key's LayerNorm and RoPE, the weights' scale: one launch
                iq = iq.view(T, Hi, Di)
                ik, iw = dsa_index_inputs(iq, ik, iw, ix.k_norm.weight, ix.k_norm.bias, ix.k_norm.eps, cos, sin,
                                          w_scale)
                extra = {"index_q": iq, "index_k": ik, "index_w": iw}
            o_lat = attn(i, q_full, kv, None, extra)
            if inv:  # per head: [H, T, r] x [H, dv, r]
                o = row_invariant_matmul(o_lat.to(h.dtype).transpose(0, 1), w_kv[:, dn:]).transpose(0, 1)
            elif grad:
                o = torch.einsum("thc,hvc->thv", o_lat.to(h.dtype), w_kv[:, dn:])
            else:  # per head [H, T, r] x [H, r, dv] into o's [T, H, dv] (o_proj reads it as [T, H * dv])
                o = torch.empty(T, H, dv, dtype=h.dtype, device=h.device)
                torch.bmm(o_lat.to(h.dtype).transpose(0, 1), w_kv[:, dn:].transpose(1, 2), out=o.transpose(0, 1))
            post = layer.post_attention_layernorm
            h, x = add_rms_norm(h, project(o.reshape(T, H * dv), a.o_proj.weight, None, inv), post.weight.to(h.dtype),
                                post.eps)
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            h, x = add_rms_norm(h, layer.mlp(x, inv), nxt.weight.to(h.dtype), nxt.eps)
        return x if len(self.layers) else self.norm(h, inv)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return project(hidden, self.lm_head.weight, None, self.batch_invariant).float()
