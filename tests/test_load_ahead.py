"""Loading ahead (``SparseConfig.lookahead_tokens``, sparsehi/decode/load_ahead.py): the
pages ranked after each layer's selection are copied for the next step, the generated
tokens stay exactly sparse-gpu's, and the counters say how many misses left the critical
path. The pieces: a second LRU diff of a step whose set contains the first (kernel against
reference), the marks kernel against its reference, the config's checks."""
from __future__ import annotations

import os

import pytest
import torch

from sparsehi.config import SparseConfig
from sparsehi.kernels.lookahead_marks import fold_lookahead_marks_reference, fold_lookahead_marks_triton
from sparsehi.kernels.lru_diff import lru_diff_triton
from sparsehi.kernels.lru_diff_reference import lru_diff_reference
from test_e2e import prompts_of, run
from test_fp8_host_kv import model_for
from test_fp8_host_kv import run as run_fp8

STEPS = 24
pytestmark = pytest.mark.usefixtures("one_thread")
needs_interp = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="interpreted Triton kernels need TRITON_INTERPRET=1")


def _quest(**kw) -> SparseConfig:
    base = dict(algorithm="quest", page_size=16, top_k=48, device_buffer_size=96, sink_tokens=16, recent_tokens=16,
                min_sparse_prompt_len=0, io_backend="kernel")
    return SparseConfig(**{**base, **kw})


@pytest.mark.parametrize("host_kv_dtype", ["auto", "fp8_e4m3"])
def test_load_ahead_keeps_tokens_and_hides_misses(host_kv_dtype):
    model = model_for("tiny-gqa")
    prompts = prompts_of((300, 333))
    runner = run_fp8 if host_kv_dtype == "fp8_e4m3" else run
    off = _quest(host_kv_dtype=host_kv_dtype)
    on = _quest(host_kv_dtype=host_kv_dtype, lookahead_tokens=32)
    gpu = runner(model, "sparse-gpu", off, prompts, STEPS)
    plain = runner(model, "sparse-hier", off, prompts, STEPS)
    ahead = runner(model, "sparse-hier", on, prompts, STEPS)
    assert ahead.tokens == gpu.tokens == plain.tokens
    a, p = ahead.stats, plain.stats
    assert "ahead_loads" not in p
    # the same selections were attended: hits + misses agree; loads ahead turned some of
    # the misses into hits that were copied off the critical path (whether that leaves
    # fewer misses depends on how stable the ranking is: the random model's is not;
    # test_loading_ahead_takes_misses_off_a_drifting_ranking measures that)
    assert a["hits"] + a["misses"] == p["hits"] + p["misses"]
    assert a["ahead_loads"] > 0 and 0 < a["hidden_misses"] <= a["ahead_loads"]
    assert a["hidden_frac"] == a["hidden_misses"] / (a["hidden_misses"] + a["misses"])
    assert 0 < a["ahead_precision"] <= 1
    assert set(a["per_layer_hidden_frac"]) == set(range(2, 3))  # quest's sparse layer of the 3-layer model


def test_load_ahead_of_dsa():
    """DSA's lookahead (one indexer pass cut twice) through the decode: tokens equal sparse-gpu's."""
    model = model_for("tiny-dsa")
    prompts = prompts_of((160, 137))
    kw = dict(algorithm="dsa", page_size=1, top_k=32, device_buffer_size=64, sink_tokens=8, recent_tokens=8,
              min_sparse_prompt_len=0, io_backend="kernel")
    gpu = run(model, "sparse-gpu", SparseConfig(**kw), prompts, 12)
    ahead = run(model, "sparse-hier", SparseConfig(**kw, lookahead_tokens=16), prompts, 12)
    assert ahead.tokens == gpu.tokens
    assert ahead.stats["ahead_loads"] > 0 and ahead.stats["hidden_misses"] > 0


def test_lookahead_set_without_the_selection_is_refused(monkeypatch):
    from sparsehi.algorithms.quest import QuestAlgorithm

    def cut_elsewhere(self, queries, layer_id, req_pool_indices, sparse_mask, *, lookahead_top_k, **kw):
        sel, val = self.retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, **kw)
        # a set that leaves the best page out (ids past the selection's, padded)
        return sel, val, lambda: (torch.where(sel >= 0, sel + 1, -1), val)

    monkeypatch.setattr(QuestAlgorithm, "retrieve_topk_and_lookahead", cut_elsewhere)
    with pytest.raises(ValueError, match="lookahead set must contain every selected id"):
        run(model_for("tiny-gqa"), "sparse-hier", _quest(lookahead_tokens=32), prompts_of((300,)), 4)


@pytest.mark.parametrize("kw,match", [
    (dict(lookahead_tokens=8), "multiple of page_size"),
    (dict(lookahead_tokens=-16), "an integer >= 0"),
    (dict(lookahead_tokens=True), "an integer >= 0"),
    (dict(lookahead_tokens=64), "at most device_buffer_size - top_k = 48"),
    (dict(lookahead_tokens=16, io_backend="direct"), "0 with io_backend='direct'"),
])
def test_lookahead_config_is_checked(kw, match):
    with pytest.raises(ValueError, match=f"lookahead_tokens.*{match}"):
        _quest(**kw)


def _ranked_sets(g, rows, ids, k, m, prev):
    """Top-k and Top-(k+m) of a slowly drifting score (nested cuts of one ranking)."""
    scores = 0.8 * prev + 0.2 * torch.rand(rows, ids, generator=g)
    order = torch.argsort(scores, 1, descending=True)
    top = torch.sort(order[:, :k], 1).values.int()
    ahead = torch.sort(order[:, :k + m], 1).values.int()
    return scores, top, ahead


@needs_interp
@pytest.mark.parametrize("slots,k,m", [(24, 8, 6), (48, 16, 32), (64, 8, 6), (32, 8, 24)])
def test_second_diff_of_a_step_matches_reference(slots, k, m):
    """Victim-side and miss-side installs (S >= 4K), and a set that fills the buffer."""
    """Each step: the selection's diff, then the diff of the Top-(k+m) set with the same
    stamp, on the kernel and on the reference: identical outputs and state throughout."""
    R, M = 3, 96
    g = torch.Generator().manual_seed(7)

    def state():
        return [torch.full((R, slots), -1, dtype=torch.int32), torch.full((R, slots), -1, dtype=torch.int32),
                torch.full((R, M), -1, dtype=torch.int32)]

    kern, ref = state(), state()
    scores = torch.rand(R, M, generator=g)
    ahead_loads = 0
    for step in range(30):
        scores, top, ahead = _ranked_sets(g, R, M, k, m, scores)
        valid = torch.full((R,), k, dtype=torch.int32)
        va = torch.tensor([k + m, 0, k + m], dtype=torch.int32)  # row 1: a row that loads nothing ahead
        for ids, val in ((top, valid), (ahead, va)):
            a = lru_diff_triton(ids, val, *kern, step)
            b = lru_diff_reference(ids, val, *ref, step)
            for x, y in zip((a.device_slots, a.load_ids, a.load_slots, a.num_loads),
                            (b.device_slots, b.load_ids, b.load_slots, b.num_loads)):
                assert torch.equal(x, y), step
            for x, y in zip(kern, ref):
                assert torch.equal(x, y), step
        ahead_loads += int(b.num_loads.sum())
        # the selection stays resident: every selected id is in its row's buffer
        for r in range(R):
            assert set(top[r].tolist()) <= set(ref[0][r].tolist())
    assert ahead_loads > 0


def test_loading_ahead_takes_misses_off_a_drifting_ranking():
    """On a ranking that drifts step by step, the selection's diff misses fewer pages when
    each step's Top-(k+m) was loaded ahead than without (reference diffs, rows that do)."""
    R, M, slots, k, m = 4, 256, 64, 16, 32

    def misses(ahead_on: bool) -> int:
        g = torch.Generator().manual_seed(11)
        st = [torch.full((R, slots), -1, dtype=torch.int32), torch.full((R, slots), -1, dtype=torch.int32),
              torch.full((R, M), -1, dtype=torch.int32)]
        scores, total = torch.rand(R, M, generator=g), 0
        for step in range(60):
            scores, top, ahead = _ranked_sets(g, R, M, k, m, scores)
            r = lru_diff_reference(top, torch.full((R,), k, dtype=torch.int32), *st, step)
            total += int(r.num_loads.sum()) if step >= 10 else 0
            if ahead_on:
                lru_diff_reference(ahead, torch.full((R,), k + m, dtype=torch.int32), *st, step)
        return total

    without, with_ahead = misses(False), misses(True)
    assert with_ahead < 0.6 * without, (with_ahead, without)


def _marks_case(seed):
    g = torch.Generator().manual_seed(seed)
    R, M, B, K, KA = 4, 40, 5, 8, 12
    marks = torch.randint(0, 2, (R, M), generator=g, dtype=torch.uint8)
    rows = torch.tensor([2, -1, 0, 3, 1])
    sel = torch.stack([torch.randperm(M, generator=g)[:K] for _ in range(B)]).int()
    nsel = torch.randint(0, K + 1, (B,), generator=g, dtype=torch.int32)
    missed = torch.stack([s[torch.randperm(K, generator=g)] for s in sel]).int()
    nmiss = torch.minimum(nsel, torch.randint(0, K + 1, (B,), generator=g, dtype=torch.int32))
    # misses are among the selected ids: take them from the selection's valid part
    missed = torch.where(torch.arange(K)[None, :] < nmiss[:, None], sel, -1)
    ahead = torch.randint(0, M, (B, KA), generator=g, dtype=torch.int32)
    nahead = torch.randint(0, KA + 1, (B,), generator=g, dtype=torch.int32)
    uses = torch.tensor([True, True, False, True, True])
    return [marks, rows, sel, nsel, uses, missed, nmiss, ahead, nahead, torch.full((B,), -7, dtype=torch.int32)]


@needs_interp
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lookahead_marks_kernel_matches_reference(seed):
    a, b = _marks_case(seed), _marks_case(seed)
    # distinct ahead pages per row, outside the row's selection (as a load ahead's are)
    for case in (a, b):
        for i in range(case[7].shape[0]):
            pool = [x for x in range(case[0].shape[1]) if x not in set(case[2][i].tolist())]
            case[7][i] = torch.tensor(pool[: case[7].shape[1]], dtype=torch.int32)
    fold_lookahead_marks_triton(*a)
    fold_lookahead_marks_reference(*b)
    assert torch.equal(a[0], b[0]) and torch.equal(a[9], b[9])
    assert b[9][1] == 0 and b[9][2] == 0  # a padding row and a row that does not use its selection
    assert (b[9] >= 0).all()


@needs_interp
def test_lookahead_marks_kernel_matches_reference_on_unvalidated_input():
    """Repeated ids, ids out of range, negative counts and counts past a list's width: the
    kernel and the reference agree (ids clamp into the row, counts into the list)."""
    g = torch.Generator().manual_seed(9)
    R, M, B, K, KA = 3, 12, 4, 6, 7
    for _ in range(12):
        args = [torch.randint(0, 2, (R, M), generator=g, dtype=torch.uint8), torch.tensor([2, -1, 0, 1]),
                torch.randint(-3, M + 4, (B, K), generator=g, dtype=torch.int32),
                torch.randint(-2, K + 5, (B,), generator=g, dtype=torch.int32),
                torch.randint(0, 2, (B,), generator=g).bool(),
                torch.randint(-3, M + 4, (B, K), generator=g, dtype=torch.int32),
                torch.randint(-2, K + 5, (B,), generator=g, dtype=torch.int32),
                torch.randint(-3, M + 4, (B, KA), generator=g, dtype=torch.int32),
                torch.randint(-2, KA + 5, (B,), generator=g, dtype=torch.int32),
                torch.full((B,), -7, dtype=torch.int32)]
        a = [t.clone() for t in args]
        fold_lookahead_marks_triton(*a)
        fold_lookahead_marks_reference(*args)
        assert torch.equal(a[0], args[0]) and torch.equal(a[9], args[9])


def test_an_empty_decode_step_with_loading_ahead():
    """A step of no rows (B = 0) runs with loading ahead as without."""
    from hicache.device_pool import DeviceKVPool
    from hicache.host_pool import HostKVPool
    from hicache.kv_spec import KVCacheSpec
    from sparsehi.algorithms.quest import QuestAlgorithm
    from sparsehi.coordinator import SparseCoordinator
    from sparsehi.forward_batch import ForwardBatch

    dev = torch.device("cpu")
    cfg = SparseConfig(algorithm="quest", page_size=4, top_k=16, device_buffer_size=32, sink_tokens=4,
                       recent_tokens=8, dense_layers=(0,), min_sparse_prompt_len=0, lookahead_tokens=8)
    pool = DeviceKVPool(KVCacheSpec("mha", 3, 2, 8, torch.float32, 4), 4 * 64, dev)
    host = HostKVPool(pool, hicache_ratio=2.0, pin_memory=False)
    coord = SparseCoordinator(cfg, QuestAlgorithm(cfg, dev), pool, mode="hierarchical", host_pool=host,
                              max_num_reqs=4, max_context_len=64, validate=False)
    coord.prepare_decode([], [])
    batch = ForwardBatch.decode(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32), prepared=True,
                                has_dense_rows=False)
    coord.forward_begin(batch)
    for layer in range(3):
        q, k, v = torch.randn(0, 4, 8), torch.randn(0, 2, 8), torch.randn(0, 2, 8)
        plan = coord.attention_begin(layer, batch, q=q)
        plan.write_kv(k, v)
        coord.attention_end(layer, batch, k=k, v=v)
    coord.forward_end(batch)
    assert coord.stats()["ahead_loads"] == 0


def test_lookahead_marks_reference_by_hand():
    marks = torch.zeros(1, 8, dtype=torch.uint8)
    marks[0, [2, 3, 5]] = 1  # loaded ahead earlier
    sel = torch.tensor([[2, 3, 4, -1]], dtype=torch.int32)
    missed = torch.tensor([[3, -1, -1, -1]], dtype=torch.int32)  # 3 was evicted again and missed
    hidden = torch.zeros(1, dtype=torch.int32)
    fold_lookahead_marks_reference(marks, torch.tensor([0]), sel, torch.tensor([3], dtype=torch.int32),
                                   torch.tensor([True]), missed, torch.tensor([1], dtype=torch.int32),
                                   torch.tensor([[6, 7]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                                   hidden)
    assert hidden.tolist() == [1]  # page 2 only
    assert marks[0].tolist() == [0, 0, 0, 0, 0, 1, 1, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("host_kv_dtype", ["auto", "fp8_e4m3"])
def test_load_ahead_in_cuda_graphs_keeps_tokens(host_kv_dtype):
    """On the GPU (Triton kernels, the attention adapter, bf16) with decode CUDA graphs: the
    side stream is captured with the step; the tokens equal sparse-gpu's and eager's, and
    the loads ahead are counted the same way in both."""
    model = model_for("tiny-gqa", "cuda", torch.bfloat16)
    prompts = prompts_of((700, 640))
    kw = dict(top_k=128, device_buffer_size=256, host_kv_dtype=host_kv_dtype)
    layout = "page_first" if host_kv_dtype == "fp8_e4m3" else "layer_first"

    def go(mode, sc, graphs):
        return run(model, mode, sc, prompts, 32, device="cuda", dtype=torch.bfloat16, adapter="auto",
                   cuda_graph=graphs, host_layout=layout)

    on = _quest(**kw, lookahead_tokens=64)
    gpu = go("sparse-gpu", _quest(**kw), True)
    plain = go("sparse-hier", _quest(**kw), True)
    ahead = go("sparse-hier", on, True)
    eager = go("sparse-hier", on, False)
    assert ahead.tokens == gpu.tokens == eager.tokens == plain.tokens
    a = ahead.stats
    assert a["hidden_misses"] > 0 and a["ahead_loads"] >= a["hidden_misses"]
    assert a["hits"] + a["misses"] == plain.stats["hits"] + plain.stats["misses"]
    for key in ("hidden_misses", "ahead_loads", "misses"):
        assert a[key] == eager.stats[key], key


@pytest.mark.gpu
def test_load_ahead_of_dsa_in_cuda_graphs_keeps_tokens():
    """DSA's lookahead (the second cut of the layer's scores, on the side stream, beside the
    layer's index-key update on the step's stream): tokens equal sparse-gpu's."""
    model = model_for("tiny-dsa", "cuda", torch.bfloat16)
    prompts = prompts_of((700, 640))
    kw = dict(algorithm="dsa", page_size=1, top_k=64, device_buffer_size=128, sink_tokens=8, recent_tokens=8,
              min_sparse_prompt_len=0)

    def go(mode, sc):
        return run(model, mode, sc, prompts, 32, device="cuda", dtype=torch.bfloat16, adapter="auto",
                   cuda_graph=True)

    gpu = go("sparse-gpu", SparseConfig(**kw))
    ahead = go("sparse-hier", SparseConfig(**kw, lookahead_tokens=32))
    assert ahead.tokens == gpu.tokens
    assert ahead.stats["hidden_misses"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 3])
def test_lookahead_marks_cuda_matches_reference(seed):
    a, b = _marks_case(seed), _marks_case(seed)
    fold_lookahead_marks_reference(*b)
    got = [t.cuda() for t in a]
    fold_lookahead_marks_triton(*got)
    assert torch.equal(got[0].cpu(), b[0]) and torch.equal(got[9].cpu(), b[9])


@pytest.mark.gpu
def test_second_diff_of_a_step_matches_reference_on_cuda():
    R, M, slots, k, m = 8, 4096, 256, 128, 64
    g = torch.Generator().manual_seed(5)
    dev = torch.device("cuda")

    def state(d):
        return [torch.full((R, slots), -1, dtype=torch.int32, device=d),
                torch.full((R, slots), -1, dtype=torch.int32, device=d), torch.full((R, M), -1, dtype=torch.int32,
                                                                                    device=d)]

    kern, ref = state(dev), state("cpu")
    scores = torch.rand(R, M, generator=g)
    for step in range(12):
        scores, top, ahead = _ranked_sets(g, R, M, k, m, scores)
        for ids, n in ((top, k), (ahead, k + m)):
            val = torch.full((R,), n, dtype=torch.int32)
            a = lru_diff_triton(ids.to(dev), val.to(dev), *kern, step)
            b = lru_diff_reference(ids, val, *ref, step)
            assert torch.equal(a.device_slots.cpu(), b.device_slots) and torch.equal(a.load_ids.cpu(), b.load_ids)
            assert torch.equal(a.load_slots.cpu(), b.load_slots) and torch.equal(a.num_loads.cpu(), b.num_loads)
            for x, y in zip(kern, ref):
                assert torch.equal(x.cpu(), y), step


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_a_slow_side_stream_changes_no_token(monkeypatch, graphs):
    """Races show when the side stream lags: each layer's load ahead starts after a spin of
    about a millisecond; the step's stream must neither read what it writes nor leave the
    step before it ends (tokens equal sparse-gpu's, the counters eager's)."""
    from sparsehi.decode.load_ahead import LoadAhead

    real = LoadAhead.launch

    def slow(self, li, layer, state, planes, step_counter, selected, num_selected, missed, lookahead):
        def late():
            torch.cuda._sleep(2_000_000)  # on the side stream, before its first kernel
            return lookahead()
        return real(self, li, layer, state, planes, step_counter, selected, num_selected, missed, late)

    model = model_for("tiny-gqa", "cuda", torch.bfloat16)
    prompts = prompts_of((700, 640))
    kw = dict(top_k=128, device_buffer_size=256)

    def go(mode, sc):
        return run(model, mode, sc, prompts, 16, device="cuda", dtype=torch.bfloat16, adapter="auto",
                   cuda_graph=graphs)

    gpu = go("sparse-gpu", _quest(**kw))
    fast = go("sparse-hier", _quest(**kw, lookahead_tokens=64))
    monkeypatch.setattr(LoadAhead, "launch", slow)
    lagging = go("sparse-hier", _quest(**kw, lookahead_tokens=64))
    assert lagging.tokens == gpu.tokens
    for key in ("hidden_misses", "ahead_loads", "misses"):
        assert lagging.stats[key] == fast.stats[key], key
