"""Adapters fed inconsistent metadata. With ``validate=True`` (the runtime's eager path)
each inconsistency is a ValueError naming the field; without it (what a CUDA graph runs)
nothing is checked, but no row reads outside the cache, a good row's output is what it
would be alone, and the cache buffers are never written."""
from __future__ import annotations

import pytest
import torch

from sparsehi.adapters import create_adapter
from sparsehi.selection import SparseMode
from sparsehi.selection import SparseSelection

PS, PAGES, HKV, D = 4, 16, 2, 8


def _selection(lids, pids, nv, seq, ps=PS):
    n = max(len(r) for r in lids)
    pad = lambda r: r + [-1] * (n - len(r))  # noqa: E731
    return SparseSelection(
        logical_ids=torch.tensor([pad(r) for r in lids], dtype=torch.int32),
        physical_ids=torch.tensor([pad(r) for r in pids], dtype=torch.int32),
        num_valid=torch.tensor(nv, dtype=torch.int32), seq_lens=torch.tensor(seq, dtype=torch.int32),
        page_size=ps, mode=SparseMode.TOKEN_WISE if ps == 1 else SparseMode.PAGE_WISE)


GOOD = ([0, 2, 3], [5, 9, 1], 3, 14)  # row 0: pages 0, 2, 3 (last one holds tokens 12, 13)
BAD_ROWS = {
    "num_valid_over_width": (([0, 1], [2, 3], 7, 6), r"selection.num_valid must be in \[0, N=3\]"),
    "num_valid_negative": (([0, 1], [2, 3], -1, 6), r"selection.num_valid must be in \[0, N=3\]"),
    "negative_id_inside": (([0, -4], [2, 3], 2, 6), "ids >= 0 in the first num_valid columns"),
    "negative_page_inside": (([0, 1], [2, -3], 2, 6), "ids >= 0 in the first num_valid columns"),
    "garbage_after_valid": (([0, 1], [2, 3], 1, 3), "-1 after the first num_valid columns"),
    "descending": (([1, 0], [2, 3], 2, 3), "strictly ascending in each row"),
    "duplicate": (([1, 1], [2, 3], 2, 6), "strictly ascending in each row"),
    "seq_beyond_last_page": (([0, 1], [2, 3], 2, 40), "selection.seq_lens must be inside the last selected page"),
    "seq_before_last_page": (([0, 3], [2, 3], 2, 5), "selection.seq_lens must be inside the last selected page"),
}


def _batch(bad):
    lids, pids, nv, seq = zip(GOOD, bad)
    return _selection(list(lids), list(pids), list(nv), list(seq))


def _pool():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(PAGES * PS, HKV, D, generator=g), torch.randn(PAGES * PS, HKV, D, generator=g))


@pytest.mark.parametrize("name", ["flashattention", "triton"])
@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_validating_adapter_names_the_inconsistent_field(name, case):
    bad, message = BAD_ROWS[case]
    with pytest.raises(ValueError, match=message):
        create_adapter(name, impl="reference", validate=True).build_metadata(_batch(bad))


@pytest.mark.parametrize("name", ["flashattention", "triton"])
def test_validating_adapter_rejects_pages_outside_the_cache(name):
    sel = _batch(([0, 1], [2, PAGES + 3], 2, 6))
    ad = create_adapter(name, impl="reference", validate=True)
    md = ad.build_metadata(sel)  # the selection is consistent; the cache is too small for it
    k, v = _pool()
    with pytest.raises(ValueError, match=r"metadata\.(page_table|kv_indices) must be -1 or a (page|slot) in \[0, "):
        ad.forward_decode(torch.randn(2, 4, D), (k, v), md, sm_scale=0.3)


def test_validating_dsa_adapter():
    sel = _selection([[0, 1, 2], [0, 2]], [[3, 9, 1], [4, 4]], [3, 2], [3, 2], ps=1)
    with pytest.raises(ValueError, match="selection.seq_lens must be inside the last selected token"):
        create_adapter("dsa", kv_lora_rank=4, impl="reference", validate=True).build_metadata(sel)
    sel = _selection([[0, 1, 2]], [[3, 9, 1000]], [3], [3], ps=1)
    ad = create_adapter("dsa", kv_lora_rank=4, impl="reference", validate=True)
    md = ad.build_metadata(sel)
    with pytest.raises(ValueError, match=r"metadata.indices must be -1 or a slot in \[0, 32\)"):
        ad.forward_decode(torch.randn(1, 2, 6), (torch.randn(32, 1, 6),), md, sm_scale=0.3)


@pytest.mark.parametrize("name", ["flashattention", "triton"])
@pytest.mark.parametrize("case", sorted(BAD_ROWS) + ["page_outside_cache"])
def test_unchecked_inconsistent_row_cannot_disturb_a_good_row(name, case):
    bad = ([0, 1], [2, PAGES + 3], 2, 6) if case == "page_outside_cache" else BAD_ROWS[case][0]
    k, v = _pool()
    k0, v0 = k.clone(), v.clone()
    q = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(3))
    ad = create_adapter(name, impl="reference")
    out = ad.forward_decode(q, (k, v), ad.build_metadata(_batch(bad)), sm_scale=0.3)
    alone = ad.forward_decode(q[:1], (k, v), ad.build_metadata(_selection(*[[x] for x in GOOD])), sm_scale=0.3)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:1], alone)
    assert torch.equal(k, k0) and torch.equal(v, v0)
