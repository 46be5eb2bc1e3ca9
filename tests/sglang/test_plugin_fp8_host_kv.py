"""FP8 host KV in the SGLang plugin (``--sparsehi-host-kv-dtype fp8_e4m3``) over SGLang
0.5.23's real pools, allocator and attention layer (CPU): the hooked decode equals the
runtime's ``sparse-hier`` decode with FP8 host KV for the same K/V, queries and budgets,
with pages completing during decode and missed pages read back from FP8 host records; the
host pool holds FP8 records and is sized by their bytes; mismatched page sizes are refused
at start-up naming both flags.
"""
from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.plugins", reason="SGLang is not installed (run scripts/setup_sglang_env.sh)")

import argparse  # noqa: E402

import torch  # noqa: E402

from hicache.kv_page_format import KVPageFormat, fp8_round_trip  # noqa: E402
from sparsehi.sglang_plugin import bridge_memory, options  # noqa: E402
from sgl_kit import HKV, HQ, PS, D, L, ReferenceHier, World, qkv, sparse_config  # noqa: E402

FP8 = "fp8_e4m3"


def _prefill(world: World, row: int, n: int, gen: torch.Generator):
    layers = qkv(n, gen)
    world.run(world.extend([row], [n]), layers)
    return [k for _, k, _ in layers], [v for _, _, v in layers]


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """``x [n * PS, HKV * D]`` (whole pages of one layer and buffer) as an FP8 page stores it."""
    pages = x.view(-1, 1, PS, HKV, D)
    return fp8_round_trip(pages).reshape(x.shape)


@pytest.mark.parametrize("chunked,lookahead", [(False, 0), (True, 0), (False, 1)])
def test_fp8_plugin_decode_equals_runtime_fp8_sparse_hier(chunked, lookahead):
    """Prompts ending mid-page, then 11 decode steps: pages complete during decode (and are
    quantised then), the one-page recent window lets them be selected and missed at once;
    every output equals the runtime's sparse-hier with FP8 host KV, and differs from the
    same plugin with host KV in the model's dtype (the rounding is really applied).
    ``chunked``: the plugin prefills each prompt in two chunks, the first ending mid-page
    (its whole pages are stored and rounded before the second chunk runs); the runtime
    prefills it whole. ``lookahead``: pages ranked after the top-k are loaded ahead (from
    FP8 records too)."""
    cfg = sparse_config(host_kv_dtype=FP8, lookahead_tokens=lookahead * PS)
    world, ref, plain = World(cfg, sgl_page=PS), ReferenceHier(cfg), World(sparse_config(), sgl_page=PS)
    gen = torch.Generator().manual_seed(3)
    lens = {1: 62, 2: 51}
    keys = {}
    for row, n in lens.items():
        layers = qkv(n, gen)
        if chunked:
            cut = 30
            world.run(world.extend([row], [cut], prompts=[n]), [(q[:cut], k[:cut], v[:cut]) for q, k, v in layers])
            world.run(world.extend([row], [n], prefix=[cut], prompts=[n]),
                      [(q[cut:], k[cut:], v[cut:]) for q, k, v in layers])
        else:
            world.run(world.extend([row], [n]), layers)
        plain.run(plain.extend([row], [n]), layers)
        ref.prefill(row, [k for _, k, _ in layers], [v for _, _, v in layers])
        keys[row] = [k for _, k, _ in layers]
    rows = [1, 2]
    differs = False
    for _ in range(11):
        for r in rows:
            lens[r] += 1
        layers = qkv(len(rows), gen)
        for i, r in enumerate(rows):
            keys[r] = [torch.cat([keys[r][j], layers[j][1][i:i + 1]]) for j in range(L)]
        got = world.run(world.decode(rows, [lens[r] for r in rows]), layers)
        want = ref.decode(rows, layers)
        bf16 = plain.run(plain.decode(rows, [lens[r] for r in rows]), layers)
        for i in range(L):
            torch.testing.assert_close(got[i], want[i], rtol=1e-5, atol=1e-5)
            differs |= not torch.allclose(got[i], bf16[i], rtol=1e-5, atol=1e-5)
    assert differs
    b = world.bridge
    assert b.host_pool.kv_format.quantized and b.registrations == 2
    st = b.coord.stats()
    assert st["misses"] > 0 and (st.get("ahead_loads", 0) > 0) == bool(lookahead)
    # every complete page's host record holds the FP8 rounding of its keys, the page being
    # filled has none yet, and only each row's newest page is on the GPU
    for r in rows:
        n = lens[r]
        full = n // PS * PS
        vids = world.req_pool.req_to_token[r, :n].long()
        for layer in range(L):
            host_k = b.host_pool.read_tokens(layer, vids[:full])[0].reshape(full, HKV * D)
            assert torch.equal(host_k, _rounded(keys[r][layer][:full]))
        assert (b.residency.v2p[vids[:full] // PS] == 0).all() and int(b.residency.v2p[vids[-1] // PS]) > 0
        assert n % PS and (b.host_pool.fp8_scales[int(vids[-1]) // PS] == 0).all()


def test_fp8_plugin_mla_decode_equals_runtime_fp8_sparse_hier():
    """SGLang's MLA pool: FP8 latent pages (one scale per page and layer) through the dsa
    adapter, equal to the runtime's sparse-hier with FP8 host KV over hicache's MLA pool."""
    cfg = sparse_config(backend="dsa", host_kv_dtype=FP8)
    world, ref = World(cfg, mla=True, sgl_page=PS), ReferenceHier(cfg, mla=True)
    gen = torch.Generator().manual_seed(6)
    layers = qkv(66, gen, mla=True)
    world.run(world.extend([1], [66]), layers)
    ref.prefill(1, [k for _, k, _ in layers], [v for _, _, v in layers])
    for n in range(67, 74):
        layers = qkv(1, gen, mla=True)
        got, want = world.run(world.decode([1], [n]), layers), ref.decode([1], layers)
        for i in range(L):
            torch.testing.assert_close(got[i], want[i], rtol=1e-5, atol=1e-5)
    assert world.bridge.host_pool.kv_format.quantized and world.bridge.coord.stats()["misses"] > 0


def test_fp8_prefix_hit_comes_back_rounded():
    """A request whose prompt starts with another's cached prefix, only in host memory: its
    pages come back dequantised (the FP8 rounding of the first request's keys) before its
    extend forward, and SGLang's own attention for it (a short request) reads them."""
    cfg = sparse_config(host_kv_dtype=FP8, min_sparse_prompt_len=40)
    world = World(cfg, sgl_page=PS)
    gen = torch.Generator().manual_seed(4)
    k_all, _ = _prefill(world, 1, 48, gen)
    world.run(world.decode([1], [49]), qkv(1, gen))  # registered: its prompt pages leave the GPU
    b = world.bridge
    vids = world.req_pool.req_to_token[1, :48].long()
    assert (b.residency.v2p[vids[:44] // PS] == 0).all()
    world.run(world.extend([2], [44 + 3], prefix=[44], share={2: 1}, prompts=[47]), qkv(3, gen))
    phys = b.residency.physical_slots(vids[:44], PS)
    assert (phys > 0).all()
    for layer in range(L):
        got = b.device_pool.get_key_buffer(layer)[phys].reshape(44, HKV * D)
        assert torch.equal(got, _rounded(k_all[layer][:44]))


def test_fp8_host_pool_is_sized_by_fp8_bytes(monkeypatch):
    """The host pool holds FP8 records (values and scales per page); the share of the
    machine's memory it may take holds as many more tokens as FP8 records are smaller."""
    fp8, auto = World(sparse_config(host_kv_dtype=FP8), sgl_page=PS).bridge, World(sparse_config(), sgl_page=PS).bridge
    fmt = KVPageFormat(fp8.device_pool.spec, FP8)
    assert fp8.host_pool.page_nbytes == fmt.page_bytes == L * 2 * PS * HKV * D + L * 2 * HKV * 4
    assert fp8.host_pool.nbytes() == fp8.host_pool.num_pages * fmt.page_bytes
    assert fp8.host_pool.num_slots == auto.host_pool.num_slots  # same ratio: the same slots
    assert auto.host_pool.nbytes() > 3 * fp8.host_pool.nbytes()  # float32 KV vs FP8 records
    cap = 1500 * fmt.page_bytes  # a machine whose memory share caps the pool below 16x SGLang's 512 tokens
    monkeypatch.setattr(bridge_memory, "host_memory_bytes", lambda: int(cap / bridge_memory.HOST_SHARE))
    capped = {name: World(sparse_config(host_kv_dtype=name, host_to_device_ratio=16.0), sgl_page=PS).bridge
              for name in (FP8, "auto")}
    for bridge in capped.values():  # at most the cap, and a page beside the virtual slots
        assert bridge.host_pool.nbytes() <= cap + bridge.host_pool.page_nbytes
    assert capped[FP8].virtual_tokens > 3 * capped["auto"].virtual_tokens


def test_fp8_needs_sglang_page_size_equal_to_the_sparse_page_size():
    """Refused at start-up (options) and when the bridge is built, naming both flags."""
    cfg = sparse_config(host_kv_dtype=FP8)
    with pytest.raises(ValueError, match=r"is 1 and --sparsehi-page-size is 4.*allowed: --page-size 4"):
        World(cfg, sgl_page=1)
    parser = argparse.ArgumentParser()
    options.add_arguments(parser)
    ns = parser.parse_args(["--sparsehi-algorithm", "quest", "--sparsehi-page-size", "16",
                            "--sparsehi-host-kv-dtype", FP8])
    with pytest.raises(ValueError, match=r"--page-size.*--sparsehi-page-size"):
        options.config_from_namespace(ns, sglang_page_size=64)
    assert options.config_from_namespace(ns, sglang_page_size=16).host_kv_dtype == FP8
    ns = parser.parse_args(["--sparsehi-algorithm", "quest", "--sparsehi-host-kv-dtype", "fp16"])
    with pytest.raises(ValueError, match=r"--sparsehi-host-kv-dtype='fp16' is invalid: one of \('auto', 'fp8_e4m3'\)"):
        options.config_from_namespace(ns)
    auto = sparse_config()
    assert World(auto, sgl_page=1).bridge.host_pool.kv_format.host_kv_dtype == "auto"  # any page size without FP8
