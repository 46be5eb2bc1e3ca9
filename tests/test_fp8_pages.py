"""FP8 KV pages: the quantise and dequantise kernels against their torch references (Triton
interpreted on CPU at small sizes, native on GPU), the power-of-two scale rule, the page
record of ``KVPageFormat`` and its errors."""
from __future__ import annotations

import pytest
import torch

from hicache.kernels.fp8_page_dequantize import fp8_page_dequantize_reference, fp8_page_dequantize_triton
from hicache.kernels.fp8_page_quantize import (E4M3_MAX, fp8_page_quantize_reference, fp8_page_quantize_triton,
                                               power_of_two_exponent_reference, power_of_two_reference)
from hicache.kv_page_format import HOST_KV_DTYPES, KVPageFormat, check_host_kv_dtype, fp8_round_trip
from hicache.kv_spec import KVCacheSpec

DEVS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _pages(shape, dtype, device, seed=0, spread=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if spread:  # heads and pages of very different magnitudes, one all-zero block
        x = x * torch.logspace(-6, 4, shape[0] * shape[1] * shape[3]).reshape(
            shape[0], shape[1], 1, shape[3], 1)
        x[0, 0, :, 0] = 0.0
    return x.to(device, dtype)


def _quantize(fn, x):
    q = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    s = torch.empty((x.shape[0], x.shape[1], x.shape[3]), dtype=torch.float32, device=x.device)
    fn(x, q, s)
    return q, s


@pytest.mark.parametrize("device", DEVS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_and_dequantize_match_their_references_bitwise(device, dtype):
    shape = (3, 4, 5, 2, 24) if device == "cpu" else (64, 16, 64, 8, 128)  # T and D not powers of 2 on CPU
    x = _pages(shape, dtype, device)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    q, s = _quantize(fp8_page_quantize_triton, x)
    q_ref, s_ref = _quantize(fp8_page_quantize_reference, x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q, q_ref)
    out = torch.empty_like(x)
    fp8_page_dequantize_triton(q, s, out)
    out_ref = torch.empty_like(x)
    fp8_page_dequantize_reference(q_ref, s_ref, out_ref)
    assert torch.equal(out, out_ref)


@pytest.mark.parametrize("device", DEVS)
def test_round_trip_error_and_idempotence(device):
    x = _pages((4, 2, 16, 2, 32), torch.float32, device, seed=3)
    y = fp8_round_trip(x)
    big = x.abs() >= 2.0 ** -6 * fp8_scale(x)  # above E4M3's subnormal range at the page's scale
    rel = ((y - x).abs() / x.abs().clamp_min(1e-30))[big]
    assert rel.max().item() <= 2.0 ** -4
    assert torch.equal(fp8_round_trip(y), y)  # FP8-rounded values are stored exactly
    assert torch.equal(y[0, 0, :, 0], torch.zeros_like(y[0, 0, :, 0]))


def fp8_scale(x: torch.Tensor) -> torch.Tensor:
    """The per (page, group, head) scale broadcast back to ``x``'s shape."""
    k = power_of_two_exponent_reference(x.float().abs().amax(dim=(2, 4)))
    return power_of_two_reference(k)[:, :, None, :, None].expand_as(x)


def test_scale_rule_is_the_least_power_of_two_that_fits():
    g = torch.Generator().manual_seed(5)
    amax = torch.cat([torch.rand(2000, generator=g) * 10.0 ** torch.randint(-20, 20, (2000,), generator=g),
                      torch.tensor([448.0, 448.0001, 224.0, 1.75, 1.0, 3.5 * 2 ** 100])])
    k = power_of_two_exponent_reference(amax)
    scale = power_of_two_reference(k).double()
    assert torch.all(amax.double() <= E4M3_MAX * scale)
    assert torch.all(amax.double() > E4M3_MAX * scale / 2)  # one binade less would saturate
    assert power_of_two_reference(power_of_two_exponent_reference(torch.zeros(1))).item() == 1.0
    assert power_of_two_exponent_reference(torch.tensor([448.0])).item() == 0
    assert power_of_two_exponent_reference(torch.tensor([449.0])).item() == 1


def test_strided_views_are_read_and_written_in_place():
    x = _pages((2, 6, 8, 3, 16), torch.bfloat16, "cpu", seed=7)[:, ::2]  # every other group
    big_q = torch.zeros(2, 6, 8, 3, 16, dtype=torch.uint8)
    q = big_q[:, 1::2]
    s = torch.zeros(2, 3, 3)
    fp8_page_quantize_triton(x, q, s)
    q_ref, s_ref = _quantize(fp8_page_quantize_reference, x.contiguous())
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    assert not big_q[:, ::2].any()  # groups outside the view untouched


@pytest.mark.parametrize("device", DEVS)
def test_page_records_carry_their_scales(device):
    spec = KVCacheSpec(attention="mha", num_layers=3, kv_heads=2, head_dim=16, dtype=torch.bfloat16, page_size=4)
    fmt = KVPageFormat(spec, "fp8_e4m3")
    assert fmt.page_bytes == 3 * 2 * 4 * 2 * 16 + 3 * 2 * 2 * 4
    assert fmt.page_bytes * 2 == KVPageFormat(spec).page_bytes + 2 * fmt.scale_bytes  # half the bytes, plus scales
    pages = _pages((5, 6, 4, 2, 16), torch.bfloat16, device, seed=9).unflatten(1, (3, 2))
    records = torch.zeros(5, fmt.page_bytes, dtype=torch.uint8, device=device)
    fmt.quantize_into(pages, records)
    out = torch.empty_like(pages)
    fmt.dequantize(records.clone(), out)  # a copy of the bytes alone (what L3 returns) suffices
    assert torch.equal(out.flatten(1, 2), fp8_round_trip(pages.flatten(1, 2)))


def test_formats_name_themselves_and_refuse_bad_input():
    spec = KVCacheSpec(attention="mla", num_layers=2, kv_heads=1, head_dim=80, dtype=torch.bfloat16, page_size=1,
                       kv_lora_rank=64)
    assert KVPageFormat(spec).namespace_tag == "kv-bfloat16"
    assert KVPageFormat(spec, "fp8_e4m3").namespace_tag == "kv-fp8e4m3-p2s"
    assert HOST_KV_DTYPES == ("auto", "fp8_e4m3")
    with pytest.raises(ValueError, match=r"host_kv_dtype must be one of \('auto', 'fp8_e4m3'\), got 'fp8'"):
        KVPageFormat(spec, "fp8")
    with pytest.raises(ValueError, match=r"--host-kv-dtype must be one of"):
        check_host_kv_dtype("int4", "--host-kv-dtype")
    with pytest.raises(ValueError, match="needs a model KV dtype"):
        KVPageFormat(KVCacheSpec(attention="mha", num_layers=1, kv_heads=1, head_dim=8, dtype=torch.uint8,
                                 page_size=4), "fp8_e4m3")
    with pytest.raises(ValueError, match="4-byte words"):
        KVPageFormat(KVCacheSpec(attention="mla", num_layers=1, kv_heads=1, head_dim=3, dtype=torch.bfloat16,
                                 page_size=1, kv_lora_rank=2), "fp8_e4m3")
    with pytest.raises(ValueError, match="split applies to FP8 pages"):
        KVPageFormat(spec).split(torch.zeros(1, 10, dtype=torch.uint8))
    fmt = KVPageFormat(spec, "fp8_e4m3")
    with pytest.raises(ValueError, match=r"records must be uint8 \[P, 168\]"):
        fmt.split(torch.zeros(1, 167, dtype=torch.uint8))
    x = torch.zeros(1, 2, 3, 1, 8)
    with pytest.raises(ValueError, match=r"x must be a 5-D \[P, G, T, H, D\]"):
        fp8_page_quantize_triton(x[0], torch.zeros(2, 3, 1, 8, dtype=torch.uint8), torch.zeros(2, 1))
    with pytest.raises(ValueError, match=r"scales must be float32 \[P, G, H\]"):
        fp8_page_quantize_triton(x, torch.zeros(1, 2, 3, 1, 8, dtype=torch.uint8), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="out must be"):
        fp8_page_dequantize_triton(torch.zeros(1, 2, 3, 1, 8, dtype=torch.uint8), torch.ones(1, 2, 1),
                                   torch.zeros(1, 2, 3, 1, 8, dtype=torch.int32))


@pytest.mark.parametrize("device", DEVS)
def test_rounding_at_every_e4m3_midpoint_is_nearest_even(device):
    """Every finite positive E4M3 value, the midpoints between neighbours (ties) and the
    float32 values one ulp either side, in a page whose amax is 448 (scale 1): the kernel's
    encoding equals torch's round-to-nearest-even cast, both signs."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1), grid,
                      torch.tensor([2.0 ** -10, 2.0 ** -9 * 0.5, 1e-30, 0.0])])
    vals = torch.cat([near, -near, torch.tensor([448.0])])
    n = -(-vals.numel() // 32) * 32
    x = torch.full((n,), 448.0)
    x[:vals.numel()] = vals
    x = x.reshape(1, 1, n // 32, 1, 32).to(device)
    q, s = _quantize(fp8_page_quantize_triton, x)
    assert s.item() == 1.0
    assert torch.equal(q, x.to(torch.float8_e4m3fn).view(torch.uint8))
