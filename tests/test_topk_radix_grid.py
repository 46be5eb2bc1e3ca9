"""topk_radix_grid: the radix select spread over each row's chunks (interpreted on CPU)
against the torch reference and a plain-Python selection, on the cases its launches must
agree about: ties taken in part (the select on the ties' ids), keys sharing all their high
bits, -inf / NaN, candidate ranges and masked rows, fewer candidates than top_k; the
dispatch rule; on the GPU, DSA shapes against the reference, in a CUDA-graph replay too."""
import pytest
import torch

from sparsehi.kernels.topk import (MAX_PROGRAMS, MAX_ROWS, radix_grid_plan, topk_select, topk_select_reference,
                                   topk_select_triton)
from sparsehi.kernels.topk_radix_grid import CHUNK, REG_BLOCK, SMALL_BLOCK, topk_select_radix_grid
from tests.test_topk_select import python_topk


def check(scores, top_k, cs, ce, row_mask=None, chunks=None):
    n = scores.shape[1]
    chunks = chunks or 1 << max(0, -(-n // CHUNK) - 1).bit_length()
    got = topk_select_radix_grid(scores, top_k, cs, ce, row_mask, chunks)
    want = python_topk(scores, top_k, cs, ce, row_mask) if n <= 2500 else topk_select_reference(
        scores, top_k, cs, ce, row_mask)
    assert got[0].dtype == torch.int32 and got[1].dtype == torch.int32
    assert torch.equal(got[1], want[1]), f"valid {got[1]} want {want[1]}"
    assert torch.equal(got[0], want[0]), f"ids\n{got[0]}\nwant\n{want[0]}"
    return got


def ranges(*pairs):
    return (torch.tensor([p[0] for p in pairs], dtype=torch.int32),
            torch.tensor([p[1] for p in pairs], dtype=torch.int32))


def test_random_rows_with_ranges_and_a_masked_row():
    torch.manual_seed(0)
    s = torch.randn(3, 5000)
    cs, ce = ranges((0, 5000), (100, 4000), (7, 4500))
    check(s, 300, cs, ce)
    check(s, 300, cs, ce, torch.tensor([True, False, True]))


def test_ties_taken_in_part_go_to_the_lowest_ids():
    # few distinct values: the threshold's ties straddle chunks and only some are taken
    torch.manual_seed(1)
    s = torch.randint(0, 5, (2, 4500)).float()
    cs, ce = ranges((0, 4500), (33, 4400))
    ids, valid = check(s, 1000, cs, ce)
    assert valid.tolist() == [1000, 1000]


def test_all_keys_equal_and_neither_minus_inf_nor_nan_is_selected():
    s = torch.full((2, 4200), 2.0)
    s[:, ::7] = float("-inf")
    s[1, ::3] = float("nan")
    cs, ce = ranges((0, 4200), (5, 4200))
    ids, _ = check(s, 700, cs, ce)
    assert ids[0, :5].tolist() == [1, 2, 3, 4, 5]


def test_keys_sharing_their_high_bits_and_signed_zeros():
    torch.manual_seed(2)
    s = 1.0 + 1e-4 * torch.rand(2, 4300)
    s[0, 10], s[0, 11] = -0.0, 0.0
    s[1, :50] = 0.0
    s[1, 50:100] = -0.0
    cs, ce = ranges((0, 4300), (0, 4300))
    check(s, 400, cs, ce)
    check(s, 4250, cs, ce)  # row 1's zeros (of both signs) are ties at the threshold


def test_boundary_lists_either_side_of_the_small_register_block():
    # 3.0 above, 2.0 the boundary (its keys alone share the boundary digits), 1.0 below:
    # row 0's list holds 200 keys (the small block), row 1's 1000 (the full block)
    s = torch.ones(2, 5000)
    s[:, 4000:4100] = 3.0
    s[0, 10:2010:10] = 2.0
    s[1, 3:4003:4] = 2.0
    cs, ce = ranges((0, 5000), (0, 5000))
    assert int((s[0] == 2.0).sum()) <= SMALL_BLOCK < int((s[1] == 2.0).sum()) <= REG_BLOCK
    for k in (60, 100 + 137, 100 + 200):  # the threshold among the 3.0s; 2.0s taken in part; row 0's all
        check(s, k, cs, ce)


def test_a_boundary_digit_past_the_register_block_takes_the_list_passes():
    # every 2.0 shares the boundary digit: 7714 keys, more than REG_BLOCK, and only some taken
    s = torch.full((2, 9000), 2.0)
    s[:, ::7] = 3.0
    s[1, 5::11] = float("nan")
    cs, ce = ranges((0, 9000), (3, 8990))
    assert 9000 - 1286 > REG_BLOCK
    ids, valid = check(s, 2000, cs, ce)
    assert valid.tolist() == [2000, 2000]
    assert ids[0, :3].tolist() == [0, 1, 2]


def test_fewer_candidates_than_top_k_and_empty_rows():
    torch.manual_seed(3)
    s = torch.randn(3, 2100)
    cs, ce = ranges((0, 2100), (2000, 2100), (50, 50))
    ids, valid = check(s, 600, cs, ce, chunks=2)
    assert valid.tolist() == [600, 100, 0] and (ids[2] == -1).all()


def test_more_chunks_than_the_row_needs():
    torch.manual_seed(4)
    s = torch.randn(2, 3000)
    cs, ce = ranges((0, 3000), (1, 2999))
    check(s, 200, cs, ce, chunks=8)


def test_rows_far_shorter_than_n_skip_their_empty_chunks():
    # a decode's scores span the pool's max_context_len: most chunks start past the row's
    # candidates (here up to 7 of 8), and the top_k padding of -1 still reaches every column
    torch.manual_seed(5)
    s = torch.randn(5, 4500)
    s[:, 2500:] = float("-inf")  # what the indexer writes past a row's tokens
    cs, ce = ranges((0, 2100), (0, 2500), (2000, 2300), (0, 0), (0, 4500))
    check(s, 250, cs, ce, chunks=8)
    # a masked row, and more ids wanted than any row has
    check(s, 3000, cs, ce, torch.tensor([True, True, False, True, True]), chunks=8)


def test_bad_chunk_counts_are_refused():
    s = torch.randn(1, 5000)
    cs, ce = ranges((0, 5000))
    for chunks in (0, 2, 2.5):  # none, too few for 5000 ids, not an int
        with pytest.raises(ValueError, match="chunks="):
            topk_select_radix_grid(s, 10, cs, ce, None, chunks)


def test_a_chunk_count_that_is_no_power_of_two():
    """3 and 5 chunks of 2048 over rows of up to 5000 ids (the masked loads of the chunk
    stats and the per-chunk counts past the last chunk), with ties across chunk borders."""
    torch.manual_seed(7)
    s = torch.randn(3, 5000)
    s[1] = torch.randint(0, 3, (5000,)).float()  # many ties, spread over every chunk
    cs, ce = ranges((0, 5000), (0, 5000), (1500, 4900))
    for chunks in (3, 5):
        check(s, 700, cs, ce, chunks=chunks)
        # a row with fewer candidates than top_k: its count must not take in the next row's
        # first chunk (the stats loads past the row's P chunks are masked)
        got = check(s, 1500, *ranges((0, 1200), (0, 5000), (100, 4000)), chunks=chunks)
        assert got[1].tolist() == [1200, 1500, 1500]
    assert radix_grid_plan(1, 5000, 700) is None and radix_grid_plan(1, 32870, 2048) == 17


def test_plan_takes_long_rows_at_small_batches_only():
    assert radix_grid_plan(1, 32768, 2048) == 32768 // CHUNK
    assert radix_grid_plan(1, 40000, 2048) == 20  # the chunks covering the row
    assert radix_grid_plan(1, 4096, 256) is None  # short row
    assert radix_grid_plan(1, 8192, 4096) is None  # fewer than 4 ids per id selected
    assert radix_grid_plan(MAX_ROWS, 32768, 2048) == 16
    assert radix_grid_plan(MAX_ROWS + 1, 32768, 2048) is None  # one program per row is as fast
    p = radix_grid_plan(1, 1 << 20, 2048)  # a million ids: 512 chunks
    assert radix_grid_plan(MAX_PROGRAMS // p, 1 << 20, 2048) == p
    assert radix_grid_plan(MAX_PROGRAMS // p + 1, 1 << 20, 2048) is None


def test_dispatch_order_between_the_grid_and_the_chunk_shortlists(monkeypatch):
    """Where both plans apply (on a GPU of 132 SMs), top 2048 goes to the grid and top 512 to
    the shortlists; the result is the reference's either way (spies record the path, the
    real kernels run)."""
    import sparsehi.kernels.topk as topk_mod
    from sparsehi.kernels.topk_split import split_plan

    taken = []
    for name in ("topk_select_radix_grid", "topk_select_split"):
        real = getattr(topk_mod, name)

        def spy(*a, real=real, name=name, **kw):
            taken.append(name)
            return real(*a, **kw)

        monkeypatch.setattr(topk_mod, name, spy)
    monkeypatch.setattr(topk_mod, "sm_count", lambda device: 132)  # an H100's SMs: the interpreter has none
    torch.manual_seed(5)
    for n, k in ((8192, 2048), (16384, 512)):
        s = torch.randn(1, n)
        cs, ce = ranges((0, n))
        assert radix_grid_plan(1, n, k) is not None and split_plan(1, n, k, 132) is not None  # both apply
        taken.clear()
        got = topk_select_triton(s, k, cs, ce, bisect=False)  # rows of 8192 ids go to topk_bisect
        want = topk_select_reference(s, k, cs, ce)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert taken == (["topk_select_radix_grid"] if k >= topk_mod.GRID_BEFORE_SPLIT_TOP_K else
                         ["topk_select_split"])


GPU_CASES = [(1, 32768, 2048), (30, 32768, 2048), (4, 65536, 2048), (48, 16384, 2048), (2, 131072, 2048),
             (8, 32768, 512), (1, 8192, 2048), (16, 8192, 2048)]


def gpu_scores(kind, b, n):
    g = torch.Generator(device="cuda").manual_seed(b + n)
    if kind == "randn":
        return torch.randn(b, n, device="cuda", generator=g)
    if kind == "crowded":
        return 1.0 + 1e-3 * torch.rand(b, n, device="cuda", generator=g)
    if kind == "two_values":  # the boundary digit holds most of the row: the list passes
        s = torch.full((b, n), 2.0, device="cuda")
        s[:, ::9] = 3.0
        return s
    s = torch.randint(0, 40, (b, n), device="cuda", generator=g).float()  # many ties
    s[:, ::5] = float("-inf")
    return s


def gpu_row_ranges(b, n):
    """Candidate ranges starting up to 100 ids in and ending up to 100 ids short, and a row
    mask that drops the last row (unless it is the only one)."""
    cs = torch.randint(0, 100, (b,), device="cuda", dtype=torch.int32)
    ce = n - torch.randint(0, 100, (b,), device="cuda", dtype=torch.int32)
    mask = torch.ones(b, dtype=torch.bool, device="cuda")
    mask[-1] = b == 1
    return cs, ce, mask


@pytest.mark.gpu
@pytest.mark.parametrize("b,n,k", GPU_CASES)
@pytest.mark.parametrize("kind", ["randn", "crowded", "ties", "two_values"])
def test_gpu_radix_grid_equals_reference(b, n, k, kind):
    s = gpu_scores(kind, b, n)
    cs, ce, mask = gpu_row_ranges(b, n)
    want = topk_select_reference(s, k, cs, ce, mask)
    chunks = radix_grid_plan(b, n, k)
    assert chunks is not None
    got = topk_select_radix_grid(s, k, cs, ce, mask, chunks)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    got = topk_select_triton(s, k, cs, ce, mask)  # whichever the dispatch takes
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


@pytest.mark.gpu
def test_gpu_radix_grid_replays_in_a_cuda_graph():
    b, n, k = 3, 32768, 2048
    s = torch.randn(b, n, device="cuda")
    cs = torch.zeros(b, dtype=torch.int32, device="cuda")
    ce = torch.full((b,), n, dtype=torch.int32, device="cuda")
    topk_select(s, k, cs, ce)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = topk_select(s, k, cs, ce)
    for seed in range(3):
        s.copy_(torch.randn(b, n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        ce.fill_(n - 1000 * seed)
        g.replay()
        want = topk_select_reference(s, k, cs, ce)
        assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
