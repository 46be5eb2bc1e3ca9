"""The split-K arrival counters (``sparsehi.kernels.arrival_counters``) and the Gluon MLA
decode kernels that merge their splits in the kernel (GPU: against the separate merge
launch and the reference, and across CUDA-graph replays, which need the counters back at
zero after every launch)."""
from __future__ import annotations

import pytest
import torch

from sparsehi.kernels import arrival_counters as ac


@pytest.fixture
def fresh_buffers(monkeypatch):
    monkeypatch.setattr(ac, "_BUFFERS", {})
    monkeypatch.setattr(ac, "_OUTGROWN", [])


def test_buffer_is_zeroed_reused_and_grows_keeping_the_old_one(fresh_buffers):
    cpu = torch.device("cpu")
    a = ac.arrival_counters(cpu, 10)
    assert a.dtype == torch.int32 and a.numel() >= max(10, ac.MIN_COUNTERS) and not a.any()
    a[3] = 7
    assert ac.arrival_counters(cpu, 100) is a            # the same buffer while it is large enough
    big = ac.arrival_counters(cpu, a.numel() + 1)
    assert big is not a and big.numel() >= a.numel() + 1 and not big.any()
    assert ac._OUTGROWN == [a]                           # graphs captured over it may still read it
    assert ac.arrival_counters(cpu, 5) is big


def test_negative_count_raises_naming_it(fresh_buffers):
    with pytest.raises(ValueError, match="count"):
        ac.arrival_counters(torch.device("cpu"), -1)


def _gpu_case(B, H, K, N, seed, fp8):
    from sparsehi.kernels.mla_fp8_latents import quantize_mla_latents

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, 576, generator=g).to("cuda", torch.bfloat16)
    kv = torch.randn(N, 1, 576, generator=g).to("cuda", torch.bfloat16)
    idx = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(B)]).int().cuda()
    idx[0, K // 3:] = -1                         # a short row: its later splits are empty
    if B > 2:
        idx[1] = -1                              # an empty row
        idx[2, 5] = N + 7                        # an out-of-pool slot (masked)
    rows = quantize_mla_latents(kv.view(N, -1), 512) if fp8 else kv
    return q, rows, idx


CASES = [  # (heads, fp8, config without num_splits / merge_in_kernel)
    (128, True, dict()),                                             # warp-specialised, FP8 rows
    (128, False, dict(block_n=32, num_buf=4, producer_warps=4)),     # warp-specialised, 16-bit rows
    (64, True, dict(num_buf=1, fp8_stages=1)),                       # warp-specialised, FP8 staging
    (16, False, dict(token_rows=True)),                              # token rows, two MMA warpgroups
    (16, False, dict(token_rows=True, mma_groups=1)),
    (16, True, dict(token_rows=True)),                               # token rows, two FP8 producers
    (32, True, dict(token_rows=True)),                               # 32-head blocks
]


@pytest.mark.gpu
@pytest.mark.parametrize("heads,fp8,kw", CASES)
def test_gpu_merge_in_kernel_matches_the_merge_launch(heads, fp8, kw):
    from sparsehi.kernels.sparse_mla_decode import (MlaGluonConfig, sparse_mla_decode_reference,
                                                    sparse_mla_decode_triton)

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels are Hopper's")
    q, rows, idx = _gpu_case(5, heads, 2048, 8192, seed=heads + fp8, fp8=fp8)
    masked = torch.where(idx >= rows.shape[0], -1, idx)
    ref = sparse_mla_decode_reference(q, rows, masked, kv_lora_rank=512, sm_scale=0.1).float()
    for splits in (2, 3, 8, 32):
        outs = {}
        for merge in (False, True):
            cfg = MlaGluonConfig(num_splits=splits, merge_in_kernel=merge, **kw)
            outs[merge] = sparse_mla_decode_triton(q, rows, idx, kv_lora_rank=512, sm_scale=0.1, config=cfg)
        torch.testing.assert_close(outs[True].float(), ref, atol=2e-2, rtol=2e-2, msg=lambda m: f"{splits}: {m}")
        # the two merges differ only in the order of their float32 operations
        torch.testing.assert_close(outs[True].float(), outs[False].float(), atol=8e-3, rtol=8e-3)
        assert torch.all(outs[True][1] == 0)
    torch.cuda.synchronize()
    for buf in ac._BUFFERS.values():
        assert not buf.any(), "a launch left an arrival counter above zero"


@pytest.mark.gpu
@pytest.mark.parametrize("heads,fp8,kw", [CASES[0], CASES[3]])
def test_gpu_merge_in_kernel_replays_in_a_cuda_graph(heads, fp8, kw):
    from sparsehi.kernels.sparse_mla_decode import (MlaGluonConfig, sparse_mla_decode_reference,
                                                    sparse_mla_decode_triton)

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels are Hopper's")
    q, rows, idx = _gpu_case(6, heads, 2048, 8192, seed=40 + heads, fp8=fp8)
    cfg = MlaGluonConfig(num_splits=3, **kw)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sparse_mla_decode_triton(q, rows, idx, kv_lora_rank=512, sm_scale=0.1, config=cfg)   # warm-up: counters
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = sparse_mla_decode_triton(q, rows, idx, kv_lora_rank=512, sm_scale=0.1, config=cfg)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        q.copy_(torch.randn(q.shape, generator=g).to(q))
        idx.copy_(torch.stack([torch.randperm(8192, generator=g)[:2048] for _ in range(idx.shape[0])]).int())
        idx[0, 100:] = -1
        graph.replay()
        torch.cuda.synchronize()
        ref = sparse_mla_decode_reference(q, rows, idx, kv_lora_rank=512, sm_scale=0.1)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    key = (str(q.device), stream.cuda_stream)
    assert key in ac._BUFFERS and not ac._BUFFERS[key].any()


@pytest.mark.gpu
def test_gpu_capture_without_counters_merges_in_a_second_launch(monkeypatch):
    from sparsehi.kernels.sparse_mla_decode import (MlaGluonConfig, sparse_mla_decode_reference,
                                                    sparse_mla_decode_triton)

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels are Hopper's")
    monkeypatch.setattr(ac, "_BUFFERS", {})
    q, rows, idx = _gpu_case(4, 16, 2048, 8192, seed=9, fp8=False)
    cfg = MlaGluonConfig(token_rows=True, num_splits=4)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            assert ac.arrival_counters(q.device, 8) is None     # none made before the capture
            out = sparse_mla_decode_triton(q, rows, idx, kv_lora_rank=512, sm_scale=0.1, config=cfg)
    torch.cuda.current_stream().wait_stream(stream)
    assert not ac._BUFFERS
    graph.replay()
    torch.cuda.synchronize()
    masked = torch.where(idx >= rows.shape[0], -1, idx)
    ref = sparse_mla_decode_reference(q, rows, masked, kv_lora_rank=512, sm_scale=0.1)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
