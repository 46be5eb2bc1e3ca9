"""Paged / ragged GQA decode kernels: Triton (interpreter on CPU) vs torch references vs
the per-row flash_attn_with_kvcache contract vs dense SDPA."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

try:  # the GPU machine may lack hypothesis; the CPU suite has it
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    given = None

from sparsehi.kernels.paged_decode import (
    DecodeLaunchConfig,
    choose_num_splits,
    flash_attn_with_kvcache_reference,
    flash_attn_with_kvcache_triton,
    paged_decode,
    paged_decode_reference,
    paged_decode_triton,
)
from sparsehi.kernels.ragged_decode import ragged_decode_reference, ragged_decode_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = DecodeLaunchConfig(block_n=16, num_warps=4, num_stages=1)


def _case(B, Hq, Hkv, D, ps, max_pages, num_pages, seqlens, dtype, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=g).to(device, dtype)
    k = torch.randn(num_pages * ps, Hkv, D, generator=g).to(device, dtype)
    v = torch.randn(num_pages * ps, Hkv, D, generator=g).to(device, dtype)
    # distinct pages per row, never page 0 (padding)
    pt = torch.stack([torch.randperm(num_pages - 1, generator=g)[:max_pages] + 1 for _ in range(B)]).int().to(device)
    sl = torch.tensor(seqlens, dtype=torch.int32, device=device)
    return q, k, v, pt, sl


def _sdpa_over_gathered(q, k, v, pt, sl, ps, scale):
    """Dense SDPA per row over the KV tokens the page table names (ground truth #2)."""
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        n = int(sl[b])
        if n == 0:
            continue
        slots = (pt[b].long()[:, None] * ps + torch.arange(ps, device=q.device)).reshape(-1)[:n]
        kk = k[slots].transpose(0, 1)[None].float()   # [1, Hkv, n, D]
        vv = v[slots].transpose(0, 1)[None].float()
        o = F.scaled_dot_product_attention(q[b][None, :, None].float(), kk, vv, scale=scale, enable_gqa=True)
        out[b] = o[0, :, 0].to(q.dtype)
    return out


def _tol(dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ps,splits", [(1, None), (4, 3), (16, 1)])
def test_triton_matches_references(dtype, ps, splits):
    max_pages = max(2, 40 // ps)
    seqlens = [0, max_pages * ps, max_pages * ps - ps // 2 - 1 if ps > 1 else 7]
    q, k, v, pt, sl = _case(3, 8, 2, 32, ps, max_pages, max_pages + 8, seqlens, dtype)
    cfg = DecodeLaunchConfig(block_n=16, num_warps=4, num_stages=1, num_splits=splits)
    out = paged_decode_triton(q, k, v, pt, sl, page_size=ps, sm_scale=0.3, config=cfg)
    ref = paged_decode_reference(q, k, v, pt, sl, page_size=ps, sm_scale=0.3)
    fa = flash_attn_with_kvcache_reference(q[:, None], k.view(-1, ps, 2, 32), v.view(-1, ps, 2, 32), sl, pt, 0.3)[:, 0]
    sdpa = _sdpa_over_gathered(q, k, v, pt, sl, ps, 0.3)
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))
    torch.testing.assert_close(fa.float(), sdpa.float(), **_tol(dtype))
    torch.testing.assert_close(out.float(), sdpa.float(), **_tol(dtype))
    assert torch.all(out[0] == 0), "a zero-length row must output zeros"


def test_flash_contract_triton_and_permutation():
    ps, P, Hkv, D = 4, 5, 2, 16
    q, k, v, pt, sl = _case(2, 4, Hkv, D, ps, P, 12, [P * ps, 9], torch.float16, seed=3)
    kc, vc = k.view(-1, ps, Hkv, D), v.view(-1, ps, Hkv, D)
    out = flash_attn_with_kvcache_triton(q[:, None], kc, vc, sl, pt, softmax_scale=None, config=SMALL)
    ref = flash_attn_with_kvcache_reference(q[:, None], kc, vc, sl, pt)
    assert out.shape == (2, 1, 4, D)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-3, rtol=3e-3)
    # move every page elsewhere; the table follows, the output must not change
    perm = torch.randperm(kc.shape[0], generator=torch.Generator().manual_seed(7)).to(DEV)
    kc2, vc2 = torch.empty_like(kc), torch.empty_like(vc)
    kc2[perm], vc2[perm] = kc, vc
    out2 = flash_attn_with_kvcache_triton(q[:, None], kc2, vc2, sl, perm[pt.long()].int(), config=SMALL)
    torch.testing.assert_close(out2.float(), out.float(), atol=1e-3, rtol=1e-3)


def test_negative_and_out_of_pool_pages_are_masked():
    ps = 4
    q, k, v, pt, sl = _case(2, 4, 1, 16, ps, 4, 8, [16, 16], torch.float16, seed=5)
    pt2 = pt.clone()
    pt2[0, 1] = -1
    pt2[1, 2] = 10_000
    out = paged_decode_triton(q, k, v, pt2, sl, page_size=ps, sm_scale=0.25, config=SMALL)
    ref = paged_decode_reference(q, k, v, pt2, sl, page_size=ps, sm_scale=0.25)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-3, rtol=3e-3)
    # equal to attending only the remaining pages
    keep0 = pt[0, [0, 2, 3]][None]
    only = paged_decode_reference(q[:1], k, v, keep0, torch.tensor([12], dtype=torch.int32, device=DEV),
                                  page_size=ps, sm_scale=0.25)
    torch.testing.assert_close(out[:1].float(), only.float(), atol=3e-3, rtol=3e-3)


def test_lengths_past_the_table_never_read_outside_it():
    """cache_seqlens > max_pages * page_size: the kernel must stop at the row's width (the
    table is a view into a wider buffer whose other columns hold real pages)."""
    ps, W = 4, 3
    q, k, v, wide, _ = _case(2, 4, 2, 16, ps, 2 * W, 2 * W + 4, [0, 0], torch.float16, seed=13)
    pt = wide[:, :W]  # stride(0) = 2W: the next W entries of each row are real pages
    sl = torch.tensor([W * ps + 5, W * ps + 2 * ps], dtype=torch.int32, device=DEV)
    for splits in (None, 2):
        cfg = DecodeLaunchConfig(block_n=16, num_warps=4, num_stages=1, num_splits=splits)
        out = paged_decode_triton(q, k, v, pt, sl, page_size=ps, sm_scale=0.25, config=cfg)
        truth = _sdpa_over_gathered(q, k, v, pt, torch.full_like(sl, W * ps), ps, 0.25)
        torch.testing.assert_close(out.float(), truth.float(), atol=3e-3, rtol=3e-3)
    ref = paged_decode_reference(q, k, v, pt, sl, page_size=ps, sm_scale=0.25)
    torch.testing.assert_close(ref.float(), truth.float(), atol=3e-3, rtol=3e-3)


def test_ragged_rows_past_the_end_of_kv_indices_are_cut():
    """kv_indptr running past kv_indices.numel(): entries beyond it are not attended (the
    indices are a view into a longer buffer holding real slots)."""
    ps = 4
    q, k, v, pt, sl = _case(2, 4, 2, 16, ps, 3, 9, [12, 12], torch.float16, seed=17)
    slots = (pt.long()[:, :, None] * ps + torch.arange(ps, device=DEV)).reshape(-1).int()  # 24 real slots
    indices = slots[:18]  # the last row is cut to 6 entries; slots[18:] stay readable memory
    indptr = torch.tensor([0, 12, 24], dtype=torch.int32, device=DEV)
    out = ragged_decode_triton(q, k, v, indptr, indices, max_kv_len=12, sm_scale=0.25, config=SMALL)
    ref = ragged_decode_reference(q, k, v, indptr, indices, max_kv_len=12, sm_scale=0.25)
    truth = paged_decode_reference(q, k, v, pt, torch.tensor([12, 6], dtype=torch.int32, device=DEV),
                                   page_size=ps, sm_scale=0.25)
    torch.testing.assert_close(out.float(), truth.float(), atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(ref.float(), truth.float(), atol=3e-3, rtol=3e-3)


def _property(B, group, ps, pages, splits, seed):
    g = torch.Generator().manual_seed(seed)
    seqlens = torch.randint(0, pages * ps + 1, (B,), generator=g).tolist()
    q, k, v, pt, sl = _case(B, 2 * group, 2, 16, ps, pages, pages + 3, seqlens, torch.float16, seed=seed)
    cfg = DecodeLaunchConfig(block_n=16, num_warps=4, num_stages=1, num_splits=splits)
    out = paged_decode_triton(q, k, v, pt, sl, page_size=ps, sm_scale=0.25, config=cfg)
    ref = paged_decode_reference(q, k, v, pt, sl, page_size=ps, sm_scale=0.25)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-3, rtol=3e-3)


if given is not None:
    test_property_triton_equals_reference = settings(max_examples=8, deadline=None)(given(
        B=st.integers(1, 3), group=st.sampled_from([1, 2, 4]), ps=st.sampled_from([1, 2, 8]),
        pages=st.integers(1, 5), splits=st.sampled_from([None, 1, 2, 4]), seed=st.integers(0, 1000),
    )(_property))


def test_ragged_matches_paged():
    ps = 4
    q, k, v, pt, sl = _case(3, 4, 2, 16, ps, 3, 9, [12, 0, 5], torch.float16, seed=11)
    slots = (pt.long()[:, :, None] * ps + torch.arange(ps, device=DEV)).reshape(3, -1)
    rows = [slots[b, : int(sl[b])] for b in range(3)]
    indices = torch.cat(rows + [torch.zeros(4, dtype=torch.long, device=DEV)]).int()  # padded tail
    indptr = torch.tensor([0, 12, 12, 17], dtype=torch.int32, device=DEV)
    out = ragged_decode_triton(q, k, v, indptr, indices, max_kv_len=12, sm_scale=0.25,
                               config=DecodeLaunchConfig(block_n=16, num_stages=1, num_splits=2))
    ref = ragged_decode_reference(q, k, v, indptr, indices, max_kv_len=12, sm_scale=0.25)
    paged = paged_decode_reference(q, k, v, pt, sl, page_size=ps, sm_scale=0.25)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(ref.float(), paged.float(), atol=3e-3, rtol=3e-3)


def test_bad_inputs_raise_value_error_naming_parameter():
    q, k, v, pt, sl = _case(2, 4, 2, 16, 4, 2, 4, [8, 3], torch.float16)
    kw = dict(page_size=4, sm_scale=0.25)
    for fn in (paged_decode_triton, paged_decode_reference):
        with pytest.raises(ValueError, match="q"):
            fn(q[0], k, v, pt, sl, **kw)
        with pytest.raises(ValueError, match="k_buffer"):
            fn(q, k.float(), v, pt, sl, **kw)
        with pytest.raises(ValueError, match="v_buffer"):
            fn(q, k, v[:, :1], pt, sl, **kw)
        with pytest.raises(ValueError, match="q"):
            fn(q[:, :3], k, v, pt, sl, **kw)  # 3 q heads over 2 kv heads
        with pytest.raises(ValueError, match="page_table"):
            fn(q, k, v, pt[:1], sl, **kw)
        with pytest.raises(ValueError, match="page_table"):
            fn(q, k, v, pt.float(), sl, **kw)
        with pytest.raises(ValueError, match="cache_seqlens"):
            fn(q, k, v, pt, sl[:1], **kw)
        with pytest.raises(ValueError, match="page_size"):
            fn(q, k, v, pt, sl, page_size=3, sm_scale=0.25)
    with pytest.raises(ValueError, match="kv_indptr"):
        ragged_decode_triton(q, k, v, sl, pt.reshape(-1), max_kv_len=8, sm_scale=0.25)
    with pytest.raises(ValueError, match="max_kv_len"):
        ragged_decode_reference(q, k, v, torch.zeros(3, dtype=torch.int32), pt.reshape(-1), max_kv_len=-1, sm_scale=0.25)


def test_split_heuristic_fills_the_gpu_from_shapes():
    assert choose_num_splits(64 * 8, 2048, 64, 132) == 1
    small = choose_num_splits(1 * 8, 2048, 64, 132)
    assert 1 < small <= 2048 // 256
    assert choose_num_splits(1, 100, 64, 132) == 1  # too short to split
    assert choose_num_splits(4, 0, 64, 132) == 1


def test_split_heuristic_splits_small_reads_finer():
    """A latency-bound call (little KV to read) takes one 64-token tile per split, up to 4
    waves of programs; a large read keeps the bandwidth-bound choice."""
    from sparsehi.kernels.paged_decode import SMALL_READ_BYTES

    llama_b1 = 1 * 2192 * 8 * 256 * 2  # tokens x heads x (K + V dims) x bf16
    assert choose_num_splits(8, 2192, 64, 132) == 9
    assert choose_num_splits(8, 2192, 64, 132, kv_bytes=llama_b1) == 35  # ceil(2192 / 64), under 4 waves
    assert choose_num_splits(32, 2192, 64, 132, kv_bytes=4 * llama_b1) == 17  # 4 waves of 32 rows x heads
    big = SMALL_READ_BYTES + 1
    assert choose_num_splits(80, 2192, 64, 132, kv_bytes=big) == choose_num_splits(80, 2192, 64, 132) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ps", [1, 16, 64])
def test_gpu_llama_shape(dtype, ps):
    max_pages = 2048 // ps
    seqlens = [0, 2048, 1000, 1]
    q, k, v, pt, sl = _case(4, 32, 8, 128, ps, max_pages, max_pages * 2, seqlens, dtype)
    out = paged_decode(q, k, v, pt, sl, page_size=ps, sm_scale=128 ** -0.5)
    ref = paged_decode_reference(q, k, v, pt, sl, page_size=ps, sm_scale=128 ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))
    for splits in (1, 7):
        out2 = paged_decode_triton(q, k, v, pt, sl, page_size=ps, sm_scale=128 ** -0.5,
                                   config=DecodeLaunchConfig(num_splits=splits))
        torch.testing.assert_close(out2.float(), ref.float(), **_tol(dtype))
