"""Backend adapters: SparseSelection → metadata → decode equals dense SDPA over the
selected KV gathered independently of the adapters."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparsehi.adapters import (
    DSAAdapter,
    FlashAttentionAdapter,
    FlashAttentionMetadata,
    TritonAdapter,
    create_adapter,
)
from sparsehi.selection import SparseMode
from sparsehi.kernels.paged_decode import flash_attn_with_kvcache_reference
from sparsehi.selection import SparseSelection

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(atol=3e-3, rtol=3e-3)


def make_selection(seq_lens, ps, num_pages, keep=0.5, seed=0, width=None):
    """Random selection (sink page, random middle pages, last page) with distinct
    physical pages (never page 0). Returns the selection and per-row token slot lists
    in logical order (the ground truth an adapter must reproduce)."""
    g = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    phys_pool = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    rows_l, rows_p, truth = [], [], []
    for n in seq_lens:
        if n == 0:
            rows_l.append([]); rows_p.append([]); truth.append([])
            continue
        last = (n - 1) // ps
        mid = [p for p in range(1, last) if torch.rand(1, generator=g).item() < keep]
        lids = sorted(set([0, last] + mid))
        pids = [phys_pool.pop() for _ in lids]
        slots = []
        for lid, pid in zip(lids, pids):
            cnt = ps if lid < last else n - last * ps
            slots += [pid * ps + o for o in range(cnt)]
        rows_l.append(lids); rows_p.append(pids); truth.append(slots)
    N = width or max(1, max(len(r) for r in rows_l))
    pad = lambda r: r + [-1] * (N - len(r))  # noqa: E731
    sel = SparseSelection(
        logical_ids=torch.tensor([pad(r) for r in rows_l], dtype=torch.int32, device=DEV),
        physical_ids=torch.tensor([pad(r) for r in rows_p], dtype=torch.int32, device=DEV),
        num_valid=torch.tensor([len(r) for r in rows_l], dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        page_size=ps,
        mode=SparseMode.TOKEN_WISE if ps == 1 else SparseMode.PAGE_WISE,
    )
    return sel, truth


def mha_pool(num_slots, Hkv, D, dtype=torch.float16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_slots, Hkv, D, generator=g).to(DEV, dtype),
            torch.randn(num_slots, Hkv, D, generator=g).to(DEV, dtype))


def sdpa_truth(q, k, v, truth, scale):
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    for b, slots in enumerate(truth):
        if not slots:
            continue
        s = torch.tensor(slots, device=q.device)
        o = F.scaled_dot_product_attention(q[b][None, :, None].float(), k[s].transpose(0, 1)[None].float(),
                                           v[s].transpose(0, 1)[None].float(), scale=scale, enable_gqa=True)
        out[b] = o[0, :, 0].to(q.dtype)
    return out


@pytest.mark.parametrize("name", ["flashattention", "triton"])
@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("ps", [1, 4])
def test_mha_adapter_equals_sdpa_over_gathered_kv(name, impl, ps):
    num_pages = 64 // ps * 4
    sel, truth = make_selection([0, 30, 17 if ps > 1 else 9, 4], ps, num_pages, seed=ps)
    k, v = mha_pool(num_pages * ps, 2, 16)
    q = torch.randn(4, 4, 16, generator=torch.Generator().manual_seed(9)).to(DEV, torch.float16)
    ad = create_adapter(name, impl=impl)
    md = ad.build_metadata(sel)
    out = ad.forward_decode(q, (k, v), md, sm_scale=0.25)
    torch.testing.assert_close(out.float(), sdpa_truth(q, k, v, truth, 0.25).float(), **TOL)
    assert torch.all(out[0] == 0), "empty row must give zeros"


def test_flash_metadata_is_the_flash_attn_contract():
    ps = 4
    sel, truth = make_selection([0, 23, 8], ps, 32, seed=3, width=6)
    md = FlashAttentionAdapter(impl="triton").build_metadata(sel)
    assert isinstance(md, FlashAttentionMetadata)
    assert md.page_table.dtype == torch.int32 and md.page_table.shape == (3, 6)
    assert md.cache_seqlens.tolist() == [len(t) for t in truth]
    assert md.cu_seqlens_k.tolist() == [0, len(truth[0]), len(truth[0]) + len(truth[1]), sum(map(len, truth))]
    nv = sel.num_valid.tolist()
    for b in range(3):
        assert md.page_table[b, : nv[b]].tolist() == sel.physical_ids[b, : nv[b]].tolist()
        assert md.page_table[b, nv[b]:].eq(0).all(), "padding is page 0"
    # adapter output == pure-torch flash_attn_with_kvcache over the same metadata
    k, v = mha_pool(32 * ps, 2, 16)
    q = torch.randn(3, 8, 16).to(DEV, torch.float16)
    out = FlashAttentionAdapter(impl="triton").forward_decode(q, (k, v), md, sm_scale=0.25)
    fa = flash_attn_with_kvcache_reference(q[:, None], k.view(32, ps, 2, 16), v.view(32, ps, 2, 16),
                                           md.cache_seqlens, md.page_table, softmax_scale=0.25)[:, 0]
    torch.testing.assert_close(out.float(), fa.float(), **TOL)


def test_triton_metadata_is_packed_token_slots():
    sel, truth = make_selection([13, 0, 6], 4, 32, seed=5, width=5)
    md = TritonAdapter().build_metadata(sel)
    assert md.kv_indices.shape == (3 * 5 * 4,) and md.max_kv_len == 20
    ptr = md.kv_indptr.tolist()
    assert ptr == [0, 13, 13, 19]
    for b in range(3):
        assert md.kv_indices[ptr[b]:ptr[b + 1]].tolist() == truth[b]
    assert md.kv_indices[ptr[3]:].eq(0).all()


def test_physical_permutation_gives_same_output():
    ps = 4
    sel, truth = make_selection([30, 21], ps, 40, seed=8)
    k, v = mha_pool(40 * ps, 2, 16)
    q = torch.randn(2, 4, 16).to(DEV, torch.float16)
    perm = torch.randperm(39, generator=torch.Generator().manual_seed(2)).to(DEV) + 1
    perm = torch.cat([torch.zeros(1, dtype=perm.dtype, device=DEV), perm])   # page 0 stays padding
    k2, v2 = torch.empty_like(k), torch.empty_like(v)
    slot_perm = (perm[:, None] * ps + torch.arange(ps, device=DEV)).reshape(-1)
    k2[slot_perm], v2[slot_perm] = k, v
    pid = sel.physical_ids.long()
    sel2 = SparseSelection(sel.logical_ids, torch.where(pid >= 0, perm[pid.clamp(min=0)], pid).int(),
                           sel.num_valid, sel.seq_lens, ps, sel.mode)
    for name in ("flashattention", "triton"):
        ad = create_adapter(name, impl="triton")
        o1 = ad.forward_decode(q, (k, v), ad.build_metadata(sel), sm_scale=0.25)
        o2 = ad.forward_decode(q, (k2, v2), ad.build_metadata(sel2), sm_scale=0.25)
        torch.testing.assert_close(o2.float(), o1.float(), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("ps", [1, 4])
def test_dsa_adapter_equals_sdpa_over_gathered_latents(impl, ps):
    Dl, Dr, H = 32, 16, 16
    num_pages = 128 // ps
    sel, truth = make_selection([0, 25, 9], ps, num_pages, seed=11 + ps)
    g = torch.Generator().manual_seed(4)
    kv = torch.randn(num_pages * ps, 1, Dl + Dr, generator=g).to(DEV, torch.float16)
    q = torch.randn(3, H, Dl + Dr, generator=g).to(DEV, torch.float16)
    ad = create_adapter("dsa", kv_lora_rank=Dl, impl=impl)
    md = ad.build_metadata(sel)
    assert md.indices.dtype == torch.int32
    for b, slots in enumerate(truth):
        row = md.indices[b]
        assert row[row >= 0].tolist() == slots and row[len(slots):].eq(-1).all()
    out = ad.forward_decode(q, (kv,), md, sm_scale=0.2)
    expect = sdpa_truth(q, kv, kv[..., :Dl], truth, 0.2)
    torch.testing.assert_close(out.float(), expect.float(), **TOL)
    assert torch.all(out[0] == 0)


def test_auto_impl_on_cpu_matches_triton():
    sel, truth = make_selection([17, 9], 4, 16, seed=21)
    k, v = mha_pool(64, 1, 16)
    q = torch.randn(2, 2, 16).to(DEV, torch.float16)
    outs = []
    for impl in ("auto", "triton"):
        ad = FlashAttentionAdapter(impl=impl)
        outs.append(ad.forward_decode(q, (k, v), ad.build_metadata(sel), sm_scale=0.3))
    torch.testing.assert_close(outs[0].float(), outs[1].float(), **TOL)


def test_errors_name_the_parameter():
    sel, _ = make_selection([9, 5], 4, 16)
    k, v = mha_pool(64, 2, 16)
    q = torch.randn(2, 4, 16).to(DEV, torch.float16)
    fa = FlashAttentionAdapter(impl="reference")
    md = fa.build_metadata(sel)
    with pytest.raises(ValueError, match="adapter name"):
        create_adapter("flashinfer")
    with pytest.raises(ValueError, match="impl"):
        TritonAdapter(impl="cuda")
    with pytest.raises(ValueError, match="layer_cache"):
        fa.forward_decode(q, (k,), md, sm_scale=0.25)
    with pytest.raises(ValueError, match="layer_cache"):
        DSAAdapter(kv_lora_rank=8).forward_decode(q, (k, v), DSAAdapter(8).build_metadata(sel), sm_scale=0.25)
    with pytest.raises(ValueError, match="q"):
        fa.forward_decode(q[:1], (k, v), md, sm_scale=0.25)
    with pytest.raises(ValueError, match="k_buffer"):
        fa.forward_decode(q, (k.float(), v), md, sm_scale=0.25)
    with pytest.raises(ValueError, match="metadata"):
        fa.forward_decode(q, (k, v), TritonAdapter().build_metadata(sel), sm_scale=0.25)
    bad = SparseSelection(sel.logical_ids, sel.physical_ids[:, :1], sel.num_valid, sel.seq_lens, 4, sel.mode)
    with pytest.raises(ValueError, match="physical_ids"):
        fa.build_metadata(bad)
    bad = SparseSelection(sel.logical_ids, sel.physical_ids, sel.num_valid[:1], sel.seq_lens, 4, sel.mode)
    with pytest.raises(ValueError, match="num_valid"):
        TritonAdapter().build_metadata(bad)
    bad = SparseSelection(sel.logical_ids.float(), sel.physical_ids, sel.num_valid, sel.seq_lens, 4, sel.mode)
    with pytest.raises(ValueError, match="logical_ids"):
        DSAAdapter(8).build_metadata(bad)
    bad = SparseSelection(sel.logical_ids, sel.physical_ids, sel.num_valid, sel.seq_lens, 4, SparseMode.TOKEN_WISE)
    with pytest.raises(ValueError, match="page_size"):
        fa.build_metadata(bad)


def test_selection_checker_has_its_own_name():
    """The adapters' SparseSelection checker is ``check_sparse_selection``; the name
    ``check_selection`` belongs to sparsehi.algorithms.base (retrieve_topk results) only."""
    import sparsehi.adapters.flash_attention as fa_mod
    from sparsehi.algorithms import base

    assert not hasattr(fa_mod, "check_selection")
    sel, _ = make_selection([9, 5], 4, 16)
    assert fa_mod.check_sparse_selection(sel) == (2, sel.logical_ids.shape[1])
    with pytest.raises(ValueError, match="selection"):
        fa_mod.check_sparse_selection((sel.logical_ids, sel.physical_ids))
    assert base.check_selection is not fa_mod.check_sparse_selection
