"""The one-launch FP8 latent quantiser (``mla_fp8_quantize``) writes the bytes of the torch
reference ``quantize_mla_latents``: under the interpreter on CPU and on the GPU, for bf16,
fp16 and fp32 rows, scales on both sides of a power of two, all-zero tiles, rope values
that round on their way to bf16, and the stored-KV path of the FP8 latent cache."""
from __future__ import annotations

import pytest
import torch

from hicache.kv_spec import KVCacheSpec
from sparsehi.kernels.mla_fp8_latents import FP8_TILE, dequantize_mla_latents, quantize_mla_latents
from sparsehi.kernels.mla_fp8_quantize import (mla_fp8_quantize, mla_fp8_quantize_reference,
                                               mla_fp8_quantize_triton)
from sparsehi.runtime.kv_cache_format import stored_kv

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rows(n, dl, dr, dtype, seed=0, device="cpu"):
    """``[n, dl + dr]`` rows whose tiles span magnitudes 1e-6 .. 1e4, with tiles whose amax is
    exactly 448 x a power of two (the scale's edge), one a hair above it, an all-zero tile and
    rope values that are not bf16 (they round on the way)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(n, dl + dr, generator=g, dtype=torch.float64)
    mag = 10.0 ** (torch.rand(n, dl // FP8_TILE, generator=g, dtype=torch.float64) * 10 - 6)
    kv[:, :dl] *= mag.repeat_interleave(FP8_TILE, dim=1)
    kv[0, :FP8_TILE] = 0.0
    if n > 2:
        kv[1, 5] = 448.0 * 2.0 ** -3                         # amax / 448 exactly 2^-3
        kv[1, 6:FP8_TILE] = kv[1, 6:FP8_TILE].clamp(-1, 1) * 0.01
        kv[2, 7] = 448.0 * 2.0 ** 2 * (1 + 2.0 ** -7)         # just above 2^2 x 448 (bf16 keeps it)
        kv[2, 8:FP8_TILE] = kv[2, 8:FP8_TILE].clamp(-1, 1)
        kv[2, dl:] = 1.0 + 2.0 ** -8 + torch.arange(dr, dtype=torch.float64) * 2.0 ** -9  # bf16 ties and halves
    return kv.to(dtype).to(device)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype == torch.uint8
    bad = (a != b).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} bytes differ, first at {bad[:4].tolist()}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dl,dr", [(512, 64), (256, 64)])
def test_kernel_writes_the_reference_bytes(dtype, dl, dr):
    kv = _rows(9, dl, dr, dtype, seed=dl + dr)
    got = mla_fp8_quantize_triton(kv, dl)
    _same_bytes(got, quantize_mla_latents(kv, dl))
    # and the rows mean what the layout says: dequantised, within FP8's step of the input
    back = dequantize_mla_latents(got, dl).float()
    x = kv.float()
    assert torch.equal(back[:, dl:], x[:, dl:].to(torch.bfloat16).float())
    scale = got[:, dl:dl + 4 * (dl // FP8_TILE)].contiguous().view(torch.float32).repeat_interleave(FP8_TILE, 1)
    assert torch.all((back[:, :dl] - x[:, :dl]).abs() <= scale * 16 + 1e-30)


def test_pool_shaped_strided_and_empty_inputs():
    kv = _rows(6, 512, 64, torch.bfloat16, seed=3)
    pool = kv[:, None, :]                                    # [N, 1, 576], as the model hands it over
    got = mla_fp8_quantize_triton(pool, 512)
    assert got.shape == (6, 1, 656)
    _same_bytes(got, quantize_mla_latents(pool, 512))
    wide = torch.zeros(6, 700, dtype=torch.bfloat16)
    wide[:, 10:586] = kv
    _same_bytes(mla_fp8_quantize_triton(wide[:, 10:586], 512), quantize_mla_latents(kv, 512))
    assert mla_fp8_quantize_triton(torch.zeros(0, 576, dtype=torch.bfloat16)).shape == (0, 656)


def test_bad_inputs_name_the_parameter():
    kv = torch.zeros(2, 192, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kv must be"):
        mla_fp8_quantize(kv.int(), 128)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla_fp8_quantize(kv, 100)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla_fp8_quantize(kv, 192)
    with pytest.raises(ValueError, match="rope_dim"):
        mla_fp8_quantize(kv[:, :191], 128)
    with pytest.raises(ValueError, match="kv must be"):
        mla_fp8_quantize_reference("rows", 128)


def test_stored_kv_of_an_fp8_latent_cache_is_the_reference_rows():
    spec = KVCacheSpec.mla_fp8(num_layers=1, kv_lora_rank=512, rope_dim=64, page_size=1)
    kv = _rows(5, 512, 64, torch.bfloat16, seed=4)[:, None, :]
    _same_bytes(stored_kv(spec, kv), quantize_mla_latents(kv, 512))


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,dl,dr", [(1, 512, 64), (77, 512, 64), (4096, 512, 64), (33, 128, 64)])
def test_gpu_kernel_writes_the_reference_bytes(dtype, n, dl, dr):
    kv = _rows(n, dl, dr, dtype, seed=n, device="cuda")
    got = mla_fp8_quantize(kv, dl)
    _same_bytes(got, quantize_mla_latents(kv, dl))


@GPU
@pytest.mark.gpu
def test_gpu_kernel_in_a_cuda_graph():
    kv = _rows(39, 512, 64, torch.bfloat16, seed=7, device="cuda")[:, None, :].contiguous()
    mla_fp8_quantize(kv)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = mla_fp8_quantize(kv)
    kv.copy_(_rows(39, 512, 64, torch.bfloat16, seed=8, device="cuda")[:, None, :])
    g.replay()
    torch.cuda.synchronize()
    _same_bytes(out, quantize_mla_latents(kv, 512))
