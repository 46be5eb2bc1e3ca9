"""Quest: kernel vs reference, the upper-bound property, incremental updates, needles,
invalid configs, and the author test kit."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from sparsehi.algorithms.oracle import exact_token_scores, page_max_scores
from sparsehi.algorithms.quest import QuestAlgorithm
from sparsehi.algorithms.registry import create_algorithm
from sparsehi.algorithms.testing import check_algorithm, plant_needles
from sparsehi.config import SparseConfig
from sparsehi.input_checks import host_checks_enabled
from sparsehi.kernels.quest_score import quest_score, quest_score_reference, quest_score_triton
from sparsehi.kernels.quest_update_bounds import quest_update_bounds_reference, quest_update_bounds_triton


def _cfg(page_size=4, top_k_pages=4, **extra):
    return SparseConfig(algorithm="quest", page_size=page_size, top_k=top_k_pages * page_size,
                        device_buffer_size=4 * top_k_pages * page_size, sparse_extra_config=extra)


def _build(keys, page_size, reduce="sum", split=None, layer=2):
    """Quest over keys [B, T, Hkv, D]; tokens >= split arrive by update_representations."""
    b, t, hkv, d = keys.shape
    alg = QuestAlgorithm(_cfg(page_size, head_reduce=reduce), torch.device("cpu"))
    alg.initialize_representation_pool(0, 3, b + 1, t + page_size, kv_heads=hkv, head_dim=d, dtype=keys.dtype)
    split = t if split is None else split
    slots = torch.arange(b * t).view(b, t).flip(1)  # slots not in position order
    kb = torch.empty(b * t, hkv, d, dtype=keys.dtype)
    kb[slots.reshape(-1)] = keys.reshape(-1, hkv, d)
    req = torch.arange(b, 0, -1)  # request slots not in batch order
    alg.construct_representations(layer, req, torch.full((b,), split, dtype=torch.int32), kb, slots)
    for pos in range(split, t):
        alg.update_representations(layer, req, torch.full((b,), pos), keys[:, pos])
    return alg, req


@pytest.mark.parametrize("reduce", ["max", "sum"])
def test_kernel_matches_reference(reduce):
    torch.manual_seed(0)
    q = torch.randn(3, 6, 24)  # D not a power of two, GQA group 3
    kmin = torch.randn(4, 70, 2, 24)
    kmax = kmin + torch.rand_like(kmin)
    req = torch.tensor([3, -1, 0])
    npages = torch.tensor([70, 9, 33])
    ref = quest_score_reference(q, kmin, kmax, req, npages, reduce)
    tri = quest_score_triton(q, kmin, kmax, req, npages, reduce)
    # both tilings (small batches: small tiles, every group's loads up front) agree
    wide = quest_score_triton(q, kmin, kmax, req, npages, reduce, block_p=16, unroll=False, num_warps=4)
    assert torch.equal(torch.isinf(wide), torch.isinf(tri))
    assert torch.allclose(wide[~torch.isinf(tri)], tri[~torch.isinf(tri)], rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isinf(ref), torch.isinf(tri))
    live = ~torch.isinf(ref)
    assert torch.allclose(ref[live], tri[live], rtol=1e-4, atol=1e-4)
    assert torch.isinf(ref[1]).all()  # req -1: nothing selectable
    # bf16 representations take the same path
    tri16 = quest_score_triton(q, kmin.bfloat16(), kmax.bfloat16(), req, npages, reduce)
    ref16 = quest_score_reference(q, kmin.bfloat16(), kmax.bfloat16(), req, npages, reduce)
    assert torch.allclose(ref16[live], tri16[live], rtol=1e-3, atol=1e-3)


def test_kernel_counts_pages_from_tokens_and_drops_padding_rows():
    """lengths in tokens with page_size: pages = ceil(len / page_size); slots < 0 or >= R
    score -inf; int32 inputs and a strided q are read as they are."""
    torch.manual_seed(6)
    kmin = torch.randn(3, 10, 2, 16)
    kmax = kmin + torch.rand_like(kmin)
    q = torch.randn(8, 5, 16).transpose(0, 1)  # [B=5, Hq=8, D]: not contiguous
    req = torch.tensor([0, 2, -1, 3, 1], dtype=torch.int32)
    lens = torch.tensor([1, 33, 160, 160, 160], dtype=torch.int32)
    ref = quest_score_reference(q, kmin, kmax, req, lens, "sum", page_size=16)
    tri = quest_score_triton(q, kmin, kmax, req, lens, "sum", page_size=16)
    assert (~torch.isinf(ref)).sum(1).tolist() == [1, 3, 0, 0, 10]
    assert torch.equal(torch.isinf(ref), torch.isinf(tri))
    live = ~torch.isinf(ref)
    assert torch.allclose(ref[live], tri[live], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_kernel_matches_reference(dtype):
    """Fold one key per row into its page: the kernel leaves the reference's bounds, resets
    a page at its first token, and writes nothing for padding / out-of-range rows."""
    torch.manual_seed(7)
    r, p, ps, hkv, d = 3, 4, 4, 2, 12
    kmin0 = torch.randn(r * p + 1, hkv, d).to(dtype)
    kmax0 = kmin0 + torch.rand_like(kmin0)
    req = torch.tensor([0, 1, -1, 2, 5, 2], dtype=torch.int32)
    pos = torch.tensor([5, 8, 3, 16, 2, -1], dtype=torch.int64)  # row 1: a page's first token
    new = torch.randn(6, d, hkv).transpose(1, 2) * 2  # [B, Hkv, D], strided
    out = []
    for fn in (quest_update_bounds_reference, quest_update_bounds_triton):
        kmin, kmax = kmin0.clone(), kmax0.clone()
        fn(kmin, kmax, req, pos, new, max_num_reqs=r, max_pages=p, page_size=ps)
        out.append((kmin, kmax))
    (rmin, rmax), (tmin, tmax) = out
    assert torch.equal(rmin[:-1], tmin[:-1]) and torch.equal(rmax[:-1], tmax[:-1])
    k = new.to(dtype)
    assert torch.equal(tmin[0 * p + 1], torch.minimum(kmin0[1], k[0])) and torch.equal(tmax[0 * p + 1], torch.maximum(kmax0[1], k[0]))
    assert torch.equal(tmin[1 * p + 2], k[1]) and torch.equal(tmax[1 * p + 2], k[1])  # reset
    untouched = [e for e in range(r * p) if e not in (1, p + 2)]
    assert torch.equal(tmin[untouched], kmin0[untouched]) and torch.equal(tmax[untouched], kmax0[untouched])
    assert torch.equal(tmin[-1], kmin0[-1])  # the kernel does not even use the dump entry


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), log_ps=st.integers(1, 4), t=st.integers(1, 70),
       reduce=st.sampled_from(["max", "sum"]), split_frac=st.floats(0, 1))
def test_bound_never_below_true_page_max(seed, log_ps, t, reduce, split_frac):
    g = torch.Generator().manual_seed(seed)
    ps = 2 ** log_ps
    keys = torch.randn(2, t, 2, 8, generator=g) * torch.rand(1, 1, 1, 8, generator=g) * 3
    q = torch.randn(2, 4, 8, generator=g)
    alg, req = _build(keys, ps, reduce, split=int(split_frac * t))
    seq = torch.full((2,), t)
    bound = alg.score(q, 2, req, seq)
    true = page_max_scores(exact_token_scores(q, keys, reduce), seq, ps)
    n = -(-t // ps)
    assert torch.isinf(bound[:, n:]).all()
    slack = bound[:, :n] - true
    assert bool((slack >= -1e-4 * (1 + true.abs())).all()), f"bound below true score by {float(slack.min())}"


def test_incremental_update_equals_construct():
    torch.manual_seed(1)
    keys = torch.randn(2, 37, 2, 8)
    full, req = _build(keys, 8)
    inc, _ = _build(keys, 8, split=5)
    assert torch.equal(full._kmin[2], inc._kmin[2]) and torch.equal(full._kmax[2], inc._kmax[2])


def test_page_reset_on_reuse_of_a_request_slot():
    torch.manual_seed(2)
    alg, req = _build(torch.randn(1, 8, 2, 8) * 100, 4)  # big keys left behind in slot 1
    k = torch.randn(1, 2, 8)
    alg.update_representations(2, req, torch.tensor([0]), k)  # new request, first token of page 0
    assert torch.equal(alg._kmin[2][1, 0], k[0]) and torch.equal(alg._kmax[2][1, 0], k[0])


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), pos=st.integers(0, 255), budget=st.integers(4, 8))
def test_needle_at_any_position_is_retrieved(seed, pos, budget):
    g = torch.Generator().manual_seed(seed)
    ps, t = 8, 256
    keys = torch.randn(1, t, 2, 16, generator=g)
    q = torch.randn(1, 4, 16, generator=g)
    plant_needles(keys[0], q[0], torch.tensor([pos]))
    alg, req = _build(keys, ps)
    sel, valid = alg.retrieve_topk(q, 2, req, torch.tensor([True]), seq_lens=torch.tensor([t]),
                                   candidate_start=torch.tensor([0]), candidate_end=torch.tensor([t // ps]),
                                   top_k=budget)
    assert int(valid[0]) == budget
    assert pos // ps in sel[0].tolist()


def _snapshot(alg, layer=2):
    return alg._kmin[layer].clone(), alg._kmax[layer].clone()


def test_padding_rows_write_nothing_and_select_nothing():
    torch.manual_seed(5)
    keys = torch.randn(2, 16, 2, 8)
    alg, req = _build(keys, 4)  # 3 request slots: 2 and 1 in use, slot max_num_reqs - 1 = 2
    before = _snapshot(alg)
    # a CUDA-graph batch: one real row, two padding rows (positions of a fresh page, huge keys)
    breq = torch.tensor([1, -1, -1])
    pos = torch.tensor([16, 4, 0])
    new = torch.randn(3, 2, 8) * 100
    alg.update_representations(2, breq, pos, new)
    after = _snapshot(alg)
    for b_, a_ in zip(before, after):
        assert torch.equal(a_[2], b_[2]) and torch.equal(a_[0], b_[0])  # untouched slots (2 = the last one)
        assert torch.equal(a_[1, :4], b_[1, :4])  # slot 1's old pages untouched
    assert torch.equal(after[0][1, 4], new[0]) and torch.equal(after[1][1, 4], new[0])  # the real row landed
    q = torch.randn(3, 4, 8)
    sel, valid = alg.retrieve_topk(q, 2, torch.tensor([2, -1, 1]), torch.tensor([True, True, True]),
                                   seq_lens=torch.tensor([16, 16, 17]), candidate_start=torch.zeros(3, dtype=torch.int32),
                                   candidate_end=torch.tensor([4, 4, 5]), top_k=2)
    assert valid.tolist() == [2, 0, 2] and (sel[1] == -1).all()


def test_shape_dtype_and_range_errors_name_the_parameter():
    alg, req = _build(torch.randn(2, 16, 2, 8), 4)
    with pytest.raises(ValueError, match="new_keys"):
        alg.update_representations(2, req, torch.tensor([16, 16]), torch.randn(2, 8))
    with pytest.raises(ValueError, match="new_keys"):
        alg.update_representations(2, req, torch.tensor([16, 16]), torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="positions"):
        alg.update_representations(2, req, torch.tensor([16.0, 16.0]), torch.randn(2, 2, 8))
    with pytest.raises(ValueError, match="positions"):
        alg.update_representations(2, req, torch.tensor([16]), torch.randn(2, 2, 8))
    with pytest.raises(ValueError, match="req_pool_indices"):
        alg.update_representations(2, torch.tensor([[1, 2]]), torch.tensor([16, 16]), torch.randn(2, 2, 8))
    with pytest.raises(ValueError, match="req_pool_indices"):
        alg.update_representations(2, torch.tensor([1, 3]), torch.tensor([16, 16]), torch.randn(2, 2, 8))
    with pytest.raises(ValueError, match="positions"):
        alg.update_representations(2, req, torch.tensor([16, 20]), torch.randn(2, 2, 8))  # past max_context_len
    kw = dict(seq_lens=torch.tensor([16, 16]), candidate_start=torch.tensor([0, 0]), candidate_end=torch.tensor([4, 4]),
              top_k=2)
    on = torch.tensor([True, True])
    with pytest.raises(ValueError, match="req_pool_indices"):
        alg.retrieve_topk(torch.randn(2, 4, 8), 2, torch.tensor([1, 3]), on, **kw)
    with pytest.raises(ValueError, match="queries"):
        alg.retrieve_topk(torch.randn(2, 4, 6), 2, req, on, **kw)
    with pytest.raises(ValueError, match="queries"):
        alg.retrieve_topk(torch.randn(2, 3, 8), 2, req, on, **kw)  # Hq not a multiple of Hkv
    with pytest.raises(ValueError, match="sparse_mask"):
        alg.retrieve_topk(torch.randn(2, 4, 8), 2, req, torch.tensor([True]), **kw)


def test_value_checks_skipped_while_capturing(monkeypatch):
    """Under CUDA-graph capture the host read-back checks must not run (they would break
    the capture); out-of-range rows then write nothing instead of raising."""
    import torch.cuda
    assert host_checks_enabled(True) and not host_checks_enabled(False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not host_checks_enabled(True)
    alg, req = _build(torch.randn(2, 16, 2, 8), 4)
    before = _snapshot(alg)

    def no_sync(*a, **k):
        raise AssertionError("host read-back during capture")

    monkeypatch.setattr(torch.Tensor, "tolist", no_sync)
    monkeypatch.setattr(torch.Tensor, "item", no_sync)
    monkeypatch.setattr(torch.Tensor, "__bool__", no_sync)
    alg.update_representations(2, torch.tensor([1, 7]), torch.tensor([99, 4]), torch.randn(2, 2, 8) * 100)
    sel, valid = alg.retrieve_topk(torch.randn(2, 4, 8), 2, torch.tensor([7, -1]), torch.tensor([True, True]),
                                   seq_lens=torch.tensor([16, 16]), candidate_start=torch.tensor([0, 0]),
                                   candidate_end=torch.tensor([4, 4]), top_k=2)
    monkeypatch.undo()
    assert valid.tolist() == [0, 0]
    after = _snapshot(alg)
    assert all(torch.equal(a_, b_) for a_, b_ in zip(before, after))


def test_invalid_configs():
    with pytest.raises(ValueError, match="page_size"):
        QuestAlgorithm(SparseConfig(algorithm="quest", page_size=1, top_k=16, device_buffer_size=64), torch.device("cpu"))
    with pytest.raises(ValueError, match="top_k"):
        SparseConfig(algorithm="quest", page_size=16, top_k=0)
    with pytest.raises(ValueError, match="page_size"):
        SparseConfig(algorithm="quest", page_size=12, top_k=48)
    with pytest.raises(ValueError, match="head_reduce"):
        QuestAlgorithm(_cfg(head_reduce="mean"), torch.device("cpu"))
    alg, req = _build(torch.randn(1, 16, 2, 8), 4)
    kw = dict(seq_lens=torch.tensor([16]), candidate_start=torch.tensor([0]), candidate_end=torch.tensor([4]))
    with pytest.raises(ValueError, match="top_k"):
        alg.retrieve_topk(torch.randn(1, 4, 8), 2, req, torch.tensor([True]), top_k=0, **kw)
    with pytest.raises(ValueError, match="dense"):
        alg.retrieve_topk(torch.randn(1, 4, 8), 0, req, torch.tensor([True]), top_k=2, **kw)
    with pytest.raises(ValueError, match="candidate_end"):
        alg.retrieve_topk(torch.randn(1, 4, 8), 2, req, torch.tensor([True]), top_k=2, seq_lens=torch.tensor([16]),
                          candidate_start=torch.tensor([0]))


def test_defaults_and_memory():
    alg = create_algorithm(_cfg(16), "cpu")
    assert isinstance(alg, QuestAlgorithm) and alg.dense_layers() == (0, 1)
    alg.initialize_representation_pool(0, 4, 2, 1024, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    key_bytes = 2 * 2 * 1024 * 8 * 128 * 2  # sparse layers 2, 3
    dump = 2 * 2 * 8 * 128 * 2  # one [Hkv, D] entry per layer and min/max for padding rows' writes
    assert alg.representation_bytes() == key_bytes * 2 // 16 + dump  # min + max = 2/page_size of the keys


def test_author_kit_quest(monkeypatch):
    report = check_algorithm(QuestAlgorithm)
    assert report.needle_recall == 1.0 and report.deterministic
    # the Triton kernel (interpreted) inside the whole algorithm, max reduction, page 8
    monkeypatch.setenv("SPARSEHI_FORCE_TRITON", "1")
    report = check_algorithm(QuestAlgorithm, {"page_size": 8, "top_k": 32, "device_buffer_size": 64,
                                              "sink_tokens": 8, "recent_tokens": 8,
                                              "sparse_extra_config": {"head_reduce": "max"}}, context_len=96)
    assert report.needle_recall == 1.0


@pytest.mark.gpu
def test_quest_default_config_captures_in_a_cuda_graph():
    """Default config (validate=True): update_representations + retrieve_topk captured in
    a CUDA graph with padding rows, replayed, equal to eager calls on a twin instance."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    ps, hkv, hq, d, ctx, reqs, B = 16, 8, 32, 128, 4096, 4, 4
    cfg = SparseConfig(algorithm="quest", page_size=ps, top_k=512, device_buffer_size=2048)
    assert cfg.sparse_extra_config.get("validate", True)
    algs = [QuestAlgorithm(cfg, dev), QuestAlgorithm(cfg, dev)]
    keys = torch.randn(reqs, ctx, hkv, d, device=dev, dtype=torch.bfloat16)
    slots = torch.arange(reqs * ctx, device=dev).view(reqs, ctx)
    for a in algs:
        a.initialize_representation_pool(0, 3, reqs, ctx, kv_heads=hkv, head_dim=d, dtype=torch.bfloat16)
        a.construct_representations(2, torch.arange(reqs, device=dev), torch.full((reqs,), 3000, device=dev),
                                    keys.view(-1, hkv, d), slots)
    last_slot = algs[0]._kmin[2][reqs - 1].clone(), algs[0]._kmax[2][reqs - 1].clone()
    static = dict(req=torch.tensor([2, 0, -1, -1], device=dev), pos=torch.full((B,), 3000, device=dev),
                  new=torch.randn(B, hkv, d, device=dev, dtype=torch.bfloat16),
                  q=torch.randn(B, hq, d, device=dev, dtype=torch.bfloat16),
                  seq=torch.full((B,), 3001, device=dev, dtype=torch.int32),
                  cs=torch.full((B,), 1, device=dev, dtype=torch.int32),
                  ce=torch.full((B,), 180, device=dev, dtype=torch.int32),
                  mask=torch.ones(B, dtype=torch.bool, device=dev))

    def step(a):
        a.update_representations(2, static["req"], static["pos"], static["new"])
        return a.retrieve_topk(static["q"], 2, static["req"], static["mask"], seq_lens=static["seq"],
                               candidate_start=static["cs"], candidate_end=static["ce"], top_k=32)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(algs[0])  # warm-up (Triton compile) outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sel, valid = step(algs[0])
    eager_twin = algs[1]
    step(eager_twin)  # the twin's own first step, matching the warm-up
    for i in range(3):
        static["pos"].fill_(3001 + i)
        static["seq"].fill_(3002 + i)
        static["new"].copy_(torch.randn(B, hkv, d, device=dev, dtype=torch.bfloat16))
        static["q"].copy_(torch.randn(B, hq, d, device=dev, dtype=torch.bfloat16))
        graph.replay()
        want_sel, want_valid = step(eager_twin)
        torch.cuda.synchronize()
        assert torch.equal(valid, want_valid) and valid[2:].eq(0).all() and valid[:2].eq(32).all()
        assert torch.equal(sel.sort(1).values, want_sel.sort(1).values)
    assert torch.equal(algs[0]._kmin[2], eager_twin._kmin[2]) and torch.equal(algs[0]._kmax[2], eager_twin._kmax[2])
    # the padding rows (req -1) left the last request slot alone
    assert torch.equal(algs[0]._kmin[2][reqs - 1], last_slot[0]) and torch.equal(algs[0]._kmax[2][reqs - 1], last_slot[1])


@pytest.mark.gpu
def test_quest_kernel_on_gpu_matches_reference():
    torch.manual_seed(0)
    b, hq, hkv, d, pages = 8, 32, 8, 128, 2048  # 32k context at page 16
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    kmin = torch.randn(b + 2, pages, hkv, d, device="cuda", dtype=torch.bfloat16)
    kmax = kmin + torch.rand_like(kmin)
    req = torch.randperm(b + 2, device="cuda")[:b]
    npages = torch.randint(1, pages + 1, (b,), device="cuda")
    for reduce in ("max", "sum"):
        ref = quest_score_reference(q, kmin, kmax, req, npages, reduce)
        tri = quest_score(q, kmin, kmax, req, npages, reduce)
        live = ~torch.isinf(ref)
        assert torch.equal(live, ~torch.isinf(tri))
        assert torch.allclose(ref[live], tri[live], rtol=1e-3, atol=1e-2)
