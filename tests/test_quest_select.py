"""Fused Quest selection (page bounds + chunk shortlists in one kernel, then the merge)
against the unfused path and the torch references: ties, -inf, padding rows, row mask,
candidate ranges, head reduce sum / max, bf16 and fp32 bounds; the pairwise D sum that
makes the score bits independent of the tiling; the split select's early-exit threshold."""
import pytest
import torch

from sparsehi.kernels.quest_score import quest_score, quest_score_reference, quest_score_triton
from sparsehi.kernels.quest_select import (FUSED_MAX_CHUNK_BYTES, quest_retrieve, quest_select_plan,
                                           quest_select_split)
from sparsehi.kernels.topk import topk_select, topk_select_reference
from sparsehi.kernels.topk_split import split_plan, topk_select_split


def _case(seed, b=3, hq=4, hkv=2, d=16, pages=96, dtype=torch.float32, integer=False, r=5):
    """Bounds of ``r`` request slots, a batch of ``b`` rows: one padding row (-1), one slot
    past the pool, lengths in tokens (page 16) from empty to past the last page, candidate
    ranges sticking out of the row and one empty. ``integer``: small integer values, so
    every product and sum is exact in float32 and the references give the kernels' bits
    (and many exact ties)."""
    g = torch.Generator().manual_seed(seed)
    if integer:
        q = torch.randint(-3, 4, (b, hq, d), generator=g).float()
        kmin = torch.randint(-4, 3, (r, pages, hkv, d), generator=g).float()
        kmax = kmin + torch.randint(0, 3, kmin.shape, generator=g).float()
    else:
        q = torch.randn(b, hq, d, generator=g)
        kmin = torch.randn(r, pages, hkv, d, generator=g)
        kmax = kmin + torch.rand(kmin.shape, generator=g)
    req = torch.randint(0, r, (b,), generator=g)
    req[0] = -1  # padding row
    if b > 2:
        req[2] = r + 1  # out of the pool: treated as padding
    lengths = torch.randint(0, pages * 16 + 40, (b,), generator=g, dtype=torch.int32)
    cs = torch.randint(-5, pages // 3, (b,), generator=g)
    ce = cs + torch.randint(-2, pages + 10, (b,), generator=g)
    return q, kmin.to(dtype), kmax.to(dtype), req, lengths, cs, ce


def _unfused(q, kmin, kmax, req, lengths, reduce, top_k, cs, ce, mask):
    return topk_select_reference(quest_score_triton(q, kmin, kmax, req, lengths, reduce, page_size=16), top_k, cs, ce,
                                 mask)


def _assert_same(got, want):
    assert torch.equal(got[0], want[0]), f"ids\n{got[0]}\nwant\n{want[0]}"
    assert torch.equal(got[1], want[1]), f"valid {got[1]} want {want[1]}"


@pytest.mark.parametrize("reduce", ["sum", "max"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_equals_the_references_with_ties(reduce, dtype):
    """Integer bounds: the torch references compute the kernels' exact values, with ties
    everywhere (lower page ids win), across several chunkings."""
    q, kmin, kmax, req, lengths, cs, ce = _case(1, integer=True, dtype=dtype)
    mask = torch.tensor([True, True, False])
    for top_k, plan in ((8, (2, 64)), (20, (4, 32)), (150, (2, 64))):  # 150: more than any row holds
        want = topk_select_reference(quest_score_reference(q, kmin, kmax, req, lengths, reduce, page_size=16), top_k,
                                     cs, ce, mask)
        got = quest_select_split(q, kmin, kmax, req, lengths, reduce, 16, top_k, cs, ce, mask, plan)
        _assert_same(got, want)
        assert got[1][0] == 0 and got[1][2] == 0  # padding row, masked row


@pytest.mark.parametrize("reduce", ["sum", "max"])
@pytest.mark.parametrize("seed", [2])
def test_fused_equals_score_kernel_then_select(reduce, seed):
    """Random float bounds (D not a power of two, GQA group 3, no row mask): the fused
    scores are the score kernel's bits, so the selection is identical."""
    q, kmin, kmax, req, lengths, cs, ce = _case(seed, b=4, hq=6, hkv=2, d=24, pages=130)
    want = _unfused(q, kmin, kmax, req, lengths, reduce, 16, cs, ce, None)
    for plan in ((2, 128), (8, 32)):
        _assert_same(quest_select_split(q, kmin, kmax, req, lengths, reduce, 16, 16, cs, ce, None, plan), want)
    # and the selection agrees with the pure torch pipeline where the scores are not near-ties
    ref = topk_select_reference(quest_score_reference(q, kmin, kmax, req, lengths, reduce, page_size=16), 16, cs, ce)
    assert torch.equal(ref[1], want[1])


def test_minus_inf_and_nan_pages_are_never_selected():
    """A page whose bound is -inf (bounds of -inf) or NaN is skipped like past-the-context
    pages; rows with fewer selectable pages than top_k return what there is."""
    q, kmin, kmax, req, lengths, cs, ce = _case(4, b=2, pages=64, integer=True)
    req = torch.tensor([1, 3])
    lengths = torch.tensor([64 * 16, 20 * 16], dtype=torch.int32)
    cs, ce = torch.zeros(2, dtype=torch.long), torch.full((2,), 64)
    kmin[1, 5:40] = float("-inf")
    kmax[1, 5:40] = float("-inf")
    q[0] = q[0].abs() + 1  # q > 0: the bound of a -inf page is -inf
    kmin[3, 7] = kmax[3, 7] = float("nan")
    want = _unfused(q, kmin, kmax, req, lengths, "sum", 40, cs, ce, None)
    got = quest_select_split(q, kmin, kmax, req, lengths, "sum", 16, 40, cs, ce, None, (2, 32))
    _assert_same(got, want)
    assert got[1].tolist() == [29, 19]  # 64 - 35 pages; 20 pages less the NaN one
    assert not set(got[0][0].tolist()) & set(range(5, 40)) and 7 not in got[0][1].tolist()


def test_dispatch_fuses_only_when_asked_and_equals_the_unfused_path(monkeypatch):
    monkeypatch.setenv("SPARSEHI_FORCE_TRITON", "1")
    q, kmin, kmax, req, lengths, cs, ce = _case(5, pages=100)
    mask = torch.tensor([True, False, True])
    unfused = quest_retrieve(q, kmin, kmax, req, lengths, "max", 16, 12, cs, ce, mask, fused=False)
    _assert_same(unfused, _unfused(q, kmin, kmax, req, lengths, "max", 12, cs, ce, mask))
    _assert_same(quest_retrieve(q, kmin, kmax, req, lengths, "max", 16, 12, cs, ce, mask, fused=True), unfused)
    # a GPU-sized plan (as split_plan makes it on CUDA)
    monkeypatch.setattr("sparsehi.kernels.quest_select.sm_count", lambda dev: 132)
    assert quest_select_plan(3, 100, 12, 132, 2 * 2 * 16 * 4) == split_plan(3, 100, 12, 132) == (4, 32)
    _assert_same(quest_retrieve(q, kmin, kmax, req, lengths, "max", 16, 12, cs, ce, mask, fused=True), unfused)
    # the default scores apart (measured faster on the GPU): no fused launch
    import triton.runtime.interpreter as interp

    names = []
    real = interp.InterpretedFunction.run
    monkeypatch.setattr(interp.InterpretedFunction, "run",
                        lambda self, *a, **k: names.append(self.fn.__name__) or real(self, *a, **k))
    _assert_same(quest_retrieve(q, kmin, kmax, req, lengths, "max", 16, 12, cs, ce, mask), unfused)
    assert "_quest_chunk_topk_kernel" not in names and "_quest_score_kernel" in names, names
    monkeypatch.setattr(interp.InterpretedFunction, "run", real)
    # the CPU reference path: the same ids
    monkeypatch.setenv("SPARSEHI_FORCE_TRITON", "0")
    ref = quest_retrieve(q, kmin, kmax, req, lengths, "max", 16, 12, cs, ce, mask)
    assert torch.equal(ref[1], unfused[1])


def test_plan_rules():
    # tiny-gqa at 32k, page 16: 2048 pages, 2 KV heads x 32 bf16 = 256 B of bounds a page
    assert quest_select_plan(2, 2048, 128, 132, 256) == (4, 512)
    # Llama-8B at 64k: 8 KiB a page, chunks of megabytes: scored apart on the full grid
    assert quest_select_plan(1, 4096, 128, 132, 8192) is None
    assert split_plan(1, 4096, 128, 132) is not None
    assert quest_select_plan(200, 2048, 128, 132, 256) is None  # enough rows: no split
    assert 512 * 256 <= FUSED_MAX_CHUNK_BYTES < 512 * 8192
    q, kmin, kmax, req, lengths, cs, ce = _case(6)
    with pytest.raises(ValueError, match="plan"):
        quest_select_split(q, kmin, kmax, req, lengths, "sum", 16, 8, cs, ce, None, (2, 32))  # 64 < 96 pages
    with pytest.raises(ValueError, match="head_reduce"):
        quest_select_split(q, kmin, kmax, req, lengths, "mean", 16, 8, cs, ce, None, (2, 64))
    with pytest.raises(ValueError, match="row_mask"):
        quest_select_split(q, kmin, kmax, req, lengths, "sum", 16, 8, cs, ce, torch.ones(3), (2, 64))


def test_score_bits_do_not_depend_on_the_tiling():
    """The pairwise sum over D: every tiling and warp count gives the same float32 bits."""
    q, kmin, kmax, req, lengths, _, _ = _case(7, b=2, hq=4, d=32, pages=40)
    base = quest_score_triton(q, kmin, kmax, req, lengths, "sum", page_size=16)
    # (4, 2, True): a GPU's default below 32 rows (the interpreter's default takes 64 pages)
    for block_p, warps, unroll in ((4, 2, True), (16, 4, False), (8, 1, True), (32, 8, False)):
        other = quest_score_triton(q, kmin, kmax, req, lengths, "sum", page_size=16, block_p=block_p,
                                   num_warps=warps, unroll=unroll)
        assert torch.equal(base, other)


@pytest.mark.parametrize("kind", ["last_bits", "all_needed", "boundary_ties", "one_value"])
def test_split_select_early_exit_cases(kind):
    """The threshold search stops once the boundary digit is wholly needed: keys that differ
    only in their last bits (every pass), exactly top_k selectable, a tie group straddling
    the boundary, one value everywhere."""
    g = torch.Generator().manual_seed(8)
    b, n, top_k = 2, 200, 24
    if kind == "last_bits":
        s = 1.0 + torch.randint(0, 1 << 20, (b, n), generator=g).float() * 2.0 ** -23  # 3 digits to find
    elif kind == "all_needed":
        s = torch.randn(b, n, generator=g)
        s[:, top_k:] = float("-inf")
    elif kind == "boundary_ties":
        s = torch.randn(b, n, generator=g)
        s[:, ::7] = 0.5  # 29 ids of one value around the boundary rank
    else:
        s = torch.full((b, n), 3.0)
    cs, ce = torch.tensor([0, 3]), torch.tensor([n, n - 1])
    want = topk_select_reference(s, top_k, cs, ce)
    for plan in ((2, 128), (4, 64), (8, 32)):
        _assert_same(topk_select_split(s, top_k, cs, ce, None, plan), want)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("b, hq, hkv, d, pages, top_k", [(2, 4, 2, 32, 2048, 128), (1, 32, 8, 128, 4096, 128),
                                                         (2, 32, 8, 128, 4096, 128)])
@pytest.mark.parametrize("reduce", ["sum", "max"])
def test_gpu_fused_is_bit_identical_to_score_then_select(b, hq, hkv, d, pages, top_k, reduce):
    """The decode shapes (tiny-gqa 32k, Llama-8B 64k; page 16): the fused path (forced where
    the plan would score apart) selects exactly what quest_score + topk_select select."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    r = b + 2
    for integer in (False, True):  # random bounds; small integers (exact ties)
        if integer:
            kmin = torch.randint(-4, 3, (r, pages, hkv, d), device=dev).to(torch.bfloat16)
            kmax = kmin + torch.randint(0, 3, kmin.shape, device=dev).to(torch.bfloat16)
            q = torch.randint(-3, 4, (b, hq, d), device=dev).to(torch.bfloat16)
        else:
            kmin = torch.randn(r, pages, hkv, d, device=dev).to(torch.bfloat16)
            kmax = (kmin.float() + torch.rand(kmin.shape, device=dev)).to(torch.bfloat16)
            q = torch.randn(b, hq, d, device=dev).to(torch.bfloat16)
        req = torch.randperm(r, device=dev)[:b]
        seq = torch.full((b,), pages * 16 - 5, device=dev, dtype=torch.int32)
        cs = torch.ones(b, device=dev, dtype=torch.int32)
        ce = torch.full((b,), pages - 4, device=dev, dtype=torch.int32)
        mask = torch.ones(b, dtype=torch.bool, device=dev)
        scores = quest_score(q, kmin, kmax, req, seq, reduce, page_size=16)
        want = topk_select(scores, top_k, cs, ce, mask)
        for fused in (None, True):
            got = quest_retrieve(q, kmin, kmax, req, seq, reduce, 16, top_k, cs, ce, mask, fused=fused)
            _assert_same(got, want)
        # the pairwise D sum: other tilings give the same bits
        wide = quest_score_triton(q, kmin, kmax, req, seq, reduce, page_size=16, block_p=16, num_warps=4, unroll=False)
        assert torch.equal(scores, wide)
        ref = topk_select_reference(scores, top_k, cs, ce, mask)
        _assert_same(ref, want)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    plan = quest_select_plan(b, pages, top_k, sms, 2 * hkv * d * 2)
    assert (plan is not None) == (d == 32)  # the plan fuses tiny-gqa's chunks, not the Llama shape's


@pytest.mark.gpu
def test_gpu_fused_select_replays_in_a_cuda_graph():
    dev = torch.device("cuda")
    torch.manual_seed(1)
    b, hq, hkv, d, pages = 4, 4, 2, 32, 2048
    kmin = torch.randn(b, pages, hkv, d, device=dev).to(torch.bfloat16)
    kmax = (kmin.float() + torch.rand(kmin.shape, device=dev)).to(torch.bfloat16)
    q = torch.randn(b, hq, d, device=dev).to(torch.bfloat16)
    req = torch.tensor([2, 0, -1, 1], device=dev)
    seq = torch.tensor([30000, 100, 5, 32000], device=dev, dtype=torch.int32)  # stays within 2048 pages
    cs = torch.ones(b, device=dev, dtype=torch.int32)
    ce = torch.full((b,), pages - 4, device=dev, dtype=torch.int32)
    mask = torch.tensor([True, True, False, True], device=dev)

    def run():
        return quest_retrieve(q, kmin, kmax, req, seq, "sum", 16, 128, cs, ce, mask, fused=True)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, valid = run()
    for step in range(3):
        q.copy_(torch.randn(b, hq, d, device=dev).to(torch.bfloat16))
        seq.add_(16)
        graph.replay()
        want = quest_retrieve(q, kmin, kmax, req, seq, "sum", 16, 128, cs, ce, mask, fused=False)
        torch.cuda.synchronize()
        _assert_same((ids, valid), want)
