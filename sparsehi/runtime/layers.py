"""Small building blocks shared by the two model families: RMSNorm, RoPE, SwiGLU MLP,
projections, the per-layer attention callback type, and seeded init helpers.

``batch_invariant=True`` (a model's ``use_batch_invariant_ops``) computes projections and
norms with kernels whose rows do not depend on how many rows are computed together
(``sparsehi/kernels/row_invariant_matmul.py``, ``add_rms_norm``): a token's KV is then
bitwise the same in a prefill of the whole prompt and in one after a reused prefix."""
from __future__ import annotations

import functools
import math
from typing import Any, Optional, Protocol

import torch
from torch import nn
import torch.nn.functional as F

from sparsehi.kernels.add_rms_norm import add_rms_norm
from sparsehi.kernels.row_invariant_matmul import row_invariant_linear
from sparsehi.kernels.silu_mul import silu_mul


class AttentionFn(Protocol):
    """What a model calls for attention in each layer; the runner implements it per mode.

    GQA: ``q [T, Hq, D]``, ``k``/``v [T, Hkv, D]`` (post-RoPE) -> ``o [T, Hq, D]``.
    MLA: ``q [T, H, kv_lora_rank + rope]`` (weight-absorbed), ``k`` = the latent cache
    entry ``[T, 1, kv_lora_rank + rope]``, ``v`` None -> ``o [T, H, kv_lora_rank]``.
    ``extra`` carries algorithm inputs (MLA: ``index_q [T, Hi, Di]``, ``index_k [T, Di]``,
    ``index_w [T, Hi]``; empty when the mode reads none, ``RuntimeMode.reads_index_inputs``).
    """

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor],
                 extra: dict[str, Any]) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        if batch_invariant:  # the fused add + norm kernel, one program per row
            return add_rms_norm(x, torch.zeros_like(x), self.weight.to(x.dtype), self.eps)[1]
        if x.is_cuda:  # one fused kernel (float32 inside) instead of ~7 launches per norm
            return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def llama3_inv_freq(inv: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int) -> torch.Tensor:
    """Llama-3.1 ``rope_scaling`` (``rope_type: llama3``): long wavelengths slowed by
    ``factor``, short ones kept, a smooth blend in between."""
    low_wl = original_max_position_embeddings / low_freq_factor
    high_wl = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wl, inv / factor, inv)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wl) & (wavelen <= low_wl)
    return torch.where(medium, blended, scaled)


@functools.lru_cache(maxsize=64)
def _inv_freq(dim: int, theta: float, scaling: Optional[tuple[float, float, float, int]],
              device: torch.device) -> torch.Tensor:
    """``[dim / 2] float32`` RoPE frequencies, built once per shape and device: a decode
    step then spends no launches on them (the first call, outside capture, builds them)."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    if scaling is not None:
        inv = llama3_inv_freq(inv, *scaling)
    return inv


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float,
                 scaling: Optional[tuple[float, float, float, int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[T, dim]`` float32 for the rotate-half (HF Llama) RoPE convention;
    ``scaling`` = llama3 (factor, low_freq_factor, high_freq_factor, original_max_pos)."""
    inv = _inv_freq(dim, float(theta), tuple(scaling) if scaling is not None else None, positions.device)
    ang = positions.to(torch.float32)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def fused_weight(owner: nn.Module, cache_attr: str, weights: list[torch.Tensor]) -> torch.Tensor:
    """The ``weights`` (same trailing shape and dtype) stacked into one matrix, so one GEMM
    launch does the work of several. The first call stacks them and makes each weight a view
    of its rows (``.data``), so the stacked matrix is their only copy and an in-place write
    to a weight (loading a checkpoint) lands in it; ``owner.<cache_attr>`` keeps ``(matrix,
    the weights' addresses)``. A weight that is no longer such a view (a new tensor, or one
    moved or recast by ``Module.to``) makes the next call stack them again. While a CUDA
    graph is being captured nothing is rebound: a stacking recorded there would fill its
    matrix only at replay, so it is returned without being kept (the decode runs eagerly
    before capture). The state dict's tensors of a group then share one storage: clone them
    before ``safetensors``' ``save_file``, which refuses shared memory."""
    hit = getattr(owner, cache_attr, None)
    # a weight still a view of its rows has its row's address: the stacked matrix holds that
    # memory, so a new, moved or recast tensor cannot have it
    if hit is not None and hit[1] == tuple(w.data_ptr() for w in weights):
        return hit[0]
    fused = torch.cat([w.detach() for w in weights])
    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        return fused
    row = 0
    for w in weights:
        w.data = fused[row:row + w.shape[0]]
        row += w.shape[0]
    setattr(owner, cache_attr, (fused, tuple(w.data_ptr() for w in weights)))
    return fused


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        # gate and up in one GEMM, then one fused silu * up
        w = fused_weight(self, "_gate_up", [self.gate_proj.weight, self.up_proj.weight])
        return project(silu_mul(project(x, w, None, batch_invariant)), self.down_proj.weight, None, batch_invariant)


def project(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
            batch_invariant: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; with ``batch_invariant`` each row's result depends on
    that row alone (``row_invariant_linear``)."""
    if batch_invariant:
        return row_invariant_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def seeded_normal_(t: torch.Tensor, gen: torch.Generator, std: float) -> torch.Tensor:
    """Fill ``t`` from ``gen`` (a generator on ``t``'s device: big models init on the GPU)
    scaled by ``std``."""
    with torch.no_grad():
        t.copy_(torch.randn(t.shape, generator=gen, device=gen.device, dtype=torch.float32).mul_(std))
    return t


def init_linear(lin: nn.Linear, gen: torch.Generator, gain: float = 1.0) -> None:
    seeded_normal_(lin.weight, gen, gain / math.sqrt(lin.in_features))
    if lin.bias is not None:
        with torch.no_grad():
            lin.bias.zero_()


def tie_rows(dst: torch.Tensor, src: torch.Tensor, tie: float, gen: torch.Generator) -> None:
    """dst = tie * src + sqrt(1 - tie^2) * fresh noise of src's scale (keeps the norm)."""
    with torch.no_grad():
        noise = torch.randn(src.shape, generator=gen, device=gen.device, dtype=torch.float32)
        noise = noise * src.float().std()
        dst.copy_(tie * src.float() + math.sqrt(max(0.0, 1 - tie * tie)) * noise)
