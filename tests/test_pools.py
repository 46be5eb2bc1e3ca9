"""KVCacheSpec, DeviceKVPool and HostKVPool: shapes, views, sizing, layouts, bad input."""
import pytest
import torch

from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HOST_LAYOUTS, HostKVPool, alloc_pinned
from hicache.kv_spec import KVCacheSpec


def mha(page_size=4, layers=3):
    return KVCacheSpec("mha", layers, 2, 8, torch.bfloat16, page_size)


def mla(page_size=1, layers=2):
    return KVCacheSpec("mla", layers, 1, 24, torch.bfloat16, page_size, kv_lora_rank=16)


def rand_rows(n, heads, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, heads, dim, generator=g).to(torch.bfloat16)


def test_spec_bytes():
    s = KVCacheSpec("mha", 32, 8, 128, torch.bfloat16, 64)
    assert s.num_buffers == 2
    assert s.token_bytes_per_layer == 8 * 128 * 2 * 2
    assert s.page_bytes_per_layer == 64 * 8 * 128 * 2 * 2 == 256 * 1024
    m = KVCacheSpec("mla", 61, 1, 576, torch.bfloat16, 1)
    assert m.num_buffers == 1 and m.token_bytes_per_layer == 1152 and m.value_dim == 512


@pytest.mark.parametrize("kw, match", [
    (dict(attention="gqa"), "attention"),
    (dict(num_layers=0), "num_layers"),
    (dict(attention="mla", kv_heads=2), "kv_heads"),
    (dict(dtype=torch.int64), "dtype"),
    (dict(page_size=-1), "page_size"),
])
def test_spec_rejects_bad_fields(kw, match):
    args = dict(attention="mha", num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float16, page_size=4)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        KVCacheSpec(**args)


def test_device_pool_mha_views_and_set_kv():
    pool = DeviceKVPool(mha(), 32, "cpu")
    k, v = pool.layer_buffers(1)
    assert k.shape == v.shape == (32, 2, 8)
    assert pool.get_key_buffer(1).data_ptr() == k.data_ptr()
    slots = torch.tensor([5, 9, 30])
    kk, vv = rand_rows(3, 2, 8, 1), rand_rows(3, 2, 8, 2)
    pool.set_kv(1, slots, kk, vv)
    assert torch.equal(pool.get_key_buffer(1)[slots], kk)
    assert torch.equal(pool.get_value_buffer(1)[slots], vv)
    assert pool.get_key_buffer(0).abs().sum() == 0  # other layers untouched
    assert pool.nbytes() == 2 * 3 * 32 * 2 * 8 * 2
    assert pool.allocator.num_pages == 8


def test_device_pool_mla_value_is_latent_prefix():
    pool = DeviceKVPool(mla(), 16, "cpu")
    assert len(pool.layer_buffers(0)) == 1
    kv = rand_rows(2, 1, 24)
    pool.set_kv(0, torch.tensor([3, 4]), kv)
    assert torch.equal(pool.get_value_buffer(0)[3:5], kv[..., :16])
    with pytest.raises(ValueError, match="v must be None"):
        pool.set_kv(0, torch.tensor([3, 4]), kv, kv)


@pytest.mark.parametrize("call, match", [
    (lambda p: p.set_kv(0, torch.tensor([1, 99]), rand_rows(2, 2, 8), rand_rows(2, 2, 8)), "slots"),
    (lambda p: p.set_kv(0, torch.tensor([1.0, 2.0]), rand_rows(2, 2, 8), rand_rows(2, 2, 8)), "dtype"),
    (lambda p: p.set_kv(0, torch.tensor([1, 2]), rand_rows(3, 2, 8), rand_rows(2, 2, 8)), "k must have shape"),
    (lambda p: p.set_kv(5, torch.tensor([1, 2]), rand_rows(2, 2, 8), rand_rows(2, 2, 8)), "layer"),
    (lambda p: p.set_kv(0, torch.tensor([1, 2], device="meta"), rand_rows(2, 2, 8), rand_rows(2, 2, 8)), "slots must be on"),
])
def test_device_pool_bad_input(call, match):
    pool = DeviceKVPool(mha(), 32, "cpu")
    with pytest.raises(ValueError, match=match):
        call(pool)
    assert pool.kv_data.abs().sum() == 0


def test_device_pool_bad_num_slots():
    with pytest.raises(ValueError, match="num_slots"):
        DeviceKVPool(mha(page_size=4), 30, "cpu")


def test_host_pool_sizing():
    dev = DeviceKVPool(mha(), 32, "cpu")
    assert HostKVPool(dev, hicache_ratio=2.5).num_slots == 80
    tok = mha().token_bytes
    host = HostKVPool(dev, hicache_ratio=0.5, hicache_size=100 * tok / 1e9)  # size overrides ratio
    assert host.num_slots == 100 // 4 * 4
    assert host.nbytes() == host.num_slots * tok
    assert not host.pin_memory and not host.kv_data.is_pinned()
    with pytest.raises(ValueError, match="hicache_ratio"):
        HostKVPool(dev, hicache_ratio=1.0)
    with pytest.raises(ValueError, match="hicache_size"):
        HostKVPool(dev, hicache_size=16 * tok / 1e9)
    with pytest.raises(ValueError, match="layout"):
        HostKVPool(dev, layout="token_first")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin_memory"):
            HostKVPool(dev, pin_memory=True)


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("spec_fn", [mha, mla])
def test_host_pool_layouts_read_write_and_pages(layout, spec_fn):
    spec = spec_fn(page_size=4)
    dev = DeviceKVPool(spec, 16, "cpu")
    host = HostKVPool(dev, hicache_ratio=2.0, layout=layout)
    slots = host.alloc(6)  # two pages
    assert slots.numel() == 8
    bufs = [rand_rows(8, spec.kv_heads, spec.head_dim, seed=b) for b in range(spec.num_buffers)]
    host.write_tokens(1, slots, *bufs)
    got = host.read_tokens(1, slots)
    assert all(torch.equal(g, b) for g, b in zip(got, bufs))
    assert all(g.abs().sum() == 0 for g in host.read_tokens(0, slots))  # other layer untouched
    view = host.paged_view()
    assert view.shape == (host.num_pages, 4, spec.num_layers, spec.num_buffers, spec.kv_heads, spec.head_dim)
    assert view.data_ptr() == host.kv_data.data_ptr()
    if layout == "layer_first":
        assert host.kv_data.shape[:3] == (spec.num_buffers, spec.num_layers, host.num_slots)
        with pytest.raises(ValueError, match="page_tensor"):
            host.page_tensor(1)
        return
    page = int(slots[4]) // 4
    pt = host.page_tensor(page)
    assert pt.is_contiguous() and pt.numel() == 4 * spec.token_bytes // spec.element_size
    # The page tensor holds exactly that page's rows, all layers.
    assert torch.equal(pt.float().abs().sum(), torch.stack(bufs, 1)[4:].float().abs().sum())
    if layout == "page_head":
        assert pt.shape[0] == spec.kv_heads
    host.free(slots)
    assert host.available_size() == (host.num_pages - 1) * 4


def test_host_pool_write_rejects_duplicates():
    dev = DeviceKVPool(mha(), 16, "cpu")
    host = HostKVPool(dev)
    with pytest.raises(ValueError, match="duplicate"):
        host.write_tokens(0, torch.tensor([5, 5]), rand_rows(2, 2, 8), rand_rows(2, 2, 8))
    with pytest.raises(ValueError, match="bufs"):
        host.write_tokens(0, torch.tensor([5, 6]), rand_rows(2, 2, 8))


@pytest.mark.gpu
def test_host_pool_pinned_on_cuda():
    dev = DeviceKVPool(mha(), 64, "cuda")
    host = HostKVPool(dev, hicache_ratio=3.0, layout="page_first")
    assert host.pin_memory and host.kv_data.is_pinned()
    assert dev.kv_data.is_cuda
    assert HostKVPool(dev, pin_memory=False).kv_data.is_pinned() is False


def test_alloc_pinned_names_the_bad_mode(monkeypatch):
    # both ways of picking the allocation are checked before any memory is touched
    with pytest.raises(ValueError, match=r"mode must be one of \('hugepage', 'register', 'torch'\) or None"):
        alloc_pinned(64, "huge")
    monkeypatch.setenv("SPARSEHI_HOST_ALLOC", "huge")
    with pytest.raises(ValueError, match="SPARSEHI_HOST_ALLOC must be one of"):
        alloc_pinned(64)
