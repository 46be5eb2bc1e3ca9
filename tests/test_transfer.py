"""KVTransferEngine and the kv_copy kernel: bit-exact round trips for every layout × io
backend × MHA/MLA, padding, per-layer calls, handles, and rejection of bad input.

On CPU the ``kernel`` backend runs the Triton kernel under TRITON_INTERPRET=1."""
import pytest
import torch

try:  # the GPU box may lack hypothesis; the property test then is skipped there only
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    given = settings = st = None

from hicache.device_pool import DeviceKVPool
from hicache.config import check_layout_io
from hicache.host_pool import HOST_LAYOUTS, HostKVPool
from hicache.kernels.kv_copy import KVCopyConfig, kv_copy, kv_copy_reference, kv_copy_triton
from hicache.kv_spec import KVCacheSpec
from hicache.transfer import IO_BACKENDS, KVTransferEngine

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _allowed(layout, backend):
    try:
        check_layout_io(layout, backend)
        return True
    except ValueError:
        return False


# every (layout, io backend) pair the one rule (hicache.config.check_layout_io) admits
PAIRS = [(lay, io) for lay in HOST_LAYOUTS for io in IO_BACKENDS if _allowed(lay, io)]


def make(attention, layout, backend, page_size=4, layers=2, dev_slots=32, device="cpu", seed=0):
    # Small odd-sized rows: MHA 2 heads × 8, MLA 1 × 12 (24 B rows: not a power of two).
    spec = (KVCacheSpec("mha", layers, 2, 8, torch.bfloat16, page_size) if attention == "mha"
            else KVCacheSpec("mla", layers, 1, 12, torch.bfloat16, page_size))
    dev = DeviceKVPool(spec, dev_slots, device)
    host = HostKVPool(dev, hicache_ratio=2.0, layout=layout)
    g = torch.Generator().manual_seed(seed)
    # Random bit patterns (viewed as int16) so any misplaced byte shows up.
    dev.kv_data.view(torch.int16).copy_(torch.randint(-2**15, 2**15, dev.kv_data.shape, generator=g, dtype=torch.int16))
    host.kv_data.view(torch.int16).copy_(torch.randint(-2**15, 2**15, host.kv_data.shape, generator=g, dtype=torch.int16))
    return dev, host, KVTransferEngine(dev, host, backend)


def bits(t):
    return t.view(torch.int16).cpu()


def host_rows(host, layer, slots):
    """[N, B, H, D] rows of the host pool, read through the host pool's own API."""
    return torch.stack(host.read_tokens(layer, slots), 1)


def dev_rows(dev, layer, slots):
    return torch.stack([b[slots.to(dev.device)] for b in dev.layer_buffers(layer)], 1).cpu()


def random_slots(n, num_slots, page_size, granularity, g):
    """Distinct slots avoiding page 0: whole pages (in order) or single tokens."""
    if granularity == "page":
        pages = torch.randperm(num_slots // page_size - 1, generator=g)[: n // page_size] + 1
        return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    return torch.randperm(num_slots - page_size, generator=g)[:n] + page_size


@pytest.mark.parametrize("granularity", ["token", "page"])
@pytest.mark.parametrize("layout,backend", PAIRS)
@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_round_trip_bit_exact(attention, layout, backend, granularity):
    dev, host, eng = make(attention, layout, backend)
    assert eng.uses_triton == (backend == "kernel")  # CPU: the kernel runs interpreted
    g = torch.Generator().manual_seed(1)
    n = 12
    d_src = random_slots(n, dev.num_slots, 4, granularity, g)
    h_dst = random_slots(n, host.num_slots, 4, granularity, g)
    expected = torch.stack([dev_rows(dev, l, d_src) for l in range(2)])
    host_before = host.paged_view().clone()  # [pages, page_size, L, B, H, D]
    eng.backup(d_src, h_dst).wait()
    for layer in range(2):
        assert torch.equal(bits(host_rows(host, layer, h_dst)), bits(expected[layer]))
    # Nothing else in the host pool changed.
    untouched = torch.ones(host.num_slots, dtype=torch.bool)
    untouched[h_dst] = False
    keep = torch.nonzero(untouched).squeeze(1)
    after = host.paged_view()
    assert torch.equal(bits(host_before[keep // 4, keep % 4]), bits(after[keep // 4, keep % 4]))

    # Load back into different device slots; the rows must come back bit-exact.
    d_dst = random_slots(n, dev.num_slots, 4, granularity, g)
    dev_before = dev.kv_data.clone()
    handle = eng.load(h_dst, d_dst)
    for layer in range(2):
        handle.wait_layer(layer)
        assert torch.equal(bits(dev_rows(dev, layer, d_dst)), bits(expected[layer]))
    assert handle.done()
    others = torch.ones(dev.num_slots, dtype=torch.bool)
    others[d_dst] = False
    assert torch.equal(bits(dev.kv_data[:, :, others]), bits(dev_before[:, :, others]))


@pytest.mark.parametrize("layout,backend", [p for p in PAIRS if p[0] in ("layer_first", "page_head")])
def test_layer_subset_and_padding(layout, backend):
    dev, host, eng = make("mha", layout, backend, page_size=1, layers=3)
    h = torch.tensor([3, -1, 40, 7, -1], dtype=torch.int32)
    d = torch.tensor([9, 10, -1, 2, 11], dtype=torch.int32)
    before = dev.kv_data.clone()
    handle = eng.load(h, d, layers=[2, 0], allow_padding=True)
    with pytest.raises(ValueError, match="layer"):
        handle.wait_layer(1)
    handle.wait()
    after = dev.kv_data
    # Only rows with both sides real move, and only in the selected layers.
    for layer in (0, 2):
        assert torch.equal(bits(dev_rows(dev, layer, torch.tensor([9, 2]))), bits(host_rows(host, layer, torch.tensor([3, 7]))))
    assert torch.equal(bits(after[:, 1]), bits(before[:, 1]))
    for slot in (10, 11):
        assert torch.equal(bits(after[:, :, slot]), bits(before[:, :, slot]))
    changed = (bits(after) != bits(before)).flatten(3).any(-1)  # [B, L, slots]
    assert set(torch.nonzero(changed.any(0).any(0)).flatten().tolist()) <= {9, 2}


@pytest.mark.parametrize("backend", IO_BACKENDS)
@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_layer_now_hot_path(attention, backend):
    # page-contiguous host layout: page_first (kernel) / page_first_direct (direct)
    dev, host, eng = make(attention, "page_first" if backend == "kernel" else "page_first_direct", backend, page_size=1)
    h = torch.tensor([5, -1, 17, 33])
    d = torch.tensor([1, 2, -1, 4])
    before = dev.kv_data.clone()
    eng.load_layer_now(1, h, d)
    assert torch.equal(bits(dev_rows(dev, 1, torch.tensor([1, 4]))), bits(host_rows(host, 1, torch.tensor([5, 33]))))
    assert torch.equal(bits(dev.kv_data[:, 0]), bits(before[:, 0]))
    assert torch.equal(bits(dev.kv_data[:, 1, 2]), bits(before[:, 1, 2]))
    eng.backup_layer_now(0, torch.tensor([6, 7, -1]), torch.tensor([50, -1, 51]))
    assert torch.equal(bits(host_rows(host, 0, torch.tensor([50]))), bits(dev_rows(dev, 0, torch.tensor([6]))))


@pytest.mark.parametrize("backend", IO_BACKENDS)
def test_sorted_index_order_moves_the_same_pairs(backend):
    dev, host, _ = make("mla", "page_head" if backend == "kernel" else "layer_first", backend, page_size=2)
    eng = KVTransferEngine(dev, host, backend, sort_threshold=1)
    h = torch.tensor([40, 3, -1, 17, 9])
    d = torch.tensor([2, 30, 5, 7, 11])
    before = dev.kv_data.clone()
    eng.load(h, d, allow_padding=True).wait()
    assert torch.equal(bits(dev_rows(dev, 1, torch.tensor([2, 30, 7, 11]))),
                       bits(host_rows(host, 1, torch.tensor([40, 3, 17, 9]))))
    assert torch.equal(bits(dev.kv_data[:, :, 5]), bits(before[:, :, 5]))
    eng.backup(torch.tensor([4, 8]), torch.tensor([60, 1])).wait()
    assert torch.equal(bits(host_rows(host, 0, torch.tensor([60, 1]))), bits(dev_rows(dev, 0, torch.tensor([4, 8]))))


def _bad_calls():
    i64 = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return [
        ("out-of-range host", lambda e: e.load(i64(1, 999), i64(1, 2)), "host_slots must be in"),
        ("out-of-range device", lambda e: e.load(i64(1, 2), i64(1, 32)), "device_slots must be in"),
        ("negative without padding", lambda e: e.load(i64(1, -1), i64(1, 2)), "host_slots must be in"),
        ("duplicate load target", lambda e: e.load(i64(1, 2), i64(3, 3)), "device_slots contains duplicate"),
        ("duplicate backup target", lambda e: e.backup(i64(1, 2), i64(5, 5)), "host_slots contains duplicate"),
        ("length mismatch", lambda e: e.load(i64(1, 2, 3), i64(1, 2)), "equal length"),
        ("float slots", lambda e: e.load(torch.tensor([1.0]), i64(1)), "host_slots must have dtype"),
        ("int16 slots", lambda e: e.backup(i64(1), torch.tensor([1], dtype=torch.int16)), "host_slots must have dtype"),
        ("2-D slots", lambda e: e.load(i64(1, 2).view(1, 2), i64(1, 2)), "1-D"),
        ("wrong device", lambda e: e.load(torch.tensor([1], device="meta"), i64(1)), "host_slots must be on"),
        ("hot path wrong dtype", lambda e: e.load_layer_now(0, torch.tensor([1.0]), i64(1)), "dtype"),
        ("hot path length", lambda e: e.backup_layer_now(0, i64(1, 2), i64(1)), "equal length"),
        ("bad layer", lambda e: e.load(i64(1), i64(1), layers=[0, 5]), "layers"),
        ("repeated layer", lambda e: e.load(i64(1), i64(1), layers=[1, 1]), "layers"),
        ("bad hot layer", lambda e: e.load_layer_now(2, i64(1), i64(1)), "layers"),
        ("bad sort threshold", lambda e: KVTransferEngine(e.device_pool, e.host_pool, sort_threshold=0), "sort_threshold"),
    ]


@pytest.mark.parametrize("backend", IO_BACKENDS)
@pytest.mark.parametrize("name, call, match", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_input_raises_before_touching_kv(name, call, match, backend):
    dev, host, eng = make("mha", "layer_first", backend)
    dev_before, host_before = dev.kv_data.clone(), host.kv_data.clone()
    with pytest.raises(ValueError, match=match):
        call(eng)
    assert torch.equal(bits(dev.kv_data), bits(dev_before))
    assert torch.equal(bits(host.kv_data), bits(host_before))


def test_engine_construction_errors():
    dev, host, _ = make("mha", "layer_first", "direct")
    with pytest.raises(ValueError, match="io_backend"):
        KVTransferEngine(dev, host, "mmap")
    other = DeviceKVPool(KVCacheSpec("mla", 2, 1, 12, torch.bfloat16, 4), 32, "cpu")
    with pytest.raises(ValueError, match="spec"):
        KVTransferEngine(other, host)


def _views(layout, heads, dim, page_size, g):
    spec = KVCacheSpec("mha", 2, heads, dim, torch.float16, page_size)
    dev = DeviceKVPool(spec, 8 * page_size, "cpu")
    host = HostKVPool(dev, hicache_ratio=2.0, layout=layout)
    host.kv_data.view(torch.int16).copy_(torch.randint(-2**15, 2**15, host.kv_data.shape, generator=g, dtype=torch.int16))
    return host.paged_view(), dev.paged_view(), dev


@pytest.mark.parametrize("cfg", [KVCopyConfig(flat=False), KVCopyConfig(flat=True), KVCopyConfig(flat=False, rows=2)])
@pytest.mark.parametrize("layout, heads, dim", [("layer_first", 2, 12), ("page_head", 3, 4), ("page_first", 1, 6)])
def test_kv_copy_triton_matches_reference(layout, heads, dim, cfg):
    g = torch.Generator().manual_seed(3)
    src, dst, dev = _views(layout, heads, dim, 2, g)
    s = torch.tensor([1, 30, -1, 5, 7, 1000, 12])  # -1 and 1000 (out of range) are skipped
    d = torch.tensor([3, 2, 4, -1, 15, 6, 9])
    ref = torch.zeros_like(dev.kv_data)
    kv_copy_reference(src, ref.permute(2, 1, 0, 3, 4).unsqueeze(1), s, d, 1, 1)
    kv_copy_triton(src, dst, s, d, 1, 1, cfg)
    assert torch.equal(bits(dev.kv_data), bits(ref))
    assert bits(ref).ne(0).any()
    kv_copy(src, dst, s, d)  # dispatcher: reference on CPU, all layers
    assert torch.equal(bits(dev.kv_data[:, 0, [3, 2, 15]]), bits(src[torch.tensor([0, 15, 3]), torch.tensor([1, 0, 1]), 0].permute(1, 0, 2, 3)))


def test_kv_copy_rejects_mismatched_views():
    g = torch.Generator().manual_seed(0)
    src, dst, _ = _views("layer_first", 2, 8, 2, g)
    other = DeviceKVPool(KVCacheSpec("mha", 2, 2, 4, torch.float16, 2), 16, "cpu").paged_view()
    idx = torch.tensor([1])
    with pytest.raises(ValueError, match="agree"):
        kv_copy_triton(src, other, idx, idx)
    with pytest.raises(ValueError, match="num_layers"):
        kv_copy_triton(src, dst, idx, idx, 1, 2)
    with pytest.raises(ValueError, match="equal length"):
        kv_copy_triton(src, dst, idx, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="dst_slots must have dtype"):
        kv_copy_triton(src, dst, idx, idx.float())


def _property_backup_then_load_is_identity(data, backend, layout, page_size):
    dev, host, eng = make("mha", layout, backend, page_size=page_size, dev_slots=8 * page_size, layers=1)
    n = data.draw(st.integers(1, 6))
    d_src = data.draw(st.lists(st.integers(page_size, dev.num_slots - 1), min_size=n, max_size=n, unique=True))
    h_dst = data.draw(st.lists(st.integers(0, host.num_slots - 1), min_size=n, max_size=n, unique=True))
    d_dst = data.draw(st.permutations(d_src))
    d_src, h_dst, d_dst = (torch.tensor(x) for x in (d_src, h_dst, d_dst))
    expected = dev_rows(dev, 0, d_src)
    eng.backup(d_src, h_dst).wait()
    eng.load(h_dst, d_dst).wait()
    assert torch.equal(bits(dev_rows(dev, 0, d_dst)), bits(expected))


if given is not None:
    test_property_backup_then_load_is_identity = settings(max_examples=12, deadline=None)(given(
        data=st.data(), pair=st.sampled_from(PAIRS), page_size=st.sampled_from([1, 2, 4]))(
        lambda data, pair, page_size: _property_backup_then_load_is_identity(data, pair[1], pair[0], page_size)))


# --- GPU: same contracts on CUDA with a pinned host pool --------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("layout,backend", PAIRS)
@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_gpu_round_trip(attention, layout, backend):
    dev, host, eng = make(attention, layout, backend, page_size=16, layers=3, dev_slots=4096, device="cuda")
    assert host.kv_data.is_pinned()
    g = torch.Generator().manual_seed(5)
    for granularity in ("token", "page"):
        d_src = random_slots(512, dev.num_slots, 16, granularity, g)
        h_dst = random_slots(512, host.num_slots, 16, granularity, g)
        expected = torch.stack([dev_rows(dev, l, d_src) for l in range(3)])
        eng.backup(d_src.cuda(), h_dst).synchronize()
        d_dst = random_slots(512, dev.num_slots, 16, granularity, g)
        h = eng.load(h_dst, d_dst.cuda())
        for layer in range(3):
            h.wait_layer(layer)
            got = dev_rows(dev, layer, d_dst)
            assert torch.equal(bits(got), bits(expected[layer]))
        torch.cuda.synchronize()
        assert h.done()
        # Hot path on the current stream, with padding.
        pad = d_dst.clone().cuda()
        pad[::3] = -1
        dev.kv_data.zero_()
        eng.load_layer_now(1, h_dst.cuda(), pad)
        torch.cuda.synchronize()
        keep = pad.cpu() >= 0
        assert torch.equal(bits(dev_rows(dev, 1, d_dst[keep])), bits(expected[1][keep]))
        assert bits(dev_rows(dev, 1, d_dst[~keep])).eq(0).all()


@pytest.mark.gpu
def test_gpu_per_layer_events_are_independent():
    dev, host, eng = make("mha", "layer_first", "kernel", page_size=1, layers=4, dev_slots=1 << 16, device="cuda")
    h = torch.randperm(host.num_slots)[: 1 << 15]
    d = torch.randperm(dev.num_slots)[: 1 << 15].cuda()
    handle = eng.load(h, d)
    assert set(handle.events) == {0, 1, 2, 3} and len({id(e) for e in handle.events.values()}) == 4
    handle.wait_layer(0)
    got0 = dev_rows(dev, 0, d)  # ordered after layer 0 only
    assert torch.equal(bits(got0), bits(host_rows(host, 0, h)))
    handle.synchronize()
    assert handle.done()


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["backup", "load"])
def test_gpu_caller_slot_lists_outlive_a_slow_engine_stream(direction):
    """A slot list the caller frees right after ``backup`` / ``load`` returns must not be
    reused by its next allocation while the engine stream still reads it: lists long enough
    to be reordered by host slot (page size 1, small rows) go through a gather on the engine
    stream, delayed here by a sleep kernel queued on that stream first."""
    dev, host, eng = make("mla", "layer_first", "kernel", page_size=1, layers=2, dev_slots=1 << 14, device="cuda")
    assert eng.sort_threshold is not None
    n = max(eng.sort_threshold, 8192)
    g = torch.Generator().manual_seed(11)
    d_slots = torch.randperm(dev.num_slots - 1, generator=g)[:n] + 1
    h_slots = torch.randperm(host.num_slots - 1, generator=g)[:n] + 1
    before_host = [host_rows(host, layer, h_slots) for layer in range(2)]
    before_dev = [dev_rows(dev, layer, d_slots) for layer in range(2)]
    with torch.cuda.stream(eng.stream):
        torch.cuda._sleep(int(2e8))  # holds the engine stream for a while (~0.1 s)
    if direction == "backup":
        handle = eng.backup(d_slots.cuda(), h_slots)  # the device list is a temporary
    else:
        handle = eng.load(h_slots, d_slots.cuda())
    junk = torch.full((n,), 3, dtype=torch.int64, device="cuda")  # the caller's next allocation
    handle.synchronize()
    torch.cuda.synchronize()
    del junk
    for layer in range(2):
        if direction == "backup":
            assert torch.equal(bits(host_rows(host, layer, h_slots)), bits(before_dev[layer]))
        else:
            assert torch.equal(bits(dev_rows(dev, layer, d_slots)), bits(before_host[layer]))


def test_layouts_take_only_their_io_backends_everywhere():
    """One rule (hicache.config.check_layout_io) for the engine, HiCacheConfig and the CLI:
    page_first / page_head need the kernel backend, page_first_direct the direct one."""
    from hicache.config import HiCacheConfig
    from sparsehi.cli import main

    for layout, backend in [(lay, io) for lay in HOST_LAYOUTS for io in IO_BACKENDS if (lay, io) not in PAIRS]:
        with pytest.raises(ValueError, match=f"host_pool.layout={layout} cannot be used with io_backend={backend}"):
            make("mha", layout, backend)
        with pytest.raises(ValueError, match="--hicache-mem-layout"):
            HiCacheConfig(hicache_mem_layout=layout, hicache_io_backend=backend)
        with pytest.raises(SystemExit) as e:
            main(["run", "--host-layout", layout, "--io-backend", backend, "--context", "256"])
        assert e.value.code == 2
    assert ("page_first", "direct") not in PAIRS and ("layer_first", "direct") in PAIRS
