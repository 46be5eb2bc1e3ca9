"""The one-launch selection table against a row-by-row construction, and the Triton kernel
(interpreted on CPU) against its torch reference."""
from __future__ import annotations

import pytest
import torch

from sparsehi.kernels.selection_table import selection_table_reference, selection_table_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(seed: int, hier: bool, B=6, K=5, sink=2, R=3, ps=4, M=40, rows_total=8):  # noqa: N803
    g = torch.Generator().manual_seed(seed)
    P = torch.tensor([0, 1, 3, 6, 12, 30][:B])  # padding row, P < sink, P < sink + R, up to sparse
    seq = torch.where(P > 0, (P - 1) * ps + 1 + torch.randint(0, ps, (B,), generator=g), 0)
    rows = torch.randperm(rows_total, generator=g)[:B]
    topk = torch.full((B, K), -1, dtype=torch.int32)
    valid = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        n_sink = min(int(P[b]), sink)
        rs = max(n_sink, int(P[b]) - R)
        cand = list(range(n_sink, rs))
        pick = sorted(torch.randperm(len(cand), generator=g)[: min(K, len(cand))].tolist())
        ids = [cand[i] for i in pick]
        topk[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        valid[b] = len(ids)
    own = torch.randint(1, 1000, (rows_total, M), generator=g, dtype=torch.int32)
    sink_t = torch.randint(1, 1000, (rows_total, sink), generator=g, dtype=torch.int32)
    ring_t = torch.randint(1, 1000, (rows_total, R), generator=g, dtype=torch.int32)
    tphys = torch.randint(1, 1000, (B, K), generator=g, dtype=torch.int32)
    kw = dict(sink=sink, recent=R, page_size=ps)
    if hier:
        kw.update(sink_table=sink_t, ring_table=ring_t, topk_phys=tphys)
    else:
        kw.update(own_table=own)
    return (topk, valid, P.to(torch.int32), seq.to(torch.int32), rows), kw


def _naive(args, kw):
    topk, valid, P, seq, rows = args
    sink, R, ps = kw["sink"], kw["recent"], kw["page_size"]
    B, K = topk.shape
    W = sink + K + R
    lid = torch.full((B, W), -1, dtype=torch.int32)
    phys = torch.full((B, W), -1, dtype=torch.int32)
    for b in range(B):
        r = int(rows[b])
        n_sink = min(int(P[b]), sink)
        rs = max(n_sink, int(P[b]) - R)
        ids = list(range(n_sink)) + topk[b, : int(valid[b])].tolist() + list(range(rs, int(P[b])))
        for j, x in enumerate(ids):
            lid[b, j] = x
            if "own_table" in kw:
                phys[b, j] = kw["own_table"][r, x]
            elif j < n_sink:
                phys[b, j] = kw["sink_table"][r, x]
            elif j < n_sink + int(valid[b]):
                phys[b, j] = kw["topk_phys"][b, j - n_sink]
            else:
                phys[b, j] = kw["ring_table"][r, x % R]
    return lid, phys


@pytest.mark.parametrize("hier", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_matches_a_row_by_row_construction(hier, seed):
    args, kw = _case(seed, hier)
    out = selection_table_reference(*args, **kw)
    lid, phys = _naive(args, kw)
    assert torch.equal(out.logical, lid) and torch.equal(out.physical, phys)
    assert torch.equal(out.page_table, torch.where(phys >= 0, phys, 0))
    nv = (lid >= 0).sum(1).to(torch.int32)
    assert torch.equal(out.num_valid, nv)
    seq, ps = args[3], kw["page_size"]
    for b in range(lid.shape[0]):
        n = int(nv[b])
        want = 0 if n == 0 else (n - 1) * ps + min(ps, int(seq[b]) - int(lid[b, n - 1]) * ps)
        assert int(out.attended[b]) == want


def test_slot_table_maps_buffer_slots_to_pages():
    args, kw = _case(4, True)
    rows = args[4]
    slot_pages = torch.randint(1, 1000, (8, 9), generator=torch.Generator().manual_seed(9), dtype=torch.int32)
    slots = torch.randint(0, 9, kw["topk_phys"].shape, generator=torch.Generator().manual_seed(8), dtype=torch.int32)
    got = selection_table_reference(*args, **{**kw, "topk_phys": slots, "slot_table": slot_pages})
    want = selection_table_reference(*args, **{**kw, "topk_phys": slot_pages[rows.long()[:, None], slots.long()]})
    assert torch.equal(got.physical, want.physical)


@pytest.mark.parametrize("hier,slots", [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("seed", [0, 3])
def test_triton_matches_reference(hier, slots, seed):
    args, kw = _case(seed, hier)
    if slots:
        kw["topk_phys"] = kw["topk_phys"] % 9
        kw["slot_table"] = torch.randint(1, 1000, (8, 9), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    args = tuple(a.to(DEV) for a in args)
    kw = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    ref = selection_table_reference(*args, **kw)
    got = selection_table_triton(*args, **kw)
    for name in ("logical", "physical", "page_table", "num_valid", "attended"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name


def test_bad_tables_are_rejected():
    args, kw = _case(0, True)
    with pytest.raises(ValueError, match="ring_table"):
        selection_table_reference(*args, **{**kw, "ring_table": None})
    with pytest.raises(ValueError, match="topk_phys"):
        selection_table_reference(*args, **{**kw, "topk_phys": kw["topk_phys"][:, :2]})


def test_triton_matches_reference_over_several_column_blocks():
    """A table wider than one program's block (sink + top_k + recent > 512 columns)."""
    g = torch.Generator().manual_seed(5)
    B, K, sink, R, ps, M = 3, 600, 2, 3, 1, 1200
    P = torch.tensor([0, 700, 1100], dtype=torch.int32)
    seq = P.clone()
    rows = torch.tensor([1, 0, 2])
    topk = torch.full((B, K), -1, dtype=torch.int32)
    valid = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        n_sink = min(int(P[b]), sink)
        rs = max(n_sink, int(P[b]) - R)
        ids = sorted((torch.randperm(rs - n_sink, generator=g)[: min(K, rs - n_sink)] + n_sink).tolist())
        topk[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        valid[b] = len(ids)
    own = torch.randint(1, 1000, (3, M), generator=g, dtype=torch.int32)
    args = tuple(a.to(DEV) for a in (topk, valid, P, seq, rows))
    kw = dict(sink=sink, recent=R, page_size=ps, own_table=own.to(DEV))
    ref = selection_table_reference(*args, **kw)
    got = selection_table_triton(*args, **kw)
    for name in ("logical", "physical", "page_table", "num_valid", "attended"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert int(ref.num_valid[2]) == sink + K + R  # the widest row fills every column block
