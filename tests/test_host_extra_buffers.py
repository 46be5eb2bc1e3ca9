"""HostKVPool extra per-token buffers: data kept with each token's host KV (allocated and
freed with the slot), stored inside the page records of the page layouts so that L3 pages
carry them, and untouched by the KV paths (writes, host<->device transfers)."""
from __future__ import annotations

import pytest
import torch

from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.kv_spec import KVCacheSpec
from hicache.storage.base import StorageConfig
from hicache.storage.file_store import FileStorage
from hicache.transfer import KVTransferEngine

EXTRA = {"aux": ((3, 5), torch.bfloat16), "tag": ((1,), torch.int32)}


def pools(layout: str, attention: str = "mha", extra=EXTRA):
    heads = 2 if attention == "mha" else 1
    spec = KVCacheSpec(attention, 2, heads, 8, torch.float32, 4)
    dev = DeviceKVPool(spec, 16, "cpu")
    return dev, HostKVPool(dev, hicache_ratio=2.0, layout=layout, pin_memory=False, extra_token_buffers=extra)


def fill(host: HostKVPool, slots: torch.Tensor, seed: int):
    g = torch.Generator().manual_seed(seed)
    spec = host.spec
    kv = [torch.randn(len(slots), spec.kv_heads, spec.head_dim, generator=g) for _ in range(spec.num_buffers)]
    for layer in range(spec.num_layers):
        host.write_tokens(layer, slots, *kv)
    aux = torch.randn(len(slots), 3, 5, generator=g).to(torch.bfloat16)
    tag = torch.randint(0, 1 << 30, (len(slots), 1), generator=g, dtype=torch.int32)
    host.write_extra("aux", slots, aux)
    host.write_extra("tag", slots, tag)
    return kv, aux, tag


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "page_head", "layer_first"])
def test_extras_live_beside_the_kv(layout):
    _, host = pools(layout)
    slots = host.alloc(8)
    kv, aux, tag = fill(host, slots, 1)
    for layer in range(2):
        got = host.read_tokens(layer, slots)
        assert all(torch.equal(a, b) for a, b in zip(got, kv))
    assert torch.equal(host.read_extra("aux", slots), aux) and torch.equal(host.read_extra("tag", slots), tag)
    # rewriting the KV leaves the extras alone, and the other way round
    for layer in range(2):
        host.write_tokens(layer, slots, *[torch.zeros_like(t) for t in kv])
    assert torch.equal(host.read_extra("aux", slots), aux)
    host.write_extra("tag", slots, torch.zeros_like(tag))
    host.write_tokens(0, slots, *kv)
    assert all(torch.equal(a, b) for a, b in zip(host.read_tokens(0, slots), kv))
    if layout != "layer_first":
        assert host.page_tensor(int(slots[0]) // 4).numel() == host.page_nbytes >= 4 * host.spec.token_bytes


def test_page_records_carry_the_extras_through_l3(tmp_path):
    _, a = pools("page_first_direct", "mla")
    _, b = pools("page_first_direct", "mla")
    st = FileStorage(StorageConfig(is_mla=True, model_name="m", extra={"file_path": str(tmp_path)}))
    slots = a.alloc(8)
    kv, aux, tag = fill(a, slots, 2)
    st.register_host_pool(a)
    pages = [int(p) for p in (slots[::4] // 4).tolist()]
    assert st.set_pages(["aa01", "aa02"], pages) == [True, True]
    st.register_host_pool(b)
    dst = b.alloc(8)
    assert st.get_pages(["aa01", "aa02"], [int(p) for p in (dst[::4] // 4).tolist()]) == [True, True]
    assert all(torch.equal(x, y) for x, y in zip(b.read_tokens(1, dst), kv))
    assert torch.equal(b.read_extra("aux", dst), aux) and torch.equal(b.read_extra("tag", dst), tag)


@pytest.mark.parametrize("layout,io", [("page_first_direct", "direct"), ("page_first", "kernel"),
                                       ("page_head", "kernel")])
def test_transfers_move_the_kv_of_strided_records(layout, io):
    dev, host = pools(layout)
    eng = KVTransferEngine(dev, host, io)
    hs = host.alloc(8)
    kv, aux, _ = fill(host, hs, 3)
    ds = dev.allocator.alloc(8)
    eng.load(hs, ds)
    for layer in range(2):
        assert all(torch.equal(b[ds], t) for b, t in zip(dev.layer_buffers(layer), kv))
    hs2 = host.alloc(8)
    eng.backup(ds, hs2)
    assert all(torch.equal(a, b) for a, b in zip(host.read_tokens(1, hs2), kv))
    assert torch.equal(host.read_extra("aux", hs), aux)  # the copies never touched the extras
    assert not host.read_extra("aux", hs2).any()


def test_bad_extra_specs_are_rejected():
    with pytest.raises(ValueError, match=r"extra_token_buffers\['x'\]"):
        pools("page_first", extra={"x": ((0,), torch.float32)})
    with pytest.raises(ValueError, match="extra_token_buffers must be a dict"):
        pools("page_first", extra=[("x", (1,))])
    _, host = pools("page_first")
    with pytest.raises(ValueError, match="extra buffer 'nope' is not in this pool"):
        host.read_extra("nope", host.alloc(4))
    with pytest.raises(ValueError, match=r"values must have shape \(4, 3, 5\)"):
        host.write_extra("aux", host.alloc(4), torch.zeros(4, 5))
