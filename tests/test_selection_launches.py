"""Kernel launches per sparse layer of the built-in selection hooks, and once per decode
step of the KV manager (its tables, the dense selection's pages, the counters), on their
capture path.

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


def test_quest_retrieve_is_two_launches(dev):
    """A small batch fuses the bounds with the chunk shortlists (then the merge); a batch
    that fills the GPU scores, then selects with one program per row: two launches either
    way (on CUDA, the 4-row batch here splits)."""
    launches = _quest_retrieve_launches(dev)
    assert launches in (FUSED_LAUNCHES, ["triton:_quest_score_kernel", "triton:_topk_select_kernel"]), launches


@pytest.fixture
def small_gpu(monkeypatch):
    """The split plans of a GPU of 132 SMs, on any device (the 4-row batch here splits)."""
    for mod in ("sparsehi.kernels.quest_select", "sparsehi.kernels.topk"):
        monkeypatch.setattr(f"{mod}._sm_count", lambda device: 132)


def test_quest_split_retrieve_is_two_launches(dev, small_gpu):
    """The split path, pinned: the fused bounds + chunk shortlists, then the merge."""
    assert _quest_retrieve_launches(dev) == FUSED_LAUNCHES


def test_quest_split_retrieve_unfused_is_three_launches(dev, small_gpu, monkeypatch):
    """What fusing saves: scored apart (chunk bounds over the byte cap), the split select
    is the score kernel, the chunk shortlists and the merge."""
    monkeypatch.setattr("sparsehi.kernels.quest_select.FUSED_MAX_CHUNK_BYTES", 0)
    assert _quest_retrieve_launches(dev) == ["triton:_quest_score_kernel", *TOPK_LAUNCHES[1]]


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
    return SparseKVCacheManager(cfg, pool, mode="hierarchical", host_pool=host, sparse_layers=(1, 2), max_num_reqs=4,
                                max_context_len=64, validate=False)


STEP_ROWS, STEP_SEQ = [2, 0, -1, -1], [9, 30, 1, 1]  # two requests, two padding rows


def test_decode_step_tables_and_counters_are_one_launch_each(dev):
    """Once per step: ``begin_step`` (write locations, page counts, the sparse selection's
    candidate tables, zeroed counters) is one launch, a dense selection's pages one, and
    ``end_step`` one (it was some 100 torch launches)."""
    m = _manager(dev)
    rows = torch.tensor(STEP_ROWS, device=dev)
    seq = torch.tensor(STEP_SEQ, dtype=torch.int32, device=dev)
    m.begin_step(rows, seq, True)  # warm-up
    m.end_step()
    with counting_launches() as c:
        step = m.begin_step(rows, seq, True)
    assert c.launches == ["triton:_step_setup_kernel"]
    assert step.num_pages.tolist() == [3, 8, 0, 0] and step.memo["sparse_tables"].ncand.tolist() == [0, 5, 0, 0]
    m.own_pages(0, step, with_table=True)  # warm-up
    with counting_launches() as c:  # the dense layers' pages, with the attention backend's page table
        d = m.own_pages(0, step, with_table=True)
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
        step = m.begin_step(rows, seq, True)
        m.own_pages(0, step, with_table=True)
        m.end_step()
    assert not any(x.startswith("triton:") for x in c.launches) and len(c.launches) > 60, c.launches
