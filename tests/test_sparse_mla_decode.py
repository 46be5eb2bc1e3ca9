"""Sparse MLA decode over token indices: Triton (interpreter on CPU) vs torch reference vs
dense SDPA over the gathered latent rows."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparsehi.kernels.sparse_mla_decode import (
    GLUON_FP8_MIN_HEADS,
    GLUON_MIN_INDICES,
    MlaGluonConfig,
    MlaLaunchConfig,
    MlaTwoPassConfig,
    default_mla_config,
    default_mla_fp8_config,
    sparse_mla_decode,
    sparse_mla_decode_reference,
    sparse_mla_decode_triton,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(B, H, Dl, Dr, K, N, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Dl + Dr, generator=g).to(DEV, dtype)
    kv = torch.randn(N, 1, Dl + Dr, generator=g).to(DEV, dtype)
    idx = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(B)]).int().to(DEV)
    return q, kv, idx


def _sdpa(q, kv, idx, Dl, scale):
    out = torch.zeros(q.shape[0], q.shape[1], Dl, dtype=q.dtype, device=q.device)
    for b in range(q.shape[0]):
        sel = idx[b][idx[b] >= 0].long()
        if sel.numel() == 0:
            continue
        rows = kv[sel, 0].float()                                    # [n, Dl+Dr]
        o = F.scaled_dot_product_attention(q[b][:, None].float(), rows[None].expand(q.shape[1], -1, -1),
                                           rows[None, :, :Dl].expand(q.shape[1], -1, -1), scale=scale)
        out[b] = o[:, 0].to(q.dtype)
    return out


def _tol(dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=3e-3, rtol=3e-3)


def _two_pass_cfg(splits, block_dv=16, block_n=16):
    return MlaTwoPassConfig(score_block_h=16, score_block_n=block_n, score_block_k=16, score_warps=4, score_stages=1,
                            pv_block_h=16, pv_block_n=16, pv_block_dv=block_dv, pv_warps=4, pv_stages=1,
                            num_splits=splits)


FUSED = [MlaLaunchConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, num_splits=None),
         MlaLaunchConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, num_splits=3, row_load=True),
         MlaLaunchConfig(block_h=32, block_n=16, num_warps=4, num_stages=1, num_splits=1)]
# value blocks of 16 (two per head block) and 32 (one), split and unsplit, score tiles of 16 and 32 tokens
TWO_PASS = [_two_pass_cfg(2), _two_pass_cfg(1, block_dv=32, block_n=32), _two_pass_cfg(None, block_n=32)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cfg", FUSED + TWO_PASS)
def test_triton_matches_reference_and_sdpa(dtype, cfg):
    Dl, Dr = 32, 16
    q, kv, idx = _case(3, 20, Dl, Dr, 40, 96, dtype)
    idx[0] = -1                     # empty row
    idx[1, ::3] = -1                # padding scattered through the row
    out = sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=Dl, sm_scale=0.2, config=cfg)
    ref = sparse_mla_decode_reference(q, kv, idx, kv_lora_rank=Dl, sm_scale=0.2)
    sdpa = _sdpa(q, kv, idx, Dl, 0.2)
    assert out.shape == (3, 20, Dl)
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))
    torch.testing.assert_close(ref.float(), sdpa.float(), **_tol(dtype))
    assert torch.all(out[0] == 0)


@pytest.mark.parametrize("cfg", [MlaLaunchConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, num_splits=2),
                                 _two_pass_cfg(2)])
def test_order_and_location_invariance(cfg):
    Dl, Dr = 32, 16
    q, kv, idx = _case(2, 16, Dl, Dr, 24, 64, torch.float16, seed=4)
    out = sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=Dl, sm_scale=0.2, config=cfg)
    # permute where rows live and the order of the index list: attention is a set function
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1)).to(DEV)
    kv2 = torch.empty_like(kv)
    kv2[perm] = kv
    idx2 = perm[idx.long()].int().flip(1)
    out2 = sparse_mla_decode_triton(q, kv2, idx2, kv_lora_rank=Dl, sm_scale=0.2, config=cfg)
    torch.testing.assert_close(out2.float(), out.float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("cfg", [MlaLaunchConfig(block_h=16, block_n=16, num_warps=4, num_stages=1),
                                 _two_pass_cfg(None)])
def test_out_of_pool_indices_are_masked(cfg):
    Dl, Dr = 32, 16
    q, kv, idx = _case(1, 16, Dl, Dr, 16, 32, torch.float16, seed=2)
    bad = idx.clone()
    bad[0, 3] = 10_000
    out = sparse_mla_decode_triton(q, kv, bad, kv_lora_rank=Dl, sm_scale=0.2, config=cfg)
    minus = idx.clone()
    minus[0, 3] = -1
    ref = sparse_mla_decode_reference(q, kv, minus, kv_lora_rank=Dl, sm_scale=0.2)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-3, rtol=3e-3)


def test_bad_inputs_raise_value_error_naming_parameter():
    q, kv, idx = _case(2, 16, 32, 16, 8, 32, torch.float16)
    for fn in (sparse_mla_decode_triton, sparse_mla_decode_reference):
        with pytest.raises(ValueError, match="q"):
            fn(q[0], kv, idx, kv_lora_rank=32, sm_scale=0.1)
        with pytest.raises(ValueError, match="kv_buffer"):
            fn(q, kv.float(), idx, kv_lora_rank=32, sm_scale=0.1)
        with pytest.raises(ValueError, match="kv_buffer"):
            fn(q, kv.expand(-1, 2, -1), idx, kv_lora_rank=32, sm_scale=0.1)
        with pytest.raises(ValueError, match="kv_buffer"):
            fn(q, kv[..., :40], idx, kv_lora_rank=32, sm_scale=0.1)
        with pytest.raises(ValueError, match="indices"):
            fn(q, kv, idx[:1], kv_lora_rank=32, sm_scale=0.1)
        with pytest.raises(ValueError, match="indices"):
            fn(q, kv, idx.float(), kv_lora_rank=32, sm_scale=0.1)
        with pytest.raises(ValueError, match="kv_lora_rank"):
            fn(q, kv, idx, kv_lora_rank=48, sm_scale=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_deepseek_shape(dtype):
    q, kv, idx = _case(4, 128, 512, 64, 2048, 8192, dtype)
    idx[0] = -1
    idx[1, 1000:] = -1
    out = sparse_mla_decode(q, kv, idx, kv_lora_rank=512, sm_scale=192 ** -0.5)
    ref = sparse_mla_decode_reference(q, kv, idx, kv_lora_rank=512, sm_scale=192 ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))
    for cfg in (MlaLaunchConfig(block_h=16, num_warps=4, num_splits=1), MlaLaunchConfig(block_h=32, num_warps=4),
                MlaLaunchConfig(block_h=64, num_warps=8, num_splits=5, row_load=True),
                MlaLaunchConfig(block_h=64, block_n=64, num_warps=8, num_stages=3),
                MlaGluonConfig(), MlaGluonConfig(num_splits=3), MlaGluonConfig(late_issue=True, num_splits=2),
                MlaGluonConfig(block_n=32, num_buf=4, num_splits=7), MlaGluonConfig(block_n=32, num_buf=1),
                MlaGluonConfig(producer_warps=4), MlaGluonConfig(block_n=32, num_buf=4, num_splits=3, producer_warps=4),
                MlaGluonConfig(producer_warps=0), MlaTwoPassConfig(), MlaTwoPassConfig(num_splits=3, pv_block_h=128, pv_block_dv=256, pv_stages=3)):
        out2 = sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=512, sm_scale=192 ** -0.5, config=cfg)
        torch.testing.assert_close(out2.float(), ref.float(), **_tol(dtype))


def test_two_pass_non_power_of_two_latent_and_empty_index_list():
    # latent 48 padded to 64: four value blocks of 16, the last fully masked; K=0 gives zeros
    Dl, Dr = 48, 16
    q, kv, idx = _case(2, 16, Dl, Dr, 37, 64, torch.float16, seed=3)
    cfg = _two_pass_cfg(2)
    out = sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=Dl, sm_scale=0.2, config=cfg)
    ref = sparse_mla_decode_reference(q, kv, idx, kv_lora_rank=Dl, sm_scale=0.2)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-3, rtol=3e-3)
    empty = sparse_mla_decode_triton(q, kv, idx[:, :0], kv_lora_rank=Dl, sm_scale=0.2, config=cfg)
    assert empty.shape == (2, 16, Dl) and torch.all(empty == 0)


def test_bad_config_type_raises():
    q, kv, idx = _case(1, 16, 32, 16, 8, 32, torch.float16)
    with pytest.raises(ValueError, match="config"):
        sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=32, sm_scale=0.1, config={"block_h": 16})


@pytest.mark.gpu
def test_gpu_bad_gluon_config_raises():
    q, kv, idx = _case(1, 64, 512, 64, 8, 32, torch.bfloat16)
    for cfg in (MlaGluonConfig(block_n=128), MlaGluonConfig(num_buf=1, late_issue=True),
                MlaGluonConfig(late_issue=True, producer_warps=4), MlaGluonConfig(num_buf=1, producer_warps=4),
                MlaGluonConfig(num_buf=3, producer_warps=4), MlaGluonConfig(producer_warps=8)):
        with pytest.raises(ValueError, match="config"):
            sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=512, sm_scale=0.1, config=cfg)


def test_default_config_stages_follow_loop_length(monkeypatch):
    import sparsehi.kernels.sparse_mla_decode as mla

    monkeypatch.setattr(mla, "sm_count", lambda device: 132)
    gpu = torch.device("cuda", 0)
    # B=64: one split of 512+ tokens per program -> 3 stages; B=16, K=512: 4 splits of 128 -> 2
    assert mla.default_mla_config(gpu, 128, 64, 2048).num_stages == 3
    assert mla.default_mla_config(gpu, 128, 64, 512).num_stages == 3
    assert mla.default_mla_config(gpu, 128, 16, 512).num_stages == 2
    assert mla.default_mla_config(gpu, 128, 16, 2048).num_stages == 3
    assert mla.default_mla_config(gpu, 128, 64).num_stages == 3
    small = mla.default_mla_config(gpu, 128, 1, 2048)
    assert (small.block_h, small.row_load) == (16, True)


def test_default_gluon_config_runs_where_it_is_chosen():
    from sparsehi.kernels.sparse_mla_gluon import (NARROW_MAX_HEADS, STAGED_FP8_MIN_ROWS, TOKEN_ROWS_16BIT_MAX_HEADS,
                                                   WS_BF16_MIN_HEADS, check_gluon_config, default_gluon_config)

    # bf16 rows above one 64-head block: the warp-specialised kernel at 32-token tiles x 4
    ws = default_gluon_config(128, fp8=False, rows=64)
    assert (ws.block_n, ws.num_buf, ws.producer_warps) == (32, 4, 4)
    assert default_gluon_config(WS_BF16_MIN_HEADS - 1, fp8=False, rows=64) == MlaGluonConfig()
    assert default_gluon_config(128, fp8=True, rows=64) == MlaGluonConfig()
    # FP8 rows up to 32 heads: tokens as the MMA rows, at any batch
    assert default_gluon_config(NARROW_MAX_HEADS, fp8=True, rows=1) == MlaGluonConfig(token_rows=True)
    assert default_gluon_config(NARROW_MAX_HEADS, fp8=True, rows=128) == MlaGluonConfig(token_rows=True)
    assert default_gluon_config(NARROW_MAX_HEADS, fp8=False, rows=64) == MlaGluonConfig()
    # 16-bit rows up to 16 heads: tokens as the MMA rows, at any batch too
    heads16 = TOKEN_ROWS_16BIT_MAX_HEADS
    for rows in (1, 4, 5, 64, 256):
        assert default_gluon_config(1, fp8=False, rows=rows) == MlaGluonConfig(token_rows=True)
        assert default_gluon_config(heads16, fp8=False, rows=rows) == MlaGluonConfig(token_rows=True)
        assert default_gluon_config(heads16 + 1, fp8=False, rows=rows) == MlaGluonConfig()
    # FP8 rows up to one 64-head block: the cp.async staging ring from STAGED_FP8_MIN_ROWS rows
    staged = MlaGluonConfig(64, 1, fp8_stages=1)
    assert default_gluon_config(NARROW_MAX_HEADS + 1, fp8=True, rows=STAGED_FP8_MIN_ROWS) == staged
    assert default_gluon_config(64, fp8=True, rows=128) == staged
    assert default_gluon_config(64, fp8=True, rows=STAGED_FP8_MIN_ROWS - 1) == MlaGluonConfig()
    assert default_gluon_config(64, fp8=False, rows=128) == MlaGluonConfig()
    assert default_gluon_config(65, fp8=True, rows=128) == MlaGluonConfig()
    for heads in (1, 16, NARROW_MAX_HEADS, 64, WS_BF16_MIN_HEADS, 128):
        for fp8 in (False, True):
            for rows in (1, STAGED_FP8_MIN_ROWS):
                cfg = default_gluon_config(heads, fp8, rows)
                check_gluon_config(cfg, 512, 64, fp8, heads)   # no ValueError: it fits


def test_token_rows_mma_groups_by_shape():
    from sparsehi.kernels.sparse_mla_gluon import TWO_MMA_MAX_HEADS, TWO_MMA_MIN_TOKENS, token_rows_mma_groups

    auto = MlaGluonConfig(token_rows=True)
    # 16-bit rows at up to 16-head blocks: two MMA warpgroups from TWO_MMA_MIN_TOKENS indices a program
    assert token_rows_mma_groups(auto, False, TWO_MMA_MAX_HEADS, TWO_MMA_MIN_TOKENS) == 2
    assert token_rows_mma_groups(auto, False, TWO_MMA_MAX_HEADS, 4096) == 2
    assert token_rows_mma_groups(auto, False, TWO_MMA_MAX_HEADS, TWO_MMA_MIN_TOKENS - 1) == 1
    assert token_rows_mma_groups(auto, False, 32, 4096) == 1
    assert token_rows_mma_groups(auto, True, 16, 4096) == 1            # FP8 rows keep one
    # a config's own choice stands
    assert token_rows_mma_groups(MlaGluonConfig(token_rows=True, mma_groups=1), False, 16, 4096) == 1
    assert token_rows_mma_groups(MlaGluonConfig(token_rows=True, mma_groups=2), False, 16, 64) == 2


def test_ws_gather_ahead_by_shape():
    from sparsehi.kernels.sparse_mla_gluon import GATHER_TWO_AHEAD_MIN_TOKENS, ws_gather_ahead

    ring4 = MlaGluonConfig(32, 4, producer_warps=4)
    # 16-bit rows, 4 slots: two tiles ahead from GATHER_TWO_AHEAD_MIN_TOKENS indices a program
    assert ws_gather_ahead(ring4, False, GATHER_TWO_AHEAD_MIN_TOKENS) == 2
    assert ws_gather_ahead(ring4, False, GATHER_TWO_AHEAD_MIN_TOKENS - 1) == 1
    assert ws_gather_ahead(MlaGluonConfig(32, 3, producer_warps=4), False, 8192) == 1
    assert ws_gather_ahead(MlaGluonConfig(producer_warps=4), False, 8192) == 1       # 64 x 2
    assert ws_gather_ahead(ring4, True, 8192) == 1                                    # FP8 rows
    assert ws_gather_ahead(MlaGluonConfig(32, 4, producer_warps=4, gather_ahead=3), False, 64) == 3


def test_check_gluon_config_refuses_gather_ahead_it_cannot_run():
    from sparsehi.kernels.sparse_mla_gluon import check_gluon_config

    for cfg, fp8 in ((MlaGluonConfig(32, 4, producer_warps=4, gather_ahead=4), False),
                     (MlaGluonConfig(32, 4, producer_warps=4, gather_ahead=0), False),
                     (MlaGluonConfig(32, 4, producer_warps=4, gather_ahead=True), False),
                     (MlaGluonConfig(32, 4, producer_warps=4, gather_ahead=2.0), False),
                     (MlaGluonConfig(producer_warps=4, gather_ahead=2), False),           # 2 slots
                     (MlaGluonConfig(32, 4, gather_ahead=2), False),                       # the 8-warp kernel
                     (MlaGluonConfig(token_rows=True, gather_ahead=1), False),
                     (MlaGluonConfig(32, 4, producer_warps=4, gather_ahead=2), True)):      # FP8 rows
        with pytest.raises(ValueError, match="config must be an MlaGluonConfig with gather_ahead None"):
            check_gluon_config(cfg, 512, 64, fp8, 16)
    for ahead in (1, 2, 3):
        check_gluon_config(MlaGluonConfig(32, 4, producer_warps=4, gather_ahead=ahead), 512, 64, False, 128)
    check_gluon_config(MlaGluonConfig(producer_warps=4, gather_ahead=1), 512, 64, False, 128)


def test_check_gluon_config_refuses_mma_groups_it_cannot_run():
    from sparsehi.kernels.sparse_mla_gluon import check_gluon_config

    for cfg, fp8, heads in ((MlaGluonConfig(mma_groups=2), False, 16), (MlaGluonConfig(mma_groups=1), False, 16),
                            (MlaGluonConfig(token_rows=True, mma_groups=3), False, 16),
                            (MlaGluonConfig(token_rows=True, mma_groups=0), False, 16),
                            (MlaGluonConfig(token_rows=True, mma_groups=True), False, 16),
                            (MlaGluonConfig(token_rows=True, mma_groups=2.0), False, 16),
                            (MlaGluonConfig(token_rows=True, mma_groups=2), True, 16),
                            (MlaGluonConfig(token_rows=True, mma_groups=2), False, 32)):
        with pytest.raises(ValueError, match="config must be an MlaGluonConfig with mma_groups None, or 1 or 2"):
            check_gluon_config(cfg, 512, 64, fp8, heads)
    for cfg, fp8, heads in ((MlaGluonConfig(token_rows=True, mma_groups=2), False, 16),
                            (MlaGluonConfig(token_rows=True, mma_groups=2), False, 1),
                            (MlaGluonConfig(token_rows=True, mma_groups=1), True, 32)):
        check_gluon_config(cfg, 512, 64, fp8, heads)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [64, 128])
def test_gpu_default_dispatch_runs_default_gluon_config(heads):
    from sparsehi.kernels.sparse_mla_gluon import default_gluon_config

    # the two kernels sum the tiles in different orders, so their bf16 outputs differ in
    # low bits: bitwise equality names the kernel the default dispatch ran
    q, kv, idx = _case(8, heads, 512, 64, 2048, 8192, torch.bfloat16, seed=11)
    idx[2, 700:] = -1
    out = sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=512, sm_scale=0.1)
    chosen = sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=512, sm_scale=0.1,
                                      config=default_gluon_config(heads, fp8=False, rows=8))
    other = MlaGluonConfig() if heads > 64 else MlaGluonConfig(32, 4, producer_warps=4)
    not_chosen = sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=512, sm_scale=0.1, config=other)
    assert torch.equal(out, chosen)
    assert not torch.equal(out, not_chosen)
    ref = sparse_mla_decode_reference(q, kv, idx, kv_lora_rank=512, sm_scale=0.1)
    torch.testing.assert_close(out.float(), ref.float(), **_tol(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("K", [GLUON_MIN_INDICES, GLUON_MIN_INDICES // 4])
def test_gpu_default_dispatch_takes_gluon_for_long_rows_at_batch_1(K):
    from sparsehi.kernels.sparse_mla_gluon import default_gluon_config

    # one request of 128 heads is two 64-head blocks, under GLUON_MIN_HEAD_BLOCKS: the fused
    # kernel below GLUON_MIN_INDICES indices, the Gluon kernel from there (a dense decode's
    # context); bitwise equality names the kernel that ran, as above
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is Hopper's")
    q, kv, idx = _case(1, 128, 512, 64, K, 2 * K, torch.bfloat16, seed=13)
    idx[0, K - 100:] = -1
    out = sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=512, sm_scale=0.1)
    gluon = sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=512, sm_scale=0.1,
                                     config=default_gluon_config(128, fp8=False, rows=1))
    fused = sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=512, sm_scale=0.1,
                                     config=default_mla_config(q.device, 128, 1, K))
    assert not torch.equal(gluon, fused)
    assert torch.equal(out, gluon if K >= GLUON_MIN_INDICES else fused)
    ref = sparse_mla_decode_reference(q, kv, idx, kv_lora_rank=512, sm_scale=0.1)
    torch.testing.assert_close(out.float(), ref.float(), **_tol(torch.bfloat16))


@pytest.mark.gpu
def test_gpu_default_dispatch_takes_gluon_over_fp8_rows_at_batch_1():
    from sparsehi.kernels.mla_fp8_latents import quantize_mla_latents
    from sparsehi.kernels.sparse_mla_gluon import default_gluon_config

    # FP8 rows at GLUON_FP8_MIN_HEADS heads and batch 1 (two 64-head blocks): the Gluon kernel,
    # even over a sparse step's short index list; bitwise equality names the kernel that ran
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is Hopper's")
    q, kv, idx = _case(1, GLUON_FP8_MIN_HEADS, 512, 64, 2176, 8192, torch.bfloat16, seed=14)
    idx[0, 2000:] = -1
    packed = quantize_mla_latents(kv.view(kv.shape[0], -1), 512)
    out = sparse_mla_decode_triton(q, packed, idx, kv_lora_rank=512, sm_scale=0.1)
    gluon = sparse_mla_decode_triton(q, packed, idx, kv_lora_rank=512, sm_scale=0.1,
                                     config=default_gluon_config(GLUON_FP8_MIN_HEADS, fp8=True, rows=1))
    fused = sparse_mla_decode_triton(q, packed, idx, kv_lora_rank=512, sm_scale=0.1,
                                     config=default_mla_fp8_config(q.device, GLUON_FP8_MIN_HEADS, 1))
    assert not torch.equal(gluon, fused)
    assert torch.equal(out, gluon)
    ref = sparse_mla_decode_reference(q, packed, idx, kv_lora_rank=512, sm_scale=0.1)
    torch.testing.assert_close(out.float(), ref.float(), **_tol(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("B", [16, 8])
def test_gpu_default_dispatch_stages_fp8_rows_at_64_heads(B, monkeypatch):
    from sparsehi.kernels import sparse_mla_gluon_launch
    from sparsehi.kernels.mla_fp8_latents import quantize_mla_latents
    from sparsehi.kernels.sparse_mla_gluon import STAGED_FP8_MIN_ROWS

    # 64 heads over FP8 rows: the staging ring from STAGED_FP8_MIN_ROWS rows, the register
    # producer below; both tile the rows alike, so the config the launch receives names the form
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is Hopper's")
    q, kv, idx = _case(B, 64, 512, 64, 2048, 8192, torch.bfloat16, seed=12)
    idx[1, 900:] = -1
    packed = quantize_mla_latents(kv.view(kv.shape[0], -1), 512)
    seen = []
    launch = sparse_mla_gluon_launch.launch_ws
    monkeypatch.setattr(sparse_mla_gluon_launch, "launch_ws",
                        lambda *a, **k: seen.append(a[8]) or launch(*a, **k))
    out = sparse_mla_decode_triton(q, packed, idx, kv_lora_rank=512, sm_scale=0.1)
    want = MlaGluonConfig(64, 1, fp8_stages=1) if B >= STAGED_FP8_MIN_ROWS else MlaGluonConfig()
    assert seen == [want]
    ref = sparse_mla_decode_reference(q, packed, idx, kv_lora_rank=512, sm_scale=0.1)
    torch.testing.assert_close(out.float(), ref.float(), **_tol(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_default_dispatch_runs_token_rows_over_16bit_rows_at_16_heads(dtype, monkeypatch):
    from sparsehi.kernels import sparse_mla_gluon_launch, sparse_mla_gluon_narrow
    from sparsehi.kernels.sparse_mla_gluon import TWO_MMA_MIN_TOKENS

    # 16 heads (TOKEN_ROWS_16BIT_MAX_HEADS) over 16-bit rows: the token-rows kernel at every
    # batch, with two MMA warpgroups where a program walks TWO_MMA_MIN_TOKENS indices or more;
    # each output against the reference
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is Hopper's")
    seen, groups = [], []
    launch = sparse_mla_gluon_launch.launch_narrow
    monkeypatch.setattr(sparse_mla_gluon_launch, "launch_narrow",
                        lambda *a, **k: seen.append((a[8], a[6])) or launch(*a, **k))
    split = sparse_mla_gluon_narrow.launch_split
    monkeypatch.setattr(sparse_mla_gluon_narrow, "launch_split",
                        lambda *a, **k: groups.append(k["MMA_GROUPS"]) or split(*a, **k))
    for B, K in ((1, 2048), (4, 2048), (8, 8192), (64, 2048)):
        q, kv, idx = _case(B, 16, 512, 64, K, 4 * K, dtype, seed=13 + B)
        idx[0, K - 500:] = -1
        seen.clear()
        groups.clear()
        out = sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=512, sm_scale=0.1)
        assert [cfg for cfg, _ in seen] == [MlaGluonConfig(token_rows=True)], B
        assert groups == [2 if seen[0][1] >= TWO_MMA_MIN_TOKENS else 1], (B, seen)
        ref = sparse_mla_decode_reference(q, kv, idx, kv_lora_rank=512, sm_scale=0.1)
        torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))
    assert groups == [2]          # B=64, K=2048: two splits of 1024 indices


@pytest.mark.gpu
def test_gpu_ws_gather_ahead_over_bf16_rows(monkeypatch):
    from sparsehi.kernels import sparse_mla_gluon_ws

    # the gather producer of the warp-specialised kernel 1, 2 and 3 tiles ahead of the tile it
    # hands over, split and unsplit, against the reference: a short and an empty row, an
    # out-of-pool slot, a ragged last tile; then what the default dispatch passes the launch
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is Hopper's")
    q, kv, idx = _case(4, 128, 512, 64, 3000, 16384, torch.bfloat16, seed=21)
    idx[0, 700:] = -1
    idx[1] = -1
    idx[3, 9] = kv.shape[0] + 3
    minus = torch.where(idx >= kv.shape[0], -1, idx)
    ref = sparse_mla_decode_reference(q, kv, minus, kv_lora_rank=512, sm_scale=0.1).float()
    for ahead in (1, 2, 3):
        for splits in (1, 3, None):
            cfg = MlaGluonConfig(32, 4, num_splits=splits, producer_warps=4, gather_ahead=ahead)
            out = sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=512, sm_scale=0.1, config=cfg)
            torch.testing.assert_close(out.float(), ref, **_tol(torch.bfloat16), msg=lambda m: f"{cfg}: {m}")
            assert torch.all(out[1] == 0)
    seen = []
    split = sparse_mla_gluon_ws.launch_split
    monkeypatch.setattr(sparse_mla_gluon_ws, "launch_split",
                        lambda *a, **k: seen.append((a[7], k["GATHER_AHEAD"])) or split(*a, **k))
    for B, K, want in ((64, 2048, 2), (8, 2048, 1)):
        q, kv, idx = _case(B, 128, 512, 64, K, 2 * B * K, torch.bfloat16, seed=22 + B)
        seen.clear()
        out = sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=512, sm_scale=0.1)
        assert [ahead for _, ahead in seen] == [want], (B, seen)
        torch.testing.assert_close(out.float(), sparse_mla_decode_reference(q, kv, idx, kv_lora_rank=512,
                                                                            sm_scale=0.1).float(),
                                   **_tol(torch.bfloat16))


def test_split_heuristic_one_wave():
    from sparsehi.kernels.sparse_mla_decode import mla_num_splits

    assert mla_num_splits(128, 2048, 64, 132) == 1      # B=64 x 2 head blocks: a full wave
    assert mla_num_splits(32, 2048, 64, 132) == 4
    assert mla_num_splits(8, 2048, 64, 132) == 2048 // 128   # capped: >= 128 indices per split
    assert mla_num_splits(8, 100, 64, 132) == 1


def test_gluon_split_count_takes_the_measured_fastest():
    """gluon_num_splits at the shapes of mla_split_count.json (one H200, 128 heads): the count
    measured fastest there, where splitting only under a full wave took one split at 39 and 96
    rows (78 and 192 programs: 1.12x slower over FP8 rows)."""
    from sparsehi.kernels.sparse_mla_gluon_launch import gluon_num_splits

    fp8_tiles, bf16_tiles = 2176 // 64 + 1, 2176 // 32  # K = 2176: 64-token FP8 tiles, 32-token 16-bit ones
    for rows, want in ((8, 7), (16, 4), (30, 2), (39, 3), (48, 1), (64, 1), (96, 2), (128, 1)):
        assert gluon_num_splits(2 * rows, fp8_tiles, 132, True, 17) == want, rows
        assert gluon_num_splits(2 * rows, bf16_tiles, 132, False, 17) == want, rows
    # long rows (K = 8192 / 32768 over 16-bit rows): 48 rows take 4, 30 rows of 32768 keep 2
    assert gluon_num_splits(96, 256, 132, False, 64) == 4
    assert gluon_num_splits(60, 1024, 132, False, 64) == 2
    assert gluon_num_splits(78, 34, 132, True, 2) in (1, 2)  # the cap
    assert gluon_num_splits(1, 1, 132, True, 1) == 1


@pytest.mark.parametrize("cfg", [MlaGluonConfig(), MlaGluonConfig(block_n=32, num_buf=4, late_issue=True, num_splits=2)])
def test_gluon_config_matches_reference_or_falls_back(cfg):
    # CPU / interpreter: the Gluon config falls back to the Triton kernel (logged once)
    Dl, Dr = 32, 16
    q, kv, idx = _case(2, 20, Dl, Dr, 40, 96, torch.float16, seed=5)
    idx[1, ::4] = -1
    out = sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=Dl, sm_scale=0.2, config=cfg)
    ref = sparse_mla_decode_reference(q, kv, idx, kv_lora_rank=Dl, sm_scale=0.2)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-3, rtol=3e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", [MlaGluonConfig(), MlaGluonConfig(late_issue=True),
                                 MlaGluonConfig(block_n=32, num_buf=3, late_issue=True, num_splits=5),
                                 MlaGluonConfig(producer_warps=4), MlaGluonConfig(producer_warps=4, num_splits=3)])
def test_gpu_gluon_odd_shapes(dtype, cfg):
    # H not a multiple of 64, K not a multiple of the tile, empty and short rows, bad slots
    q, kv, idx = _case(3, 80, 512, 64, 1000, 4096, dtype, seed=7)
    idx[0] = -1
    idx[1, 13:] = -1
    idx[2, ::5] = -1
    idx[2, 7] = 10_000
    out = sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=512, sm_scale=192 ** -0.5, config=cfg)
    bad = idx.clone()
    bad[2, 7] = -1
    ref = sparse_mla_decode_reference(q, kv, bad, kv_lora_rank=512, sm_scale=192 ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))
    assert torch.all(out[0] == 0)
