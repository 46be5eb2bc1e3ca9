"""The DSA indexer's per-token inputs in one launch, from the model's projections.

For each token ``t``: RoPE (rotate-half) on the first ``rope_dim`` dims of every index query
head, in place; the index key's LayerNorm (weight and bias), rounded to the key's dtype, then
RoPE on its first ``rope_dim`` dims; and the head weights times ``w_scale`` in float32. In
torch that is six launches a layer (the key's copy out of the projection's columns, the
LayerNorm, two RoPE calls, the weights' cast and product); here one program per token.

Arguments: ``index_q [T, Hi, Di]`` (rotated in place), ``index_k [T, Di]``, ``index_w [T,
Hi]`` (any row strides, last dim contiguous), the LayerNorm's ``weight`` / ``bias [Di]`` and
``eps``, ``cos`` / ``sin [T, rope_dim]`` float32, ``w_scale``. Returns ``(key [T, Di]`` in
``index_k``'s dtype, ``weights [T, Hi]`` float32). Values are computed in float32 and
rounded once per step as the reference rounds (bf16 by hand: the CPU interpreter truncates
there); the LayerNorm's sums may differ from torch's in the last float32 bit.

Entry points: ``dsa_index_inputs`` (dispatch), ``dsa_index_inputs_triton``,
``dsa_index_inputs_reference``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hicache.triton_support import dispatch
from sparsehi.kernels.rope import rope_inplace_reference
from sparsehi.kernels.store_rounding import as_stored

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(index_q, index_k, index_w, weight, bias, cos, sin) -> None:
    for name, t, dims in (("index_q", index_q, 3), ("index_k", index_k, 2), ("index_w", index_w, 2)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims or t.dtype not in _DTYPES or t.stride(-1) != 1:
            raise ValueError(f"{name} must be a {dims}-D bf16/fp16/fp32 tensor with a contiguous last dim, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    T, Hi, Di = index_q.shape
    if index_k.shape != (T, Di) or index_w.shape != (T, Hi):
        raise ValueError(f"index_k must be [T={T}, Di={Di}] and index_w [T, Hi={Hi}], got {tuple(index_k.shape)} "
                         f"and {tuple(index_w.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if not isinstance(t, torch.Tensor) or t.shape != (Di,):
            raise ValueError(f"{name} must be the LayerNorm's [{Di}] tensor")
    if cos.dim() != 2 or cos.shape[0] != T or cos.shape[1] % 2 or not 0 < cos.shape[1] <= Di \
            or sin.shape != cos.shape or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"cos/sin must be float32 [T={T}, rope_dim] with an even rope_dim <= {Di}, got "
                         f"{tuple(cos.shape)} {cos.dtype} and {tuple(sin.shape)} {sin.dtype}")


def dsa_index_inputs_reference(index_q: torch.Tensor, index_k: torch.Tensor, index_w: torch.Tensor,
                               weight: torch.Tensor, bias: torch.Tensor, eps: float, cos: torch.Tensor,
                               sin: torch.Tensor, w_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference (the model's own steps): see the module docstring."""
    _check(index_q, index_k, index_w, weight, bias, cos, sin)
    dr = cos.shape[1]
    rope_inplace_reference(index_q[..., :dr], cos, sin)
    key = torch.nn.functional.layer_norm(index_k, (index_k.shape[1],), weight.to(index_k.dtype),
                                         bias.to(index_k.dtype), eps)
    rope_inplace_reference(key[:, None, :dr], cos, sin)
    return key, index_w.float() * w_scale


@triton.jit
def _dsa_index_inputs_kernel(q_ptr, k_ptr, w_ptr, nw_ptr, nb_ptr, cos_ptr, sin_ptr, ko_ptr, wo_ptr,
                             HI, DI, s_qt, s_qh, s_kt, s_wt, s_ct, s_ko, s_wo, eps, w_scale,
                             HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_REST: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF)
    c = tl.load(cos_ptr + t * s_ct + d)
    s = tl.load(sin_ptr + t * s_ct + d)
    # the queries' rope halves, every head
    h = tl.arange(0, BLOCK_H)
    mq = (h < HI)[:, None] & (d < HALF)[None, :]
    qb = q_ptr + t * s_qt + h[:, None] * s_qh + d[None, :]
    q1 = tl.load(qb, mask=mq, other=0.0).to(tl.float32)
    q2 = tl.load(qb + HALF, mask=mq, other=0.0).to(tl.float32)
    tl.store(qb, as_stored(q1 * c[None, :] - q2 * s[None, :], q_ptr.dtype.element_ty).to(q_ptr.dtype.element_ty),
             mask=mq)
    tl.store(qb + HALF, as_stored(q2 * c[None, :] + q1 * s[None, :], q_ptr.dtype.element_ty)
             .to(q_ptr.dtype.element_ty), mask=mq)
    # the key in three parts: the rope halves and the rest, LayerNorm over all of them
    r = 2 * HALF + tl.arange(0, BLOCK_REST)
    mr = r < DI
    kb = k_ptr + t * s_kt
    k1 = tl.load(kb + d).to(tl.float32)
    k2 = tl.load(kb + HALF + d).to(tl.float32)
    k3 = tl.load(kb + r, mask=mr, other=0.0).to(tl.float32)
    mean = (tl.sum(k1, 0) + tl.sum(k2, 0) + tl.sum(k3, 0)) / DI
    x1, x2, x3 = k1 - mean, k2 - mean, tl.where(mr, k3 - mean, 0.0)
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0) + tl.sum(x3 * x3, 0)) / DI + eps)
    kt = ko_ptr.dtype.element_ty
    y1 = as_stored(x1 * rstd * tl.load(nw_ptr + d).to(tl.float32) + tl.load(nb_ptr + d).to(tl.float32), kt)
    y2 = as_stored(x2 * rstd * tl.load(nw_ptr + HALF + d).to(tl.float32)
                   + tl.load(nb_ptr + HALF + d).to(tl.float32), kt)
    y3 = (x3 * rstd * tl.load(nw_ptr + r, mask=mr, other=0.0).to(tl.float32)
          + tl.load(nb_ptr + r, mask=mr, other=0.0).to(tl.float32))
    ob = ko_ptr + t * s_ko
    tl.store(ob + d, as_stored(y1 * c - y2 * s, kt).to(kt))
    tl.store(ob + HALF + d, as_stored(y2 * c + y1 * s, kt).to(kt))
    tl.store(ob + r, as_stored(y3, kt).to(kt), mask=mr)
    # the head weights
    mh = h < HI
    w = tl.load(w_ptr + t * s_wt + h, mask=mh, other=0.0).to(tl.float32)
    tl.store(wo_ptr + t * s_wo + h, w * w_scale, mask=mh)


def dsa_index_inputs_triton(index_q: torch.Tensor, index_k: torch.Tensor, index_w: torch.Tensor,
                            weight: torch.Tensor, bias: torch.Tensor, eps: float, cos: torch.Tensor,
                            sin: torch.Tensor, w_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher: one program per token; no host sync (CUDA-graph safe)."""
    _check(index_q, index_k, index_w, weight, bias, cos, sin)
    T, Hi, Di = index_q.shape
    half = cos.shape[1] // 2
    if half & (half - 1):
        raise ValueError(f"rope_dim must be twice a power of two for the Triton kernel, got {2 * half}")
    key = torch.empty((T, Di), dtype=index_k.dtype, device=index_k.device)
    wts = torch.empty((T, Hi), dtype=torch.float32, device=index_w.device)
    if T == 0:
        return key, wts
    if cos.stride(1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    weight, bias = weight.to(index_k.dtype), bias.to(index_k.dtype)  # as the reference's LayerNorm takes them
    _dsa_index_inputs_kernel[(T,)](
        index_q, index_k, index_w, weight, bias, cos, sin, key, wts,
        Hi, Di, index_q.stride(0), index_q.stride(1), index_k.stride(0), index_w.stride(0), cos.stride(0),
        key.stride(0), wts.stride(0), float(eps), float(w_scale),
        HALF=half, BLOCK_H=triton.next_power_of_2(Hi), BLOCK_REST=triton.next_power_of_2(max(1, Di - 2 * half)),
        num_warps=4,
    )
    return key, wts


def dsa_index_inputs(index_q: torch.Tensor, index_k: torch.Tensor, index_w: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                     w_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's inputs (module docstring): Triton on CUDA where ``rope_dim`` is twice a
    power of two (the kernel's halves are whole blocks), the torch reference elsewhere."""
    half = cos.shape[-1] // 2 if isinstance(cos, torch.Tensor) and cos.dim() == 2 else 0
    impl = dispatch("dsa_index_inputs", index_q, dsa_index_inputs_triton, dsa_index_inputs_reference,
                    triton_ok=half > 0 and half & (half - 1) == 0)
    return impl(index_q, index_k, index_w, weight, bias, eps, cos, sin, w_scale)
