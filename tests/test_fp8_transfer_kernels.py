"""The FP8 host pool's transfer kernels: whole-page backups quantised into host records
(with the device rows rounded in place), and token loads dequantised out of them; each
Triton kernel (interpreted on CPU, native on GPU) bitwise equal to its torch reference, and
both consistent with ``fp8_page_quantize``."""
from __future__ import annotations

import pytest
import torch

from hicache.kernels.fp8_page_store import ROUND_ONLY, fp8_page_store_reference, fp8_page_store_triton
from hicache.kernels.fp8_token_load import fp8_token_load_reference, fp8_token_load_triton
from hicache.kv_page_format import fp8_round_trip

DEVS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
L, B, H, D, PS = 3, 2, 2, 24, 4


def _device_view(n_slots: int, dtype, device, seed: int) -> torch.Tensor:
    """A layer-first device pool ``[B, L, slots, H, D]`` as the 6-D paged view."""
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(B, L, n_slots, H, D, generator=g) * torch.logspace(-3, 3, H)[:, None]).to(device, dtype)
    return kv.view(B, L, n_slots // PS, PS, H, D).permute(2, 3, 1, 0, 4, 5)


def _host(n_pages: int, device):
    values = torch.zeros(n_pages, L, B, PS, H, D, dtype=torch.uint8, device=device)
    scales = torch.zeros(n_pages, L, B, H, dtype=torch.float32, device=device)
    return values, scales


@pytest.mark.parametrize("device", DEVS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_page_store_matches_reference_and_rounds_the_device_rows(device, dtype):
    dev_ref = _device_view(40, dtype, device, seed=1)
    dev_tri = dev_ref.clone()
    dev_pages = torch.tensor([3, 7, 1, -1], device=device)  # the last has no device page: not stored
    host_pages = torch.tensor([4, -1, ROUND_ONLY, 0], device=device)
    out = {}
    for name, fn, dev in (("ref", fp8_page_store_reference, dev_ref), ("tri", fp8_page_store_triton, dev_tri)):
        v, s = _host(6, device)
        fn(dev, dev_pages, v, s, host_pages, 1, 2, round_device=True)
        out[name] = (v, s)
    assert torch.equal(out["ref"][0], out["tri"][0]) and torch.equal(out["ref"][1], out["tri"][1])
    assert torch.equal(dev_ref, dev_tri)
    v, s = out["tri"]
    assert not v[[0, 1, 2, 3, 5]].any() and not v[4, 0].any() and v[4, 1:].any()  # page 4, layers 1-2 only
    # the stored page and the rounded rows are fp8_page_quantize's rule applied to the page
    orig = _device_view(40, dtype, device, seed=1)
    ds = 3 * PS + torch.arange(PS, device=device)  # device page 3
    page = orig[ds // PS, ds % PS, 1:3].permute(1, 2, 0, 3, 4)[None]  # [1, L', B, T, H, D]
    rounded = fp8_round_trip(page.flatten(1, 2)).unflatten(1, (2, B))
    assert torch.equal(dev_tri[ds // PS, ds % PS, 1:3], rounded[0].permute(2, 0, 1, 3, 4))
    assert torch.equal((v[4, 1:3].view(torch.float8_e4m3fn).float() * s[4, 1:3, :, None, :, None]).to(dtype),
                       rounded[0])
    # ROUND_ONLY rounded device page 1 in place, wrote nothing to the host
    assert not torch.equal(dev_tri[1, :, 1:3], orig[1, :, 1:3])
    # untouched: the page whose host page is -1 (device page 7), every page no entry names
    # (device page 0 among them), layer 0
    for p in (7, 0, 2, 4, 5, 6, 8, 9):
        assert torch.equal(dev_tri[p], orig[p])
    assert torch.equal(dev_tri[:, :, 0], orig[:, :, 0])


@pytest.mark.parametrize("device", DEVS)
def test_token_load_returns_what_the_store_rounded(device):
    dev = _device_view(32, torch.bfloat16, device, seed=2)
    v, s = _host(4, device)
    fp8_page_store_triton(dev, torch.tensor([5, 0, 2], device=device), v, s, torch.tensor([1, 3, 0], device=device), 0, L, round_device=True)
    host_slots = torch.tensor([1 * PS + 2, 3 * PS + 0, -1, 0 * PS + 3, 99, 1 * PS + 3], device=device)
    target = torch.tensor([0, 1, 2, 3, 4, 31], device=device)
    outs = []
    for fn in (fp8_token_load_reference, fp8_token_load_triton):
        d = torch.zeros_like(dev)
        fn(v, s, d, host_slots, target, 0, L)
        outs.append(d)
    assert torch.equal(outs[0], outs[1])
    got = outs[1]
    src = torch.tensor([5 * PS + 2, 0 * PS + 0, 2 * PS + 3, 5 * PS + 3])  # device rows of those host tokens
    for t, sl in zip((0, 1, 3, 31), src):
        assert torch.equal(got[t // PS, t % PS], dev[sl // PS, sl % PS])  # the rounded rows, exactly
    for t in (2, 4):  # -1 and an out-of-range host slot: skipped
        assert not got[t // PS, t % PS].any()


def test_bad_arguments_are_named():
    dev = _device_view(8, torch.bfloat16, "cpu", seed=3)
    v, s = _host(2, "cpu")
    with pytest.raises(ValueError, match=r"dev_pages must be int32/int64 \[len\(host_pages\)\]"):
        fp8_page_store_triton(dev, torch.zeros(1, 3, dtype=torch.int64), v, s, torch.zeros(1, dtype=torch.int64), 0, L)
    with pytest.raises(ValueError, match=r"layers \[2, 2 \+ 2\) must lie in \[0, 3\)"):
        fp8_page_store_triton(dev, torch.zeros(1, dtype=torch.int64), v, s, torch.zeros(1, dtype=torch.int64), 2, 2)
    with pytest.raises(ValueError, match="host_slots and dev_slots must pair up"):
        fp8_token_load_triton(v, s, dev, torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), 0, L)
    with pytest.raises(ValueError, match=r"scales must be float32 \[pages, layers, buffers, heads\]"):
        fp8_token_load_triton(v, s[:, :1], dev, torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                              0, L)
