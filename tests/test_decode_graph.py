"""The decode step in CUDA graphs: every mode's captured step replays bit-identically to its
eager step (same padded batch, same kernels) over many steps with page-boundary crossings
and LRU misses, and a replay makes no host sync. The bucket logic and the static inputs
are checked on CPU too."""
from __future__ import annotations

import pytest
import torch

from sparsehi.config import SparseConfig
from sparsehi.runtime.decode_graph import DecodeInputs, batch_buckets
from sparsehi.runtime.model_config import get_model_config
from sparsehi.runtime.runtime_config import RuntimeConfig
from sparsehi.runtime.runner import ModelRunner
from sparsehi.runtime.weights import build_model

STEPS = 40


def test_batch_buckets_follow_sglang():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    with pytest.raises(ValueError, match="max_batch"):
        batch_buckets(0)


def test_inputs_pad_rows_with_row_minus_one():
    inp = DecodeInputs.allocate(4, torch.device("cpu"))
    inp.fill([7, 8], [10, 20], [3, 1], [11, 21], 4)
    assert inp.input_ids.tolist() == [7, 8, 0, 0]
    assert inp.positions.tolist() == [10, 20, 0, 0]
    assert inp.req_pool_indices.tolist() == [3, 1, -1, -1]
    assert inp.seq_lens.tolist() == [11, 21, 1, 1]
    inp.fill([5], [4], [2], [5], 2)  # a smaller step pads again, whatever was there
    assert inp.req_pool_indices[:2].tolist() == [2, -1]


def test_inputs_carry_the_steps_page_entries_and_clear_them_after():
    """A step's new page-table entries travel in the packed inputs; the next step's slots
    are all unused again (a replayed stale entry could overwrite a reused row's table)."""
    import numpy as np

    inp = DecodeInputs.allocate(2, torch.device("cpu"))
    assert inp.page_entries.shape == (6, 4) and (inp.page_entries[:, 0] == -1).all()
    inp.fill([1, 2], [3, 4], [0, 1], [4, 5], 2, np.array([[0, 1, 2, 30], [2, 0, 5, 40]]))
    assert inp.page_entries[:2].tolist() == [[0, 1, 2, 30], [2, 0, 5, 40]]
    assert (inp.page_entries[2:, 0] == -1).all()
    inp.fill([1, 2], [4, 5], [0, 1], [5, 6], 2)
    assert (inp.page_entries[:, 0] == -1).all()
    with pytest.raises(ValueError, match="page entries"):
        inp.fill([1], [1], [0], [2], 1, np.zeros((7, 4), dtype=np.int64))


_MODELS: dict = {}


def _model(name: str):
    if name not in _MODELS:
        cfg = get_model_config(name, num_layers=4 if name == "tiny-gqa" else 3)
        _MODELS[name] = build_model(config=cfg, device="cuda", dtype=torch.bfloat16)
    return _MODELS[name]


def _prompts(lengths, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _runner(name, mode, sc, prompts, graph, adapter="auto"):
    rt = RuntimeConfig(mode=mode, sparse=sc, device="cuda", dtype=torch.bfloat16, max_num_reqs=len(prompts) + 2,
                       max_context_len=max(map(len, prompts)) + STEPS + 1, adapter=adapter, validate=False,
                       cuda_graph=graph)
    return ModelRunner(_model(name), rt)


GQA = dict(algorithm="quest", page_size=16, top_k=64, device_buffer_size=96, sink_tokens=16, recent_tokens=16)
DSA = dict(algorithm="dsa", page_size=1, top_k=48, device_buffer_size=96, sink_tokens=8, recent_tokens=8)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["dense", "sparse-gpu", "sparse-hier", "offload-full"])
@pytest.mark.parametrize("name,kw", [("tiny-gqa", GQA), ("tiny-dsa", DSA)], ids=["gqa", "mla"])
def test_captured_step_replays_its_eager_step(mode, name, kw):
    sc = SparseConfig(min_sparse_prompt_len=0, **kw)
    prompts = _prompts((300, 333, 290))  # 3 rows -> bucket 4: one padding row every step
    res = {}
    for graph in (True, False):
        runner = _runner(name, mode, sc, prompts, graph)
        res[graph] = runner.generate(prompts, STEPS)
        if graph:
            assert runner.graphs.enabled and runner.graphs.captured, "the step really ran as a graph"
        else:
            assert not runner.graphs.captured
    assert res[True].tokens == res[False].tokens
    if mode == "sparse-hier":
        g, e = res[True].stats, res[False].stats
        assert g["misses"] > 0 and g["hits"] > 0, "loads really happened"
        assert (g["hits"], g["misses"], g["steps"]) == (e["hits"], e["misses"], e["steps"])
        assert [s["misses"] for s in g["per_step"]] == [s["misses"] for s in e["per_step"]]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["dense", "sparse-gpu", "sparse-hier"])
def test_captured_step_over_fp8_latent_rows_replays_its_eager_step(mode):
    """``kv_cache_dtype='fp8_e4m3'``: the step quantises the new token's latent row inside
    the graph (no host sync, fixed shapes) and attends the uint8 rows; replay == eager."""
    sc = SparseConfig(min_sparse_prompt_len=0, kv_cache_dtype="fp8_e4m3", **DSA)
    prompts = _prompts((300, 333, 290))
    res = {}
    for graph in (True, False):
        runner = _runner("tiny-dsa-fp8", mode, sc, prompts, graph)
        res[graph] = runner.generate(prompts, STEPS)
        assert runner.mode.pool.kv_data.dtype == torch.uint8
        assert bool(runner.graphs.captured) == graph
    assert res[True].tokens == res[False].tokens
    if mode == "sparse-hier":
        assert res[True].stats["misses"] == res[False].stats["misses"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["sparse-gpu", "sparse-hier"])
def test_captured_step_with_a_dense_row(mode):
    """A short prompt (< min_sparse_prompt_len) in the batch: the dense-row graph key of the
    graph, replayed against its eager step."""
    sc = SparseConfig(min_sparse_prompt_len=200, **GQA)
    prompts = _prompts((300, 120, 333), seed=3)
    toks = [_runner("tiny-gqa", mode, sc, prompts, graph).generate(prompts, STEPS).tokens for graph in (True, False)]
    assert toks[0] == toks[1]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["dense", "sparse-gpu", "sparse-hier", "offload-full"])
def test_replay_makes_no_host_sync(mode):
    sc = SparseConfig(min_sparse_prompt_len=0, **GQA)
    prompts = _prompts((300, 333))
    runner = _runner("tiny-gqa", mode, sc, prompts, True)
    reqs = runner.new_requests(prompts)
    for r in reqs:
        runner.prefill(r)
    runner.decode_step(reqs)  # captures the bucket
    runtime_mode = runner.mode
    for _ in range(20):  # crosses a page boundary (page 16)
        graph_key = runtime_mode.prepare_decode(reqs)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            toks, outputs = runner.graphs.run([r.output[-1] for r in reqs], [r.seq_len for r in reqs],
                                              [r.req_pool_idx for r in reqs], [r.seq_len + 1 for r in reqs], graph_key,
                                              runtime_mode.take_page_entries())
        finally:
            torch.cuda.set_sync_debug_mode("default")
        runtime_mode.end_decode(reqs, outputs)
        for r, t in zip(reqs, toks[: len(reqs)].tolist()):
            r.output.append(t)
    assert len(runner.graphs.captured) == 1


@pytest.mark.gpu
def test_reset_stats_keeps_counting_after_capture():
    """reset_stats between phases (as benchmarks do after a warm-up) zeroes the counters the
    captured graph writes, in place: later replays are counted, and nothing writes freed memory."""
    sc = SparseConfig(min_sparse_prompt_len=0, **GQA)
    prompts = _prompts((300, 333))
    runner = _runner("tiny-gqa", "sparse-hier", sc, prompts, True)
    reqs = runner.new_requests(prompts)
    for r in reqs:
        runner.prefill(r)
    for _ in range(3):
        runner.decode_step(reqs)
    runner.mode.coord.reset_stats()
    assert runner.mode.coord.stats()["steps"] == 0
    for _ in range(5):
        runner.decode_step(reqs)
    st = runner.mode.coord.stats()
    assert st["steps"] == 5 and st["hits"] + st["misses"] > 0 and len(st["per_step"]) == 5


@pytest.mark.gpu
def test_generate_captures_before_timing(monkeypatch):
    """generate() captures the step's graph before its timed decode loop: no step of the
    loop captures (a capture is seconds of eager warm-up and recording)."""
    sc = SparseConfig(min_sparse_prompt_len=0, **GQA)
    prompts = _prompts((300, 333))
    runner = _runner("tiny-gqa", "sparse-hier", sc, prompts, True)
    captures = []
    real = runner.graphs._capture
    monkeypatch.setattr(runner.graphs, "_capture", lambda nb, v: captures.append(runner.mode.decode_graph_key([])) or real(nb, v))
    real_step = runner.launch_decode
    in_loop = []
    monkeypatch.setattr(runner, "launch_decode",
                        lambda reqs, feed=None, after=None: in_loop.append(len(captures)) or real_step(reqs, feed, after))
    runner.generate(prompts, 5)
    assert len(captures) == 1 and in_loop == [1] * 5


@pytest.mark.gpu
def test_capture_survives_a_dropped_runner_collected_meanwhile():
    """A dropped runner's graphs are freed by the cycle collector, whenever it runs. Freeing
    a graph while another one records is an error in CUDA, so capture collects first and
    keeps the collector off while it records (here the collector would run at every
    allocation)."""
    import gc

    sc = SparseConfig(min_sparse_prompt_len=0, **GQA)
    prompts = _prompts((300, 333))
    first = _runner("tiny-gqa", "sparse-hier", sc, prompts, True)
    want = first.generate(prompts, 6).tokens
    del first  # unreachable now, but held by reference cycles until a collection
    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        second = _runner("tiny-gqa", "sparse-hier", sc, prompts, True)
        got = second.generate(prompts, 6).tokens
    finally:
        gc.set_threshold(*threshold)
    assert second.graphs.captured and got == want
