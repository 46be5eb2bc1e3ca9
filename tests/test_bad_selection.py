"""A third-party algorithm whose ``retrieve_topk`` breaks its contract (ids out of range,
repeated, negative inside the valid part, wrong dtype or shape, too many) through the
runtime's sparse-hier decode:

* with value checks on (the eager/debug path) the step stops with a ValueError that says
  what is wrong, before the LRU buffers, tables or allocators move;
* with them off (what a captured CUDA graph runs) nothing is checked, but the kernels
  clamp every id into the request's own rows: a request's output never depends on
  another request's KV, nor on KV a previous occupant of its row left behind.
"""
from __future__ import annotations

import pytest
import torch

from sparsehi.algorithms.quest import QuestAlgorithm
from sparsehi.config import SparseConfig
from sparsehi.runtime.runtime_config import RuntimeConfig
from sparsehi.runtime.runner import ModelRunner
from sparsehi.runtime.weights import build_model

PS, K = 16, 32


class HostileQuest(QuestAlgorithm):
    """Quest whose selection is rewritten by ``how`` (a class attribute the tests set)."""

    how = "none"

    def retrieve_topk(self, queries, layer_id, req_pool_indices, sparse_mask, **kw):
        sel, val = super().retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, **kw)
        how, b, k = type(self).how, sel.shape[0], sel.shape[1]
        ce = kw["candidate_end"].to(torch.int32)
        live = val > 0
        if how == "far":  # beyond the page tables' width
            sel = torch.where(live[:, None], torch.full_like(sel, 1 << 20) + torch.arange(k, dtype=torch.int32), sel)
        elif how == "beyond":  # past the request's candidates, inside the table width
            sel = torch.where(live[:, None], ce[:, None] + 3 + torch.arange(k, dtype=torch.int32), sel)
        elif how == "negative":
            sel = torch.where(live[:, None] & (torch.arange(k) == 0), torch.full_like(sel, -5), sel)
        elif how == "duplicate":
            sel = torch.where(live[:, None], sel[:, :1].expand(b, k), sel)
        elif how == "other_rows":  # every id up to the table width: other rows' positions too
            sel = torch.where(live[:, None], torch.arange(k, dtype=torch.int32) * 7 + 300, sel)
        elif how == "int64":
            sel = sel.long()
        elif how == "wide":
            sel = torch.cat([sel, sel[:, :1]], 1)
        elif how == "one_dim":
            sel = sel[:, 0]
        elif how == "valid_big":
            val = torch.where(live, val + 5, val)
        elif how == "not_tensor":
            return sel.tolist(), val
        return sel, val

    def construct_representations(self, layer_id, req_pool_indices, seq_lens, key_buffer, token_slots, **kw):
        if type(self).how == "raise_in_prefill":
            raise RuntimeError("algorithm failed in its prefill hook")
        return super().construct_representations(layer_id, req_pool_indices, seq_lens, key_buffer, token_slots, **kw)


def _runner(validate: bool, how: str, prefix_cache: bool = False) -> ModelRunner:
    HostileQuest.how = how
    model = build_model("tiny-gqa", device="cpu", dtype=torch.float32, num_layers=2)
    sc = SparseConfig(algorithm=f"{__name__}:HostileQuest", top_k=K, device_buffer_size=2 * K, page_size=PS,
                      min_sparse_prompt_len=0, sink_tokens=PS, recent_tokens=PS, io_backend="direct",
                      dense_layers=(0,))
    rt = RuntimeConfig(mode="sparse-hier", sparse=sc, device="cpu", dtype=torch.float32, max_num_reqs=2,
                       max_context_len=256, adapter="none", host_layout="page_first_direct", prefix_cache=prefix_cache,
                       cuda_graph=False, validate=validate)
    return ModelRunner(model, rt)


def _prompt(seed: int, n: int = 160) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 500, (n,), generator=g).tolist()


def _state(runner: ModelRunner) -> dict[str, torch.Tensor]:
    coord = runner.mode.coord
    lru, tables = coord.decoder.lru, coord.kv.tables
    return {"resident": lru.resident.clone(), "last_used": lru.last_used.clone(), "slot_of": lru.slot_of.clone(),
            "buf_pages": tables.lru_pages.clone(), "host_page_table": tables.host_pages.clone(),
            "dev_free": torch.tensor(runner.mode.pool.allocator.available_size()),
            "host_free": torch.tensor(runner.mode.host.allocator.available_size())}


CHECKED = {
    "far": "ids outside \\[candidate_start, candidate_end\\)",
    "beyond": "ids outside \\[candidate_start, candidate_end\\)",
    "negative": "valid_lengths ids then -1 padding",
    "duplicate": "duplicate ids",
    "int64": "must return int32 tensors, got selected_indices=torch.int64",
    "wide": "selected_indices must be \\[B, <= top_k=2\\]",
    "one_dim": "selected_indices must be \\[B, <= top_k=2\\]",
    "valid_big": "valid_lengths must lie in \\[0, 2\\]",
    "not_tensor": "must return two torch.Tensors",
}


@pytest.mark.parametrize("how", sorted(CHECKED))
def test_checked_decode_rejects_a_broken_selection_before_any_state_moves(how, one_thread):
    runner = _runner(True, "none")
    reqs = runner.new_requests([_prompt(1), _prompt(2)])
    for r in reqs:
        runner.prefill(r)
    runner.decode_step(reqs)  # a good step first: the buffers hold something
    before = _state(runner)
    HostileQuest.how = how
    with pytest.raises(ValueError, match=CHECKED[how]):
        runner.decode_step(reqs)
    after = _state(runner)
    for name, t in before.items():
        assert torch.equal(t, after[name]), f"{name} changed by a rejected selection ({how})"


def _tokens(how: str, prompts: list[list[int]], before: list[list[int]] = ()) -> list[list[int]]:
    runner = _runner(False, "none")
    for p in before:  # earlier requests leave their KV in the rows' buffers
        runner.generate([p], 3)
    HostileQuest.how = how
    out = runner.generate(prompts, 4).tokens
    runner.mode.close()
    return out


@pytest.mark.parametrize("how", ["far", "beyond", "negative", "duplicate", "other_rows", "valid_big"])
def test_unchecked_bad_ids_never_reach_another_requests_kv(how, one_thread):
    a = _prompt(10)
    # the same request beside two different neighbours: its tokens may not change
    t1 = _tokens(how, [a, _prompt(11)])
    t2 = _tokens(how, [a, _prompt(12, 200)])
    assert t1[0] == t2[0]
    # nor with different requests having used its row (and buffer pages) before
    t3 = _tokens(how, [a, _prompt(11)], before=[_prompt(20, 200)])
    t4 = _tokens(how, [a, _prompt(11)], before=[_prompt(21, 200)])
    assert t3[0] == t4[0] == t1[0]


def _free_counts(runner: ModelRunner) -> tuple[int, int, int]:
    mode = runner.mode
    return mode.pool.allocator.available_size(), mode.host.allocator.available_size(), mode.req_pool.available_size()


def test_a_failed_generate_releases_its_requests(one_thread):
    runner = _runner(True, "none")
    base = _free_counts(runner)
    HostileQuest.how = "duplicate"
    with pytest.raises(ValueError, match="duplicate ids"):
        runner.generate([_prompt(1), _prompt(2)], 3)
    assert _free_counts(runner) == base  # rows, device and host slots all back
    HostileQuest.how = "none"
    assert len(runner.generate([_prompt(1), _prompt(2)], 3).tokens) == 2
    assert _free_counts(runner) == base


@pytest.mark.parametrize("prompts,steps,message", [
    ([[]], 1, r"prompts\[0\] must be a non-empty list of token ids"),
    ([[1, -1]], 1, r"prompts\[0\] holds token id -1: ids are ints in \[0, vocab_size=512\)"),
    ([[1, 512]], 1, r"holds token id 512"), ([[True] * 4], 1, "holds token id True"), ([[1.5]], 1, "holds token id 1.5"),
    (["abc"], 1, r"prompts\[0\] must be a non-empty list"), ([[1] * 256], 1, "must have at most max_context_len=256 - 1"),
    ([[1] * 250], 10, "must have at most max_context_len=256 - 10 = 246"), ([[1]] * 3, 1, "3 prompts exceed max_num_reqs=2"),
    ([], 1, "prompts must be a non-empty list"), ([[1]], -1, "decode_steps must be an int >= 0"),
    ([[1]], 1.5, "decode_steps must be an int >= 0"),
])
def test_generate_rejects_bad_prompts_before_taking_anything(prompts, steps, message, one_thread):
    runner = _runner(True, "none")
    base = _free_counts(runner)
    with pytest.raises(ValueError, match=message):
        runner.generate(prompts, steps)
    assert _free_counts(runner) == base


@pytest.mark.parametrize("how", ["duplicate", "raise_in_prefill"])
def test_a_failed_request_leaves_only_complete_kv_in_the_prefix_tree(how, one_thread):
    runner = _runner(True, "none", prefix_cache=True)
    base = _free_counts(runner)
    a, b = _prompt(1), _prompt(2)
    reference = runner.generate([a], 3).tokens[0]  # a's prompt pages are now in the tree
    tree = runner.mode.tree
    held = tree.host_tokens()
    HostileQuest.how = how
    with pytest.raises((ValueError, RuntimeError)):
        runner.generate([a, b], 3)
    HostileQuest.how = "none"
    tree.check_invariants()
    # decode steps of the failed batch added nothing; its prompts are kept only if prefilled
    assert tree.host_tokens() == held + (len(b) // PS * PS if how == "duplicate" else 0)
    again = runner.generate([a], 3)
    assert again.prefix_hits[0] > 0 and again.tokens[0] == reference
    tree.evict_host(10 ** 9)
    assert _free_counts(runner)[1] == base[1]  # every host page is back once the tree lets go
