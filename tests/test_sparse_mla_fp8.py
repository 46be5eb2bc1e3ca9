"""FP8 MLA latent rows (DeepSeek-V3.2 / FlashMLA layout): the torch quantiser and
dequantiser, and the sparse MLA decode kernels reading the packed rows (the fused one under
the interpreter on CPU; on the GPU also the Hopper Gluon one) against the torch reference
over the dequantised rows."""
from __future__ import annotations

import logging
import math

import pytest
import torch

import hicache.triton_support as triton_support
from sparsehi.kernels.mla_fp8_latents import (
    FP8_TILE,
    MLA_FP8_BYTES_PER_TOKEN,
    MLA_FP8_ROPE_OFFSET,
    MLA_FP8_SCALE_OFFSET,
    MlaFp8Layout,
    dequantize_mla_latents,
    fp8_row_bytes,
    quantize_mla_latents,
)
from sparsehi.kernels.sparse_mla_decode import (
    MlaGluonConfig,
    MlaLaunchConfig,
    MlaTwoPassConfig,
    default_mla_fp8_config,
    sparse_mla_decode,
    sparse_mla_decode_reference,
    sparse_mla_decode_triton,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.float8_e4m3fn


def _latents(n, dl, dr, seed=0, device="cpu"):
    """``[n, dl + dr]`` bf16 rows whose 128-value tiles span magnitudes 1e-3 .. 1e3, so a
    tile read with another tile's scale is off by orders of magnitude."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(n, dl + dr, generator=g)
    tile_mag = 10.0 ** (torch.rand(n, dl // FP8_TILE, generator=g) * 6 - 3)
    kv[:, :dl] *= tile_mag.repeat_interleave(FP8_TILE, dim=1)
    return kv.to(device=device, dtype=torch.bfloat16)


def _tol(dtype):
    # the tolerances of the bf16 / fp16 sparse MLA tests (test_sparse_mla_decode)
    return dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=3e-3, rtol=3e-3)


# ----------------------------------------------------------------------------- layout
def test_layout_sizes_and_offsets():
    ds = MlaFp8Layout(512, 64)
    assert (ds.bytes_per_token, ds.scale_offset, ds.rope_offset, ds.num_tiles) == (656, 512, 528, 4)
    assert (MLA_FP8_BYTES_PER_TOKEN, MLA_FP8_SCALE_OFFSET, MLA_FP8_ROPE_OFFSET) == (656, 512, 528)
    assert fp8_row_bytes(128, 64) == 128 + 4 + 128
    assert fp8_row_bytes(384, 32) == 384 + 12 + 64
    for dl, dr in ((96, 64), (0, 64), (512, 63), (512, 0)):
        with pytest.raises(ValueError, match="kv_lora_rank" if dr in (64,) else "rope_dim"):
            MlaFp8Layout(dl, dr)


def test_quantize_bytes_follow_the_layout():
    kv = _latents(33, 512, 64, seed=1)
    kv[3, 128:256] = 0                                     # an all-zero tile
    packed = quantize_mla_latents(kv)
    assert packed.shape == (33, 656) and packed.dtype == torch.uint8
    # rope: the bf16 bits, untouched
    assert torch.equal(packed[:, 528:].contiguous().view(torch.bfloat16), kv[:, 512:])
    # scales at bytes 512..528: 2 ** ceil(log2(max(amax / 448, 1e-4))) per 128-value tile
    scales = packed[:, 512:528].contiguous().view(torch.float32)
    amax = kv[:, :512].float().view(33, 4, 128).abs().amax(-1)
    want = torch.tensor([[2.0 ** math.ceil(math.log2(max(a / 448.0, 1e-4))) for a in r] for r in amax.tolist()])
    assert torch.equal(scales, want)
    assert scales[3, 1] == 2.0 ** -13
    # latents: E4M3 values within +-448, the tile max in its upper octave (the scale is tight)
    vals = packed[:, :512].contiguous().view(E4M3).float().view(33, 4, 128)
    assert vals.abs().max() <= 448
    nonzero = amax > 448 * 1e-4
    assert torch.all(vals.abs().amax(-1)[nonzero] >= 224)
    assert torch.all(vals[3, 1] == 0)


def test_round_trip_error_bound_and_requantise_is_exact():
    kv = _latents(64, 256, 64, seed=2)
    packed = quantize_mla_latents(kv, kv_lora_rank=256)
    assert packed.shape == (64, 260 + 128 + 4)
    back = dequantize_mla_latents(packed, kv_lora_rank=256)
    assert back.shape == (64, 320) and back.dtype == torch.bfloat16
    assert torch.equal(back[:, 256:], kv[:, 256:])
    scale = packed[:, 256:264].contiguous().view(torch.float32).repeat_interleave(FP8_TILE, dim=1)
    x, y = kv[:, :256].float(), back[:, :256].float()
    # E4M3: half an ulp is 2^-4 relative for normals, 2^-10 * scale absolute for subnormals
    assert torch.all((y - x).abs() <= torch.maximum(x.abs() * 2.0 ** -4, scale * 2.0 ** -10))
    assert (y - x).abs().max() > 0                          # it is a lossy format
    # power-of-two scales: dequantised rows are exact in bf16, so they survive another round
    # trip unchanged (the bytes may differ: a tile max rounded down to 224 halves the scale)
    assert torch.equal(dequantize_mla_latents(quantize_mla_latents(back, kv_lora_rank=256), kv_lora_rank=256), back)


def test_pool_shapes_and_empty():
    kv = _latents(5, 128, 64, seed=3).view(5, 1, 192)
    packed = quantize_mla_latents(kv, kv_lora_rank=128)
    assert packed.shape == (5, 1, 260)
    back = dequantize_mla_latents(packed, kv_lora_rank=128)
    assert back.shape == (5, 1, 192) and torch.equal(back, dequantize_mla_latents(packed[:, 0], 128)[:, None])
    assert quantize_mla_latents(torch.zeros(0, 576, dtype=torch.bfloat16)).shape == (0, 656)
    assert dequantize_mla_latents(torch.zeros(0, 656, dtype=torch.uint8)).shape == (0, 576)


def test_quantiser_bad_inputs_name_the_parameter():
    kv = _latents(4, 128, 64)
    with pytest.raises(ValueError, match="kv must"):
        quantize_mla_latents(kv.int(), kv_lora_rank=128)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        quantize_mla_latents(kv, kv_lora_rank=64)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        quantize_mla_latents(kv, kv_lora_rank=192)
    with pytest.raises(ValueError, match="rope_dim"):
        quantize_mla_latents(kv[:, :191], kv_lora_rank=128)
    packed = quantize_mla_latents(kv, kv_lora_rank=128)
    with pytest.raises(ValueError, match="packed must"):
        dequantize_mla_latents(packed.float(), kv_lora_rank=128)
    with pytest.raises(ValueError, match="packed's last dim"):
        dequantize_mla_latents(packed[:, :-2], kv_lora_rank=128)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        dequantize_mla_latents(packed, kv_lora_rank=100)


# ----------------------------------------------------------------------------- kernel
def _case(B, H, Dl, Dr, K, N, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed + 100)
    q = (torch.randn(B, H, Dl + Dr, generator=g) * 0.05).to(DEV, dtype)
    packed = quantize_mla_latents(_latents(N, Dl, Dr, seed=seed, device=DEV).clamp(-4, 4), kv_lora_rank=Dl)
    idx = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(B)]).int().to(DEV)
    return q, packed, idx


def _reference(q, packed, idx, Dl, scale=0.2):
    # fp16 q: the bf16 rows in fp16 (exact here: power-of-two scales, values far inside its range)
    kv = dequantize_mla_latents(packed, Dl).to(q.dtype)
    return sparse_mla_decode_reference(q, kv, idx, kv_lora_rank=Dl, sm_scale=scale)


FUSED = [MlaLaunchConfig(block_h=16, block_n=16, num_warps=4, num_stages=1),
         MlaLaunchConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, num_splits=3, row_load=True),
         MlaLaunchConfig(block_h=32, block_n=32, num_warps=4, num_stages=1, num_splits=1)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", FUSED)
def test_fp8_kernel_matches_reference(dtype, cfg):
    Dl, Dr = 128, 64
    q, packed, idx = _case(3, 20, Dl, Dr, 40, 96, dtype)
    idx[0] = -1                      # a row with no valid index
    idx[1, ::3] = -1                 # padding scattered through the row
    out = sparse_mla_decode_triton(q, packed, idx, kv_lora_rank=Dl, sm_scale=0.2, config=cfg)
    ref = _reference(q, packed, idx, Dl)
    assert out.shape == (3, 20, Dl) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))
    assert torch.all(out[0] == 0)
    # the packed reference path is the same computation
    torch.testing.assert_close(sparse_mla_decode_reference(q, packed, idx, kv_lora_rank=Dl, sm_scale=0.2), ref)


@pytest.mark.parametrize("Dl", [256, 384])
def test_fp8_kernel_several_tiles_pool_view_and_split(Dl):
    # 2 and 3 scale tiles (3: the tile axis padded to 4); [N, 1, bytes] pool view; 2 splits
    Dr = 64
    q, packed, idx = _case(2, 16, Dl, Dr, 24, 48, seed=6)
    cfg = MlaLaunchConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, num_splits=2, row_load=Dl == 384)
    out = sparse_mla_decode_triton(q, packed[:, None], idx, kv_lora_rank=Dl, sm_scale=0.2, config=cfg)
    torch.testing.assert_close(out.float(), _reference(q, packed, idx, Dl).float(), **_tol(torch.bfloat16))


@pytest.mark.parametrize("row_load", [False, True])
def test_fp8_out_of_pool_and_padding_never_read(row_load):
    Dl, Dr = 128, 64
    q, packed, idx = _case(2, 16, Dl, Dr, 32, 64, seed=2)
    packed[0] = 0x7F                 # slot 0 all NaN bytes (E4M3 and fp32 NaN): padding must not read it
    idx[idx == 0] = 1
    idx[0, 5], idx[1, 17] = 10_000, -1
    idx[1, 20:] = -1
    cfg = MlaLaunchConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, num_splits=2, row_load=row_load)
    out = sparse_mla_decode_triton(q, packed, idx, kv_lora_rank=Dl, sm_scale=0.2, config=cfg)
    assert torch.isfinite(out).all()
    minus = idx.clone()
    minus[0, 5] = -1
    torch.testing.assert_close(out.float(), _reference(q, packed, minus, Dl).float(), **_tol(torch.bfloat16))


def test_fp8_scales_change_the_result():
    # the same bytes with one tile's scale doubled: the kernel must follow the scale bytes
    Dl, Dr = 128, 64
    q, packed, idx = _case(1, 16, Dl, Dr, 16, 32, seed=3)
    cfg = MlaLaunchConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
    out = sparse_mla_decode_triton(q, packed, idx, kv_lora_rank=Dl, sm_scale=0.2, config=cfg)
    bumped = packed.clone()
    bumped[:, Dl:Dl + 4] = (packed[:, Dl:Dl + 4].contiguous().view(torch.float32) * 2).view(torch.uint8)
    out2 = sparse_mla_decode_triton(q, bumped, idx, kv_lora_rank=Dl, sm_scale=0.2, config=cfg)
    torch.testing.assert_close(out2.float(), _reference(q, bumped, idx, Dl).float(), **_tol(torch.bfloat16))
    assert (out2.float() - out.float()).abs().max() > 0.1


@pytest.mark.parametrize("cfg", [MlaGluonConfig(num_splits=2), MlaTwoPassConfig(num_splits=2), None])
def test_fp8_runs_on_the_fused_kernel_and_says_so(cfg, monkeypatch, caplog):
    monkeypatch.setattr(triton_support, "_announced", set())
    Dl, Dr = 128, 64
    q, packed, idx = _case(2, 20, Dl, Dr, 40, 96, seed=5)
    idx[1, ::4] = -1
    with caplog.at_level(logging.INFO):
        out = sparse_mla_decode_triton(q, packed, idx, kv_lora_rank=Dl, sm_scale=0.2, config=cfg)
    torch.testing.assert_close(out.float(), _reference(q, packed, idx, Dl).float(), **_tol(torch.bfloat16))
    assert "triton (fp8 latents)" in caplog.text
    if isinstance(cfg, MlaTwoPassConfig):
        assert "MlaTwoPassConfig has no fp8 kernel" in caplog.text
    elif isinstance(cfg, MlaGluonConfig):              # kv_lora_rank 128 (and the CPU): no Gluon FP8 kernel
        assert "fp8 latents: gluon unavailable for these rows" in caplog.text


def test_dispatch_takes_fp8_rows(monkeypatch):
    Dl, Dr = 128, 64
    q, packed, idx = _case(2, 16, Dl, Dr, 24, 48, seed=7)
    ref = _reference(q, packed, idx, Dl)
    monkeypatch.setenv("SPARSEHI_FORCE_TRITON", "1")      # the kernel under the interpreter
    out = sparse_mla_decode(q, packed, idx, kv_lora_rank=Dl, sm_scale=0.2)
    torch.testing.assert_close(out.float(), ref.float(), **_tol(torch.bfloat16))
    monkeypatch.setenv("SPARSEHI_FORCE_TRITON", "0")      # CPU: the torch reference on packed rows
    got = sparse_mla_decode(q, packed, idx, kv_lora_rank=Dl, sm_scale=0.2)
    if DEV == "cpu":
        assert torch.equal(got, ref)
    else:                                                 # CUDA always runs the kernel
        torch.testing.assert_close(got.float(), ref.float(), **_tol(torch.bfloat16))


def test_fp8_bad_inputs_name_the_parameter():
    Dl, Dr = 128, 64
    q, packed, idx = _case(2, 16, Dl, Dr, 8, 32)
    for fn in (sparse_mla_decode_triton, sparse_mla_decode_reference):
        with pytest.raises(ValueError, match="q must be bfloat16 or float16"):
            fn(q.float(), packed, idx, kv_lora_rank=Dl, sm_scale=0.1)
        with pytest.raises(ValueError, match="kv_buffer must be uint8 with last dim 260"):
            fn(q, packed[:, :-4], idx, kv_lora_rank=Dl, sm_scale=0.1)
        with pytest.raises(ValueError, match="kv_buffer must be of q's dtype .* or uint8"):
            fn(q, packed.view(torch.int8), idx, kv_lora_rank=Dl, sm_scale=0.1)
        with pytest.raises(ValueError, match="kv_lora_rank must be a multiple of 128"):
            fn(q, packed, idx, kv_lora_rank=96, sm_scale=0.1)
        with pytest.raises(ValueError, match="rope_dim"):
            fn(q[..., :-1], packed, idx, kv_lora_rank=Dl, sm_scale=0.1)
        misaligned = torch.zeros(32 * 260 + 2, dtype=torch.uint8, device=DEV)[2:].view(32, 260)
        with pytest.raises(ValueError, match="kv_buffer must be FP8 rows starting on 4-byte boundaries"):
            fn(q, misaligned, idx, kv_lora_rank=Dl, sm_scale=0.1)
        with pytest.raises(ValueError, match="kv_buffer"):
            fn(q, packed[:, None].expand(-1, 2, -1), idx, kv_lora_rank=Dl, sm_scale=0.1)


# ----------------------------------------------------------------------------- GPU
def _dsa_case(B, T, H, K, dtype=torch.bfloat16, seed=0):
    """DeepSeek shapes (512 + 64): ``B`` requests of ``T`` query tokens, each token its own
    top-``K`` over its request's ``1.25 K`` slots of a shared FP8 pool: ``q [B*T, H, 576]``,
    ``packed [B * span, 656]`` uint8, ``idx [B*T, K]`` int32."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    span = K + K // 4
    kv = torch.randn(B * span, 576, device="cuda", generator=g)
    # tiles of different magnitudes (scales 4x apart) at the spread of the bf16 tests' rows
    kv[:, :512] *= torch.rand(B * span, 4, device="cuda", generator=g).mul(1.5).add(0.5).repeat_interleave(128, dim=1)
    packed = quantize_mla_latents(kv.bfloat16())
    q = torch.randn(B * T, H, 576, device="cuda", generator=g).to(dtype)
    idx = torch.stack([torch.randperm(span, device="cuda", generator=g)[:K] + (r // T) * span
                       for r in range(B * T)]).int()
    return q, packed, idx


GPU_CASES = [(h, t, k, b) for h in (128, 64, 16) for t in (1, 2) for k, b in ((512, 64), (2048, 16), (8192, 2))]


@pytest.mark.gpu
@pytest.mark.parametrize("H,T,K,B", GPU_CASES)
def test_gpu_fp8_deepseek_shapes(H, T, K, B):
    # the default dispatch, the Gluon kernel (64 x 2 ring; 32 x 4 with 3 splits) and the fused kernel, each
    # against the reference
    q, packed, idx = _dsa_case(B, T, H, K, seed=H + T + K)
    idx[0, 100:] = -1                        # a first token with a short context
    idx[-1, 7] = packed.shape[0] + 5         # out of the pool: masked
    scale = 192 ** -0.5
    minus = idx.clone()
    minus[-1, 7] = -1
    ref = _reference(q, packed, minus, 512, scale)
    out = sparse_mla_decode(q, packed, idx, kv_lora_rank=512, sm_scale=scale)
    torch.testing.assert_close(out.float(), ref.float(), **_tol(torch.bfloat16))
    narrow = (MlaGluonConfig(token_rows=True), MlaGluonConfig(num_splits=3, token_rows=True)) if H <= 32 else ()
    for cfg in (MlaGluonConfig(), MlaGluonConfig(block_n=32, num_buf=4, num_splits=3),
                MlaGluonConfig(block_n=32, num_buf=3, fp8_stages=2),
                MlaGluonConfig(block_n=32, num_buf=2, num_splits=3, fp8_stages=3),
                MlaGluonConfig(num_buf=1, fp8_stages=1),
                MlaGluonConfig(producer_warps=0), MlaGluonConfig(block_n=32, num_buf=4, num_splits=3, producer_warps=0),
                default_mla_fp8_config(q.device, H, B * T), *narrow):
        out = sparse_mla_decode_triton(q, packed, idx, kv_lora_rank=512, sm_scale=scale, config=cfg)
        torch.testing.assert_close(out.float(), ref.float(), **_tol(torch.bfloat16), msg=lambda m: f"{cfg}: {m}")


@pytest.mark.gpu
def test_gpu_fp8_gluon_is_the_default_on_hopper_and_says_so(monkeypatch, caplog):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is Hopper's")
    monkeypatch.setattr(triton_support, "_announced", set())
    q, packed, idx = _dsa_case(8, 1, 128, 1024, seed=4)
    with caplog.at_level(logging.INFO):
        out = sparse_mla_decode(q, packed, idx, kv_lora_rank=512, sm_scale=192 ** -0.5)
    assert "gluon (fp8 latents)" in caplog.text
    torch.testing.assert_close(out.float(), _reference(q, packed, idx, 512, 192 ** -0.5).float(),
                               **_tol(torch.bfloat16))
    # a tile's scale doubled in one row: the Gluon kernel follows the scale bytes
    bumped = packed.clone()
    rows = idx[0, :64].long()
    bumped[rows, 512:516] = (packed[rows, 512:516].contiguous().view(torch.float32) * 2).view(torch.uint8)
    out2 = sparse_mla_decode(q, bumped, idx, kv_lora_rank=512, sm_scale=192 ** -0.5)
    torch.testing.assert_close(out2.float(), _reference(q, bumped, idx, 512, 192 ** -0.5).float(),
                               **_tol(torch.bfloat16))
    assert (out2[0].float() - out[0].float()).abs().max() > 1e-2


def test_fp8_gluon_config_it_cannot_run_is_refused_everywhere(monkeypatch, caplog):
    # the same ValueError where the Gluon kernel runs and where the fused kernel stands in
    q, packed, idx = _case(2, 16, 512, 64, 8, 32, seed=2)
    for cfg in (MlaGluonConfig(late_issue=True), MlaGluonConfig(num_buf=3), MlaGluonConfig(producer_warps=2), MlaGluonConfig(late_issue=True, producer_warps=4),
                MlaGluonConfig(num_buf=3, producer_warps=0), MlaGluonConfig(block_n=32, num_buf=5),
                MlaGluonConfig(block_n=32, token_rows=True), MlaGluonConfig(token_rows=True, producer_warps=0),
                MlaGluonConfig(num_buf=1, token_rows=True), MlaGluonConfig(block_n=32, num_buf=4, fp8_stages=1),
                MlaGluonConfig(num_buf=2, fp8_stages=1), MlaGluonConfig(fp8_stages=-1), MlaGluonConfig(fp8_stages=1.0),
                MlaGluonConfig(fp8_stages=1, producer_warps=0), MlaGluonConfig(fp8_stages=1, token_rows=True)):
        with pytest.raises(ValueError, match="config must be an MlaGluonConfig without late_issue"):
            sparse_mla_decode_triton(q, packed, idx, kv_lora_rank=512, sm_scale=0.1, config=cfg)
    with pytest.raises(ValueError, match="mma_groups None, or 1 or 2 with token_rows"):   # 16-bit rows only
        sparse_mla_decode_triton(q, packed, idx, kv_lora_rank=512, sm_scale=0.1,
                                 config=MlaGluonConfig(token_rows=True, mma_groups=2))
    wide_q = torch.cat([q] * 4, dim=1)          # 64 heads: past the token-rows kernel's 32
    with pytest.raises(ValueError, match="token_rows only for up to 32 query heads"):
        sparse_mla_decode_triton(wide_q, packed, idx, kv_lora_rank=512, sm_scale=0.1,
                                 config=MlaGluonConfig(token_rows=True))
    monkeypatch.setattr(triton_support, "_announced", set())
    with caplog.at_level(logging.INFO):            # an explicit fused config over FP8 rows says so too
        out = sparse_mla_decode_triton(q, packed, idx, kv_lora_rank=512, sm_scale=0.2, config=FUSED[0])
    assert "triton (fp8 latents)" in caplog.text
    torch.testing.assert_close(out.float(), _reference(q, packed, idx, 512).float(), **_tol(torch.bfloat16))


@pytest.mark.gpu
def test_gpu_fp8_long_topk_and_empty_row():
    q, packed, idx = _dsa_case(1, 2, 128, 32768, seed=11)
    idx[1] = -1
    out = sparse_mla_decode(q, packed, idx, kv_lora_rank=512, sm_scale=192 ** -0.5)
    ref = _reference(q, packed, idx, 512, 192 ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), **_tol(torch.bfloat16))
    assert torch.all(out[1] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fp8_configs_and_pool_view(dtype):
    q, packed, idx = _dsa_case(4, 1, 128, 2048, dtype=dtype, seed=3)
    idx[1, ::5] = -1
    ref = _reference(q, packed, idx, 512, 192 ** -0.5)
    for cfg in (None, MlaLaunchConfig(block_h=16, num_warps=4, num_splits=1),
                MlaLaunchConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, num_splits=5, row_load=True),
                MlaLaunchConfig(block_h=64, block_n=64, num_warps=8, num_stages=2),
                MlaLaunchConfig(block_h=16, block_n=64, num_warps=4, num_stages=2, row_load=True),
                MlaGluonConfig(num_splits=3), MlaTwoPassConfig()):
        out = sparse_mla_decode_triton(q, packed[:, None], idx, kv_lora_rank=512, sm_scale=192 ** -0.5, config=cfg)
        torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))


@pytest.mark.gpu
def test_gpu_fp8_gluon_ragged_topk_nan_slot_and_pool_views(monkeypatch, caplog):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is Hopper's")
    q, packed, idx = _dsa_case(8, 1, 128, 1000, seed=9)    # K = 1000: a partial last tile
    idx[:, -3:] = -1
    idx = torch.where(idx == 0, 1, idx)
    packed[0] = 0x7F                                        # padding must never read slot 0's NaN bytes
    scale = 192 ** -0.5
    ref = _reference(q, packed, idx, 512, scale)
    wide = torch.zeros(packed.shape[0], 672, dtype=torch.uint8, device="cuda")
    wide[:, :656] = packed                                  # rows 672 bytes apart: still 16-byte boundaries
    shifted = torch.zeros(packed.numel() + 4, dtype=torch.uint8, device="cuda")
    shifted[4:] = packed.flatten()                          # rows 4 bytes off: the fused kernel reads them
    monkeypatch.setattr(triton_support, "_announced", set())
    with caplog.at_level(logging.INFO):
        for cfg in (MlaGluonConfig(), MlaGluonConfig(num_splits=5), MlaGluonConfig(num_buf=1),
                    MlaGluonConfig(block_n=32, num_buf=4, num_splits=2), MlaGluonConfig(block_n=32, num_buf=1),
                    MlaGluonConfig(block_n=32, num_buf=3),
                    MlaGluonConfig(block_n=32, num_buf=3, fp8_stages=2), MlaGluonConfig(num_buf=1, fp8_stages=1),
                    MlaGluonConfig(block_n=32, num_buf=1, num_splits=5, fp8_stages=3),
                    MlaGluonConfig(producer_warps=0), MlaGluonConfig(num_buf=1, producer_warps=0)):
            out = sparse_mla_decode_triton(q, packed, idx, kv_lora_rank=512, sm_scale=scale, config=cfg)
            torch.testing.assert_close(out.float(), ref.float(), **_tol(torch.bfloat16), msg=lambda m: f"{cfg}: {m}")
        assert "gluon (fp8 latents)" in caplog.text
        out = sparse_mla_decode(q, wide[:, :656], idx, kv_lora_rank=512, sm_scale=scale)
        torch.testing.assert_close(out.float(), ref.float(), **_tol(torch.bfloat16))
        out = sparse_mla_decode_triton(q, wide[:, :656], idx, kv_lora_rank=512, sm_scale=scale,
                                       config=MlaGluonConfig(block_n=32, num_buf=3, fp8_stages=2))
        torch.testing.assert_close(out.float(), ref.float(), **_tol(torch.bfloat16))
        caplog.clear()
        out = sparse_mla_decode(q, shifted[4:].view(-1, 656), idx, kv_lora_rank=512, sm_scale=scale)
        torch.testing.assert_close(out.float(), ref.float(), **_tol(torch.bfloat16))
        assert "gluon (fp8 latents)" not in caplog.text


@pytest.mark.gpu
@pytest.mark.parametrize("H,T,K,B", [(16, 1, 1000, 5), (16, 2, 2048, 3), (8, 1, 33, 2), (20, 1, 2048, 4),
                                     (32, 2, 8192, 2), (16, 1, 32768, 1)])
def test_gpu_token_rows_kernel_fp8_and_bf16_rows(H, T, K, B):
    # tokens as the MMA rows (16- or 32-head blocks), FP8 rows (two producer warpgroups) and
    # the same values as bf16 rows, split and unsplit, against the reference: a ragged
    # last tile, a short and an empty row, an out-of-pool slot, NaN bytes in slot 0
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is Hopper's")
    q, packed, idx = _dsa_case(B, T, H, K, seed=H * 7 + K)
    idx = torch.where(idx == 0, 1, idx)
    idx[0, K // 3:] = -1
    if B * T > 2:
        idx[1] = -1
    idx[-1, min(5, K - 1)] = packed.shape[0] + 9
    packed[0] = 0x7F
    minus = torch.where(idx >= packed.shape[0], -1, idx)
    ref = _reference(q, packed, minus, 512, 192 ** -0.5).float()
    kv = dequantize_mla_latents(packed, 512).bfloat16()
    kv[0] = float("nan")
    # over 16-bit rows at 16-head blocks also two MMA warpgroups on alternate tiles, split and unsplit
    two = ((kv, MlaGluonConfig(token_rows=True, mma_groups=2)),
           (kv, MlaGluonConfig(num_splits=1, token_rows=True, mma_groups=2)),
           (kv, MlaGluonConfig(num_splits=3, token_rows=True, mma_groups=2)),
           (kv, MlaGluonConfig(num_splits=1, token_rows=True, mma_groups=1))) if H <= 16 else ()
    for buf, cfg in ((packed, MlaGluonConfig(token_rows=True)), (packed, MlaGluonConfig(num_splits=4, token_rows=True)),
                     (packed, MlaGluonConfig(num_splits=1, token_rows=True)), (packed, None),
                     (kv, MlaGluonConfig(token_rows=True)), (kv, MlaGluonConfig(num_splits=3, token_rows=True)), *two):
        out = sparse_mla_decode_triton(q, buf, idx, kv_lora_rank=512, sm_scale=192 ** -0.5, config=cfg)
        torch.testing.assert_close(out.float(), ref, **_tol(torch.bfloat16), msg=lambda m: f"{buf.dtype} {cfg}: {m}")
        if B * T > 2:
            assert torch.all(out[1] == 0)
    # the default dispatch over FP8 rows runs this kernel up to 32 heads, at any batch
    chosen = sparse_mla_decode_triton(q, packed, idx, kv_lora_rank=512, sm_scale=192 ** -0.5,
                                      config=MlaGluonConfig(token_rows=True))
    assert torch.equal(sparse_mla_decode(q, packed, idx, kv_lora_rank=512, sm_scale=192 ** -0.5), chosen)
