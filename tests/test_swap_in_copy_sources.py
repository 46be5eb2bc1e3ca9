"""swap_in_copy / swap_in_copy_and_table with the host KV addressed per token
(``host_tokens``) and tokens still in GPU memory read from the device view (``resident``):
the torch reference against a plain per-token Python loop (tiny cases), the Triton kernels
(interpreted on CPU, native on GPU) against the reference, every host layout, MHA pages
and MLA rows, padding rows and ``num_loads < K``; and the argument checks."""
from __future__ import annotations

import pytest
import torch

from hicache.config import HOST_LAYOUTS
from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.kv_spec import KVCacheSpec
from sparsehi.kernels.selection_table import selection_table_reference
from sparsehi.kernels.swap_in_copy import swap_in_copy, swap_in_copy_reference, swap_in_copy_triton
from sparsehi.kernels.swap_in_fused import (swap_in_copy_and_table, swap_in_copy_and_table_reference,
                                            swap_in_copy_and_table_triton)
from test_swap_in_copy import DEV, _pools
from test_swap_in_fused import _table_inputs

B, K, M, S, R = 4, 6, 20, 8, 4
LAYER = 1


def _loop_copy(hv, dv, layer, load_ids, load_slots, num, rows, host_pages, slot_pages, ps, host_tokens=None,
               resident=None):
    """The documented rule, one token at a time (writes ``dv`` in place; resident tokens
    are read from ``dv`` as it was before)."""
    before = dv.clone()
    src_n, dst_n = hv.shape[0] * hv.shape[1], dv.shape[0] * dv.shape[1]
    for b in range(load_ids.shape[0]):
        row = int(rows[b])
        if row < 0:
            continue
        for j in range(min(int(num[b]), load_ids.shape[1])):
            lid, slot = int(load_ids[b, j]), int(load_slots[b, j])
            if lid < 0 or slot < 0 or slot >= slot_pages.shape[1] or int(slot_pages[row, slot]) < 0:
                continue
            dp = int(slot_pages[row, slot])
            for t in range(ps):
                if host_tokens is None:
                    if lid >= host_pages.shape[1] or int(host_pages[row, lid]) < 0:
                        continue
                    h = int(host_pages[row, lid]) * ps + t
                else:
                    c = lid * ps + t
                    if c >= host_tokens.shape[1] or int(host_tokens[row, c]) < 0:
                        continue
                    h = int(host_tokens[row, c])
                d = dp * ps + t
                if h >= src_n or d >= dst_n:
                    continue
                x = hv[h // hv.shape[1], h % hv.shape[1], layer]
                if resident is not None:
                    v2p, vps = resident
                    if h // vps < v2p.shape[0] and int(v2p[h // vps]) > 0:
                        rs = int(v2p[h // vps]) * vps + h % vps
                        if rs >= dst_n:
                            continue
                        x = before[rs // dv.shape[1], rs % dv.shape[1], layer]
                dv[d // dv.shape[1], d % dv.shape[1], layer] = x.to(dv.device)


def _case(host_slots: int, dev_slots: int, ps: int, *, tokens: bool, vps: int | None, seed: int = 0,
          dtype=torch.int64, strided: bool = False):
    """Load lists, tables and (optionally) a token table and a v2p table.

    Rows ``[2, -1, 0, 3]`` (row 1 padding, with loads listed that must not be copied),
    ``num_loads`` ``[3, 2, 6, 2]`` of ``K = 6`` (entries past ``num_loads`` look valid and must
    not be copied), a -1 id inside ``num_loads``, an id past the tables, a slot past
    ``slot_pages``, the last logical page partly past ``T``, a token in the last host page
    (past the v2p table). Buffer slots are device pages ``[1, 33)``; resident tokens live in
    pages ``[33, 64)`` (never written), a few v2p entries point past the device pool. The token
    table holds scattered host slots (not page aligned), -1 entries and slots past the host
    pool; ``strided``: token and v2p tables are non-contiguous views."""
    g = torch.Generator().manual_seed(seed)
    num = torch.tensor([3, 2, 6, 2], dtype=torch.int32)
    rows = torch.tensor([2, -1, 0, 3])
    load_ids = torch.stack([torch.randperm(M, generator=g)[:K] for _ in range(B)]).int()
    load_slots = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(B)]).int()
    load_ids[0, 0] = M - 1  # partly past T in the token table
    load_ids[2, 1] = M + 3  # past host_pages' columns and T
    load_ids[3, 1] = -1
    load_slots[0, 1] = S + 1  # past slot_pages' columns
    host_pages = (torch.randperm(host_slots // ps - 1, generator=g)[: R * M] + 1).view(R, M)
    slot_pages = (torch.randperm(32, generator=g)[: R * S] + 1).view(R, S).int()
    # one token of row 0 (request row 0) in the last host page: past v2p's N pages
    host_pages[0, int(load_ids[2, 0])] = host_slots // ps - 1
    host_tokens = v2p = None
    if tokens:
        t_cols = M * ps - 1
        ht = torch.randint(0, host_slots, (R, t_cols), generator=g)
        u = torch.rand(R, t_cols, generator=g)
        ht = torch.where(u < 0.15, -1, torch.where(u > 0.9, host_slots + torch.randint(0, 9, (R, t_cols),
                                                                                        generator=g), ht))
        ht[0, int(load_ids[2, 0]) * ps] = host_slots - 1
        ht = ht.to(dtype)
        if strided:
            wide = torch.full((R, 2 * t_cols), -7, dtype=dtype)
            wide[:, ::2] = ht
            ht = wide[:, ::2]
        host_tokens = ht
    if vps is not None:
        n = host_slots // vps - 3  # the last host pages are past v2p: read from the host
        lo, hi = -(-33 * ps // vps), 64 * ps // vps  # device pages of vps tokens inside [33, 64) pages
        pp = torch.randint(lo, hi, (n,), generator=g)
        u = torch.rand(n, generator=g)
        pp = torch.where(u < 0.25, 0, torch.where(u < 0.4, -1, torch.where(u > 0.95, hi + 2, pp))).to(dtype)
        if strided:
            wide = torch.zeros(2 * n, dtype=dtype)
            wide[1::2] = pp
            pp = wide[1::2]
        v2p = pp
        assert pp.min() <= 0 and pp.max() > 0
    return (load_ids, load_slots, num, rows, host_pages, slot_pages), host_tokens, v2p


def _filled(attention: str, ps: int, layout: str):
    dev, host = _pools(attention, ps, layout)
    g = torch.Generator().manual_seed(7)
    dev.kv_data.copy_(torch.randn(dev.kv_data.shape, generator=g) - 10)  # resident reads differ from host ones
    return dev, host


def _inputs(dev, host, ps, *, tokens, vps, **kw):
    args, ht, v2p = _case(host.num_slots, dev.num_slots, ps, tokens=tokens, vps=vps, **kw)
    args = tuple(a.to(DEV) for a in args)
    extra = {}
    if ht is not None:
        extra["host_tokens"] = ht.to(DEV)
        args = args[:4] + (None,) + args[5:]  # host_pages is not read with host_tokens
    if v2p is not None:
        extra["resident"] = (v2p.to(DEV), vps)
    return args, extra


# --- the reference against the plain loop ------------------------------------------------------

@pytest.mark.parametrize("attention,ps", [("mha", 4), ("mla", 1)])
@pytest.mark.parametrize("tokens,vps", [(False, None), (True, None), (False, 1), (False, 4), (True, 1), (True, 4)])
def test_reference_matches_a_plain_loop(attention, ps, tokens, vps):
    dev, host = _filled(attention, ps, "layer_first")
    args, ht, v2p = _case(host.num_slots, dev.num_slots, ps, tokens=tokens, vps=vps)
    resident = (v2p, vps) if v2p is not None else None
    hv, dv = host.paged_view(), dev.paged_view()
    want = dv.clone()
    _loop_copy(hv.cpu(), want, LAYER, *args, ps, host_tokens=ht, resident=resident)
    before = dv.clone()
    swap_in_copy_reference(hv, dv, LAYER, *args, ps, host_tokens=ht, resident=resident)
    assert torch.equal(dv, want.to(dv.device))
    changed = (dv != before).flatten(1).any(1)
    assert changed.sum() > 0
    if resident is not None:  # some written tokens came from the device pool (values near -10)
        assert (dv[changed] < -5).flatten(1).all(1).any()
        assert (dv[changed] > -5).flatten(1).any(1).any()


def test_reference_without_new_arguments_is_the_page_copy():
    """No ``host_tokens`` / ``resident``: host page ``host_pages[row, lid]``, slots ``hp * ps +
    t`` (the same as a token table holding exactly those slots)."""
    ps = 4
    dev, host = _filled("mha", ps, "page_first")
    args, _, _ = _case(host.num_slots, dev.num_slots, ps, tokens=False, vps=None)
    hp = args[4]
    ht = (hp[:, :, None] * ps + torch.arange(ps)).reshape(R, M * ps)
    hv, dv = host.paged_view(), dev.paged_view()
    base = dv.clone()
    swap_in_copy_reference(hv, dv, LAYER, *args, ps)
    a = dv.clone()
    dv.copy_(base)
    swap_in_copy_reference(hv, dv, LAYER, *args[:4], None, args[5], ps, host_tokens=ht)
    assert torch.equal(dv, a)
    # a v2p table with no entry > 0 reads every token from the host
    dv.copy_(base)
    swap_in_copy_reference(hv, dv, LAYER, *args, ps, resident=(torch.zeros(host.num_slots, dtype=torch.int64), 1))
    assert torch.equal(dv, a)


# --- Triton against the reference --------------------------------------------------------------

def _triton_vs_reference(dev, host, ps, args, extra, variants):
    hv, dv = host.paged_view(), dev.paged_view()
    base = dev.kv_data.clone()
    swap_in_copy_reference(hv, dv, LAYER, *args, ps, **extra)
    want = dev.kv_data.clone()
    assert not torch.equal(want, base)
    for kw in variants:
        dev.kv_data.copy_(base)
        swap_in_copy_triton(hv, dv, LAYER, *args, ps, **kw, **extra)
        assert torch.equal(dev.kv_data, want), kw


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("attention,ps", [("mha", 4), ("mla", 1)])
def test_triton_token_table_and_resident_every_layout(layout, attention, ps):
    dev, host = _filled(attention, ps, layout)
    args, extra = _inputs(dev, host, ps, tokens=True, vps=4)
    # one token row per program (pages split over programs), several pages per program,
    # one program looping over all of a row's runs
    _triton_vs_reference(dev, host, ps, args, extra, ({"block_bytes": 64}, {"block_bytes": 4096},
                                                      {"block_bytes": 64, "programs_per_row": 1}))


@pytest.mark.parametrize("attention,ps", [("mha", 4), ("mla", 1)])
@pytest.mark.parametrize("tokens,vps,dtype,strided", [
    (True, None, torch.int64, False),
    (True, None, torch.int32, True),
    (False, 1, torch.int64, False),
    (False, 4, torch.int32, True),
    (True, 1, torch.int32, False),
])
def test_triton_source_variants(attention, ps, tokens, vps, dtype, strided):
    dev, host = _filled(attention, ps, "layer_first")
    args, extra = _inputs(dev, host, ps, tokens=tokens, vps=vps, dtype=dtype, strided=strided, seed=3)
    _triton_vs_reference(dev, host, ps, args, extra, ({"block_bytes": 64, "row_major": False},))


def test_empty_token_and_v2p_tables():
    """``T = 0``: nothing is copied; ``N = 0``: nothing is resident (the page copy)."""
    ps = 4
    dev, host = _filled("mha", ps, "layer_first")
    args, _ = _inputs(dev, host, ps, tokens=False, vps=None)
    hv, dv = host.paged_view(), dev.paged_view()
    base = dev.kv_data.clone()
    swap_in_copy_reference(hv, dv, LAYER, *args, ps)
    plain = dev.kv_data.clone()
    empty_t = torch.empty(R, 0, dtype=torch.int64, device=DEV)
    empty_v = torch.empty(0, dtype=torch.int32, device=DEV)
    for fn in (swap_in_copy_reference, swap_in_copy_triton):
        dev.kv_data.copy_(base)
        fn(hv, dv, LAYER, *args, ps, host_tokens=empty_t, resident=(empty_v, 2))
        assert torch.equal(dev.kv_data, base), fn.__name__
        dev.kv_data.copy_(base)
        fn(hv, dv, LAYER, *args, ps, resident=(empty_v, 2))
        assert torch.equal(dev.kv_data, plain), fn.__name__


def test_host_slots_past_the_source_are_skipped_even_where_v2p_maps_them():
    """A host slot outside ``src`` skips its token before ``resident`` is looked at, also
    where the v2p table reaches past the host pool."""
    ps, vps = 4, 4
    dev, host = _filled("mha", ps, "layer_first")
    args, ht, _ = _case(host.num_slots, dev.num_slots, ps, tokens=True, vps=None)
    assert (ht >= host.num_slots).any()
    n = host.num_slots // vps + 8  # past the host pool; every page resident
    v2p = torch.randint(-(-33 * ps // vps), 64 * ps // vps, (n,), generator=torch.Generator().manual_seed(9))
    resident = (v2p.to(DEV), vps)
    args = tuple(a.to(DEV) for a in args)
    hv, dv = host.paged_view(), dev.paged_view()
    base = dev.kv_data.clone()
    want = dv.clone()
    _loop_copy(hv.cpu(), want, LAYER, *args, ps, host_tokens=ht, resident=(v2p, vps))
    for fn in (swap_in_copy_reference, swap_in_copy_triton):
        dev.kv_data.copy_(base)
        fn(hv, dv, LAYER, *args, ps, host_tokens=ht.to(DEV), resident=resident)
        assert torch.equal(dv, want.to(dv.device)), fn.__name__
    assert not torch.equal(dev.kv_data, base)


# --- the fused copy + table ---------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["layer_first", "page_head"])
@pytest.mark.parametrize("attention,ps", [("mha", 4), ("mla", 1)])
def test_fused_copies_as_the_unfused_and_builds_the_same_table(layout, attention, ps):
    dev, host = _filled(attention, ps, layout)
    args, extra = _inputs(dev, host, ps, tokens=True, vps=4, seed=5)
    slot_pages = args[5]
    topk, valid, npages, seq, slots, sink_t, ring_t = (a.to(DEV) for a in _table_inputs(B, K, S, 2, 3, ps))
    trows = args[3].clamp(min=0)
    kw = dict(sink=2, recent=3, sink_table=sink_t, ring_table=ring_t, device_slots=slots)
    table_args = (topk, valid, npages, seq, trows)
    hv, dv = host.paged_view(), dev.paged_view()
    base = dev.kv_data.clone()
    swap_in_copy_triton(hv, dv, LAYER, *args, ps, **extra)
    unfused = dev.kv_data.clone()
    assert not torch.equal(unfused, base)
    # the table does not depend on where the copy reads from
    want = selection_table_reference(*table_args, sink=2, recent=3, page_size=ps, sink_table=sink_t,
                                     ring_table=ring_t, topk_phys=slots, slot_table=slot_pages)
    for fn, fkw in ((swap_in_copy_and_table_reference, {}), (swap_in_copy_and_table_triton, {"block_bytes": 64}),
                    (swap_in_copy_and_table_triton, {"block_bytes": 4096})):
        dev.kv_data.copy_(base)
        got = fn(hv, dv, LAYER, *args, ps, *table_args, **kw, **extra, **fkw)
        assert torch.equal(dev.kv_data, unfused), (fn.__name__, fkw)
        for name in ("logical", "physical", "page_table", "num_valid", "attended"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (fn.__name__, fkw, name)


# --- argument checks ----------------------------------------------------------------------------

def _bad_cases():
    ht = torch.zeros(R, 8, dtype=torch.int64)
    v2p = torch.zeros(16, dtype=torch.int32)
    return [
        ("host_pages=None", dict(host_pages=None), "host_pages may be None only with host_tokens"),
        ("tokens 1-D", dict(host_tokens=ht[0]), r"host_tokens must be a 2-D tensor \[R, T\]"),
        ("tokens rows", dict(host_tokens=ht[:3]), r"host_tokens must be \[R, T\] over the same request rows"),
        ("tokens dtype", dict(host_tokens=ht.float()), "host_tokens must have dtype int32 or int64"),
        ("tokens device", dict(host_tokens=ht.to("meta")), "host_tokens must be on the device"),
        ("tokens list", dict(host_tokens=[[0]] * R), "host_tokens must be a 2-D tensor"),
        ("resident list", dict(resident=[v2p, 1]), r"resident must be a tuple \(v2p, v2p_page_size\)"),
        ("resident 3", dict(resident=(v2p, 1, 1)), r"resident must be a tuple \(v2p, v2p_page_size\)"),
        ("v2p 2-D", dict(resident=(v2p[None], 1)), r"resident\[0\] \(v2p\) must be a 1-D tensor"),
        ("v2p dtype", dict(resident=(v2p.to(torch.int16), 1)), r"resident\[0\] \(v2p\) must have dtype"),
        ("v2p device", dict(resident=(v2p.to("meta"), 1)), r"resident\[0\] \(v2p\) must be on the device"),
        ("vps 0", dict(resident=(v2p, 0)), r"v2p_page_size\)=0 is invalid: a power of two int >= 1"),
        ("vps 3", dict(resident=(v2p, 3)), r"v2p_page_size\)=3 is invalid"),
        ("vps float", dict(resident=(v2p, 4.0)), r"v2p_page_size\)=4.0 is invalid"),
        ("vps bool", dict(resident=(v2p, True)), r"v2p_page_size\)=True is invalid"),
    ]


@pytest.mark.parametrize("name,bad,match", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_token_and_resident_arguments_are_rejected(name, bad, match):
    ps = 4
    dev, host = _pools("mha", ps, "layer_first")
    args, _, _ = _case(host.num_slots, dev.num_slots, ps, tokens=False, vps=None)
    bad = {k: (v.to(DEV) if isinstance(v, torch.Tensor) and v.device.type != "meta" else
               (tuple(x.to(DEV) if isinstance(x, torch.Tensor) and x.device.type != "meta" else x for x in v)
                if isinstance(v, tuple) else v)) for k, v in bad.items()}
    args = [a.to(DEV) for a in args]
    if "host_pages" in bad:
        args[4] = bad.pop("host_pages")
    hv, dv = host.paged_view(), dev.paged_view()
    topk, valid, npages, seq, slots, sink_t, ring_t = (a.to(DEV) for a in _table_inputs(B, K, S, 2, 3, ps))
    table = dict(sink=2, recent=3, sink_table=sink_t, ring_table=ring_t, device_slots=slots)
    before = dev.kv_data.clone()
    for fn in (swap_in_copy, swap_in_copy_reference, swap_in_copy_triton):
        with pytest.raises(ValueError, match=match):
            fn(hv, dv, LAYER, *args, ps, **bad)
    for fn in (swap_in_copy_and_table, swap_in_copy_and_table_reference, swap_in_copy_and_table_triton):
        with pytest.raises(ValueError, match=match):
            fn(hv, dv, LAYER, *args, ps, topk, valid, npages, seq, args[3].clamp(min=0), **table, **bad)
    assert torch.equal(dev.kv_data, before)


# --- GPU: realistic sizes -----------------------------------------------------------------------

def _gpu_pools(layout: str, dev_pages: int = 512, ps: int = 64, layers: int = 3):
    spec = KVCacheSpec("mha", layers, 8, 128, torch.bfloat16, ps)
    dev = DeviceKVPool(spec, dev_pages * ps, "cuda")
    host = HostKVPool(DeviceKVPool(spec, dev_pages * ps // 2, "cuda"), hicache_ratio=2.0, layout=layout,
                      pin_memory=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    host.kv_data.copy_(torch.randn(host.kv_data.shape, generator=g, device="cuda").to(torch.bfloat16))
    dev.kv_data.copy_((torch.randn(dev.kv_data.shape, generator=g, device="cuda") - 10).to(torch.bfloat16))
    assert host.pin_memory
    return dev, host


def _gpu_case(host_slots: int, dev_slots: int, ps: int, *, vps: int | None, seed: int, kg: int = 32,
              write_pages: tuple[int, int] = (1, 257), resident_pages: tuple[int, int] = (257, 512)):
    """B = 4 rows (one padding), K = ``kg`` pages of ``ps`` tokens, ``num_loads < K`` on three
    (the padding row's loads must not be copied); a token table of scattered host slots with -1s, entries past the host pool and the
    last logical page partly past T; with ``vps`` a v2p table (half the host pages resident in
    device pages ``resident_pages``, a few past the pool). Device tensors."""
    g = torch.Generator().manual_seed(seed)
    b, mg = 4, 2 * kg
    rows = torch.tensor([1, -1, 0, 3])
    num = torch.tensor([kg, 7, kg - 5, kg // 2], dtype=torch.int32)
    load_ids = torch.stack([torch.randperm(mg, generator=g)[:kg] for _ in range(b)]).int()
    load_slots = torch.stack([torch.randperm(kg, generator=g) for _ in range(b)]).int()
    load_ids[0, 0] = mg - 1
    load_ids[2, 3] = -1
    lo, hi = write_pages
    slot_pages = (torch.randperm(hi - lo, generator=g)[: 4 * kg] + lo).view(4, kg).int()
    t_cols = mg * ps - ps // 2
    ht = torch.randint(0, host_slots, (4, t_cols), generator=g)
    u = torch.rand(4, t_cols, generator=g)
    ht = torch.where(u < 0.1, -1, torch.where(u > 0.95, host_slots + 3, ht))
    out = [a.cuda() for a in (load_ids, load_slots, num, rows)], ht.cuda(), None
    if vps is not None:
        n = host_slots // vps
        rlo, rhi = -(-resident_pages[0] * ps // vps), resident_pages[1] * ps // vps
        pp = torch.randint(rlo, rhi, (n,), generator=g)
        u = torch.rand(n, generator=g)
        pp = torch.where(u < 0.5, 0, torch.where(u > 0.98, dev_slots // vps + 1, pp))
        out = out[0], out[1], pp.int().cuda()
    return out[0] + [slot_pages.cuda()], out[1], out[2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("vps", [None, 1, 64])
def test_gpu_token_table_and_resident_match_the_reference(layout, vps):
    """B = 4, K = 32 pages of 64 tokens, 8 heads x 128 dims bf16, host pool pinned: the
    Triton copy (and the fused copy + table) write what the reference writes."""
    ps = 64
    dev, host = _gpu_pools(layout)
    (load_ids, load_slots, num, rows, slot_pages), ht, v2p = _gpu_case(host.num_slots, dev.num_slots, ps, vps=vps,
                                                                       seed=11)
    extra = {"host_tokens": ht}
    if v2p is not None:
        extra["resident"] = (v2p, vps)
    args = (load_ids, load_slots, num, rows, None, slot_pages, ps)
    hv, dv = host.paged_view(), dev.paged_view()
    base = dev.kv_data.clone()
    swap_in_copy_reference(hv, dv, LAYER, *args, **extra)
    want = dev.kv_data.clone()
    assert not torch.equal(want, base)
    for kw in ({}, {"block_bytes": 16384}, {"row_major": False}):
        dev.kv_data.copy_(base)
        swap_in_copy_triton(hv, dv, LAYER, *args, **kw, **extra)
        torch.cuda.synchronize()
        assert torch.equal(dev.kv_data, want), kw
    topk, valid, npages, seq, slots, sink_t, ring_t = (a.cuda() for a in _table_inputs(4, 32, 32, 2, 3, ps))
    tkw = dict(sink=2, recent=3, sink_table=sink_t, ring_table=ring_t, device_slots=slots)
    targs = (topk, valid, npages, seq, rows.clamp(min=0))
    dev.kv_data.copy_(base)
    got = swap_in_copy_and_table_triton(hv, dv, LAYER, *args, *targs, **tkw, **extra)
    torch.cuda.synchronize()
    assert torch.equal(dev.kv_data, want)
    ref = selection_table_reference(*targs, sink=2, recent=3, page_size=ps, sink_table=sink_t, ring_table=ring_t,
                                    topk_phys=slots, slot_table=slot_pages)
    for name in ("logical", "physical", "page_table", "num_valid", "attended"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_resident_pages_without_token_table_match_the_reference():
    """``resident`` over the page table (``h = host_pages[row, lid] * 64 + t``), v2p in
    pages of 64 tokens, int64 tables."""
    ps, vps = 64, 64
    dev, host = _gpu_pools("page_first")
    (load_ids, load_slots, num, rows, slot_pages), _, v2p = _gpu_case(host.num_slots, dev.num_slots, ps, vps=vps,
                                                                      seed=12)
    g = torch.Generator().manual_seed(13)
    host_pages = torch.randperm(host.num_slots // ps, generator=g)[: 4 * 64].view(4, 64).cuda()
    args = (load_ids, load_slots, num, rows, host_pages, slot_pages, ps)
    hv, dv = host.paged_view(), dev.paged_view()
    base = dev.kv_data.clone()
    swap_in_copy_reference(hv, dv, LAYER, *args, resident=(v2p.long(), vps))
    want = dev.kv_data.clone()
    assert not torch.equal(want, base)
    dev.kv_data.copy_(base)
    swap_in_copy(hv, dv, LAYER, *args, resident=(v2p.long(), vps))
    torch.cuda.synchronize()
    assert torch.equal(dev.kv_data, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_token_table_and_resident_in_a_pool_past_2_31_elements():
    """A device pool whose last layer starts past 2**31 elements per buffer (as in
    test_swap_in_copy): tokens written to and resident tokens read from its last layer's
    high pages, through a token table, land as the reference puts them; no other layer is
    touched (int64 offsets for the resident read as for the write)."""
    ps, heads, dim, vps = 64, 8, 128, 64
    spec = KVCacheSpec("mha", 3, heads, dim, torch.bfloat16, ps)
    pages = (1 << 31) // (2 * heads * dim * ps) + 64
    big = DeviceKVPool(spec, pages * ps, "cuda")
    assert 2 * big.kv_data.stride(1) > 2 ** 31
    host = HostKVPool(DeviceKVPool(spec, 64 * ps, "cuda"), hicache_ratio=2.0, pin_memory=True)
    g = torch.Generator(device="cuda").manual_seed(4)
    host.kv_data.copy_(torch.randn(host.kv_data.shape, generator=g, device="cuda").to(torch.bfloat16))
    layer = 2
    big.kv_data[:, layer, (pages - 128) * ps:].copy_(
        (torch.randn(big.kv_data[:, layer, (pages - 128) * ps:].shape, generator=g, device="cuda") - 10)
        .to(torch.bfloat16))
    (load_ids, load_slots, num, rows, slot_pages), ht, v2p = _gpu_case(
        host.num_slots, big.num_slots, ps, vps=vps, seed=14, kg=16, write_pages=(pages - 256, pages - 128),
        resident_pages=(pages - 128, pages))
    args = (load_ids, load_slots, num, rows, None, slot_pages, ps)
    extra = dict(host_tokens=ht, resident=(v2p, vps))
    hv, dv = host.paged_view(), big.paged_view()
    hi = big.kv_data[:, layer, (pages - 256) * ps:]
    base = hi.clone()
    swap_in_copy_reference(hv, dv, layer, *args, **extra)
    want = hi.clone()
    assert not torch.equal(want, base)
    hi.copy_(base)
    swap_in_copy_triton(hv, dv, layer, *args, **extra)
    torch.cuda.synchronize()
    assert torch.equal(hi, want)
    assert not big.kv_data[:, 0].any() and not big.kv_data[:, 1].any()
    assert not big.kv_data[:, layer, : (pages - 256) * ps].any()
