"""DSA lightning indexer: kernel vs reference, a hand-written loop, FP8 storage, needles,
the index-length invariant, invalid inputs, and the author test kit."""
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings, strategies as st

from sparsehi.algorithms.dsa import DSAAlgorithm, choose_index_dtype, choose_index_query_dtype
from sparsehi.algorithms.registry import create_algorithm
from sparsehi.algorithms.testing import ProjectedIndexerInputs, check_algorithm
from sparsehi.config import SparseConfig
from sparsehi.kernels.dsa_index_store import (dsa_store_index_keys, dsa_store_index_keys_reference,
                                              dsa_store_index_keys_triton)
from sparsehi.kernels.dsa_indexer import (_round_to_e4m3, dsa_indexer, dsa_indexer_reference, dsa_indexer_triton,
                                          quantize_index_keys, quantize_index_queries)
from sparsehi.kernels.topk import masked_topk


def _cfg(top_k=4, dim=8, dtype="fp32", **extra):
    return SparseConfig(algorithm="dsa", page_size=1, top_k=top_k, device_buffer_size=4 * top_k,
                        sparse_extra_config={"index_head_dim": dim, "index_dtype": dtype, **extra})


def _alg(index_keys, seq, dtype="fp32", top_k=4, reqs=None):
    b, t, dim = index_keys.shape
    alg = create_algorithm(_cfg(top_k, dim, dtype), "cpu")
    alg.initialize_representation_pool(0, 1, b + 2, t + 4, kv_heads=1, head_dim=dim, dtype=torch.float32)
    req = torch.arange(b) + 1 if reqs is None else reqs
    alg.construct_representations(0, req, seq, torch.empty(0, 1, dim), torch.empty(b, t, dtype=torch.long),
                                  index_keys=index_keys)
    return alg, req


@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8"])
def test_kernel_matches_reference(kind):
    torch.manual_seed(0)
    q, w = torch.randn(3, 5, 24), torch.rand(3, 5)  # H and D not powers of two
    keys = torch.randn(4, 150, 24)
    if kind == "fp8":
        kk, sc = quantize_index_keys(keys)
    else:
        kk, sc = (keys.bfloat16() if kind == "bf16" else keys), None
    req, n = torch.tensor([2, -1, 0]), torch.tensor([131, 7, 150])
    ref = dsa_indexer_reference(q, w, kk, sc, req, n)
    tri = dsa_indexer_triton(q, w, kk, sc, req, n)
    assert torch.equal(torch.isinf(ref), torch.isinf(tri)) and torch.isinf(ref[1]).all()
    live = ~torch.isinf(ref)
    assert torch.allclose(ref[live], tri[live], rtol=1e-4, atol=1e-4)
    # "kernel = reference" at the selection level: same top-k sets
    cs, ce = torch.zeros(3, dtype=torch.int32), n.to(torch.int32)
    assert torch.equal(masked_topk(ref, 16, cs, ce)[0].sort(1).values, masked_topk(tri, 16, cs, ce)[0].sort(1).values)


@pytest.mark.parametrize("kind", ["fp32", "fp8"])
def test_kernel_reads_indexed_counts_and_drops_padding_rows(kind):
    """Rows score min(num_tokens, indexed[slot]) tokens; slots < 0 or >= R score nothing;
    int32 inputs and bf16 queries / strided weights are read as they are."""
    torch.manual_seed(4)
    keys = torch.randn(4, 90, 16)
    kk, sc = quantize_index_keys(keys) if kind == "fp8" else (keys, None)
    q = torch.randn(5, 3, 16).bfloat16()
    w = torch.rand(3, 5).t()  # not contiguous
    req = torch.tensor([2, -1, 0, 4, 3], dtype=torch.int32)
    n = torch.tensor([80, 50, 90, 90, 30], dtype=torch.int32)
    indexed = torch.tensor([60, 0, 85, 90, 7], dtype=torch.int64)  # [R + 1]: a spare entry
    ref = dsa_indexer_reference(q, w, kk, sc, req, n, indexed)
    tri = dsa_indexer_triton(q, w, kk, sc, req, n, indexed)
    lengths = (~torch.isinf(ref)).sum(1).tolist()
    assert lengths == [80, 0, 60, 0, 30]
    assert torch.equal(torch.isinf(ref), torch.isinf(tri))
    live = ~torch.isinf(ref)
    assert torch.allclose(ref[live], tri[live], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="indexed"):
        dsa_indexer_triton(q, w, kk, sc, req, n, indexed[:2])


@pytest.mark.parametrize("tiles,stages", [(2, 2), (3, 1), (8, 3)])
def test_programs_of_several_tiles_score_what_one_tile_programs_do(tiles, stages):
    """A program looping over several tiles (rows of 150 tokens: the last program's tiles
    run past the pool, and past a row's indexed count) writes the one-tile launch's scores,
    bit for bit, and -inf where that one does."""
    torch.manual_seed(6)
    kk, sc = quantize_index_keys(torch.randn(4, 150, 24))
    q, w = torch.randn(3, 5, 24), torch.rand(3, 5)
    req, n = torch.tensor([2, -1, 0]), torch.tensor([131, 7, 150])
    indexed = torch.tensor([150, 150, 97, 150])
    one = dsa_indexer_triton(q, w, kk, sc, req, n, indexed, block_t=16, tiles=1)
    many = dsa_indexer_triton(q, w, kk, sc, req, n, indexed, block_t=16, tiles=tiles, num_stages=stages)
    assert torch.equal(one, many)
    ref = dsa_indexer_reference(q, w, kk, sc, req, n, indexed)
    assert (~torch.isinf(many)).sum(1).tolist() == [97, 0, 150]
    live = ~torch.isinf(ref)
    assert torch.equal(live, ~torch.isinf(many)) and torch.allclose(ref[live], many[live], rtol=1e-4, atol=1e-4)


def test_fp8_query_scale_is_the_smallest_power_of_two_over_the_head():
    """quantize_index_queries: per (row, head) s = 2^e with 448 s >= max|q_h| > 224 s, q̂ = q / s
    rounded to e4m3, w' = w s; heads whose max is exactly 448 x 2^k take 2^k, all-zero heads 1."""
    torch.manual_seed(8)
    q = torch.randn(2, 6, 32) * torch.logspace(-6, 6, 6)[None, :, None]
    q[0, 1] = 0.0
    q[1, 2] = torch.linspace(-1.75, 1.75, 32)  # max 1.75 = 448 x 2^-8
    q[1, 3] = torch.linspace(-1.7500001, 1.0, 32)  # just past it: 2^-7
    w = torch.rand(2, 6) + 0.5
    q8, w8 = quantize_index_queries(q, w)
    s = w8 / w
    assert q8.dtype == torch.float8_e4m3fn and w8.dtype == torch.float32
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two
    amax = q.abs().amax(-1)
    live = amax > 0
    assert (448 * s[live] >= amax[live]).all() and (224 * s[live] < amax[live]).all()
    assert float(s[0, 1]) == 1.0 and float(s[1, 2]) == 2.0 ** -8 and float(s[1, 3]) == 2.0 ** -7
    assert float(q8[1, 2].float().abs().max()) == 448.0
    back = q8.float() * s[..., None]
    assert ((back - q).abs() <= amax[..., None] / 16).all()  # e4m3: 3 mantissa bits
    assert torch.equal(q8.float(), (q / s[..., None]).to(torch.float8_e4m3fn).float())


@triton.jit
def _round_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, _round_to_e4m3(tl.load(x_ptr + offs)))


def test_interpreted_e4m3_rounding_equals_torchs_cast():
    """The kernel's float32 -> e4m3 rounding (used where the interpreter's cast is wrong)
    equals torch's cast on every e4m3 value, every midpoint between two (ties to even), values
    just off those, subnormals and random values."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = values[torch.isfinite(values)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, torch.nextafter(mids, grid[1:]), torch.nextafter(mids, grid[:-1]),
                   torch.randn(1000) * 30, torch.rand(100) * 2 ** -7])
    x = x[x.abs() <= 448]
    n = triton.next_power_of_2(x.numel())
    xp = torch.cat([x, torch.zeros(n - x.numel())])
    out = torch.empty_like(xp)
    _round_kernel[(1,)](xp, out, N=n)
    assert torch.equal(out[: x.numel()], x.to(torch.float8_e4m3fn).float())


def test_fp8_queries_kernel_matches_reference():
    """fp8_queries=True: the kernel quantises each head as quantize_index_queries does (heads
    of 1e4, of 1e-5 and of zeros; a padding row) and scores what the reference does."""
    torch.manual_seed(9)
    q, w = torch.randn(3, 5, 24).bfloat16(), torch.rand(3, 5)
    q[0, 1] *= 1e4
    q[1, 2] = 0
    q[2, 0] *= 1e-5
    kk, sc = quantize_index_keys(torch.randn(4, 150, 24))
    req, n = torch.tensor([2, -1, 0]), torch.tensor([131, 7, 150])
    ref = dsa_indexer_reference(q, w, kk, sc, req, n, fp8_queries=True)
    tri = dsa_indexer_triton(q, w, kk, sc, req, n, fp8_queries=True, block_t=16, tiles=4, num_stages=2)
    live = ~torch.isinf(ref)
    assert torch.equal(live, ~torch.isinf(tri)) and live.sum(1).tolist() == [131, 0, 150]
    assert torch.allclose(ref[live], tri[live], rtol=1e-5, atol=1e-5)
    native = dsa_indexer_reference(q, w, kk, sc, req, n)
    assert not torch.allclose(native[live], ref[live], rtol=1e-5, atol=1e-5)  # the queries were quantised
    with pytest.raises(ValueError, match="fp8_queries"):
        dsa_indexer_triton(q, w, kk.float(), None, req, n, fp8_queries=True)
    with pytest.raises(ValueError, match="fp8_queries"):
        dsa_indexer_reference(q, w, kk, sc, req, n, fp8_queries="yes")


def test_index_query_dtype_choice_and_the_algorithms_scores():
    assert choose_index_query_dtype("fp8") == "fp8" and choose_index_query_dtype("bf16") == "native"
    assert choose_index_query_dtype("fp8", "native") == "native"
    with pytest.raises(ValueError, match="index_query_dtype"):
        choose_index_query_dtype("bf16", "fp8")
    with pytest.raises(ValueError, match="index_query_dtype"):
        choose_index_query_dtype("fp8", "fp16")
    torch.manual_seed(10)
    keys = torch.randn(1, 40, 16)
    q, w = torch.randn(1, 3, 16), torch.rand(1, 3)
    seq = torch.tensor([40])
    scores = {}
    for query_dtype in ("auto", "native"):
        cfg = _cfg(top_k=4, dim=16, dtype="fp8", index_query_dtype=query_dtype)
        alg = create_algorithm(cfg, "cpu")
        alg.initialize_representation_pool(0, 1, 2, 44, kv_heads=1, head_dim=16, dtype=torch.float32)
        alg.construct_representations(0, torch.tensor([1]), seq, torch.empty(0, 1, 16),
                                      torch.empty(1, 40, dtype=torch.long), index_keys=keys)
        scores[query_dtype] = alg.score(q, w, 0, torch.tensor([1]), seq)[0, :40]
        assert alg.index_query_dtype == ("fp8" if query_dtype == "auto" else "native")
    k8, sc = quantize_index_keys(keys)
    for query_dtype, fp8 in (("auto", True), ("native", False)):
        want = dsa_indexer_reference(q, w, k8, sc, torch.tensor([0]), seq, fp8_queries=fp8)[0]
        assert torch.allclose(scores[query_dtype], want, rtol=1e-6, atol=1e-6)


def test_tiles_per_program_and_bad_launch_arguments():
    from sparsehi.kernels.dsa_indexer import MAX_TILES, PROGRAMS_PER_SM, indexer_tiles

    sms = 132
    assert indexer_tiles(1, 512, sms) == 1  # 512 programs: fewer than 4 a SM already
    assert indexer_tiles(8, 512, sms) == 4  # 8 x 128 programs >= 4 x 132; 8 x 64 would be fewer
    for b in (1, 2, 8, 30, 64):
        t = indexer_tiles(b, 513, sms)
        assert 1 <= t <= MAX_TILES and t & (t - 1) == 0
        assert t == 1 or b * -(-513 // t) >= PROGRAMS_PER_SM * sms  # enough programs remain
        assert t == MAX_TILES or b * -(-513 // (2 * t)) < PROGRAMS_PER_SM * sms  # the largest such
    q, w, kk = torch.randn(1, 2, 8), torch.rand(1, 2), torch.randn(1, 20, 8)
    req, n = torch.tensor([0]), torch.tensor([20])
    for kw, name in (({"tiles": 0}, "tiles"), ({"num_stages": 0}, "num_stages"), ({"block_t": 0}, "block_t"),
                     ({"max_registers": 0}, "max_registers")):
        with pytest.raises(ValueError, match=f"{name}=0 is invalid"):
            dsa_indexer_triton(q, w, kk, None, req, n, **kw)


@pytest.mark.parametrize("kind", ["fp8", "bf16", "fp32"])
def test_store_kernel_matches_reference(kind):
    """One decoded index key per row: the kernel stores the reference's bytes (FP8 values and
    scales included) and counts, and writes nothing for padding / out-of-range rows."""
    torch.manual_seed(5)
    r, t, d = 3, 20, 24
    dtype = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}[kind]
    keys0 = torch.randn(r * t + 1, d).to(dtype)
    scales0 = torch.rand(r * t + 1) + 0.5 if kind == "fp8" else None
    idx0 = torch.tensor([5, 19, 0, 0], dtype=torch.int64)
    req = torch.tensor([1, -1, 0, 7, 2, 2], dtype=torch.int64)
    pos = torch.tensor([19, 3, 4, 1, 20, -1], dtype=torch.int32)  # last two: past the end / negative
    new = torch.randn(6, 24) * 3
    new[2] = 0.0  # an all-zero key: scale 1
    out = []
    for fn in (dsa_store_index_keys_reference, dsa_store_index_keys_triton):
        keys, idx = keys0.clone(), idx0.clone()
        scales = scales0.clone() if scales0 is not None else None
        fn(keys, scales, idx, req, pos, new, max_num_reqs=r, max_context_len=t)
        out.append((keys, scales, idx))
    (kr, sr, ir), (kt, st_, it) = out
    assert torch.equal(kr[:-1].view(torch.uint8), kt[:-1].view(torch.uint8))
    assert ir.tolist() == it.tolist() == [5, 20, 0, 0]  # slot 0: max(5, 4 + 1); slot 1: 20
    changed = (kt[:-1].view(torch.uint8) != keys0[:-1].view(torch.uint8)).any(1).nonzero().flatten().tolist()
    assert set(changed) <= {1 * t + 19, 0 * t + 4}  # only the two live rows' entries
    if kind == "fp8":
        assert torch.equal(sr[:-1], st_[:-1])
        assert float(st_[4]) == 1.0  # the zero key
        deq = kt[t + 19].float() * st_[t + 19]
        assert torch.allclose(deq, new[0], rtol=0.07, atol=1e-3)  # e4m3: 3 mantissa bits
        assert torch.equal(st_[:-1] != scales0[:-1], torch.isin(torch.arange(r * t), torch.tensor([t + 19, 4])))
    else:
        assert torch.equal(kt[t + 19], new[0].to(dtype))
    with pytest.raises(ValueError, match="scales_flat"):
        dsa_store_index_keys(keys0.clone(), None if kind == "fp8" else torch.ones(r * t + 1), idx0.clone(), req, pos,
                             new, max_num_reqs=r, max_context_len=t)
    with pytest.raises(ValueError, match="index_keys"):
        dsa_store_index_keys(keys0.clone(), scales0, idx0.clone(), req, pos, new[:, :8], max_num_reqs=r,
                             max_context_len=t)


def test_tiny_indexer_equals_hand_written_loop():
    torch.manual_seed(3)
    t, h, dim = 7, 2, 3
    keys = torch.randn(1, t, dim)
    q, w = torch.randn(1, h, dim), torch.tensor([[0.7, -0.4]])  # a negative weight too
    alg, req = _alg(keys, torch.tensor([t]), top_k=3)
    want = []
    for tok in range(t):
        s = 0.0
        for head in range(h):
            dot = sum(float(q[0, head, i]) * float(keys[0, tok, i]) for i in range(dim))
            s += float(w[0, head]) * max(dot, 0.0)
        want.append(s)
    got = alg.score(q, w, 0, req, torch.tensor([t]))[0, :t]
    assert torch.allclose(got, torch.tensor(want), atol=1e-5)
    sel, valid = alg.retrieve_topk(q, 0, req, torch.tensor([True]), weights=w, seq_lens=torch.tensor([t + 1]),
                                   candidate_start=torch.tensor([1]), candidate_end=torch.tensor([t]), top_k=3)
    expect = sorted(range(1, t), key=lambda i: -want[i])[:3]
    assert valid.tolist() == [3] and sorted(sel[0].tolist()) == sorted(expect)


def test_lookahead_cuts_one_indexer_pass_twice(monkeypatch):
    """retrieve_topk_and_lookahead: the indexer runs once; the selection and the lookahead
    set are what retrieve_topk gives at top_k and at lookahead_top_k."""
    torch.manual_seed(12)
    keys = torch.randn(2, 60, 8)
    alg, req = _alg(keys, torch.tensor([60, 45]), top_k=4)
    q, w = torch.randn(2, 3, 8), torch.rand(2, 3)
    kw = dict(weights=w, seq_lens=torch.tensor([61, 46]), candidate_start=torch.tensor([2, 0]),
              candidate_end=torch.tensor([58, 44]))
    mask = torch.tensor([True, True])
    calls = []
    score = alg.score
    monkeypatch.setattr(alg, "score", lambda *a, **k: calls.append(1) or score(*a, **k))
    sel, val, more = alg.retrieve_topk_and_lookahead(q, 0, req, mask, lookahead_top_k=12, top_k=4, **kw)
    ids, valid = more()
    assert len(calls) == 1
    want_sel, want_val = alg.retrieve_topk(q, 0, req, mask, top_k=4, **kw)
    want_ids, want_valid = alg.retrieve_topk(q, 0, req, mask, top_k=12, **kw)
    assert torch.equal(sel, want_sel) and torch.equal(val, want_val)
    assert torch.equal(ids, want_ids) and torch.equal(valid, want_valid) and valid.tolist() == [12, 12]
    assert all(set(sel[r].tolist()) <= set(ids[r].tolist()) for r in range(2))


def test_fp8_storage_and_dtype_choice():
    torch.manual_seed(4)
    assert choose_index_dtype(torch.device("cpu")) == "bf16"  # no FP8 path on the CPU
    assert choose_index_dtype(torch.device("cpu"), "fp8") == "fp8"
    with pytest.raises(ValueError, match="index_dtype"):
        choose_index_dtype(torch.device("cpu"), "int8")
    keys = torch.randn(2, 40, 16) * torch.linspace(0.01, 50, 40)[None, :, None]  # scales span 3 decades
    k8, scale = quantize_index_keys(keys)
    assert k8.dtype == torch.float8_e4m3fn and scale.shape == (2, 40)
    deq = k8.float() * scale[..., None]
    assert ((deq - keys).abs() <= 0.07 * keys.abs().amax(-1, keepdim=True)).all()  # e4m3: 3 mantissa bits
    alg, _ = _alg(keys, torch.tensor([40, 33]), dtype="fp8")
    assert alg._keys[0].dtype == torch.float8_e4m3fn
    # keys + scales of 4 slots x 44 positions, plus one dump entry for padding rows' writes
    assert alg.representation_bytes() == (4 * 44 + 1) * 16 * 1 + (4 * 44 + 1) * 4


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), pos=st.integers(0, 199), dtype=st.sampled_from(["bf16", "fp8"]))
def test_needle_at_any_position_is_retrieved(seed, pos, dtype):
    g = torch.Generator().manual_seed(seed)
    t, dim, h = 200, 32, 4
    keys = torch.randn(1, t, dim, generator=g)
    q = torch.randn(1, h, dim, generator=g)
    keys[0, pos] = 4 * dim ** 0.5 * q[0].mean(0) / q[0].mean(0).norm()
    alg, req = _alg(keys, torch.tensor([t]), dtype=dtype, top_k=4)
    sel, _ = alg.retrieve_topk(q, 0, req, torch.tensor([True]), weights=torch.ones(1, h), seq_lens=torch.tensor([t]),
                               candidate_start=torch.tensor([0]), candidate_end=torch.tensor([t]), top_k=4)
    assert pos in sel[0].tolist()


def test_index_must_cover_candidates_and_inputs_validated():
    alg, req = _alg(torch.randn(1, 10, 8), torch.tensor([10]))
    q, w = torch.randn(1, 2, 8), torch.ones(1, 2)
    kw = dict(seq_lens=torch.tensor([13]), candidate_start=torch.tensor([0]), top_k=2)
    with pytest.raises(ValueError, match="indexed"):
        alg.retrieve_topk(q, 0, req, torch.tensor([True]), weights=w, candidate_end=torch.tensor([12]), **kw)
    alg.update_representations(0, req, torch.tensor([10]), torch.randn(1, 1, 8), index_keys=torch.randn(1, 8))
    alg.update_representations(0, req, torch.tensor([11]), torch.randn(1, 1, 8), index_keys=torch.randn(1, 8))
    sel, valid = alg.retrieve_topk(q, 0, req, torch.tensor([True]), weights=w, candidate_end=torch.tensor([12]), **kw)
    assert int(valid[0]) == 2
    with pytest.raises(ValueError, match="weights"):
        alg.retrieve_topk(q, 0, req, torch.tensor([True]), candidate_end=torch.tensor([12]), **kw)
    with pytest.raises(ValueError, match="index_head_dim"):
        alg.retrieve_topk(torch.randn(1, 2, 4), 0, req, torch.tensor([True]), weights=w,
                          candidate_end=torch.tensor([12]), **kw)
    with pytest.raises(ValueError, match="index_keys"):
        alg.update_representations(0, req, torch.tensor([12]), torch.randn(1, 1, 8))
    with pytest.raises(ValueError, match="page_size"):
        DSAAlgorithm(SparseConfig(algorithm="dsa", page_size=16, top_k=64, device_buffer_size=128), torch.device("cpu"))
    with pytest.raises(ValueError, match="index_head_dim"):
        DSAAlgorithm(_cfg(dim=0), torch.device("cpu"))
    alg.on_request_end(int(req[0]))
    with pytest.raises(ValueError, match="indexed"):
        alg.retrieve_topk(q, 0, req, torch.tensor([True]), weights=w, candidate_end=torch.tensor([12]), **kw)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_author_kit_dsa(dtype, monkeypatch):
    monkeypatch.setenv("SPARSEHI_FORCE_TRITON", "1")  # the interpreted kernel inside the algorithm
    report = check_algorithm(DSAAlgorithm, {"sparse_extra_config": {"index_head_dim": 32, "index_dtype": dtype}},
                             inputs=ProjectedIndexerInputs(32), context_len=96, decode_steps=1)
    assert report.needle_recall == 1.0 and report.deterministic


@pytest.mark.gpu
def test_dsa_on_gpu_fp8_and_kernel_equals_reference():
    alg = create_algorithm(SparseConfig(algorithm="dsa", page_size=1, top_k=2048, device_buffer_size=4096), "cuda")
    major, minor = torch.cuda.get_device_capability()
    assert alg.index_dtype == ("fp8" if (major, minor) >= (8, 9) else "bf16")
    torch.manual_seed(0)
    b, h, dim, t = 4, 64, 128, 32768
    keys = torch.randn(b + 1, t, dim, device="cuda")
    k8, sc = quantize_index_keys(keys)
    q, w = torch.randn(b, h, dim, device="cuda"), torch.rand(b, h, device="cuda")
    req = torch.tensor([4, 0, 2, 1], device="cuda")
    n = torch.tensor([t, 30000, 16384, 2049], device="cuda")
    for kk, s in ((k8, sc), (keys.bfloat16(), None)):
        ref = dsa_indexer_reference(q, w, kk, s, req, n)
        tri = dsa_indexer(q, w, kk, s, req, n)
        live = ~torch.isinf(ref)
        assert torch.equal(live, ~torch.isinf(tri))
        assert torch.allclose(ref[live], tri[live], rtol=1e-4, atol=1e-3)
        cs, ce = torch.zeros_like(n), n
        a, va = masked_topk(ref, 2048, cs, ce)
        bsel, vb = masked_topk(tri, 2048, cs, ce)
        assert torch.equal(va, vb)
        same = sum(int(torch.isin(a[i, : int(va[i])], bsel[i, : int(vb[i])]).sum()) for i in range(b))
        overlap = same / int(va.sum())
        assert overlap > 0.999, overlap  # only near-ties at the top-k boundary may differ


def _cuda_case(seed: int, b: int, t: int) -> tuple:
    """FP8 index keys ``[b, t, 128]`` with their scales, float32 queries ``[b, 64, 128]`` and
    weights ``[b, 64]`` on the GPU."""
    torch.manual_seed(seed)
    k8, sc = quantize_index_keys(torch.randn(b, t, 128, device="cuda"))
    return k8, sc, torch.randn(b, 64, 128, device="cuda"), torch.rand(b, 64, device="cuda")


@pytest.mark.gpu
def test_gpu_kernel_bf16_queries_on_fp8_keys():
    """The decode path's dtypes (bf16 index queries, FP8 keys): tensor-core products are exact,
    only the accumulation order differs from the reference."""
    t = 8192
    k8, sc, q, w = _cuda_case(1, 3, t)
    q = q.bfloat16()
    req = torch.tensor([2, 0, -1], device="cuda", dtype=torch.int32)
    n = torch.tensor([t, 5000, t], device="cuda", dtype=torch.int32)
    indexed = torch.tensor([4000, 9, t, 0], device="cuda")
    ref = dsa_indexer_reference(q, w, k8, sc, req, n, indexed)
    tri = dsa_indexer(q, w, k8, sc, req, n, indexed)
    live = ~torch.isinf(ref)
    assert live.sum(1).tolist() == [t, 4000, 0] and torch.equal(live, ~torch.isinf(tri))
    assert torch.allclose(ref[live], tri[live], rtol=1e-4, atol=1e-3)
    one = dsa_indexer_triton(q, w, k8, sc, req, n, indexed, tiles=1, num_stages=1)
    for tiles, stages in ((2, 2), (4, 3), (8, 2)):  # several tiles a program: the same scores, bit for bit
        assert torch.equal(dsa_indexer_triton(q, w, k8, sc, req, n, indexed, tiles=tiles, num_stages=stages), one)
    # a register cap (spilling at 80 a thread) changes where values live, not the scores
    assert torch.equal(dsa_indexer_triton(q, w, k8, sc, req, n, indexed, tiles=8, num_stages=3, max_registers=80), one)
    # the fp16 dot equals the bf16 one bit for bit (exact products of the same values)
    assert torch.equal(dsa_indexer_triton(q, w, k8, sc, req, n, indexed, tiles=1, num_stages=1, fp16_dot=False), one)


@pytest.mark.gpu
def test_gpu_fp8_queries_match_the_reference():
    """fp8_queries=True on the GPU (FP8 x FP8 tensor-core products) at the decode's shapes:
    scores as the torch reference of the same quantised queries, multi-tile programs bit for
    bit the one-tile launch, and the top 2048 of each row nearly all shared with bf16 queries'."""
    t = 8192
    k8, sc, q, w = _cuda_case(3, 3, t)
    q[0, :8] *= 3e5
    q[1, 8:16] *= 1e-6
    q[2, 16] = 0.0
    q = q.bfloat16()
    req = torch.tensor([2, 0, 1], device="cuda", dtype=torch.int32)
    n = torch.tensor([t, 5000, t - 3], device="cuda", dtype=torch.int32)
    ref = dsa_indexer_reference(q, w, k8, sc, req, n, fp8_queries=True)
    one = dsa_indexer_triton(q, w, k8, sc, req, n, tiles=1, num_stages=1, fp8_queries=True)
    live = ~torch.isinf(ref)
    assert torch.equal(live, ~torch.isinf(one))
    for row in range(3):
        # the products are exact; Hopper's FP8 MMA adds them with fewer bits than float32
        # (1.4e-4 of the row's largest score measured on an H200)
        scale = ref[row][live[row]].abs().max()
        assert (one[row][live[row]] - ref[row][live[row]]).abs().max() <= 1e-3 * scale, row
    for tiles, stages in ((2, 2), (4, 3), (8, 3)):
        assert torch.equal(dsa_indexer_triton(q, w, k8, sc, req, n, tiles=tiles, num_stages=stages,
                                              fp8_queries=True), one)
    assert torch.equal(dsa_indexer(q, w, k8, sc, req, n, fp8_queries=True), dsa_indexer_triton(
        q, w, k8, sc, req, n, fp8_queries=True))
    native = dsa_indexer_triton(q, w, k8, sc, req, n)
    cs = torch.zeros_like(n)
    a, va = masked_topk(native, 2048, cs, n)
    b_, vb = masked_topk(one, 2048, cs, n)
    shared = sum(int(torch.isin(a[i, : int(va[i])], b_[i, : int(vb[i])]).sum()) for i in range(3)) / int(va.sum())
    assert shared > 0.9, shared


@pytest.mark.gpu
def test_gpu_fp16_dot_keeps_queries_past_fp16s_range():
    """Queries past fp16's range (scaled by a power of two inside the kernel) and below its
    normal range still score what the reference does."""
    b, t = 3, 2048
    k8, sc, q, w = _cuda_case(2, b, t)
    q[0] *= 3e5  # |q| up to about 1e6: fp16 holds 65504
    q[1, :, :64] *= 1e-6  # half the dims below 2^-14
    q = q.bfloat16()
    req = torch.arange(b, device="cuda")
    n = torch.full((b,), t, device="cuda")
    ref = dsa_indexer_reference(q, w, k8, sc, req, n)
    got = dsa_indexer_triton(q, w, k8, sc, req, n)
    bf16 = dsa_indexer_triton(q, w, k8, sc, req, n, fp16_dot=False)
    assert torch.isfinite(got).all()
    for row in range(b):
        scale = ref[row].abs().max()
        assert (got[row] - ref[row]).abs().max() <= 1e-4 * scale, row
    assert torch.equal(got[0], bf16[0])  # scaled by a power of two: the same products


def test_short_index_never_selects_unindexed_tokens_without_validation():
    keys = torch.randn(1, 12, 8)
    cfg = _cfg(top_k=8, dim=8, validate=False)
    alg = create_algorithm(cfg, "cpu")
    alg.initialize_representation_pool(0, 1, 2, 16, kv_heads=1, head_dim=8, dtype=torch.float32)
    req = torch.tensor([1])
    alg.construct_representations(0, req, torch.tensor([5]), torch.empty(0, 1, 8), torch.empty(1, 12, dtype=torch.long),
                                  index_keys=keys)
    sel, valid = alg.retrieve_topk(torch.randn(1, 2, 8), 0, req, torch.tensor([True]), weights=torch.ones(1, 2),
                                   seq_lens=torch.tensor([12]), candidate_start=torch.tensor([0]),
                                   candidate_end=torch.tensor([10]), top_k=8)
    assert int(valid[0]) <= 5 and int(sel[0].max()) < 5


def test_padding_rows_write_nothing_and_select_nothing():
    torch.manual_seed(6)
    alg, req = _alg(torch.randn(2, 10, 8), torch.tensor([10, 6]))  # slots 1, 2; max_num_reqs 4
    alg.construct_representations(0, torch.tensor([3]), torch.tensor([10]), torch.empty(0, 1, 8),
                                  torch.empty(1, 10, dtype=torch.long), index_keys=torch.randn(1, 10, 8))
    keys0, count0 = alg._keys[0].clone(), alg._indexed[0][:4].clone()
    assert count0.tolist() == [0, 10, 6, 10]
    # CUDA-graph batch: real row slot 2 at position 6, padding rows at positions past slot 3's index
    alg.update_representations(0, torch.tensor([2, -1, -1]), torch.tensor([6, 30, 12]), torch.randn(3, 1, 8),
                               index_keys=torch.randn(3, 8) * 100)
    keys1, count1 = alg._keys[0], alg._indexed[0][:4]
    assert count1.tolist() == [0, 10, 7, 10]  # slot 3 (the last) keeps its count
    assert torch.equal(keys1[3], keys0[3]) and torch.equal(keys1[0], keys0[0]) and torch.equal(keys1[1], keys0[1])
    assert torch.equal(keys1[2, :6], keys0[2, :6])
    q, w = torch.randn(3, 2, 8), torch.ones(3, 2)
    sel, valid = alg.retrieve_topk(q, 0, torch.tensor([-1, 3, 2]), torch.tensor([True, True, True]), weights=w,
                                   seq_lens=torch.tensor([13, 11, 8]), candidate_start=torch.zeros(3, dtype=torch.int32),
                                   candidate_end=torch.tensor([12, 10, 7]), top_k=4)  # padding row: no index check
    assert valid.tolist() == [0, 4, 4] and (sel[0] == -1).all()


def test_shape_dtype_and_range_errors_name_the_parameter():
    alg, req = _alg(torch.randn(1, 10, 8), torch.tensor([10]))  # max_num_reqs 3
    ik = torch.randn(1, 8)
    with pytest.raises(ValueError, match="index_keys"):
        alg.update_representations(0, req, torch.tensor([10]), torch.randn(1, 1, 8), index_keys=torch.randn(2, 8))
    with pytest.raises(ValueError, match="index_keys"):
        alg.update_representations(0, req, torch.tensor([10]), torch.randn(1, 1, 8), index_keys=torch.ones(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="positions"):
        alg.update_representations(0, req, torch.tensor([[10]]), torch.randn(1, 1, 8), index_keys=ik)
    with pytest.raises(ValueError, match="positions"):
        alg.update_representations(0, req, torch.tensor([14]), torch.randn(1, 1, 8), index_keys=ik)  # >= max_context_len
    with pytest.raises(ValueError, match="req_pool_indices"):
        alg.update_representations(0, torch.tensor([3]), torch.tensor([10]), torch.randn(1, 1, 8), index_keys=ik)
    with pytest.raises(ValueError, match="req_pool_indices"):
        alg.update_representations(0, torch.tensor([1.0]), torch.tensor([10]), torch.randn(1, 1, 8), index_keys=ik)
    kw = dict(weights=torch.ones(1, 2), seq_lens=torch.tensor([10]), candidate_start=torch.tensor([0]),
              candidate_end=torch.tensor([8]), top_k=2)
    with pytest.raises(ValueError, match="req_pool_indices"):
        alg.retrieve_topk(torch.randn(1, 2, 8), 0, torch.tensor([5]), torch.tensor([True]), **kw)
    with pytest.raises(ValueError, match="sparse_mask"):
        alg.retrieve_topk(torch.randn(1, 2, 8), 0, req, torch.tensor([True, False]), **kw)
    with pytest.raises(ValueError, match="queries"):
        alg.retrieve_topk(torch.randn(2, 2, 8), 0, req, torch.tensor([True]), **kw)


def test_value_checks_skipped_while_capturing(monkeypatch):
    """During CUDA-graph capture the host read-back checks (index coverage, ranges) do
    not run; the fallbacks still keep padding/out-of-range rows from writing or selecting."""
    import torch.cuda
    alg, req = _alg(torch.randn(1, 10, 8), torch.tensor([10]))
    count0 = alg._indexed[0].clone()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)

    def no_sync(*a, **k):
        raise AssertionError("host read-back during capture")

    for name in ("tolist", "item", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    alg.update_representations(0, torch.tensor([1, 9, -1]), torch.tensor([40, 3, 3]), torch.randn(3, 1, 8),
                               index_keys=torch.randn(3, 8))
    sel, valid = alg.retrieve_topk(torch.randn(2, 2, 8), 0, torch.tensor([1, 9]), torch.tensor([True, True]),
                                   weights=torch.ones(2, 2), seq_lens=torch.tensor([13, 13]),
                                   candidate_start=torch.tensor([0, 0]), candidate_end=torch.tensor([12, 12]), top_k=4)
    monkeypatch.undo()
    assert torch.equal(alg._indexed[0][:3], count0[:3])  # nothing real changed
    assert valid.tolist() == [4, 0] and int(sel[0].max()) < 10  # short index: only indexed tokens


@pytest.mark.gpu
def test_dsa_default_config_captures_in_a_cuda_graph():
    """Default config (validate=True, FP8 on H100/H200): update + retrieve captured in a CUDA
    graph with padding rows; replays equal eager calls on a twin instance."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    reqs, ctx, dim, h, B = 4, 4096, 128, 16, 4
    cfg = SparseConfig(algorithm="dsa", page_size=1, top_k=256, device_buffer_size=1024)
    algs = [create_algorithm(cfg, dev), create_algorithm(cfg, dev)]
    ik = torch.randn(reqs, 3000, dim, device=dev)
    for a in algs:
        a.initialize_representation_pool(0, 1, reqs, ctx, kv_heads=1, head_dim=dim, dtype=torch.bfloat16)
        a.construct_representations(0, torch.arange(reqs, device=dev), torch.full((reqs,), 3000, device=dev),
                                    torch.empty(0, 1, dim, device=dev), torch.empty(reqs, 3000, dtype=torch.long, device=dev),
                                    index_keys=ik)
    count_last = algs[0]._indexed[0][reqs - 1].clone()
    st_ = dict(req=torch.tensor([1, 3, -1, -1], device=dev), pos=torch.full((B,), 3000, device=dev),
               ik=torch.randn(B, dim, device=dev), q=torch.randn(B, h, dim, device=dev), w=torch.rand(B, h, device=dev),
               seq=torch.full((B,), 3001, device=dev, dtype=torch.int32),
               cs=torch.full((B,), 4, device=dev, dtype=torch.int32), ce=torch.full((B,), 2990, device=dev, dtype=torch.int32),
               mask=torch.ones(B, dtype=torch.bool, device=dev))

    def step(a):
        a.update_representations(0, st_["req"], st_["pos"], torch.empty(B, 1, dim, device=dev), index_keys=st_["ik"])
        return a.retrieve_topk(st_["q"], 0, st_["req"], st_["mask"], weights=st_["w"], seq_lens=st_["seq"],
                               candidate_start=st_["cs"], candidate_end=st_["ce"], top_k=256)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(algs[0])
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sel, valid = step(algs[0])
    step(algs[1])
    for i in range(3):
        st_["pos"].fill_(3001 + i)
        st_["seq"].fill_(3002 + i)
        st_["ik"].copy_(torch.randn(B, dim, device=dev))
        st_["q"].copy_(torch.randn(B, h, dim, device=dev))
        graph.replay()
        want_sel, want_valid = step(algs[1])
        torch.cuda.synchronize()
        assert torch.equal(valid, want_valid) and valid.tolist() == [256, 256, 0, 0]
        assert torch.equal(sel.sort(1).values, want_sel.sort(1).values)
    # the real row in the last slot advanced; the padding rows added nothing to it
    assert int(algs[0]._indexed[0][reqs - 1]) == 3004 and int(count_last) == 3000
    assert torch.equal(algs[0]._indexed[0], algs[1]._indexed[0])


def test_store_kernel_rounds_fp8_ties_and_carries_as_torch():
    """FP8 keys at e4m3 ties (rounded to even) and at values that round up into the next
    binade: the kernel stores torch's bytes (the CPU interpreter's own float -> e4m3 cast rounds
    ties away and drops that carry, so the kernel makes the bytes by integer arithmetic)."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = values[torch.isfinite(values) & (values.abs() <= 448)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    d = 64
    rows = []
    for chunk in (mids[i:i + d - 1] for i in range(0, mids.numel(), d - 1)):
        row = torch.zeros(d)
        row[0] = 448.0                          # scale 1: the stored values are the inputs
        row[1:1 + chunk.numel()] = chunk
        rows.append(row)
    rows.append(torch.tensor([448.0, 31.625, -31.625, 50.0, 0.4921875, 17.0] + [0.0] * (d - 6)))
    new = torch.stack(rows)
    b = new.shape[0]
    r, t = b, 2
    req = torch.arange(b, dtype=torch.int64)
    pos = torch.ones(b, dtype=torch.int32)
    out = []
    for fn in (dsa_store_index_keys_reference, dsa_store_index_keys_triton):
        keys = torch.zeros(r * t + 1, d).to(torch.float8_e4m3fn)
        scales = torch.ones(r * t + 1)
        fn(keys, scales, torch.zeros(r, dtype=torch.int64), req, pos, new, max_num_reqs=r, max_context_len=t)
        out.append(keys[:-1].view(torch.uint8))
    assert torch.equal(out[1], out[0])
    assert torch.equal(out[0][1::2].view(torch.float8_e4m3fn).float(), new.to(torch.float8_e4m3fn).float())
