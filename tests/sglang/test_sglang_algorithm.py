"""SGLang 0.5.23's own QuestAlgorithm, unchanged, inside our coordinator (sparse-hier).

Runs in the SGLang test environment (.venv-sglang). The reference is SGLang's own
``SparseCoordinator`` driving a second ``QuestAlgorithm`` over SGLang's real
``ReqToTokenPool`` / ``MHATokenToKVPool`` holding the whole KV (its attention_end builds and
updates the representations; retrieve_topk is called the way its ``_handle_sparse_retrieve``
calls it). Ours runs the same class through ``SGLangAlgorithm`` with our KV manager, where
the prompt's KV is offloaded to host and pages are swapped into a small device buffer.
"""
from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.sparsity", reason="SGLang is not installed (run scripts/setup_sglang_env.sh)")

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.sparsity.algorithms.quest_algorithm import QuestAlgorithm  # noqa: E402
from sglang.srt.mem_cache.sparsity.core.sparse_coordinator import SparseConfig as SGLangSparseConfig  # noqa: E402
from sglang.srt.mem_cache.sparsity.core.sparse_coordinator import SparseCoordinator as SGLangCoordinator  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch as SGLangBatch  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from hicache.device_pool import DeviceKVPool  # noqa: E402
from hicache.host_pool import HostKVPool  # noqa: E402
from hicache.kv_spec import KVCacheSpec  # noqa: E402
from hicache.transfer import KVTransferEngine  # noqa: E402
from sparsehi.config import SparseConfig  # noqa: E402
from sparsehi.coordinator import SparseCoordinator  # noqa: E402
from sparsehi.forward_batch import ForwardBatch  # noqa: E402
from sparsehi.sglang_plugin.sglang_algorithm import (SGLangAlgorithm, SlotKeyView, check_algorithm_name,  # noqa: E402
                                                     create_plugin_algorithm, requires_eager)

QUEST = "sglang.srt.mem_cache.sparsity.algorithms.quest_algorithm:QuestAlgorithm"
L, HKV, HQ, D, PS = 3, 2, 4, 8, 4
ROWS = 4  # SGLang's ReqToTokenPool: rows 1..ROWS (row 0 is its padding row)
MAX_CTX = 128
RATIO, RECENT_PAGES, TOPK_PAGES = 0.3, 2, 8
PROMPTS = {1: 70, 2: 88, 3: 30}  # req_pool_index -> prompt length; request 3 turns sparse mid-run
STEPS = 14  # every row crosses at least three page boundaries


def our_config() -> SparseConfig:
    return SparseConfig(algorithm=QUEST, page_size=PS, top_k=TOPK_PAGES * PS, device_buffer_size=12 * PS,
                        sink_tokens=0, recent_tokens=RECENT_PAGES * PS, dense_layers=(0,), min_sparse_prompt_len=0,
                        sparse_extra_config={"sparsity_ratio": RATIO})


class Data:
    """Keys, values and queries of every (layer, request, position)."""

    def __init__(self, seed: int = 3) -> None:
        g = torch.Generator().manual_seed(seed)
        n = ROWS + 1
        self.k = torch.randn(L, n, MAX_CTX, HKV, D, generator=g)
        self.v = torch.randn(L, n, MAX_CTX, HKV, D, generator=g)
        base = torch.randn(L, n, HQ, D, generator=g) * 2  # a drifting query: overlapping selections
        self.q = base[:, :, None] + 0.6 * torch.randn(L, n, MAX_CTX, HQ, D, generator=g)


def sglang_pools(seed: int = 5) -> tuple[ReqToTokenPool, MHATokenToKVPool]:
    """SGLang's real pools on CPU, each request's slots as its scheduler would leave them:
    whole pages, scattered over the pool, fixed for the request's life (page 0 unused)."""
    rtp = ReqToTokenPool(size=ROWS, max_context_len=MAX_CTX, device="cpu", enable_memory_saver=False)
    pages_per_req = MAX_CTX // PS
    kvp = MHATokenToKVPool(size=(ROWS + 1) * MAX_CTX, page_size=PS, dtype=torch.float32, head_num=HKV, head_dim=D,
                           layer_num=L, device="cpu", enable_memory_saver=False)
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(ROWS * pages_per_req, generator=g) + 1
    for r in range(1, ROWS + 1):
        mine = pages[(r - 1) * pages_per_req: r * pages_per_req]
        rtp.req_to_token[r] = (mine[:, None] * PS + torch.arange(PS)).reshape(-1).to(torch.int32)
    return rtp, kvp


def sglang_batch(mode: ForwardMode, reqs: list[int], seqs: list[int]) -> SGLangBatch:
    r = torch.tensor(reqs, dtype=torch.int64)
    s = torch.tensor(seqs, dtype=torch.int64)
    return SGLangBatch(forward_mode=mode, batch_size=len(reqs), input_ids=torch.zeros(0, dtype=torch.int64),
                       req_pool_indices=r, seq_lens=s, out_cache_loc=torch.zeros(0, dtype=torch.int64),
                       seq_lens_sum=sum(seqs))


# ----------------------------------------------------------------------------- reference
def run_sglang_reference(data: Data) -> dict:
    """SGLang's own coordinator + QuestAlgorithm over its pools: per (step, layer), the
    selection (logical page ids) of every request."""
    rtp, kvp = sglang_pools()
    cfg = SGLangSparseConfig(top_k=TOPK_PAGES * PS, page_size=PS, min_sparse_prompt_len=0,
                             sparse_extra_config={"sparsity_ratio": RATIO, "num_recent_pages": RECENT_PAGES})
    algo = QuestAlgorithm(cfg, torch.device("cpu"))
    coord = SGLangCoordinator(cfg, algo, None, rtp, kvp, start_layer=0, end_layer=L, device=torch.device("cpu"))
    reqs, seqs = list(PROMPTS), list(PROMPTS.values())
    for r, n in PROMPTS.items():
        coord.on_request_begin(SimpleNamespace(kv=SimpleNamespace(holds_kv=True, req_pool_idx=r),
                                               origin_input_ids=[0] * n))

    def write(layer: int, r: int, pos: torch.Tensor) -> None:
        slots = rtp.req_to_token[r, pos].long()
        kvp.get_key_buffer(layer)[slots] = data.k[layer, r, pos]
        kvp.get_value_buffer(layer)[slots] = data.v[layer, r, pos]

    fb = sglang_batch(ForwardMode.EXTEND, reqs, seqs)
    for layer in range(L):
        for r, n in PROMPTS.items():
            write(layer, r, torch.arange(n))
        coord.attention_end(None, SimpleNamespace(layer_id=layer), fb)
    out = {}
    for step in range(STEPS):
        seqs = [s + 1 for s in seqs]
        fb = sglang_batch(ForwardMode.DECODE, reqs, seqs)
        req_t = fb.req_pool_indices
        for layer in range(L):
            pos = torch.tensor(seqs) - 1
            q = data.q[layer, reqs, pos]
            if layer > 0:  # layer 0 attends densely in ours; retrieval changes no state
                sel, val = algo.retrieve_topk(queries=q, layer_id=layer, req_pool_indices=req_t,
                                              sparse_mask=coord._compute_sparse_mask(req_t), forward_batch=fb,
                                              attn_metadata=None)
                out[step, layer] = [sel[b, : int(val[b])].tolist() for b in range(len(reqs))]
            for r, p in zip(reqs, pos.tolist()):
                write(layer, r, torch.tensor([p]))
            coord.attention_end(None, SimpleNamespace(layer_id=layer), fb)
    return out


# ----------------------------------------------------------------------------- ours
def expected_attention(data: Data, layer: int, reqs: list[int], q: torch.Tensor, logical: torch.Tensor,
                       num_valid: torch.Tensor, seqs: list[int], scale: float) -> torch.Tensor:
    out = []
    for b, r in enumerate(reqs):
        ids = logical[b, : int(num_valid[b])].long()
        pos = (ids[:, None] * PS + torch.arange(PS)).reshape(-1)
        pos = pos[pos < seqs[b]]
        k, v = data.k[layer, r, pos], data.v[layer, r, pos]
        qg = q[b].view(HKV, HQ // HKV, D)
        att = torch.softmax(torch.einsum("grd,tgd->grt", qg, k) * scale, -1)
        out.append(torch.einsum("grt,tgd->grd", att, v).reshape(HQ, D))
    return torch.stack(out)


def run_ours(mode: str, data: Data, sglang_pools_given: bool = True) -> tuple[SparseCoordinator, torch.Tensor, dict]:
    """QuestAlgorithm through SGLangAlgorithm and our coordinator in ``mode``: outputs
    ``[steps, L, B, Hq, D]`` and the selections per (step, layer). Without SGLang's pools
    the adapter builds its own (our runtime's case)."""
    cfg = our_config()
    rtp, kvp = sglang_pools() if sglang_pools_given else (None, None)
    spec = KVCacheSpec("mha", L, HKV, D, torch.float32, PS)
    dev_pool = DeviceKVPool(spec, num_slots=PS * 160, device="cpu")
    host_pool = HostKVPool(dev_pool, hicache_ratio=2.0, pin_memory=False) if mode == "hierarchical" else None
    transfer = KVTransferEngine(dev_pool, host_pool, io_backend="direct") if host_pool is not None else None
    algo = create_plugin_algorithm(cfg, "cpu", req_to_token_pool=rtp, token_to_kv_pool=kvp)
    assert isinstance(algo, SGLangAlgorithm) and isinstance(algo.inner, QuestAlgorithm)
    coord = SparseCoordinator(cfg, algo, dev_pool, mode=mode, host_pool=host_pool, transfer=transfer,
                              max_num_reqs=ROWS + 1, max_context_len=MAX_CTX)
    if sglang_pools_given:
        assert algo.inner.req_to_token_pool is rtp and algo.inner.token_to_kv_pool is kvp  # SGLang's own pools
    reqs, seqs = list(PROMPTS), list(PROMPTS.values())
    for r in reqs:
        coord.on_request_begin(r)
    token_slots = torch.full((len(reqs), max(seqs)), -1, dtype=torch.int64)
    for b, n in enumerate(seqs):
        token_slots[b, :n] = dev_pool.allocator.alloc(n)[:n]
    batch = ForwardBatch.prefill(torch.tensor(reqs), torch.tensor(seqs, dtype=torch.int32), token_slots)
    for layer in range(L):
        for b, (r, n) in enumerate(zip(reqs, seqs)):
            dev_pool.set_kv(layer, token_slots[b, :n], data.k[layer, r, :n], data.v[layer, r, :n])
        coord.attention_end(layer, batch)
    coord.forward_end(batch)
    outs, sels = [], {}
    scale = 1 / math.sqrt(D)
    for step in range(STEPS):
        seqs = [s + 1 for s in seqs]
        batch = ForwardBatch.decode(torch.tensor(reqs), torch.tensor(seqs, dtype=torch.int32))
        coord.forward_begin(batch)
        per_layer = []
        for layer in range(L):
            pos = torch.tensor(seqs) - 1
            q, k, v = data.q[layer, reqs, pos], data.k[layer, reqs, pos], data.v[layer, reqs, pos]
            plan = coord.attention_begin(layer, batch, q=q)
            plan.write_kv(k, v)
            o = plan.attend(q, scale)
            sel = plan.selection
            # attention reads exactly the selected pages' true KV (whatever mode moved them)
            torch.testing.assert_close(o, expected_attention(data, layer, reqs, q, sel.logical_ids, sel.num_valid,
                                                             seqs, scale), atol=1e-5, rtol=1e-5)
            sels[step, layer] = [sel.logical_ids[b, : int(sel.num_valid[b])].tolist() for b in range(len(reqs))]
            per_layer.append(o)
            coord.attention_end(layer, batch, k=k, v=v)
        coord.forward_end(batch)
        outs.append(torch.stack(per_layer))
    return coord, torch.stack(outs), sels


def _sparse_in_ours(step: int, b: int) -> bool:
    """Our coordinator hands a row to the algorithm once its candidates outgrow top-k."""
    seq = list(PROMPTS.values())[b] + step + 1
    return -(-seq // PS) - RECENT_PAGES > TOPK_PAGES


@pytest.fixture(scope="module")
def data() -> Data:
    return Data()


@pytest.fixture(scope="module")
def reference(data) -> dict:
    return run_sglang_reference(data)


@pytest.fixture(scope="module")
def hier(data):
    return run_ours("hierarchical", data)


# ----------------------------------------------------------------------------- tests
def test_selections_equal_sglang_own_coordinator(reference, hier):
    _, _, ours = hier
    compared = changed = 0
    for (step, layer), rows in reference.items():
        for b, ref in enumerate(rows):
            if not _sparse_in_ours(step, b):
                continue  # SGLang prunes even a context that fits top-k; ours attends all of it
            assert ours[step, layer][b] == ref, (step, layer, b)
            # the selection is sparse: fewer pages than the context
            assert len(ref) < -(-(list(PROMPTS.values())[b] + step + 1) // PS)
            compared += 1
            if step and reference[step - 1, layer][b] != ref:
                changed += 1
    assert compared >= 2 * STEPS * 2  # two long rows in both sparse layers, and row 3 once it is sparse
    assert any(_sparse_in_ours(s, 2) for s in range(STEPS)) and not _sparse_in_ours(0, 2)
    assert changed > 0  # the selections move as pages fill and queries drift


def test_hierarchical_equals_gpu_only(data, hier):
    coord_h, out_h, sel_h = hier
    _, out_g, sel_g = run_ours("gpu_only", data)
    assert sel_h == sel_g
    torch.testing.assert_close(out_h, out_g, atol=1e-6, rtol=1e-6)
    st = coord_h.stats()
    assert st["misses"] > 0 and st["hits"] > 0  # pages really came from host into the small buffer
    assert st["per_layer_hit_rate"][0] == 1.0  # the dense layer loads nothing


def test_not_capture_safe_is_logged_and_eager(data, caplog):
    from sparsehi.sglang_plugin import sglang_algorithm as mod

    mod._logged.clear()
    with caplog.at_level(logging.INFO, logger=mod.__name__):
        coord, _, _ = run_ours("hierarchical", data)
    algo = coord.algorithm
    assert requires_eager(algo) and algo.capture_safe is False
    text = caplog.text
    assert "QuestAlgorithm is not CUDA-graph capture safe" in text and "eager path" in text
    hooks = {f.hook for f in algo._probe.findings}
    assert hooks == {"retrieve_topk", "update_representations"}
    where = " ".join(f.where for f in algo._probe.findings)
    assert "quest_algorithm.py" in where or "base_algorithm.py" in where  # SGLang's lines, not ours
    assert text.count("not CUDA-graph capture safe") == 1  # once, not per call


def test_key_view_gathers_held_slots():
    src = torch.arange(12.0).view(6, 1, 2)
    slot_map = torch.full((100,), -1, dtype=torch.int64)
    slot_map[torch.tensor([40, 41])] = torch.tensor([5, 0])
    kb = SlotKeyView(100, src, slot_map, "Algo")
    assert kb.shape == (100, 1, 2) and kb.dtype == src.dtype and kb.device == src.device
    torch.testing.assert_close(kb[torch.tensor([[41, 40]])], src[torch.tensor([[0, 5]])])
    torch.testing.assert_close(kb.index_select(0, torch.tensor([40])), src[5:6])
    # a slot not held reads as zeros (an algorithm masks positions past the context)
    torch.testing.assert_close(kb[torch.tensor([7, 41])], torch.stack([torch.zeros(1, 2), src[0]]))
    with pytest.raises(TypeError, match="k_buffer supports indexing"):
        kb.sum()


def test_names_resolve_to_the_right_api():
    assert check_algorithm_name(QUEST) == "sglang"
    assert check_algorithm_name("quest") == "sparsehi"
    with pytest.raises(ValueError, match="SGLang's BaseSparseAlgorithm"):
        check_algorithm_name("sglang.srt.mem_cache.sparsity.core.sparse_coordinator:RequestTrackers")
    with pytest.raises(ValueError, match="algorithm_cls"):
        SGLangAlgorithm(our_config(), torch.device("cpu"), algorithm_cls=dict)


def test_builds_its_own_pools_without_sglang_ones(data, hier):
    """Without SGLang's pools (our own runtime) the adapter builds a real ReqToTokenPool
    of stable ids and a shape-only key pool, and selects as with SGLang's pools."""
    _, out, sels = run_ours("hierarchical", data, sglang_pools_given=False)
    assert sels == hier[2]
    torch.testing.assert_close(out, hier[1], atol=1e-6, rtol=1e-6)
    cfg = our_config()
    algo = SGLangAlgorithm(cfg, torch.device("cpu"))
    algo.initialize_representation_pool(0, L, ROWS + 1, MAX_CTX, kv_heads=HKV, head_dim=D, dtype=torch.float32)
    assert isinstance(algo.req_to_token_pool, ReqToTokenPool)
    assert int(algo.req_to_token_pool.req_to_token[2, 5]) == 2 * MAX_CTX + 5
    assert algo.token_to_kv_pool.get_key_buffer(1).shape == ((ROWS + 1) * MAX_CTX, HKV, D)


def test_capture_is_refused_before_any_host_sync():
    from sparsehi.algorithms.graph_safety import simulated_capture

    algo = SGLangAlgorithm(our_config(), torch.device("cpu"))
    algo.initialize_representation_pool(0, L, ROWS + 1, MAX_CTX, kv_heads=HKV, head_dim=D, dtype=torch.float32)
    req = torch.tensor([1])
    with simulated_capture(), pytest.raises(RuntimeError, match="QuestAlgorithm.retrieve_topk is not CUDA-graph"):
        algo.retrieve_topk(torch.zeros(1, HQ, D), 1, req, torch.tensor([True]), seq_lens=torch.tensor([40]),
                           candidate_start=torch.tensor([0]), candidate_end=torch.tensor([8]), top_k=4)
    with simulated_capture(), pytest.raises(RuntimeError, match="update_representations is not CUDA-graph"):
        algo.update_representations(1, req, torch.tensor([39]), torch.zeros(1, HKV, D))


def test_ids_map_onto_candidates_and_budget(caplog):
    """SGLang's ids (recent window included, its own budget) become ours: only candidates,
    at most top_k per row (the highest kept when it picked more), ascending, -1 padded."""
    from sparsehi.sglang_plugin import sglang_algorithm as mod

    mod._logged.clear()
    algo = SGLangAlgorithm(our_config(), torch.device("cpu"))
    sel = torch.tensor([[0, 2, 5, 7, 9, 10], [1, 3, 9, 10, -1, -1], [4, 5, -1, -1, -1, -1]], dtype=torch.int32)
    val = torch.tensor([6, 4, 2], dtype=torch.int32)
    mask = torch.tensor([True, True, False])
    cs, ce = torch.tensor([0, 2, 0], dtype=torch.int32), torch.tensor([9, 9, 9], dtype=torch.int32)
    with caplog.at_level(logging.WARNING):
        out, n = algo._to_candidates(sel, val, mask, cs, ce, top_k=3)
    assert out.dtype == torch.int32 and n.dtype == torch.int32
    assert out.tolist() == [[2, 5, 7], [3, -1, -1], [-1, -1, -1]] and n.tolist() == [3, 1, 0]
    assert "selected more than top_k=3" in caplog.text


def test_algorithm_option_takes_an_sglang_class():
    import argparse

    from sparsehi.sglang_plugin.options import add_arguments, config_from_namespace

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_namespace(parser.parse_args(["--sparsehi-algorithm", QUEST, "--sparsehi-page-size", "16"]))
    assert cfg.algorithm == QUEST and cfg.page_size == 16
    for bad, why in ((f"{QUEST}Nope", "has no attribute|must name"), ("sglang.srt.no_such_module:X", "cannot import"),
                     ("questt", "unknown")):
        with pytest.raises(ValueError, match=f"--sparsehi-algorithm=.*({why})"):
            config_from_namespace(parser.parse_args(["--sparsehi-algorithm", bad]))


def test_an_algorithm_without_page_ids_is_refused_clearly():
    """SGLang's DeepSeekDSAAlgorithm returns its model indexer's output and no lengths."""
    from sglang.srt.mem_cache.sparsity.algorithms.deepseek_dsa import DeepSeekDSAAlgorithm

    cfg = our_config()
    algo = SGLangAlgorithm(cfg, torch.device("cpu"), algorithm_cls=DeepSeekDSAAlgorithm)
    algo.initialize_representation_pool(0, L, ROWS + 1, MAX_CTX, kv_heads=HKV, head_dim=D, dtype=torch.float32)
    kw = dict(seq_lens=torch.tensor([40]), candidate_start=torch.tensor([0]), candidate_end=torch.tensor([8]), top_k=4,
              indexer=lambda **_: torch.zeros(1, 4, dtype=torch.int32), x=0, q_lora=0, positions=0)
    with pytest.raises(ValueError, match="DeepSeekDSAAlgorithm.retrieve_topk returned .*not supported"):
        algo.retrieve_topk(torch.zeros(1, HQ, D), 1, torch.tensor([1]), torch.tensor([True]), **kw)
