"""Stream-K sparse MLA decode (``sparse_mla_gluon_stream``): the plan's walk over the (request,
head block) pairs' tiles, the merge of parts that were never written, the config checks, and
on a Hopper GPU the kernel against the torch reference over FP8 and bf16 rows."""
from __future__ import annotations

import pytest
import torch

from sparsehi.kernels.flash_decoding import merge_splits
from sparsehi.kernels.mla_fp8_latents import dequantize_mla_latents, quantize_mla_latents
from sparsehi.kernels.sparse_mla_decode import (MlaGluonConfig, sparse_mla_decode_reference,
                                                sparse_mla_decode_triton)
from sparsehi.kernels.sparse_mla_gluon_launch import stream_k
from sparsehi.kernels.sparse_mla_gluon_stream import stream_k_plan


@pytest.mark.parametrize("pairs,row_tiles,sms", [(78, 34, 132), (128, 32, 132), (2, 512, 132), (4, 1, 132),
                                                 (1, 3, 132), (7, 5, 4), (256, 128, 132), (3, 40, 7)])
def test_plan_covers_every_tile_once_within_max_parts(pairs, row_tiles, sms):
    plan = stream_k_plan(pairs, row_tiles, sms)
    assert plan.programs == min(sms, pairs * row_tiles)
    seen = torch.zeros(pairs, row_tiles, dtype=torch.int32)
    parts = {}
    for p in range(plan.programs):
        segs = plan.segments(p)
        assert segs, p
        sizes = sum(t1 - t0 for _, t0, t1, _ in segs)
        assert sizes in (plan.total_tiles // plan.programs, plan.total_tiles // plan.programs + 1)
        for pair, t0, t1, part in segs:
            assert 0 <= t0 < t1 <= row_tiles
            seen[pair, t0:t1] += 1
            assert 0 <= part < plan.max_parts
            assert (pair, part) not in parts           # one writer a part
            parts[pair, part] = p
    assert bool((seen == 1).all())
    # each pair's parts are 0 .. n-1, part 0 written by the owner of its first tile
    for pair in range(pairs):
        mine = sorted(k for (q, k) in parts if q == pair)
        assert mine == list(range(len(mine)))
        assert parts[pair, 0] == plan.owner(pair * row_tiles)
    # the partial buffers hold max_parts a pair: no pair may need more
    assert max(len([k for (q, k) in parts if q == pair]) for pair in range(pairs)) <= plan.max_parts


def test_plan_bad_sizes_name_them():
    with pytest.raises(ValueError, match="pairs, row_tiles and sms"):
        stream_k_plan(0, 4, 132)
    with pytest.raises(ValueError, match="pairs, row_tiles and sms"):
        stream_k_plan(3, 4, 0)


def test_merge_skips_parts_marked_empty_whatever_they_hold():
    # a part whose log-sum-exp is -inf may be memory no program wrote: NaN there must not reach the output
    g = torch.Generator().manual_seed(0)
    B, H, S, D = 2, 3, 4, 32
    part = torch.randn(B, H, S, D, generator=g)
    lse = torch.randn(B, H, S, generator=g)
    part[:, :, 2:] = float("nan")
    lse[:, :, 2:] = float("-inf")
    out = torch.empty(B, H, D)
    merge_splits(part, lse, out, 32)
    w = torch.softmax(lse[:, :, :2], dim=-1)
    torch.testing.assert_close(out, (part[:, :, :2] * w[..., None]).sum(2))


def test_stream_k_config_checks_and_choice():
    # checked wherever the config is read (FP8 rows: on the CPU too)
    q = torch.zeros(1, 16, 576, dtype=torch.bfloat16)
    kv = quantize_mla_latents(torch.zeros(16, 576, dtype=torch.bfloat16))
    idx = torch.zeros(1, 8, dtype=torch.int32)
    for cfg in (MlaGluonConfig(stream_k=True, token_rows=True), MlaGluonConfig(stream_k=True, producer_warps=0),
                MlaGluonConfig(stream_k=1)):
        with pytest.raises(ValueError, match="config.*stream_k"):
            sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=512, sm_scale=0.1, config=cfg)
    assert stream_k(MlaGluonConfig(stream_k=True), 128, 132)
    assert not stream_k(MlaGluonConfig(stream_k=False), 234, 132)
    # the default: split-K over more than one wave filled to less than 0.9
    assert stream_k(MlaGluonConfig(), 234, 132)                  # 39 rows x 2 head blocks x 3 splits
    assert not stream_k(MlaGluonConfig(num_splits=3), 234, 132)  # a split count asked for
    assert not stream_k(MlaGluonConfig(), 120, 132)              # one wave
    assert not stream_k(MlaGluonConfig(), 384, 132)              # 0.97 of three waves


# ----------------------------------------------------------------------------- GPU
def _case(B, H, K, fp8, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    N = B * K + K // 2 + 64
    kv = torch.randn(N, 576, device="cuda", generator=g)
    kv[:, :512] *= torch.rand(N, 4, device="cuda", generator=g).mul(1.5).add(0.5).repeat_interleave(128, dim=1)
    kv = kv.bfloat16()
    if fp8:
        kv = quantize_mla_latents(kv)
    q = torch.randn(B, H, 576, device="cuda", generator=g).bfloat16()
    idx = torch.stack([torch.randperm(N, device="cuda", generator=g)[:K] for _ in range(B)]).int()
    return q, kv, idx


def _ref(q, kv, idx, scale):
    rows = dequantize_mla_latents(kv, 512).bfloat16() if kv.dtype == torch.uint8 else kv
    return sparse_mla_decode_reference(q, rows, torch.where(idx >= kv.shape[0], -1, idx), kv_lora_rank=512,
                                       sm_scale=scale).float()


def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels are Hopper's")


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("H,K,B", [(128, 2176, 39), (128, 2048, 64), (128, 1000, 5), (64, 2048, 30), (16, 33, 3),
                                   (128, 64, 2), (128, 32768, 1), (64, 8192, 3), (128, 4096, 130)])
def test_gpu_stream_k_matches_reference(fp8, H, K, B):
    # ragged rows, an empty row, an out-of-pool slot and NaN bytes in slot 0 that padding must never read
    _hopper()
    q, kv, idx = _case(B, H, K, fp8, seed=H + K + B)
    idx = torch.where(idx == 0, 1, idx)
    idx[0, K // 3:] = -1
    if B > 2:
        idx[1] = -1
    idx[-1, min(5, K - 1)] = kv.shape[0] + 9
    kv[0] = 0x7F if fp8 else float("nan")
    scale = 192 ** -0.5
    ref = _ref(q, kv, idx, scale)
    cfgs = [MlaGluonConfig(stream_k=True)] if fp8 else [MlaGluonConfig(32, 4, producer_warps=4, stream_k=True)]
    if fp8:
        cfgs += [MlaGluonConfig(num_buf=1, fp8_stages=1, stream_k=True),
                 MlaGluonConfig(block_n=32, num_buf=3, fp8_stages=2, stream_k=True)]
    else:
        cfgs += [MlaGluonConfig(64, 2, producer_warps=4, stream_k=True),
                 MlaGluonConfig(32, 4, producer_warps=4, gather_ahead=2, stream_k=True)]
    for cfg in cfgs:
        out = sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=512, sm_scale=scale, config=cfg).float()
        assert not out.isnan().any(), cfg
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2, msg=lambda m: f"{cfg}: {m}")


@pytest.mark.gpu
def test_gpu_stream_k_graph_replays_new_inputs():
    # captured once, replayed over other queries and indices of the same shapes (parts of
    # the last replay left in the buffers must not leak into the next)
    _hopper()
    q, kv, idx = _case(39, 128, 2176, True, seed=1)
    cfg = MlaGluonConfig(stream_k=True)
    sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=512, sm_scale=0.1, config=cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=512, sm_scale=0.1, config=cfg)
    for seed in (2, 3):
        q2, _, idx2 = _case(39, 128, 2176, True, seed=seed)
        idx2[seed] = -1
        q.copy_(q2)
        idx.copy_(idx2)
        graph.replay()
        torch.testing.assert_close(out.float(), _ref(q, kv, idx, 0.1), atol=2e-2, rtol=2e-2)
