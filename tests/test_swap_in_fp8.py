"""The FP8 swap-in copy: misses of one layer from FP8 host pages into the device buffer,
dequantised; the Triton kernel (interpreted on CPU, native on GPU) equals its torch
reference bitwise and writes exactly the dequantised pages, nothing else."""
from __future__ import annotations

import pytest
import torch

from hicache.kernels.fp8_page_quantize import fp8_page_quantize_reference
from sparsehi.kernels.swap_in_fp8 import swap_in_fp8_copy_reference, swap_in_fp8_copy_triton

DEVS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
L, NB, PS, H, D = 3, 2, 4, 2, 24


def _host(n_pages: int, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_pages, L * NB, PS, H, D, generator=g) * torch.logspace(-2, 2, H)[:, None]
    q = torch.empty(x.shape, dtype=torch.uint8)
    s = torch.empty(n_pages, L * NB, H)
    fp8_page_quantize_reference(x, q, s)
    return q.view(n_pages, L, NB, PS, H, D).to(device), s.view(n_pages, L, NB, H).to(device)


@pytest.mark.parametrize("device", DEVS)
@pytest.mark.parametrize("dtype,programs_per_row", [(torch.bfloat16, None), (torch.float32, None),
                                                    (torch.bfloat16, 1), (torch.bfloat16, 2)])
def test_kernel_equals_reference_and_writes_only_the_misses(device, dtype, programs_per_row):
    """Also with few programs per row, each looping over the row's misses (loading ahead)."""
    values, scales = _host(10, device, seed=1)
    host_pages = torch.tensor([[3, 7, 1, 9, -1], [0, 2, 4, 6, 8]], device=device)  # [R, M]
    slot_pages = torch.tensor([[5, 6, 7], [8, 9, 10]], dtype=torch.int32, device=device)  # [R, S]
    rows = torch.tensor([1, -1, 0], device=device)  # a padding row between two live ones
    load_ids = torch.tensor([[4, 1, 3], [0, 1, 2], [3, 4, 9]], dtype=torch.int32, device=device)
    load_slots = torch.tensor([[2, 0, -1], [0, 1, 2], [1, 2, 0]], dtype=torch.int32, device=device)
    num_loads = torch.tensor([3, 3, 2], dtype=torch.int32, device=device)
    outs = []
    for fn in (swap_in_fp8_copy_reference, swap_in_fp8_copy_triton):
        dev = torch.full((12, PS, L, NB, H, D), 7.0, dtype=dtype, device=device)
        fn(values, scales, dev, 1, load_ids, load_slots, num_loads, rows, host_pages, slot_pages, programs_per_row)
        outs.append(dev)
    assert torch.equal(outs[0], outs[1])
    dev = outs[1]

    def page(hp):
        return (values[hp, 1].view(torch.float8_e4m3fn).float() * scales[hp, 1][:, None, :, None]).permute(1, 0, 2, 3)

    # row 1 (b=0): lid 4 -> host page 8 into slot 2 (device page 10); lid 1 -> page 2 into slot 0 (page 8);
    # the third has slot -1. Row 0 (b=2): lid 3 -> page 9 into slot 1 (page 6); lid 4 is -1 on host.
    assert torch.equal(dev[10, :, 1], page(8).to(dtype)) and torch.equal(dev[8, :, 1], page(2).to(dtype))
    assert torch.equal(dev[6, :, 1], page(9).to(dtype))
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[[10, 8, 6]] = False
    assert (dev[untouched] == 7).all() and (dev[:, :, [0, 2]] == 7).all()


def test_a_device_view_paged_by_single_tokens_gets_the_same_rows():
    """The device pool may page its slots otherwise (the sparse buffers use page size 1):
    device page ``dp`` of the selection is token slots ``dp * page_size + t`` there."""
    values, scales = _host(6, "cpu", seed=3)
    host_pages = torch.tensor([[5, 2]])
    slot_pages = torch.tensor([[3, 1]], dtype=torch.int32)
    args = (torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([[1, 0]], dtype=torch.int32),
            torch.tensor([2], dtype=torch.int32), torch.tensor([0]), host_pages, slot_pages)
    paged = torch.zeros(5, PS, L, NB, H, D)
    swap_in_fp8_copy_reference(values, scales, paged, 2, *args)
    for fn in (swap_in_fp8_copy_reference, swap_in_fp8_copy_triton):
        flat = torch.zeros(5 * PS, 1, L, NB, H, D)
        fn(values, scales, flat, 2, *args)
        assert torch.equal(flat.view(5, PS, L, NB, H, D), paged)
    assert paged[1].any() and paged[3].any() and not paged[[0, 2, 4]].any()


def test_bad_arguments_are_named():
    values, scales = _host(2, "cpu", seed=2)
    dev = torch.zeros(4, PS, L, NB, H, D)
    z = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 3\)"):
        swap_in_fp8_copy_triton(values, scales, dev, 3, z, z, z[0], z[0].long(), z.long(), z)
    with pytest.raises(ValueError, match="dev must be a 6-D view"):
        swap_in_fp8_copy_triton(values, scales, dev[..., :3], 0, z, z, z[0], z[0].long(), z.long(), z)
    with pytest.raises(ValueError, match="must match load_ids"):
        swap_in_fp8_copy_triton(values, scales, dev, 0, z, z, torch.zeros(2, dtype=torch.int32), z[0].long(),
                                z.long(), z)
