"""topk_bisect: the row held in registers, its threshold bisected (interpreted on CPU)
against the plain-Python selection and topk_select_reference, on the awkward cases (ties,
-inf / NaN, -0.0, all keys equal, fewer candidates than top_k, ranges sticking out of the
row, masked rows, crowded keys); the dispatch rule; on the GPU, the decode's shapes and a
CUDA-graph replay."""
import pytest
import torch

import sparsehi.kernels.topk as topk_mod
from sparsehi.kernels.topk import bisect_plan, topk_select, topk_select_reference, topk_select_triton
from sparsehi.kernels.topk_bisect import MAX_BLOCK, topk_select_bisect
from tests.test_topk_radix_grid import gpu_row_ranges, gpu_scores, ranges
from tests.test_topk_select import python_topk


def check(scores, top_k, cs, ce, mask=None):
    want = python_topk(scores, top_k, cs, ce, mask)
    got = topk_select_bisect(scores, top_k, cs, ce, mask)
    assert got[0].dtype == torch.int32 and got[1].dtype == torch.int32
    assert torch.equal(got[0], want[0]), f"ids\n{got[0]}\nwant\n{want[0]}"
    assert torch.equal(got[1], want[1]), f"valid {got[1]} want {want[1]}"
    ref = topk_select_reference(scores, top_k, cs, ce, mask)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    return got


def test_normal_scores_with_ranges_that_stick_out_of_the_row():
    torch.manual_seed(0)
    s = torch.randn(4, 1000)
    cs, ce = ranges((0, 1000), (-30, 700), (250, 1300), (900, 905))
    got = check(s, 120, cs, ce)
    assert got[1].tolist() == [120, 120, 120, 5]


def test_ties_are_taken_from_the_lower_ids():
    s = torch.zeros(3, 900)
    s[0, 500:] = 1.0  # 400 tied at the top: the first 150 of them
    s[1] = torch.randint(0, 4, (900,), generator=torch.Generator().manual_seed(1)).float()
    s[2, ::2] = -0.0  # -0.0 ties with +0.0: every id equal
    got = check(s, 150, *ranges((0, 900), (0, 900), (0, 900)))
    assert got[0][0].tolist() == list(range(500, 650))
    assert got[0][2].tolist() == list(range(150))


def test_unselectable_ids_masked_rows_and_fewer_candidates_than_top_k():
    torch.manual_seed(2)
    s = torch.randn(4, 1024)
    s[0, ::3] = float("-inf")
    s[1, 1::2] = float("nan")
    s[2] = float("-inf")
    s[2, [7, 9, 500]] = torch.tensor([0.0, -0.0, float("inf")])
    mask = torch.tensor([True, True, True, False])
    got = check(s, 600, *ranges((0, 1024), (0, 1024), (0, 1024), (0, 1024)), mask)
    assert got[1].tolist() == [600, 512, 3, 0]
    assert (got[0][3] == -1).all()


def test_keys_that_differ_in_the_last_bits_and_all_equal_keys():
    torch.manual_seed(3)
    bits = (torch.randint(0, 64, (2, 1500)) + 0x3F800000).to(torch.int32)  # 1.0 plus a few ulps
    s = bits.view(torch.float32)
    s[1] = 2.5
    got = check(s, 700, *ranges((0, 1500), (3, 1500)))
    assert got[0][1].tolist() == list(range(3, 703))


def test_crowded_and_half_precision_scores():
    torch.manual_seed(4)
    s = 1.0 + 1e-3 * torch.rand(2, 2048)
    check(s, 1000, *ranges((0, 2048), (100, 2000)))
    check(s.half(), 1000, *ranges((0, 2048), (100, 2000)))  # many ties after rounding


def test_one_and_every_id():
    torch.manual_seed(5)
    s = torch.randn(2, 1100)
    check(s, 1, *ranges((0, 1100), (1099, 1100)))
    got = check(s, 1100, *ranges((0, 1100), (50, 1100)))
    assert got[1].tolist() == [1100, 1050]


def test_bad_arguments_name_the_parameter():
    s = torch.randn(1, 100)
    cs, ce = ranges((0, 100))
    with pytest.raises(ValueError, match="num_warps"):
        topk_select_bisect(s, 3, cs, ce, num_warps=6)
    with pytest.raises(ValueError, match=str(MAX_BLOCK)):
        topk_select_bisect(torch.zeros(1, MAX_BLOCK + 1), 3, cs, ce)


def test_plan_rule():
    sms = 132
    assert bisect_plan(1, 8192, 2048, sms) and bisect_plan(1, 2048, 128, sms)
    assert bisect_plan(30, 6000, 2048, sms) and bisect_plan(200, 8192, 128, sms)
    assert not bisect_plan(1, 1024, 128, sms)  # shorter than measured
    assert not bisect_plan(1, 8192, 8192, sms)  # nothing to select against
    assert not bisect_plan(1, 8192, 128, sms)  # the chunk shortlists keep 1/64 of the row
    assert bisect_plan(1, 8192, 128, 0)  # without SMs to fill the shortlists do not apply
    assert bisect_plan(1, 4096, 128, sms)  # 1/32: the registers
    assert not bisect_plan(30, 16384, 2048, sms) and bisect_plan(64, 16384, 2048, sms)
    assert not bisect_plan(200, 32768, 2048, sms)


def test_dispatch_takes_the_bisection_where_the_plan_says(monkeypatch):
    taken = []
    real = topk_mod.topk_select_bisect

    def spy(*a, **kw):
        taken.append(a[0].shape)
        return real(*a, **kw)

    monkeypatch.setattr(topk_mod, "topk_select_bisect", spy)
    torch.manual_seed(6)
    s = torch.randn(2, 2048)
    cs, ce = ranges((0, 2048), (10, 2000))
    got = topk_select_triton(s, 300, cs, ce)
    assert taken == [s.shape]
    want = topk_select_reference(s, 300, cs, ce)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    topk_select_triton(s, 300, cs, ce, bisect=False)
    topk_select_triton(torch.randn(2, 1000), 300, cs, ce)  # below BISECT_MIN_IDS
    assert len(taken) == 1


GPU_CASES = [(1, 2048, 128), (30, 4096, 512), (64, 8192, 2048), (200, 8192, 128), (64, 16384, 2048),
             (3, 32768, 2048), (2, 6000, 5999)]


@pytest.mark.gpu
@pytest.mark.parametrize("b,n,k", GPU_CASES)
@pytest.mark.parametrize("kind", ["randn", "crowded", "ties"])
def test_gpu_bisect_equals_reference(b, n, k, kind):
    s = gpu_scores(kind, b, n)
    cs, ce, mask = gpu_row_ranges(b, n)
    want = topk_select_reference(s, k, cs, ce, mask)
    got = topk_select_bisect(s, k, cs, ce, mask)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    got = topk_select(s, k, cs, ce, mask)  # whichever plan the dispatch takes
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


@pytest.mark.gpu
def test_gpu_bisect_replays_in_a_cuda_graph():
    b, n, k = 5, 8192, 2048
    s = torch.randn(b, n, device="cuda")
    cs = torch.zeros(b, dtype=torch.int32, device="cuda")
    ce = torch.full((b,), n, dtype=torch.int32, device="cuda")
    assert bisect_plan(b, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    topk_select(s, k, cs, ce)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, valid = topk_select(s, k, cs, ce)
    for i in range(3):
        s.copy_(torch.randn(b, n, device="cuda"))
        ce.fill_(n - 1000 * i)
        graph.replay()
        want = topk_select_reference(s, k, cs, ce)
        assert torch.equal(ids, want[0]) and torch.equal(valid, want[1])
