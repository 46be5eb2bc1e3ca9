"""Fused RoPE and SwiGLU kernels against their torch references (Triton interpreted on
CPU, native on GPU)."""
from __future__ import annotations

import pytest
import torch

from sparsehi.kernels.rope import rope_inplace_triton, rope_reference
from sparsehi.kernels.silu_mul import silu_mul_reference, silu_mul_triton
from sparsehi.runtime.layers import rope_cos_sin

DEVS = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_per_program", [None, 1, 4])
def test_rope_inplace_matches_reference_on_a_strided_view(device, dtype, rows_per_program):
    g = torch.Generator().manual_seed(0)
    T, Hq, Hkv, D = 5, 6, 2, 32
    qkv = torch.randn(T, Hq + 2 * Hkv, D, generator=g).to(device, dtype)
    pos = torch.tensor([0, 3, 17, 100, 4000], device=device)
    cos, sin = rope_cos_sin(pos, D, 10000.0)
    want = rope_reference(qkv[:, : Hq + Hkv], cos, sin)
    v_before = qkv[:, Hq + Hkv:].clone()
    # a view: rows strided by Hq + 2 Hkv heads; 4 rows a program: half a token's heads, None
    # (under the interpreter): every token in one program
    out = rope_inplace_triton(qkv[:, : Hq + Hkv], cos, sin, rows_per_program)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    torch.testing.assert_close(qkv[:, : Hq + Hkv], want, atol=tol, rtol=tol)  # really in place
    assert torch.equal(qkv[:, Hq + Hkv:], v_before)  # v untouched
    with pytest.raises(ValueError, match="cos/sin must be"):
        rope_inplace_triton(qkv, cos[:, :8], sin[:, :8])
    with pytest.raises(ValueError, match="rows_per_program"):
        rope_inplace_triton(qkv, cos, sin, 3)


@pytest.mark.parametrize("device", DEVS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens_per_program", [None, 1, 2])
def test_silu_mul_matches_reference(device, dtype, tokens_per_program):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 2 * 1500, generator=g) * 4).to(device, dtype)  # not a multiple of the block
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    # 2 tokens a program: the last one half empty
    torch.testing.assert_close(silu_mul_triton(x, tokens_per_program), silu_mul_reference(x), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="gate_up must be"):
        silu_mul_triton(x[:, :-1])
    with pytest.raises(ValueError, match="tokens_per_program"):
        silu_mul_triton(x, 6)


@pytest.mark.parametrize("device", DEVS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens_per_program", [None, 1, 2])
def test_add_rms_norm_matches_reference(device, dtype, tokens_per_program):
    from sparsehi.kernels.add_rms_norm import add_rms_norm_reference, add_rms_norm_triton

    g = torch.Generator().manual_seed(2)
    r = torch.randn(3, 200, generator=g).to(device, dtype)
    d = torch.randn(3, 200, generator=g).to(device, dtype)
    w = (torch.rand(200, generator=g) + 0.5).to(device, dtype)
    h_ref, n_ref = add_rms_norm_reference(r, d, w, 1e-6)
    h, n = add_rms_norm_triton(r, d, w, 1e-6, tokens_per_program)  # 2 a program: the last one half empty
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: one rounding step (the interpreter truncates)
    torch.testing.assert_close(h, h_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(n, n_ref, atol=tol, rtol=tol)
    # the reference is the model's own RMSNorm of the sum
    from sparsehi.runtime.layers import RMSNorm

    with pytest.raises(ValueError, match="tokens_per_program"):
        add_rms_norm_triton(r, d, w, 1e-6, 0)
    norm = RMSNorm(200, 1e-6).to(device, dtype)
    norm.weight.data.copy_(w)
    if device == "cpu":
        torch.testing.assert_close(n_ref, norm(h_ref), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device", DEVS)
@pytest.mark.parametrize("two", [True, False])
def test_store_kv_matches_index_copy(device, two):
    from sparsehi.kernels.store_kv import store_kv_reference, store_kv_triton

    g = torch.Generator().manual_seed(3)
    H, D = (2, 8) if two else (1, 12)
    caches = tuple(torch.zeros(20, H, D, device=device) for _ in range(2 if two else 1))
    vals = tuple(torch.randn(4, H, D, generator=g).to(device) for _ in caches)
    loc = torch.tensor([3, -1, 7, 19], device=device)  # a padding row (-1) writes nothing
    want = tuple(c.clone() for c in caches)
    store_kv_reference(want, loc, vals)
    store_kv_triton(caches, loc, tuple(v.to(torch.bfloat16) for v in vals))  # cast to the cache dtype
    for c, w in zip(caches, want):
        torch.testing.assert_close(c, w, atol=1e-2, rtol=1e-2)
    assert (caches[0][[0, 1, 2, 4]] == 0).all()
    with pytest.raises(ValueError, match="must match"):
        store_kv_triton(caches, loc, tuple(v[:2] for v in vals))
