"""topk_select's long-row path (a sampled floor, chunks filtered in parallel, one select
per row; ``sparsehi.kernels.topk_floor``) against the plain-Python selection, interpreted
on CPU at small blocks, and against the reference on the GPU at decode sizes."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from sparsehi.kernels.topk import topk_select, topk_select_reference
from sparsehi.kernels.topk_floor import MAX_CHUNKS, MIN_IDS, floor_plan, topk_select_floor
from tests.test_topk_select import python_topk

SMALL = dict(sample=32, block=32, list_block=32)


def run_small(s, top_k, cs, ce, mask=None, chunk=64):
    n = s.shape[1]
    p = max(1, -(-n // chunk))
    return topk_select_floor(s, top_k, cs, ce, mask, (p, chunk), **SMALL)


def check(s, top_k, cs, ce, mask=None, chunk=64):
    got = run_small(s, top_k, cs, ce, mask, chunk)
    want = python_topk(s, top_k, cs, ce, mask)
    assert torch.equal(got[0], want[0]), f"ids\n{got[0]}\nwant\n{want[0]}"
    assert torch.equal(got[1], want[1]), f"valid {got[1]} want {want[1]}"
    return got


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 3), n=st.integers(1, 600), top_k=st.integers(1, 120),
       chunk=st.sampled_from([16, 64, 256]), kind=st.sampled_from(["normal", "ties", "special"]),
       use_mask=st.booleans())
def test_floor_select_equals_python(seed, b, n, top_k, chunk, kind, use_mask):
    """Every row length, chunking and score kind: the same ids as the plain rule, ties to
    the lower id across chunk borders included."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-2, 3, (b, n), generator=g).float() if kind == "ties" else torch.randn(b, n, generator=g)
    if kind == "special":
        pick = torch.rand(b, n, generator=g)
        s = torch.where(pick < 0.1, float("nan"), torch.where(pick < 0.3, float("-inf"), s))
    cs = torch.randint(-5, n + 3, (b,), generator=g)
    ce = cs + torch.randint(-3, n + 10, (b,), generator=g)
    mask = (torch.rand(b, generator=g) < 0.8) if use_mask else None
    if -(-n // chunk) > MAX_CHUNKS:
        chunk = 64
    check(s, top_k, cs, ce, mask, chunk)


def test_a_misleading_sample_falls_back_to_the_whole_row():
    """The floor comes from every stride-th candidate; where those are all large (or none
    is selectable, or fewer ids are selectable than top_k asks) the select still returns
    the exact top set, by shortlisting the whole row."""
    n = 512  # sample 32 -> stride 16
    s = torch.rand(4, n)
    s[0, ::16] += 100.0  # the sample's floor is far above the 100th key
    s[1, ::16] = float("-inf")  # the sample sees nothing selectable
    s[2, 1::2] = float("nan")  # 256 selectable ids, fewer than top_k below
    s[3] = torch.arange(n, 0, -1).float()  # sorted: the top ids are the first ones
    cs, ce = torch.zeros(4, dtype=torch.int32), torch.full((4,), n, dtype=torch.int32)
    got = check(s, 100, cs, ce)
    assert got[0][3].tolist() == list(range(100))
    got = check(s, 300, cs, ce)
    assert got[1].tolist() == [300, 300, 256, 300]


def test_keys_that_differ_in_the_last_bits_and_a_wide_range():
    torch.manual_seed(2)
    base = torch.full((1, 900), 1.0).view(torch.int32)
    close = (base + torch.randint(-300, 300, (1, 900), dtype=torch.int32)).view(torch.float32)
    wide = torch.randn(1, 900) * torch.logspace(-30, 30, 900)[None]
    s = torch.cat([close, wide])
    for k in (1, 100, 255, 256, 257):
        check(s, k, torch.tensor([0, 3], dtype=torch.int32), torch.tensor([900, 900], dtype=torch.int32))


def test_plan_rules():
    assert floor_plan(1, 65536, 128, 132) == (32, 2048)  # Quest at 1M tokens, page 16
    assert floor_plan(1, 65536, 2048, 132) == (32, 2048)  # DSA at 64k tokens
    assert floor_plan(64, 131072, 2048, 132) == (4, 32768)  # a full batch: fewer, longer chunks
    assert floor_plan(1, 1 << 20, 2048, 132) == (64, 16384)  # at most MAX_CHUNKS
    assert floor_plan(1, MIN_IDS - 1, 128, 132) is None  # short rows keep the other paths
    assert floor_plan(1, 65536, 20000, 132) is None  # top_k near the row
    assert floor_plan(1, 65536, 128, 0) is None  # no GPU to size a plan by


def test_bad_plans_and_blocks_name_the_parameter():
    s = torch.zeros(1, 100)
    cs, ce = torch.zeros(1, dtype=torch.int32), torch.full((1,), 100, dtype=torch.int32)
    with pytest.raises(ValueError, match="plan"):
        topk_select_floor(s, 8, cs, ce, None, (1, 64))
    with pytest.raises(ValueError, match="sample"):
        topk_select_floor(s, 8, cs, ce, None, (2, 64), sample=100)


@pytest.mark.gpu
@pytest.mark.parametrize("b, n, k", [(1, 65536, 128), (1, 65536, 2048), (4, 32768, 2048), (16, 131072, 2048),
                                     (1, 1 << 20, 2048)])
def test_gpu_floor_select_equals_reference(b, n, k):
    dev = torch.device("cuda")
    torch.manual_seed(3)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    plan = floor_plan(b, n, k, sms)
    assert plan is not None
    for scores in (torch.randn(b, n, device=dev),
                   torch.randint(0, 50, (b, n), device=dev).float(),  # heavy ties
                   torch.randn(b, n, device=dev).relu(),  # half zeros
                   torch.arange(n, 0, -1, device=dev).float().expand(b, n).contiguous()):  # sorted
        cs = torch.randint(0, 8, (b,), device=dev, dtype=torch.int32)
        ce = torch.full((b,), n - 5, device=dev, dtype=torch.int32)
        mask = torch.rand(b, device=dev) < 0.9
        ref = topk_select_reference(scores, k, cs, ce, mask)
        got = topk_select_floor(scores, k, cs, ce, mask, plan)
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
        got = topk_select(scores, k, cs, ce, mask)
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
