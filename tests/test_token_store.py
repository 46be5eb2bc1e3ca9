"""KVTransferEngine.backup_tokens_from and the token_store kernel: rows written to host
straight from the caller's tensors are bit for bit what staging them in the device pool
(``index_copy_``) and backing the staged slots up (``backup_layer_now``) writes, for every
layout x io backend x MHA/MLA, with padding, strided sources and a dtype cast; bad input is
rejected before anything moves. On CPU the ``kernel`` backend runs the Triton kernel under
TRITON_INTERPRET=1; the gpu-marked params run it natively into pinned host memory."""
import pytest
import torch

from hicache.kernels.token_store import token_store_reference, token_store_triton
from test_transfer import PAIRS, bits, make

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _sources(attention: str, n: int, device: str, dtype: torch.dtype, seed: int):
    """k, v (MHA) or kv (MLA) ``[n, heads, dim]``; k strided (a slice of a wider tensor)."""
    heads, dim = (2, 8) if attention == "mha" else (1, 12)
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(n, heads + 1, dim, generator=g).to(device=device, dtype=dtype)
    k = wide[:, 1:]  # row stride (heads + 1) * dim
    if attention == "mla":
        return (k,)
    return k, torch.randn(n, heads, dim, generator=g).to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout,backend", PAIRS)
@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_backup_from_tensors_matches_staging_in_the_pool(attention, layout, backend, device):
    layer, n = 1, 6
    host_slots = torch.tensor([9, -1, 40, 3, 63, -1], device=device)  # two padding rows
    stage = torch.tensor([2, 5, 6, 11, 20, 21], device=device)  # free device slots to stage in
    for dtype in (torch.bfloat16, torch.float32):  # float32 sources are cast to the bf16 pool
        srcs = _sources(attention, n, device, dtype, seed=3)
        dev_a, host_a, eng_a = make(attention, layout, backend, device=device)
        dev_b, host_b, eng_b = make(attention, layout, backend, device=device)
        for buf, x in zip(dev_a.layer_buffers(layer), srcs):
            buf.index_copy_(0, stage, x.to(buf.dtype))
        eng_a.backup_layer_now(layer, stage, host_slots)
        eng_b.backup_tokens_from(layer, host_slots, *srcs)
        if device == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(bits(host_b.kv_data), bits(host_a.kv_data)), dtype
        changed = bits(host_b.kv_data) != bits(make(attention, layout, backend, device=device)[1].kv_data)
        assert changed.any(), "the rows were written"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["layer_first", "page_head", "page_first"])
def test_token_store_kernel_matches_reference(layout, device):
    _, host_a, _ = make("mha", layout, "kernel", page_size=2,
                        device=device)
    _, host_b, _ = make("mha", layout, "kernel", page_size=2, device=device)
    srcs = _sources("mha", 5, device, torch.bfloat16, seed=8)
    slots = torch.tensor([0, 17, -1, 1000, 31], device=device)  # padding and out of range: skipped
    token_store_reference(host_a.paged_view(), 0, slots, srcs)
    token_store_triton(host_b.paged_view(), 0, slots, srcs)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(bits(host_a.kv_data), bits(host_b.kv_data))


@pytest.mark.parametrize("backend", ["kernel", "direct"])
def test_bad_sources_are_rejected_before_anything_moves(backend):
    dev, host, eng = make("mha", "layer_first", backend)
    before = host.kv_data.clone()
    k, v = _sources("mha", 3, "cpu", torch.bfloat16, seed=1)
    slots = torch.tensor([1, 2, 3])
    for call, match in [
        (lambda: eng.backup_tokens_from(1, slots, k), "sources must be 2"),
        (lambda: eng.backup_tokens_from(1, slots, k, v[:2]), r"sources\[1\] must be \[N, heads, dim\]"),
        (lambda: eng.backup_tokens_from(5, slots, k, v), "layers"),
        (lambda: eng.backup_tokens_from(1, slots.float(), k, v), "host_slots"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
    assert torch.equal(bits(host.kv_data), bits(before))
    with pytest.raises(ValueError, match="dtype"):
        token_store_reference(host.paged_view(), 0, slots, (k.float(), v))
