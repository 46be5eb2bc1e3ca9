"""dsa_index_inputs: the DSA indexer's per-token inputs (query RoPE in place, the key's
LayerNorm and RoPE, the weights' scale) in one launch, against the model's own torch steps,
under the interpreter on CPU and on the GPU (inside a CUDA graph too)."""
from __future__ import annotations

import pytest
import torch

from sparsehi.kernels.dsa_index_inputs import (dsa_index_inputs, dsa_index_inputs_reference,
                                               dsa_index_inputs_triton)
from sparsehi.runtime.layers import rope_cos_sin

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _inputs(T, Hi, Di, dr, dtype, device="cpu", seed=0):
    """The three projections as column blocks of one wider GEMM output (strided rows), a
    LayerNorm's weight and bias, and cos/sin of positions far apart."""
    g = torch.Generator().manual_seed(seed)
    wide = (torch.randn(T, Hi * Di + Di + Hi + 7, generator=g) * 2).to(dtype).to(device)
    iq = wide[:, :Hi * Di].view(T, Hi, Di)
    ik = wide[:, Hi * Di:Hi * Di + Di]
    iw = wide[:, Hi * Di + Di:Hi * Di + Di + Hi]
    weight = (1 + 0.3 * torch.randn(Di, generator=g)).to(dtype).to(device)
    bias = (0.1 * torch.randn(Di, generator=g)).to(dtype).to(device)
    cos, sin = rope_cos_sin(torch.arange(T, device=device) * 997 + 5, dr, 10000.0)
    return wide, iq, ik, iw, weight, bias, cos, sin


def _compare(fn, T, Hi, Di, dr, dtype, device):
    a = _inputs(T, Hi, Di, dr, dtype, device)
    b = [x.clone() for x in a[:1]] + list(a[1:])
    wide_b = b[0]
    b[1] = wide_b[:, :Hi * Di].view(T, Hi, Di)
    b[2] = wide_b[:, Hi * Di:Hi * Di + Di]
    b[3] = wide_b[:, Hi * Di + Di:Hi * Di + Di + Hi]
    k, w = fn(*a[1:6], 1e-6, a[6], a[7], 0.0125)
    rk, rw = dsa_index_inputs_reference(*b[1:6], 1e-6, b[6], b[7], 0.0125)
    return a, b, k, w, rk, rw


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,Hi,Di,dr", [(5, 4, 32, 16), (3, 6, 40, 8)])
def test_kernel_computes_the_models_steps(dtype, T, Hi, Di, dr):
    a, b, k, w, rk, rw = _compare(dsa_index_inputs_triton, T, Hi, Di, dr, dtype, "cpu")
    assert torch.equal(a[0], b[0])                     # the queries rotated in place, bit for bit
    assert torch.equal(w, rw) and w.dtype == torch.float32
    assert k.dtype == dtype
    # the LayerNorm's float32 sums (torch: Welford) may round differently in their last bits:
    # bf16 keys at most one step apart, float32 keys a few ulps
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -18)
    assert torch.all((k.float() - rk.float()).abs() <= ulp * rk.float().abs().clamp_min(1.0))
    if dtype == torch.bfloat16:
        assert (k == rk).float().mean() > 0.95


def test_a_rope_width_the_kernel_cannot_block_takes_the_reference(monkeypatch):
    monkeypatch.setenv("SPARSEHI_FORCE_TRITON", "1")  # the dispatch's Triton path on CPU (interpreted)
    for dr in (12, 16):  # halves of 6 (not a power of two) and of 8
        a = _inputs(4, 3, 32, dr, torch.bfloat16)
        b = _inputs(4, 3, 32, dr, torch.bfloat16)
        k, w = dsa_index_inputs(*a[1:6], 1e-6, a[6], a[7], 0.5)
        rk, rw = dsa_index_inputs_reference(*b[1:6], 1e-6, b[6], b[7], 0.5)
        assert torch.equal(a[0], b[0]) and torch.equal(w, rw)
        assert torch.all((k.float() - rk.float()).abs() <= 2.0 ** -7 * rk.float().abs().clamp_min(1.0))
    with pytest.raises(ValueError, match="rope_dim"):  # the kernel itself refuses it, by name
        a = _inputs(4, 3, 32, 12, torch.bfloat16)
        dsa_index_inputs_triton(*a[1:6], 1e-6, a[6], a[7], 0.5)


def test_bad_inputs_name_the_parameter():
    _, iq, ik, iw, weight, bias, cos, sin = _inputs(4, 2, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="index_k"):
        dsa_index_inputs(iq, ik[:, :8], iw, weight, bias, 1e-6, cos, sin, 1.0)
    with pytest.raises(ValueError, match="weight"):
        dsa_index_inputs(iq, ik, iw, weight[:8], bias, 1e-6, cos, sin, 1.0)
    with pytest.raises(ValueError, match="cos/sin"):
        dsa_index_inputs(iq, ik, iw, weight, bias, 1e-6, cos.double(), sin, 1.0)
    with pytest.raises(ValueError, match="index_q"):
        dsa_index_inputs(iq.int(), ik, iw, weight, bias, 1e-6, cos, sin, 1.0)


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 39, 200])
def test_gpu_kernel_computes_the_models_steps(T):
    a, b, k, w, rk, rw = _compare(dsa_index_inputs, T, 64, 128, 64, torch.bfloat16, "cuda")
    torch.cuda.synchronize()
    q, rq = a[1].float(), b[1].float()
    assert torch.all((q - rq).abs() <= 2.0 ** -7 * rq.abs().clamp_min(1.0))  # fused products may round once
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=0)
    assert torch.all((k.float() - rk.float()).abs() <= 2.0 ** -7 * rk.float().abs().clamp_min(1.0))


@GPU
@pytest.mark.gpu
def test_gpu_kernel_in_a_cuda_graph():
    wide, iq, ik, iw, weight, bias, cos, sin = _inputs(39, 64, 128, 64, torch.bfloat16, "cuda")
    src = wide.clone()
    dsa_index_inputs(iq, ik, iw, weight, bias, 1e-6, cos, sin, 0.0125)  # compile outside the capture
    wide.copy_(src)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        k, w = dsa_index_inputs(iq, ik, iw, weight, bias, 1e-6, cos, sin, 0.0125)
    wide.copy_(src)
    g.replay()
    ref = src.clone()
    rk, rw = dsa_index_inputs_reference(ref[:, :64 * 128].view(39, 64, 128), ref[:, 8192:8320], ref[:, 8320:8384],
                                        weight, bias, 1e-6, cos, sin, 0.0125)
    torch.cuda.synchronize()
    assert torch.all((k.float() - rk.float()).abs() <= 2.0 ** -7 * rk.float().abs().clamp_min(1.0))
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=0)
