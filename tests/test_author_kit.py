"""The author test kit passes good algorithms and catches each kind of broken one."""
from pathlib import Path

import pytest
import torch

from sparsehi.algorithms import BaseSparseAlgorithm, SparseMode
from sparsehi.algorithms.oracle import OracleAlgorithm
from sparsehi.algorithms.testing import AlgorithmReport, attention_mass, check_algorithm, mass_recall

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


class _Window(BaseSparseAlgorithm):
    """Reference-correct base for the broken variants below."""

    mode = SparseMode.PAGE_WISE

    def initialize_representation_pool(self, start_layer, end_layer, max_num_reqs, max_context_len, **kw): pass
    def construct_representations(self, layer_id, req_pool_indices, seq_lens, key_buffer, token_slots, **kw): pass
    def update_representations(self, layer_id, req_pool_indices, positions, new_keys, **kw): pass

    def _ids(self, start, end, top_k, mask):
        cols = torch.arange(top_k)[None, :]
        count = (end.long() - start.long()).clamp(0, top_k) * mask.long()
        return torch.where(cols < count[:, None], start.long()[:, None] + cols, -1), count

    def retrieve_topk(self, queries, layer_id, req_pool_indices, sparse_mask, **kw):
        ids, count = self._ids(kw["candidate_start"], kw["candidate_end"], kw["top_k"], sparse_mask)
        return ids.int(), count.int()


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
    assert "padding rows" in rep.checks


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
