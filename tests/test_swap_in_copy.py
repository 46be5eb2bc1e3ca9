"""The swap-in copy (misses straight from the LRU diff's output, host -> device) against a
page-by-page copy, for every host layout, MHA pages and MLA rows, with padding rows and
-1 entries; Triton interpreted on CPU (native on GPU) against the torch reference."""
from __future__ import annotations

import pytest
import torch

from hicache.config import HOST_LAYOUTS
from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.kv_spec import KVCacheSpec
from sparsehi.kernels.swap_in_copy import swap_in_copy_reference, swap_in_copy_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _pools(attention: str, ps: int, layout: str):
    heads, dim = (2, 8) if attention == "mha" else (1, 12)
    spec = KVCacheSpec(attention, 3, heads, dim, torch.float32, ps, **({"kv_lora_rank": 8} if attention == "mla" else {}))
    dev = DeviceKVPool(spec, 64 * ps, DEV)
    host = HostKVPool(dev, hicache_ratio=2.0, layout=layout, pin_memory=DEV == "cuda")
    g = torch.Generator().manual_seed(0)
    host.kv_data.copy_(torch.randn(host.kv_data.shape, generator=g))
    return dev, host


def _lists(ps_pages_host: int, ps_pages_dev: int):
    g = torch.Generator().manual_seed(1)
    B, K, M, S = 4, 6, 20, 8
    load_ids = torch.full((B, K), -1, dtype=torch.int32)
    load_slots = torch.full((B, K), -1, dtype=torch.int32)
    num = torch.tensor([3, 0, 6, 2], dtype=torch.int32)
    for b in range(B):
        n = int(num[b])
        load_ids[b, :n] = torch.randperm(M, generator=g)[:n].int()
        load_slots[b, :n] = torch.randperm(S, generator=g)[:n].int()
    rows = torch.tensor([2, -1, 0, 3])  # row 1 is padding (its lists are empty anyway)
    host_pages = torch.randperm(ps_pages_host - 1, generator=g)[: 4 * M].view(4, M) + 1
    slot_pages = (torch.randperm(ps_pages_dev - 1, generator=g)[: 4 * S].view(4, S) + 1).int()
    return load_ids, load_slots, num, rows, host_pages, slot_pages


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("attention,ps", [("mha", 4), ("mla", 1)])
def test_copy_matches_page_by_page(layout, attention, ps):
    dev, host = _pools(attention, ps, layout)
    hv, dv = host.paged_view(), dev.paged_view()
    args = _lists(host.num_slots // ps, dev.num_slots // ps)
    args = tuple(a.to(DEV) for a in args)
    load_ids, load_slots, num, rows, host_pages, slot_pages = args
    layer = 1
    want = dev.kv_data.clone()
    for b in range(load_ids.shape[0]):
        for j in range(int(num[b])):
            r = int(rows[b])
            hp, dp = int(host_pages[r, load_ids[b, j]]), int(slot_pages[r, load_slots[b, j]])
            for t in range(ps):
                src = hv[(hp * ps + t) // hv.shape[1], (hp * ps + t) % hv.shape[1], layer]
                want[:, layer, dp * ps + t] = src.to(want.device)
    # block sizes: one token row per program (pages split over programs) and many pages each
    for fn, kw in ((swap_in_copy_reference, {}), (swap_in_copy_triton, {"block_bytes": 64}),
                   (swap_in_copy_triton, {"block_bytes": 4096}),
                   (swap_in_copy_triton, {"block_bytes": 64, "row_major": True}),
                   # one program per row loops over all its runs; more programs than runs
                   (swap_in_copy_triton, {"block_bytes": 64, "programs_per_row": 1}),
                   (swap_in_copy_triton, {"block_bytes": 64, "row_major": False, "programs_per_row": 1000})):
        dev.kv_data.zero_()
        want_z = want.clone()
        touched = torch.zeros_like(want, dtype=torch.bool)
        for b in range(load_ids.shape[0]):
            for j in range(int(num[b])):
                dp = int(slot_pages[int(rows[b]), load_slots[b, j]])
                touched[:, layer, dp * ps:(dp + 1) * ps] = True
        want_z[~touched] = 0
        fn(hv, dv, layer, *args, ps, **kw)
        assert torch.equal(dev.kv_data, want_z), (fn.__name__, kw)


def test_bad_views_are_rejected():
    dev, host = _pools("mha", 4, "layer_first")
    args = tuple(a.to(DEV) for a in _lists(host.num_slots // 4, dev.num_slots // 4))
    with pytest.raises(ValueError, match="layer=9"):
        swap_in_copy_reference(host.paged_view(), dev.paged_view(), 9, *args, 4)
    with pytest.raises(ValueError, match="page_size"):
        swap_in_copy_reference(host.paged_view(), dev.paged_view(), 0, *args, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_copy_into_a_layer_past_2_31_elements_of_the_pool():
    """A device pool whose layer offset passes 2**31 elements (over 4 GiB per buffer, e.g.
    an SGLang KV pool the plugin adopts whole): pages copied into its last layer land where
    the page-by-page copy puts them (the offset is computed in int64; the fused swap-in
    runs the same copy block)."""
    ps, heads, dim = 64, 8, 128
    spec = KVCacheSpec("mha", 3, heads, dim, torch.bfloat16, ps)
    pages = (1 << 31) // (2 * heads * dim * ps) + 64  # layer 2 starts past 2**31 elements
    big = DeviceKVPool(spec, pages * ps, "cuda")
    small = HostKVPool(DeviceKVPool(spec, 16 * ps, "cuda"), hicache_ratio=2.0, pin_memory=True)
    assert 2 * big.kv_data.stride(1) > 2 ** 31
    g = torch.Generator().manual_seed(4)
    small.kv_data.copy_(torch.randn(small.kv_data.shape, generator=g).to(torch.bfloat16))
    load_ids = torch.tensor([[0, 1, 2]], dtype=torch.int32, device="cuda")
    load_slots = torch.tensor([[0, 1, 2]], dtype=torch.int32, device="cuda")
    num = torch.tensor([3], dtype=torch.int32, device="cuda")
    rows = torch.tensor([0], device="cuda")
    host_pages = torch.tensor([[3, 5, 7]], device="cuda")
    slot_pages = torch.tensor([[pages - 1, pages - 2, 1]], dtype=torch.int32, device="cuda")
    layer = 2
    swap_in_copy_triton(small.paged_view(), big.paged_view(), layer, load_ids, load_slots, num, rows, host_pages,
                        slot_pages, ps)
    torch.cuda.synchronize()
    hv = small.paged_view()
    for hp, dp in ((3, pages - 1), (5, pages - 2), (7, 1)):
        want = torch.stack([hv[(hp * ps + t) // hv.shape[1], (hp * ps + t) % hv.shape[1], layer] for t in range(ps)])
        got = big.kv_data[:, layer, dp * ps:(dp + 1) * ps].permute(1, 0, 2, 3).cpu()
        assert torch.equal(got, want.cpu()), (hp, dp)
    assert not big.kv_data[:, 0].any() and not big.kv_data[:, 1].any()  # no write wrapped into another layer


def test_ids_and_slots_past_their_tables_are_skipped():
    """A load id past ``host_pages``' columns or a slot past ``slot_pages``' is skipped by
    the kernel and by the reference alike (the reference once clamped them to the last
    column and copied a page the kernel does not)."""
    dev, host = _pools("mha", 4, "layer_first")
    load_ids, load_slots, num, rows, host_pages, slot_pages = (a.to(DEV) for a in _lists(host.num_slots // 4,
                                                                                         dev.num_slots // 4))
    load_ids[0, 0] = host_pages.shape[1]
    load_slots[2, 1] = slot_pages.shape[1] + 5
    args = (load_ids, load_slots, num, rows, host_pages, slot_pages, 4)
    got = []
    for fn in (swap_in_copy_reference, swap_in_copy_triton):
        dev.kv_data.zero_()
        fn(host.paged_view(), dev.paged_view(), 1, *args)
        got.append(dev.kv_data.clone())
    assert torch.equal(got[0], got[1])
    # the six other loads copied (4 tokens, 2 buffers, 2 x 8 words each), the two skipped not
    assert int((got[0] != 0).sum()) == (3 + 6 + 2 - 2) * 4 * 2 * 16
