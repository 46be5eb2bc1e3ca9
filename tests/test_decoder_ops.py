"""Fused RoPE and SwiGLU kernels against their torch references (Triton interpreted on
CPU, native on GPU)."""
from __future__ import annotations

import pytest
import torch

from sparsehi.kernels.decoder_ops import (rope_inplace_triton, rope_reference, silu_mul_reference,
                                          silu_mul_triton)
from sparsehi.runtime.layers import rope_cos_sin

DEVS = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_inplace_matches_reference_on_a_strided_view(device, dtype):
    g = torch.Generator().manual_seed(0)
    T, Hq, Hkv, D = 5, 6, 2, 32
    qkv = torch.randn(T, Hq + 2 * Hkv, D, generator=g).to(device, dtype)
    pos = torch.tensor([0, 3, 17, 100, 4000], device=device)
    cos, sin = rope_cos_sin(pos, D, 10000.0)
    want = rope_reference(qkv[:, : Hq + Hkv], cos, sin)
    v_before = qkv[:, Hq + Hkv:].clone()
    out = rope_inplace_triton(qkv[:, : Hq + Hkv], cos, sin)  # a view: rows strided by Hq + 2 Hkv heads
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    torch.testing.assert_close(qkv[:, : Hq + Hkv], want, atol=tol, rtol=tol)  # really in place
    assert torch.equal(qkv[:, Hq + Hkv:], v_before)  # v untouched
    with pytest.raises(ValueError, match="cos/sin must be"):
        rope_inplace_triton(qkv, cos[:, :8], sin[:, :8])


@pytest.mark.parametrize("device", DEVS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_reference(device, dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 2 * 1500, generator=g) * 4).to(device, dtype)  # not a multiple of the block
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(silu_mul_triton(x), silu_mul_reference(x), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="gate_up must be"):
        silu_mul_triton(x[:, :-1])
