"""table_scatter: page-table entries written in one launch (Triton interpreted on CPU, native
on GPU) against the torch reference, spans 1 and page-sized, mixed dtypes, out-of-range
entries skipped, bad arguments named."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsehi.kernels.table_scatter import stage_entries, table_scatter_reference, table_scatter_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _tables():
    return [torch.full((4, 10), -1, dtype=torch.int64, device=DEV),
            torch.full((4, 10), -1, dtype=torch.int32, device=DEV),
            torch.full((3, 6), -7, dtype=torch.int32, device=DEV)]


@pytest.mark.parametrize("span", [1, 4])
@pytest.mark.parametrize("n_tables", [1, 3])
def test_triton_matches_reference(span, n_tables):
    g = np.random.default_rng(span * 10 + n_tables)
    ent = np.stack([g.integers(-1, 4, 40), g.integers(-1, 5, 40), g.integers(-1, 4, 40),
                    g.integers(0, 1000, 40)], 1)
    ent[0] = (2, 2, 1, 77)  # a table index past the given ones names no table when n_tables == 1
    entries = stage_entries(ent, torch.device(DEV))
    want, got = _tables()[:n_tables], _tables()[:n_tables]
    table_scatter_reference(entries, want, span)
    table_scatter_triton(entries, got, span)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert any((t != _tables()[i]).any() for i, t in enumerate(want))  # something was written


def test_span_writes_consecutive_slots():
    t = torch.zeros(2, 8, dtype=torch.int64, device=DEV)
    table_scatter_triton(stage_entries(np.array([[0, 1, 1, 40]]), torch.device(DEV)), [t], span=4)
    assert t[1].tolist() == [0, 0, 0, 0, 40, 41, 42, 43] and not t[0].any()


def test_bad_arguments_are_named():
    t = torch.zeros(2, 8, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="entries"):
        table_scatter_triton(torch.zeros(3, 3, dtype=torch.int64, device=DEV), [t])
    with pytest.raises(ValueError, match="span"):
        table_scatter_triton(torch.zeros(1, 4, dtype=torch.int64, device=DEV), [t], span=0)
    with pytest.raises(ValueError, match="tables"):
        table_scatter_triton(torch.zeros(1, 4, dtype=torch.int64, device=DEV), [t, t, t, t])
    with pytest.raises(ValueError, match=r"tables\[0\]"):
        table_scatter_triton(torch.zeros(1, 4, dtype=torch.int64, device=DEV), [t.float()])


def test_entry_stager_reuses_its_buffers_and_spills_past_capacity():
    from sparsehi.kernels.table_scatter import EntryStager

    st = EntryStager(4, torch.device(DEV))
    t = torch.full((3, 8), -1, dtype=torch.int64, device=DEV)
    a = st.stage(np.array([[0, 0, 1, 5], [0, 2, 3, 6]]))
    table_scatter_triton(a, [t])
    b = st.stage(np.array([[0, 1, 0, 7]]))  # the same buffers again
    table_scatter_triton(b, [t])
    big = st.stage(np.array([[0, 1, i, i] for i in range(6)]))  # past capacity: staged apart
    assert big.shape == (6, 4)
    table_scatter_triton(big, [t])
    assert t[0, 1] == 5 and t[2, 3] == 6 and t[1].tolist()[:6] == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="capacity"):
        EntryStager(0, torch.device(DEV))
