"""Kernel launches per sparse layer of the built-in selection hooks, once per decode step
of the KV manager (its tables, the dense selection's pages, the counters), and per decode
layer of the hierarchical coordinator (what a sparse and a dense layer launch besides the
algorithm), on their capture path.

Counted: every aten op that runs a kernel (views, metadata and allocations excluded) plus
one per Triton launch, while ``simulated_capture`` makes the hooks take the path they
take inside a CUDA graph. On a CPU the Triton kernels run interpreted (their own aten
calls, copies to and from the interpreter, are not counted: a GPU launch has none).
"""
import os
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.kv_spec import KVCacheSpec
from sparsehi.algorithms.dsa import DSAAlgorithm
from sparsehi.algorithms.graph_safety import simulated_capture
from sparsehi.algorithms.quest import QuestAlgorithm
from sparsehi.config import SparseConfig
from sparsehi.kernels.quest_score import quest_score
from sparsehi.kernels.topk import masked_topk
from sparsehi.decode import SparseDecoder
from sparsehi.kv_manager import SparseKVCacheManager

aten = torch.ops.aten
# no kernel behind these: views, metadata, allocation
NO_LAUNCH = {aten.view, aten._unsafe_view, aten.slice, aten.select, aten.as_strided, aten.expand, aten.t,
             aten.unsqueeze, aten.squeeze, aten.detach, aten.alias, aten.empty, aten.empty_strided,
             aten.permute, aten.transpose, aten.reshape, aten.unbind, aten.split, aten.lift_fresh}


class LaunchCounter(TorchDispatchMode):
    """Records the aten ops that launch a kernel, and Triton launches as ``triton:<name>``."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: list[str] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and func.overloadpacket not in NO_LAUNCH:
            self.launches.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@contextmanager
def counting_launches():
    """``LaunchCounter`` active, Triton launches counted (and their interpreter's own aten
    calls not), the hooks on their CUDA-graph capture path."""
    import triton.runtime.interpreter as interp
    import triton.runtime.jit as jit

    counter = LaunchCounter()
    patched = []
    for cls in (interp.InterpretedFunction, jit.JITFunction):
        original = cls.run

        def run(self, *args, _original=original, **kwargs):
            if kwargs.get("warmup"):
                return _original(self, *args, **kwargs)
            if not counter.paused:
                counter.launches.append(f"triton:{getattr(self, 'fn', self).__name__}")
            paused, counter.paused = counter.paused, True
            try:
                return _original(self, *args, **kwargs)
            finally:
                counter.paused = paused

        cls.run = run
        patched.append((cls, original))
    try:
        with simulated_capture(), counter:
            yield counter
    finally:
        for cls, original in patched:
            cls.run = original


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def dev(request, monkeypatch):
    """The device the hooks run on: a GPU natively, or a CPU with the kernels interpreted."""
    if request.param == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("interpreted Triton kernels need TRITON_INTERPRET=1 (set on machines without CUDA)")
        monkeypatch.setenv("SPARSEHI_FORCE_TRITON", "1")
    return torch.device(request.param)


# the Top-k: one program per row, or (a batch smaller than the GPU, on CUDA) split over
# several programs per row: chunk shortlists, then a merge
TOPK_LAUNCHES = (["triton:_topk_select_kernel"], ["triton:_chunk_topk_kernel", "triton:_merge_topk_kernel"])


def _quest(dev, B=4, ctx=512, ps=16, hq=8, hkv=2, d=32):
    cfg = SparseConfig(algorithm="quest", page_size=ps, top_k=4 * ps, device_buffer_size=16 * ps)
    alg = QuestAlgorithm(cfg, dev)
    reqs = 3
    alg.initialize_representation_pool(0, 3, reqs, ctx, kv_heads=hkv, head_dim=d, dtype=torch.bfloat16)
    keys = torch.randn(reqs * ctx, hkv, d, device=dev, dtype=torch.bfloat16)
    alg.construct_representations(2, torch.arange(reqs, device=dev), torch.full((reqs,), 400, device=dev),
                                  keys, torch.arange(reqs * ctx, device=dev).view(reqs, ctx))
    # a CUDA-graph batch: two requests, two padding rows; int32 metadata as the coordinator passes it
    x = dict(req=torch.tensor([2, 0, -1, -1], device=dev), pos=torch.full((B,), 400, device=dev),
             new=torch.randn(B, hkv, d, device=dev, dtype=torch.bfloat16),
             q=torch.randn(B, hq, d, device=dev, dtype=torch.bfloat16),
             seq=torch.full((B,), 401, device=dev, dtype=torch.int32),
             cs=torch.ones(B, device=dev, dtype=torch.int32), ce=torch.full((B,), 22, device=dev, dtype=torch.int32),
             mask=torch.tensor([True, True, False, False], device=dev))
    return alg, x


def _dsa(dev, index_dtype, B=4, ctx=512, h=4, di=32):
    cfg = SparseConfig(algorithm="dsa", page_size=1, top_k=64, device_buffer_size=256,
                       sparse_extra_config={"index_head_dim": di, "index_dtype": index_dtype})
    alg = DSAAlgorithm(cfg, dev)
    reqs = 3
    alg.initialize_representation_pool(0, 1, reqs, ctx, kv_heads=1, head_dim=8, dtype=torch.bfloat16)
    alg.construct_representations(0, torch.arange(reqs, device=dev), torch.full((reqs,), 400, device=dev, dtype=torch.int32),
                                  torch.zeros(1, 1, 8, device=dev), torch.zeros(reqs, 400, dtype=torch.long, device=dev),
                                  index_keys=torch.randn(reqs, 400, di, device=dev))
    x = dict(req=torch.tensor([2, 0, -1, -1], device=dev), pos=torch.full((B,), 400, device=dev),
             ik=torch.randn(B, di, device=dev, dtype=torch.bfloat16),
             q=torch.randn(B, h, di, device=dev, dtype=torch.bfloat16), w=torch.rand(B, h, device=dev),
             seq=torch.full((B,), 401, device=dev, dtype=torch.int32),
             cs=torch.ones(B, device=dev, dtype=torch.int32), ce=torch.full((B,), 300, device=dev, dtype=torch.int32),
             mask=torch.tensor([True, True, False, False], device=dev))
    return alg, x


def _quest_retrieve_launches(dev):
    alg, x = _quest(dev)

    def call():
        return alg.retrieve_topk(x["q"], 2, x["req"], x["mask"], seq_lens=x["seq"], candidate_start=x["cs"],
                                 candidate_end=x["ce"], top_k=4)

    call()  # warm-up (a GPU compiles the kernels here)
    with counting_launches() as c:
        sel, valid = call()
    assert valid.tolist() == [4, 4, 0, 0]
    return c.launches


FUSED_LAUNCHES = ["triton:_quest_chunk_topk_kernel", "triton:_merge_topk_kernel"]


def test_quest_retrieve_is_at_most_three_launches(dev):
    """The bounds, then the select: one program per row (a batch that fills the GPU), or
    chunk shortlists and the merge (on CUDA, the 4-row batch here splits)."""
    launches = _quest_retrieve_launches(dev)
    assert launches in (["triton:_quest_score_kernel", *t] for t in TOPK_LAUNCHES), launches


@pytest.fixture
def small_gpu(monkeypatch):
    """The split plans of a GPU of 132 SMs, on any device (the 4-row batch here splits)."""
    for mod in ("sparsehi.kernels.quest_select", "sparsehi.kernels.topk"):
        monkeypatch.setattr(f"{mod}.sm_count", lambda device: 132)


def test_quest_split_retrieve_is_three_launches(dev, small_gpu):
    """The split path by default: the score kernel, the chunk shortlists and the merge."""
    assert _quest_retrieve_launches(dev) == ["triton:_quest_score_kernel", *TOPK_LAUNCHES[1]]


def test_quest_split_retrieve_fused_is_two_launches(dev, small_gpu, monkeypatch):
    """The fused kernel when asked for: bounds + chunk shortlists, then the merge."""
    import functools

    from sparsehi.kernels import quest_select

    monkeypatch.setattr("sparsehi.algorithms.quest.quest_retrieve",
                        functools.partial(quest_select.quest_retrieve, fused=True))
    assert _quest_retrieve_launches(dev) == FUSED_LAUNCHES


def test_quest_update_is_one_launch(dev):
    alg, x = _quest(dev)
    alg.update_representations(2, x["req"], x["pos"], x["new"])  # warm-up
    with counting_launches() as c:
        alg.update_representations(2, x["req"], x["pos"], x["new"])
    assert c.launches == ["triton:_quest_update_kernel"]


@pytest.mark.parametrize("index_dtype", ["fp8", "bf16"])
def test_dsa_retrieve_is_at_most_three_launches(dev, index_dtype):
    alg, x = _dsa(dev, index_dtype)

    def call():
        return alg.retrieve_topk(x["q"], 0, x["req"], x["mask"], seq_lens=x["seq"], candidate_start=x["cs"],
                                 candidate_end=x["ce"], top_k=64, weights=x["w"])

    call()  # warm-up
    with counting_launches() as c:
        sel, valid = call()
    assert len(c.launches) <= 3, c.launches
    assert c.launches[:1] == ["triton:_dsa_indexer_kernel"] and c.launches[1:] in TOPK_LAUNCHES, c.launches
    assert valid.tolist() == [64, 64, 0, 0]


@pytest.mark.parametrize("index_dtype", ["fp8", "bf16"])
def test_dsa_update_is_one_launch(dev, index_dtype):
    alg, x = _dsa(dev, index_dtype)
    attn_keys = torch.zeros(4, 1, 8, device=x["req"].device)  # not used by dsa
    alg.update_representations(0, x["req"], x["pos"], attn_keys, index_keys=x["ik"])  # warm-up
    with counting_launches() as c:
        alg.update_representations(0, x["req"], x["pos"], attn_keys, index_keys=x["ik"])
    assert c.launches == ["triton:_dsa_store_kernel"]


def test_the_counter_sees_torch_launches(dev):
    """The earlier selection (score kernel + torch sort over masked scores) counts its
    torch ops: the counter is not blind to them."""
    alg, x = _quest(dev)
    kmin, kmax = alg._kmin[2], alg._kmax[2]

    def old_path():
        scores = quest_score(x["q"], kmin, kmax, x["req"], x["seq"], page_size=16)
        return masked_topk(scores, 4, x["cs"], x["ce"], x["mask"])

    old_path()  # warm-up
    with counting_launches() as c:
        old_path()
    assert c.launches[0] == "triton:_quest_score_kernel"
    assert "aten.sort" in c.launches and len(c.launches) > 6, c.launches


def _manager(dev):
    """Hierarchical, layer 0 dense (its own pool), layers 1 and 2 sparse."""
    cfg = SparseConfig(algorithm="quest", page_size=4, top_k=16, device_buffer_size=32, sink_tokens=4,
                       recent_tokens=8, min_sparse_prompt_len=0)
    pool = DeviceKVPool(KVCacheSpec("mha", 3, 2, 8, torch.float32, 4), 4 * 64, dev)
    host = HostKVPool(pool, hicache_ratio=2.0, pin_memory=dev.type == "cuda")
    kv = SparseKVCacheManager(cfg, pool, mode="hierarchical", host_pool=host, sparse_layers=(1, 2), max_num_reqs=4,
                              max_context_len=64, validate=False)
    return SparseDecoder.over(kv)


STEP_ROWS, STEP_SEQ = [2, 0, -1, -1], [9, 30, 1, 1]  # two requests, two padding rows


def test_decode_step_tables_and_counters_are_one_launch_each(dev):
    """Once per step: ``begin_step`` (write locations, page counts, the sparse selection's
    candidate tables, zeroed counters) is one launch, a dense selection's pages one, and
    ``end_step`` one (it was some 100 torch launches)."""
    m = _manager(dev)
    rows = torch.tensor(STEP_ROWS, device=dev)
    seq = torch.tensor(STEP_SEQ, dtype=torch.int32, device=dev)
    m.begin_step(rows, seq, True, 0)  # warm-up
    m.end_step()
    with counting_launches() as c:
        step = m.begin_step(rows, seq, True, 0)
    assert c.launches == ["triton:_step_setup_kernel"]
    assert step.num_pages.tolist() == [3, 8, 0, 0] and step.candidates.num_candidates.tolist() == [0, 5, 0, 0]
    m.all_pages(0, step, with_table=True)  # warm-up
    with counting_launches() as c:  # the dense layers' pages, with the attention backend's page table
        d = m.all_pages(0, step, with_table=True)
    assert c.launches == ["triton:_dense_pages_kernel"]
    assert d.logical[0, :4].tolist() == [0, 1, 2, -1] and d.attended.tolist() == [9, 30, 0, 0]
    with counting_launches() as c:
        m.end_step()
    assert c.launches == ["triton:_close_step_kernel"]
    assert m.counters.read()[0] == 2


def test_the_counter_sees_the_torch_step_setup(dev, monkeypatch):
    """The torch references of the same per-step work: what the kernels replace."""
    monkeypatch.setenv("SPARSEHI_FORCE_REFERENCE", "1")
    m = _manager(dev)
    rows = torch.tensor(STEP_ROWS, device=dev)
    seq = torch.tensor(STEP_SEQ, dtype=torch.int32, device=dev)
    with counting_launches() as c:
        step = m.begin_step(rows, seq, True, 0)
        m.all_pages(0, step, with_table=True)
        m.end_step()
    assert not any(x.startswith("triton:") for x in c.launches) and len(c.launches) > 60, c.launches


# What a decode layer of the hierarchical coordinator launches besides its algorithm (whose
# Top-k and representation update are counted above), on the capture path.
SPARSE_LAYER = ["triton:_lru_diff_kernel", "triton:_swap_in_and_table_kernel",  # swap-in + selection table
                "triton:_store_kv_kernel",  # the new token into the layer's buffer
                "triton:_kv_copy_kernel"]  # and to host
# Until 2026-11-25 a sparse layer also substituted the plain candidate lists of rows that
# are not sparse with two torch.where launches (aten.where x2: 6 launches per sparse layer,
# 4 now), and a dense layer staged its new token in the main pool (aten.index_copy_ x2)
# before backing it up with kv_copy (3 launches per dense layer, 1 now besides its write).
DENSE_LAYER = ["triton:_store_kv_kernel", "triton:_token_store_kernel"]


def _coordinator(dev):
    """Hierarchical Quest, layer 0 dense, layers 1 and 2 sparse; requests 2 and 0 prefilled
    (8 and 29 tokens: the decode step of ``STEP_SEQ``)."""
    from sparsehi.coordinator import SparseCoordinator
    from sparsehi.forward_batch import ForwardBatch

    cfg = SparseConfig(algorithm="quest", page_size=4, top_k=16, device_buffer_size=32, sink_tokens=4,
                       recent_tokens=8, dense_layers=(0,), min_sparse_prompt_len=0)
    spec = KVCacheSpec("mha", 3, 2, 8, torch.float32, 4)
    pool = DeviceKVPool(spec, 4 * 64, dev)
    host = HostKVPool(pool, hicache_ratio=2.0, pin_memory=dev.type == "cuda")
    coord = SparseCoordinator(cfg, QuestAlgorithm(cfg, dev), pool, mode="hierarchical", host_pool=host,
                              max_num_reqs=4, max_context_len=64, validate=False)
    reqs, lens = [2, 0], [s - 1 for s in STEP_SEQ[:2]]
    g = torch.Generator().manual_seed(0)
    slots = torch.full((2, max(lens)), -1, dtype=torch.int64)
    for b, (r, n) in enumerate(zip(reqs, lens)):
        coord.on_request_begin(r)
        slots[b, :n] = pool.allocator.alloc(n)[:n]
    slots = slots.to(dev)
    batch = ForwardBatch.prefill(torch.tensor(reqs, device=dev), torch.tensor(lens, dtype=torch.int32, device=dev),
                                 slots)
    for layer in range(3):
        for b, n in enumerate(lens):
            kv = torch.randn(2, n, 2, 8, generator=g).to(dev)
            pool.set_kv(layer, slots[b, :n], kv[0], kv[1])
        coord.attention_end(layer, batch)
    coord.forward_end(batch)
    return coord


def _decode_layer(coord, batch, layer, counter, q, k, v):
    """One decode layer: begin (select, swap in), write the new token, attend, end (back up,
    update representations)."""
    plan = coord.attention_begin(layer, batch, q=q)
    plan.write_kv(k, v)
    counter.paused = True  # the torch fallback attention is not the coordinator's
    plan.attend(q, 0.35)
    counter.paused = False
    coord.attention_end(layer, batch, k=k, v=v)


def test_decode_layers_launch_only_their_kernels(dev, monkeypatch):
    """Per sparse layer: the diff, the copy + table, the write and the host backup (no torch
    glue: the kernels choose each row's selection themselves); per dense layer: the write and
    the host backup straight from k / v; plus the step's dense pages once."""
    from sparsehi.forward_batch import ForwardBatch

    coord = _coordinator(dev)
    alg = coord.algorithm
    counter = [None]

    def quiet(name, fn):
        def run(*a, **kw):  # the algorithm's launches, pinned by the tests above: one entry
            c = counter[0]
            if c is None:
                return fn(*a, **kw)
            c.launches.append(f"algorithm:{name}")
            paused, c.paused = c.paused, True
            try:
                return fn(*a, **kw)
            finally:
                c.paused = paused
        return run

    monkeypatch.setattr(alg, "retrieve_topk", quiet("retrieve_topk", alg.retrieve_topk))
    monkeypatch.setattr(alg, "update_representations", quiet("update_representations", alg.update_representations))
    g = torch.Generator().manual_seed(1)
    seq = list(STEP_SEQ)
    for it in range(2):  # a warm-up step (a GPU compiles the kernels), then the counted one
        live = [r for r in STEP_ROWS if r >= 0]
        has_dense = coord.prepare_decode(live, seq[: len(live)])
        batch = ForwardBatch.decode(torch.tensor(STEP_ROWS, device=dev), torch.tensor(seq, dtype=torch.int32, device=dev),
                                    prepared=True, has_dense_rows=has_dense)
        coord.forward_begin(batch)
        per_layer = []
        for layer in range(3):
            q = torch.randn(4, 4, 8, generator=g).to(dev)
            k, v = (torch.randn(4, 2, 8, generator=g).to(dev) for _ in range(2))
            with counting_launches() as c:
                counter[0] = c
                _decode_layer(coord, batch, layer, c, q, k, v)
                counter[0] = None
            per_layer.append(c.launches)
        coord.forward_end(batch)
        seq = [s + 1 if r >= 0 else s for r, s in zip(STEP_ROWS, seq)]
    dense, sparse1, sparse2 = per_layer
    assert dense == ["triton:_dense_pages_kernel"] + DENSE_LAYER, dense
    for launches in (sparse1, sparse2):
        assert launches == ["algorithm:retrieve_topk", *SPARSE_LAYER, "algorithm:update_representations"], launches
    assert coord.stats()["steps"] == 2
