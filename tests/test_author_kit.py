"""The author test kit passes good algorithms and catches each kind of broken one."""
from pathlib import Path

import pytest
import torch

from sparsehi.algorithms import BaseSparseAlgorithm, SparseMode
from sparsehi.algorithms.oracle import OracleAlgorithm
from sparsehi.algorithms.testing import AlgorithmReport, attention_mass, check_algorithm, mass_recall

from kit_algorithms import Window as _Window

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def sink_window(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from examples.sink_window import SinkWindow
    return SinkWindow


def test_example_passes_conformance_and_reports_its_low_recall(sink_window):
    rep = check_algorithm(sink_window, min_needle_recall=None)
    assert isinstance(rep, AlgorithmReport) and rep.deterministic and rep.mean_fill == 1.0
    assert rep.needle_recall < 1.0  # query-blind: misses needles outside the window
    with pytest.raises(AssertionError, match="needle recall"):
        check_algorithm(sink_window)
    rep = check_algorithm(sink_window, {"page_size": 1, "top_k": 16, "device_buffer_size": 64}, min_needle_recall=None)
    assert rep.mode == "page_wise" and rep.page_size == 1


@pytest.mark.parametrize("page_size", [1, 4])
def test_oracle_passes(page_size):
    rep = check_algorithm(OracleAlgorithm, {"page_size": page_size, "top_k": 8 * page_size,
                                            "device_buffer_size": 32 * page_size}, min_mass_recall=0.9)
    assert rep.needle_recall == 1.0 and rep.representation_bytes > 0


class _Int64(_Window):
    def retrieve_topk(self, queries, layer_id, req_pool_indices, sparse_mask, **kw):
        ids, count = self._ids(kw["candidate_start"], kw["candidate_end"], kw["top_k"], sparse_mask)
        return ids, count.int()


class _IgnoresCandidates(_Window):
    def retrieve_topk(self, queries, layer_id, req_pool_indices, sparse_mask, **kw):
        start = torch.zeros_like(kw["candidate_start"])
        ids, count = self._ids(start, kw["seq_lens"], kw["top_k"], sparse_mask)
        return ids.int(), count.int()


class _IgnoresMask(_Window):
    def retrieve_topk(self, queries, layer_id, req_pool_indices, sparse_mask, **kw):
        return super().retrieve_topk(queries, layer_id, req_pool_indices, torch.ones_like(sparse_mask), **kw)


class _OverBudget(_Window):
    def retrieve_topk(self, queries, layer_id, req_pool_indices, sparse_mask, **kw):
        return super().retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, **{**kw, "top_k": kw["top_k"] + 1})


class _CountsTooMany(_Window):
    def retrieve_topk(self, queries, layer_id, req_pool_indices, sparse_mask, **kw):
        ids, count = super().retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, **kw)
        return ids, torch.where(count == ids.shape[1], count + 1, count)


class _Random(_Window):
    def retrieve_topk(self, queries, layer_id, req_pool_indices, sparse_mask, **kw):
        start, end, k = kw["candidate_start"].long(), kw["candidate_end"].long(), kw["top_k"]
        out = torch.full((start.shape[0], k), -1, dtype=torch.int32)
        count = (end - start).clamp(0, k) * sparse_mask.long()
        for b in range(start.shape[0]):
            c = int(count[b])
            out[b, :c] = (start[b] + torch.randperm(int(end[b] - start[b]))[:c]).int()
        return out, count.int()


class _NoKwargs(_Window):
    def retrieve_topk(self, queries, layer_id, req_pool_indices, sparse_mask):
        raise AssertionError("unreachable")


class _Abstract(BaseSparseAlgorithm):
    mode = SparseMode.PAGE_WISE

    def retrieve_topk(self, queries, layer_id, req_pool_indices, sparse_mask, **kw): pass


@pytest.mark.parametrize("cls,match", [
    (_Int64, "int32"),
    (_IgnoresCandidates, "outside"),
    (_IgnoresMask, "sparse_mask"),
    (_OverBudget, "top_k"),
    (_CountsTooMany, "valid_lengths"),
    (_Random, "different selections"),
    (_NoKwargs, "kwargs"),
    (_Abstract, "abstract"),
    (dict, "not a BaseSparseAlgorithm"),
])
def test_kit_catches_broken_algorithms(cls, match):
    with pytest.raises(AssertionError, match=match):
        check_algorithm(cls, min_needle_recall=None)


def test_kit_baseline_is_not_too_strict():
    rep = check_algorithm(_Window, min_needle_recall=None)
    assert rep.checks[-1] == "recall"
    with pytest.raises(AssertionError, match="attention-mass recall"):
        check_algorithm(_Window, min_needle_recall=None, min_mass_recall=0.99)


class _PadsWithMinus2(_Window):
    """-2 after the valid ids (check_selection alone counts any negative as padding)."""

    def retrieve_topk(self, queries, layer_id, req_pool_indices, sparse_mask, **kw):
        ids, count = super().retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, **kw)
        return torch.where(ids < 0, -2, ids).int(), count


class _SelectsForPaddingRows(_Window):
    """Honours sparse_mask but not req_pool_indices == -1."""

    def retrieve_topk(self, queries, layer_id, req_pool_indices, sparse_mask, **kw):
        ids, count = self._ids(kw["candidate_start"], kw["candidate_end"], kw["top_k"], sparse_mask)
        return ids.int(), count.int()


class _ReturnsLists(_Window):
    def retrieve_topk(self, queries, layer_id, req_pool_indices, sparse_mask, **kw):
        ids, count = super().retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, **kw)
        return ids.tolist(), count.tolist()


class _UpdateDoesNothing(OracleAlgorithm):
    """Scores keys exactly but never folds decoded tokens in."""

    def update_representations(self, layer_id, req_pool_indices, positions, new_keys, **kw):
        pass


class _UpdateNextPage(OracleAlgorithm):
    """Writes each decoded key one page too far."""

    def update_representations(self, layer_id, req_pool_indices, positions, new_keys, **kw):
        pos = (positions + self.page_size).clamp(max=self.max_context_len - 1)
        super().update_representations(layer_id, req_pool_indices, pos, new_keys, **kw)


@pytest.mark.parametrize("cls,over,match", [
    (_PadsWithMinus2, None, r"pads with \[-2\] after the valid ids: the padding value is exactly -1"),
    (_SelectsForPaddingRows, None, r"req_pool_indices == -1 .*padding rows must get valid_lengths == 0 and all -1"),
    (_ReturnsLists, None, r"must return two torch.Tensor .* got \(list, list\)"),
    (_UpdateDoesNothing, None, r"decoded tokens at positions .* retrieve_topk missed page"),
    (_UpdateDoesNothing, {"page_size": 1, "top_k": 16, "device_buffer_size": 64}, r"missed token"),
    (_UpdateNextPage, None, r"decoded tokens at positions .* missed page"),
])
def test_kit_catches_contract_gaps_at_default_settings(cls, over, match):
    """Each passed the kit at its default decode_steps=2 before these checks existed."""
    with pytest.raises(AssertionError, match=match):
        check_algorithm(cls, over, min_needle_recall=None)


def test_decoded_key_check_applies_to_content_dependent_algorithms_only(sink_window):
    """SinkWindow's update does nothing, legitimately: its selection ignores key content."""
    rep = check_algorithm(sink_window, min_needle_recall=None)
    assert rep.content_dependent is False
    assert "decoded keys (n/a: selection ignores key content)" in rep.checks
    rep = check_algorithm(OracleAlgorithm, min_needle_recall=None)
    assert rep.content_dependent is True and "decoded keys" in rep.checks


def test_report_prints_the_budget_in_tokens_and_pages():
    rep = check_algorithm(_Window, {"page_size": 16, "top_k": 64, "device_buffer_size": 256, "sink_tokens": 16,
                                    "recent_tokens": 16}, min_needle_recall=None, context_len=320)
    assert rep.top_k_units == 4 and rep.top_k_tokens == 64
    assert "top_k=64 tokens (4 pages of 16)" in str(rep)
    rep = check_algorithm(OracleAlgorithm, {"page_size": 1, "top_k": 16, "device_buffer_size": 64},
                          min_needle_recall=None)
    assert "(token_wise, page_size=1, top_k=16 tokens)" in str(rep)


def test_attention_mass_and_recall_metrics():
    torch.manual_seed(0)
    q, keys = torch.randn(4, 8), torch.randn(10, 2, 8)
    m = attention_mass(q, keys, 10, 4)
    assert m.shape == (3,) and torch.isclose(m.sum(), torch.tensor(1.0))
    best = torch.topk(m, 2).indices.int()
    assert mass_recall(m, best, 0, 3, 2) == pytest.approx(1.0)
    worst = torch.topk(-m, 1).indices.int()
    assert mass_recall(m, torch.cat([worst, torch.tensor([-1], dtype=torch.int32)]), 0, 3, 2) < 1.0


@pytest.mark.gpu
def test_kit_on_gpu_runs_builtins_through_triton():
    from sparsehi.algorithms.dsa import DSAAlgorithm
    from sparsehi.algorithms.quest import QuestAlgorithm
    from sparsehi.algorithms.testing import ProjectedIndexerInputs

    for cls, over, inputs in ((QuestAlgorithm, {"page_size": 16, "top_k": 128, "device_buffer_size": 256,
                                                "sink_tokens": 16, "recent_tokens": 16}, None),
                              (DSAAlgorithm, {"sparse_extra_config": {"index_head_dim": 64}}, ProjectedIndexerInputs(64)),
                              (OracleAlgorithm, None, None)):
        rep = check_algorithm(cls, over, device="cuda", inputs=inputs, context_len=640)
        assert rep.needle_recall == 1.0 and rep.deterministic, str(rep)


class _PaddingWrapsAround(OracleAlgorithm):
    """Writes padding rows (req -1) with plain indexing: -1 wraps to the last request slot."""

    def update_representations(self, layer_id, req_pool_indices, positions, new_keys, **kw):
        pool = self._layer(layer_id)
        if pool is not None:
            pool[req_pool_indices.long(), positions.long()] = new_keys.to(pool.dtype)


def test_kit_catches_padding_rows_that_corrupt_a_request():
    with pytest.raises(AssertionError, match="padding rows"):
        check_algorithm(_PaddingWrapsAround, min_needle_recall=None)
    rep = check_algorithm(OracleAlgorithm, min_needle_recall=None)  # the built-in ignores them
    assert "padding-row writes" in rep.checks


def test_examples_is_a_package_importable_by_path():
    """``examples.sink_window:SinkWindow`` resolves as a regular package from the repo root."""
    import importlib
    import sys

    from sparsehi.algorithms.registry import resolve_algorithm

    sys.path.insert(0, str(ROOT))
    try:
        sys.modules.pop("examples", None)
        sys.modules.pop("examples.sink_window", None)
        pkg = importlib.import_module("examples")
        assert pkg.__file__ is not None and Path(pkg.__file__).name == "__init__.py"  # not a namespace package
        cls = resolve_algorithm("examples.sink_window:SinkWindow")
        assert cls.__name__ == "SinkWindow"
    finally:
        sys.path.remove(str(ROOT))


def test_kit_holds_algorithms_to_their_selects_ascending_claim():
    """An algorithm that says its ids come ascending (so the coordinator skips its sort) but
    returns them in another order is caught."""
    from sparsehi.algorithms.oracle import OracleAlgorithm

    class ClaimsAscending(OracleAlgorithm):
        def retrieve_topk(self, queries, layer_id, req_pool_indices, sparse_mask, **kw):
            sel, val = super().retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, **kw)
            cols = torch.arange(sel.shape[1], device=sel.device)[None, :]
            rev = torch.where(cols < val[:, None], (val[:, None] - 1 - cols).clamp(min=0), cols)
            return sel.gather(1, rev.long()), val  # valid ids descending, padding kept

    check_algorithm(OracleAlgorithm, {"sparse_extra_config": {"validate": False}})
    with pytest.raises(AssertionError, match="selects_ascending is True but"):
        check_algorithm(ClaimsAscending, {"sparse_extra_config": {"validate": False}})
