"""The per-step tables kernel (sparsehi/kernels/step_setup.py) against its torch reference:
padding rows, dense rows, rows at page boundaries, rows shorter than the sink, rows whose
candidates do not outgrow top-k, lengths past the page bound."""
import dataclasses
import os

import pytest
import torch

from sparsehi.kernels.dense_pages import dense_pages, dense_pages_reference, dense_pages_triton
from sparsehi.kernels.step_setup import step_setup, step_setup_reference, step_setup_triton

needs_interp = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="interpreted Triton kernels need TRITON_INTERPRET=1")


def _tables(dev, n_req=6, M=12, sink=2, R=3, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, dtype=torch.int32):
        return torch.randint(0, 1000, shape, generator=g).to(dev, dtype)

    return dict(page_table=rnd(n_req, M), sink_table=rnd(n_req, max(sink, 1)), ring_table=rnd(n_req, R),
                host_page_table=rnd(n_req, M, dtype=torch.int64), dense_pool_table=rnd(n_req, M),
                dense_rows_t=(rnd(n_req) % 2 == 0))


def _batch(dev, ps, M, sink):
    # (row, seq_len): padding, first token, page boundaries, shorter than the sink, long rows,
    # a length past the page bound (clamped to the last page)
    pairs = [(3, 1), (-1, 0), (0, ps), (5, ps + 1), (1, 2 * ps - 1), (-1, 7), (2, sink * ps),
             (4, M * ps), (0, M * ps + 5), (3, 5 * ps + 3)]
    rows = torch.tensor([r for r, _ in pairs], dtype=torch.int64, device=dev)
    seq = torch.tensor([s for _, s in pairs], dtype=torch.int32, device=dev)
    return rows, seq


def _same(a, b):
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x is None or y is None:
            assert x is None and y is None, f.name
            continue
        assert x.dtype == y.dtype and x.shape == y.shape, (f.name, x.dtype, y.dtype, x.shape, y.shape)
        assert torch.equal(x.cpu(), y.cpu()), (f.name, x, y)


CASES = [  # (page_size, top_k, sink, recent, hierarchical, dense pool, dense rows)
    (4, 3, 2, 3, True, True, True),
    (4, 3, 2, 3, True, False, False),
    (1, 5, 0, 2, True, True, False),
    (16, 2, 1, 1, False, False, True),
    (2, 6, 2, 3, False, False, False),
]


def _run(fn, dev, ps, K, sink, R, hier, dpool, drows, zero=None):
    M = 12
    tabs = _tables(dev, M=M, sink=sink, R=R)
    rows, seq = _batch(dev, ps, M, sink)
    kw = dict(page_size=ps, top_k=K, sink=sink, recent=R, zero_cols=zero)
    if hier:
        kw.update(sink_table=tabs["sink_table"], ring_table=tabs["ring_table"],
                  host_page_table=tabs["host_page_table"])
        if dpool:
            kw["dense_pool_table"] = tabs["dense_pool_table"]
    if drows:
        kw["dense_rows_t"] = tabs["dense_rows_t"]
    return fn(rows, seq, tabs["page_table"], **kw)


@needs_interp
@pytest.mark.parametrize("case", CASES)
def test_step_setup_kernel_matches_reference(case):
    ps, K, sink, R, hier, dpool, drows = case
    z_ref = torch.full((5, 10), 7, dtype=torch.int32)
    z_tri = z_ref.clone()
    ref = _run(step_setup_reference, torch.device("cpu"), *case, zero=z_ref)
    got = _run(step_setup_triton, torch.device("cpu"), *case, zero=z_tri)
    _same(ref, got)
    assert not z_tri.any() and not z_ref.any()
    # the cases are not trivial: padding, sparse and plain rows, dense rows are all there
    assert (~ref.live).any() and ref.use.any() and (ref.ncand > 0).any()
    if drows:
        assert ref.dense_rows.any() and (ref.dense_rows & (ref.ncand == 0)).any()


def test_step_setup_reference_values():
    """A few rows by hand: the reference is what the decode step computed before."""
    dev = torch.device("cpu")
    tabs = _tables(dev, M=12, sink=2, R=3)
    rows = torch.tensor([3, -1, 1], dtype=torch.int64)
    seq = torch.tensor([1, 9, 4 * 9], dtype=torch.int32)  # page 0 (sink), padding, page 8 (ring slot 2)
    s = step_setup_reference(rows, seq, tabs["page_table"], page_size=4, top_k=2, sink=2, recent=3,
                             sink_table=tabs["sink_table"], ring_table=tabs["ring_table"],
                             host_page_table=tabs["host_page_table"])
    assert s.live.tolist() == [True, False, True] and s.safe_rows.tolist() == [3, 0, 1]
    assert s.num_pages.tolist() == [1, 0, 9]
    assert s.out_loc.tolist() == [int(tabs["sink_table"][3, 0]) * 4, 0, int(tabs["ring_table"][1, 8 % 3]) * 4 + 3]
    assert s.host_loc.tolist() == [int(tabs["host_page_table"][3, 0]) * 4, -1,
                                   int(tabs["host_page_table"][1, 8]) * 4 + 3]
    # row 2: 9 pages, sink 2, recent 3 -> candidates [2, 6): 4 > top_k 2, sparse
    assert s.cs.tolist() == [1, 0, 2] and s.ce.tolist() == [1, 0, 6] and s.ncand.tolist() == [0, 0, 4]
    assert s.use.tolist() == [False, False, True] and s.all_ids[2].tolist() == [2, 3]
    assert s.dense_rows is None and s.dense_loc is None


def test_step_setup_dispatch_runs_reference_on_plain_cpu(monkeypatch):
    monkeypatch.delenv("SPARSEHI_FORCE_TRITON", raising=False)
    dev = torch.device("cpu")
    a = _run(step_setup, dev, *CASES[0])
    b = _run(step_setup_reference, dev, *CASES[0])
    _same(a, b)


def test_step_setup_rejects_bad_input():
    tabs = _tables(torch.device("cpu"))
    rows, seq = _batch(torch.device("cpu"), 4, 12, 2)
    with pytest.raises(ValueError, match="rows must be"):
        step_setup_reference(rows.int(), seq, tabs["page_table"], page_size=4, top_k=2, sink=2, recent=3)
    with pytest.raises(ValueError, match="seq_lens must be"):
        step_setup_reference(rows, seq.long(), tabs["page_table"], page_size=4, top_k=2, sink=2, recent=3)
    with pytest.raises(ValueError, match="recent=0 is invalid"):
        step_setup_reference(rows, seq, tabs["page_table"], page_size=4, top_k=2, sink=2, recent=0)
    with pytest.raises(ValueError, match="come together"):
        step_setup_reference(rows, seq, tabs["page_table"], page_size=4, top_k=2, sink=2, recent=3,
                             sink_table=tabs["sink_table"])
    with pytest.raises(ValueError, match="zero_cols"):
        step_setup_reference(rows, seq, tabs["page_table"], page_size=4, top_k=2, sink=2, recent=3,
                             zero_cols=torch.zeros(2, 3, dtype=torch.int32))


def _dense_case(dtype, M=37):
    g = torch.Generator().manual_seed(1)
    table = torch.randint(0, 500, (5, M), generator=g).to(dtype)
    num_pages = torch.tensor([0, 1, M, 20, 0, M - 1], dtype=torch.int32)
    safe = torch.tensor([0, 4, 2, 1, 0, 3], dtype=torch.int64)
    seq = torch.tensor([1, 3, 4 * M, 4 * 19 + 2, 1, 4 * (M - 2) + 1], dtype=torch.int32)
    return num_pages, safe, table, seq


def _same_pages(a, b):
    for name in ("logical", "physical", "page_table", "attended"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype == torch.int32 and torch.equal(x.cpu(), y.cpu()), (name, x, y)


@needs_interp
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("with_table", [False, True])
def test_dense_pages_kernel_matches_reference(dtype, with_table):
    num_pages, safe, table, seq = _dense_case(dtype)
    extra = (seq, 4) if with_table else ()
    ref = dense_pages_reference(num_pages, safe, table, *extra)
    _same_pages(ref, dense_pages_triton(num_pages, safe, table, *extra))
    assert ref.logical[3].tolist() == list(range(20)) + [-1] * 17
    assert ref.physical[3, :20].tolist() == table[1, :20].tolist() and ref.physical[0].eq(-1).all()


def test_dense_pages_table_is_the_attention_backends():
    """The page table and lengths built with the pages are what the FlashAttention adapter
    would build from the selection itself."""
    from sparsehi.adapters.flash_attention import build_page_table
    from sparsehi.selection import SparseMode
    from sparsehi.selection import SparseSelection

    num_pages, safe, table, seq = _dense_case(torch.int32)
    d = dense_pages_reference(num_pages, safe, table, seq, 4)
    pt, lens = build_page_table(SparseSelection(d.logical, d.physical, num_pages, seq, 4, SparseMode.PAGE_WISE))
    assert torch.equal(pt, d.page_table) and torch.equal(lens, d.attended)
    assert d.attended.tolist()[:4] == [0, 3, 4 * 37, 4 * 19 + 2]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_step_setup_cuda_matches_reference(case):
    dev = torch.device("cuda")
    ref = _run(step_setup_reference, dev, *case)
    got = _run(step_setup, dev, *case)
    _same(ref, got)
    num_pages = torch.randint(0, 13, (9,), dtype=torch.int32, device=dev)
    safe = torch.randint(0, 6, (9,), device=dev)
    table = torch.randint(0, 1000, (6, 12), dtype=torch.int32, device=dev)
    seq = torch.randint(1, 60, (9,), dtype=torch.int32, device=dev)
    _same_pages(dense_pages_reference(num_pages, safe, table), dense_pages(num_pages, safe, table))
    _same_pages(dense_pages_reference(num_pages, safe, table, seq, 4), dense_pages(num_pages, safe, table, seq, 4))
