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
from sparsehi.kernels.quest_score import quest_score, quest_score_reference, quest_score_triton


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
    assert torch.equal(torch.isinf(ref), torch.isinf(tri))
    live = ~torch.isinf(ref)
    assert torch.allclose(ref[live], tri[live], rtol=1e-4, atol=1e-4)
    assert torch.isinf(ref[1]).all()  # req -1: nothing selectable
    # bf16 representations take the same path
    tri16 = quest_score_triton(q, kmin.bfloat16(), kmax.bfloat16(), req, npages, reduce)
    ref16 = quest_score_reference(q, kmin.bfloat16(), kmax.bfloat16(), req, npages, reduce)
    assert torch.allclose(ref16[live], tri16[live], rtol=1e-3, atol=1e-3)


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
    assert alg.representation_bytes() == key_bytes * 2 // 16  # min + max = 2/page_size of the keys


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
