"""topk_select: the Triton radix select (interpreted on CPU) against its torch reference and
a plain-Python selection, on the awkward cases: ties, -inf / NaN, rows with fewer
candidates than top_k, candidate ranges sticking out of the row, padding rows, rows
longer than a chunk, keys that differ only in their last bits."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from sparsehi.kernels.topk import topk_select, topk_select_reference, topk_select_triton

# small chunks so that interpreted rows of a few hundred ids take several passes
SMALL = dict(sample=256, block=256, list_block=256)


def python_topk(scores, top_k, cs, ce, row_mask=None):
    """The selection spelled out: candidates that are not -inf/NaN, by descending score then
    ascending id, the first top_k, returned in ascending id order."""
    b, n = scores.shape
    out, valid = [], []
    for r in range(b):
        cand = []
        if row_mask is None or bool(row_mask[r]):
            for i in range(max(int(cs[r]), 0), min(int(ce[r]), n)):
                v = float(scores[r, i])
                if not math.isnan(v) and v != -math.inf:
                    cand.append((-v, i))
        picked = sorted(i for _, i in sorted(cand)[:top_k])
        out.append(picked + [-1] * (top_k - len(picked)))
        valid.append(len(picked))
    return torch.tensor(out, dtype=torch.int32).view(b, top_k), torch.tensor(valid, dtype=torch.int32)


def check_all(scores, top_k, cs, ce, row_mask=None, **launch):
    want = python_topk(scores, top_k, cs, ce, row_mask)
    ref = topk_select_reference(scores, top_k, cs, ce, row_mask)
    tri = topk_select_triton(scores, top_k, cs, ce, row_mask, **(launch or SMALL))
    for name, got in (("reference", ref), ("triton", tri)):
        assert got[0].dtype == torch.int32 and got[1].dtype == torch.int32, name
        assert torch.equal(got[0], want[0]), f"{name} ids\n{got[0]}\nwant\n{want[0]}"
        assert torch.equal(got[1], want[1]), f"{name} valid {got[1]} want {want[1]}"
    return tri


def test_hand_worked_example():
    scores = torch.tensor([[5.0, 1.0, 4.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0, 0.0]])
    ids, valid = topk_select_triton(scores, 3, torch.tensor([1, 3]), torch.tensor([5, 5]), **SMALL)
    # row 0: candidates 1..4 -> 4.0 (id 2), 4.0 (id 4), 3.0 (id 3); row 1: ids 3, 4 only
    assert ids.tolist() == [[2, 3, 4], [3, 4, -1]] and valid.tolist() == [3, 2]


def test_ties_break_towards_the_lower_id():
    scores = torch.zeros(2, 700)
    scores[0, 100:] = 1.0  # 600 tied at the top, 3 chunks
    out = check_all(scores, 130, torch.tensor([0, 0]), torch.tensor([700, 700]))
    assert out[0][0].tolist() == list(range(100, 230))
    assert out[0][1].tolist() == list(range(130))  # row 1: all equal -> the first 130


def test_unselectable_scores_and_empty_rows():
    s = torch.tensor([[1.0, float("-inf"), float("nan"), 2.0, float("inf"), -0.0, 0.0, -3.0],
                      [float("-inf")] * 8,
                      [float("nan")] * 8])
    out = check_all(s, 6, torch.zeros(3, dtype=torch.int32), torch.full((3,), 8, dtype=torch.int32))
    assert out[0][0].tolist() == [0, 3, 4, 5, 6, 7] and out[1].tolist() == [6, 0, 0]
    assert (out[0][1:] == -1).all()


def test_negative_zero_ties_with_zero():
    s = torch.tensor([[-0.0, 0.0, -1.0], [0.0, -0.0, -1.0]])
    out = check_all(s, 1, torch.tensor([0, 0]), torch.tensor([3, 3]))
    assert out[0].tolist() == [[0], [0]]


def test_fewer_candidates_than_top_k_and_ranges_outside_the_row():
    torch.manual_seed(0)
    s = torch.randn(4, 300)
    cs = torch.tensor([-50, 290, 0, 310], dtype=torch.int64)
    ce = torch.tensor([5, 400, 0, 320], dtype=torch.int64)  # partly before, partly after, empty, past the end
    out = check_all(s, 20, cs, ce)
    assert out[1].tolist() == [5, 10, 0, 0]


def test_padding_rows_select_nothing():
    torch.manual_seed(1)
    s = torch.randn(3, 500)
    mask = torch.tensor([True, False, True])
    out = check_all(s, 64, torch.tensor([0, 0, 10]), torch.tensor([500, 500, 400]), mask)
    assert out[1].tolist() == [64, 0, 64] and (out[0][1] == -1).all()


def test_long_rows_and_keys_that_differ_in_the_last_bits():
    """Every radix digit matters: scores one ulp apart around 1.0, and a wide range."""
    torch.manual_seed(2)
    base = torch.full((1, 1000), 1.0).view(torch.int32)
    close = (base + torch.randint(-300, 300, (1, 1000), dtype=torch.int32)).view(torch.float32)
    wide = torch.randn(1, 1000) * torch.logspace(-30, 30, 1000)[None]
    s = torch.cat([close, wide])
    for k in (1, 255, 256, 257, 999, 1000, 1500):
        check_all(s, k, torch.tensor([0, 3], dtype=torch.int32), torch.tensor([1000, 1000], dtype=torch.int32))


def test_long_rows_whose_sample_misleads():
    """Rows longer than the sample pick a floor from every stride-th candidate; when the
    sample overestimates (or sees nothing selectable) the pass keeps every selectable id."""
    n = 1024  # sample 256 -> stride 4
    s = torch.rand(4, n)
    s[0, ::4] += 100.0  # the sample is all large: its floor is far above the 200th key
    s[1, ::4] = float("-inf")  # the sample sees nothing selectable
    s[2, 1::2] = float("nan")  # fewer selectable ids (512) than top_k asks for (600 below)
    s[3] = torch.arange(n, 0, -1).float()  # sorted: the top ids are the first ones
    cs, ce = torch.zeros(4, dtype=torch.int32), torch.full((4,), n, dtype=torch.int32)
    out = check_all(s, 200, cs, ce)
    assert out[0][3].tolist() == list(range(200))
    out = check_all(s, 600, cs, ce)
    assert out[1].tolist() == [600, 600, 512, 600]


def test_default_blocks_and_bf16_scores():
    torch.manual_seed(3)
    s = torch.randn(2, 5000).bfloat16()  # many ties in bf16, more than one default chunk
    out = check_all(s.float(), 300, torch.tensor([0, 17]), torch.tensor([5000, 4000]), block=4096, list_block=1024)
    tri = topk_select_triton(s, 300, torch.tensor([0, 17]), torch.tensor([5000, 4000]))
    assert torch.equal(tri[0], out[0]) and torch.equal(tri[1], out[1])


def test_dispatch_uses_the_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("SPARSEHI_FORCE_TRITON", raising=False)
    s = torch.randn(2, 50)
    a = topk_select(s, 7, torch.tensor([0, 5]), torch.tensor([50, 40]))
    monkeypatch.setenv("SPARSEHI_FORCE_TRITON", "1")
    b = topk_select(s, 7, torch.tensor([0, 5]), torch.tensor([50, 40]))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_bad_arguments_name_the_parameter():
    s = torch.randn(2, 10)
    cs, ce = torch.tensor([0, 0]), torch.tensor([10, 10])
    for fn in (topk_select_reference, topk_select_triton):
        with pytest.raises(ValueError, match="top_k"):
            fn(s, 0, cs, ce)
        with pytest.raises(ValueError, match="scores"):
            fn(s[0], 3, cs, ce)
        with pytest.raises(ValueError, match="scores"):
            fn(s.long(), 3, cs, ce)
        with pytest.raises(ValueError, match="candidate_start"):
            fn(s, 3, cs.float(), ce)
        with pytest.raises(ValueError, match="candidate_end"):
            fn(s, 3, cs, ce[:1])
        with pytest.raises(ValueError, match="row_mask"):
            fn(s, 3, cs, ce, torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="block"):
        topk_select_triton(s, 3, cs, ce, block=100)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 3), n=st.integers(1, 700), top_k=st.integers(1, 300),
       kind=st.sampled_from(["normal", "ties", "special"]), use_mask=st.booleans(), wide=st.booleans())
def test_kernel_equals_reference_and_python(seed, b, n, top_k, kind, use_mask, wide):
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":
        s = torch.randint(-2, 3, (b, n), generator=g).float()
    else:
        s = torch.randn(b, n, generator=g) * (1e6 if wide else 1.0)
    if kind == "special":
        pick = torch.rand(b, n, generator=g)
        s = torch.where(pick < 0.1, float("nan"), s)
        s = torch.where((pick >= 0.1) & (pick < 0.3), float("-inf"), s)
        s = torch.where((pick >= 0.3) & (pick < 0.32), float("inf"), s)
    cs = torch.randint(-20, n + 5, (b,), generator=g)
    ce = cs + torch.randint(-5, n + 30, (b,), generator=g)
    dtype = torch.int32 if seed % 2 else torch.int64
    mask = (torch.rand(b, generator=g) < 0.8) if use_mask else None
    check_all(s, top_k, cs.to(dtype), ce.to(dtype), mask)


@pytest.mark.gpu
@pytest.mark.parametrize("b, n, k", [(1, 4100, 128), (64, 4096, 128), (8, 65536, 2048), (3, 300, 512)])
def test_gpu_kernel_equals_reference(b, n, k):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    for scores in (torch.randn(b, n, device=dev),
                   torch.randint(0, 50, (b, n), device=dev).float(),  # heavy ties
                   torch.randn(b, n, device=dev).relu()):  # a block of zeros (DSA-like)
        cs = torch.randint(0, 8, (b,), device=dev, dtype=torch.int32)
        ce = torch.full((b,), n - 5, device=dev, dtype=torch.int32)
        mask = torch.rand(b, device=dev) < 0.9
        ref = topk_select_reference(scores, k, cs, ce, mask)
        tri = topk_select(scores, k, cs, ce, mask)
        assert torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1])


@pytest.mark.gpu
def test_gpu_replay_equals_eager():
    dev = torch.device("cuda")
    b, n, k = 8, 65536, 2048
    scores = torch.randn(b, n, device=dev)
    cs = torch.zeros(b, device=dev, dtype=torch.int32)
    ce = torch.full((b,), n, device=dev, dtype=torch.int32)
    topk_select(scores, k, cs, ce)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ids, valid = topk_select(scores, k, cs, ce)
    for i in range(3):
        scores.copy_(torch.randn(b, n, device=dev))
        ce.fill_(n - 1000 * i)
        g.replay()
        want = topk_select_reference(scores, k, cs, ce)
        assert torch.equal(ids, want[0]) and torch.equal(valid, want[1])


# ----------------------------------------------------------------------------- split select
from sparsehi.kernels.topk_split import split_plan, topk_select_split  # noqa: E402


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 3), n=st.integers(1, 500), top_k=st.integers(1, 64),
       p=st.sampled_from([2, 4, 8]), kind=st.sampled_from(["normal", "ties", "special"]), use_mask=st.booleans())
def test_split_select_equals_python(seed, b, n, top_k, p, kind, use_mask):
    """Several programs per row (chunk shortlists, then a merge) select exactly what the
    plain-Python rule selects, ties to the lower id across chunk borders included."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-2, 3, (b, n), generator=g).float() if kind == "ties" else torch.randn(b, n, generator=g)
    if kind == "special":
        pick = torch.rand(b, n, generator=g)
        s = torch.where(pick < 0.1, float("nan"), torch.where(pick < 0.3, float("-inf"), s))
    cs = torch.randint(-5, n + 3, (b,), generator=g)
    ce = cs + torch.randint(-3, n + 10, (b,), generator=g)
    mask = (torch.rand(b, generator=g) < 0.8) if use_mask else None
    chunk = max(16, 1 << math.ceil(math.log2(max(1, -(-n // p)))))
    got = topk_select_split(s, top_k, cs, ce, mask, (p, chunk))
    want = python_topk(s, top_k, cs, ce, mask)
    assert torch.equal(got[0], want[0]), f"ids\n{got[0]}\nwant\n{want[0]}"
    assert torch.equal(got[1], want[1])


def test_split_plan_rules():
    assert split_plan(1, 4096, 128, 132) == (8, 512)  # Quest at 64k, page 16: balanced chunks
    assert split_plan(64, 4096, 128, 132) == (4, 1024)  # fewer chunks as rows fill the GPU
    assert split_plan(200, 4096, 128, 132) is None  # enough rows: one program each
    assert split_plan(1, 65536, 2048, 132) is None  # chunks past the register bound
    assert split_plan(1, 200, 128, 132) is None  # nothing to shortlist
    assert split_plan(1, 4096, 128, 0) is None  # no GPU (interpreter): never unasked
    with pytest.raises(ValueError, match="plan"):
        topk_select_split(torch.zeros(1, 100), 8, torch.zeros(1), torch.full((1,), 100), None, (2, 32))


@pytest.mark.gpu
@pytest.mark.parametrize("b, n, k", [(1, 4096, 128), (4, 2048, 128), (16, 4100, 128), (1, 4096, 2048)])
def test_gpu_split_select_equals_reference(b, n, k):
    dev = torch.device("cuda")
    torch.manual_seed(1)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for scores in (torch.randn(b, n, device=dev), torch.randint(0, 50, (b, n), device=dev).float()):
        cs = torch.randint(0, 8, (b,), device=dev, dtype=torch.int32)
        ce = torch.full((b,), n - 5, device=dev, dtype=torch.int32)
        mask = torch.rand(b, device=dev) < 0.9
        ref = topk_select_reference(scores, k, cs, ce, mask)
        plan = split_plan(b, n, k, sms)
        if plan is not None:
            got = topk_select_split(scores, k, cs, ce, mask, plan)
            assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
        got = topk_select(scores, k, cs, ce, mask)
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    assert split_plan(1, 4096, 128, sms) is not None  # the decode shape does split
