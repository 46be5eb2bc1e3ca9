"""benchmarks/mla_gather_limit.py: the gather probe reads exactly the rows the indices select
(its per-program sums match torch's over the same rows, for FP8 and bf16 rows and several
launch shapes) and refuses a split that does not divide the indices."""
from __future__ import annotations

import pytest
import torch

from benchmarks.mla_gather_limit import gather_rows, gather_rows_reference
from sparsehi.kernels.mla_fp8_latents import quantize_mla_latents


@pytest.mark.parametrize("fp8", [True, False])
def test_gather_rows_sums_the_selected_rows(fp8):
    g = torch.Generator().manual_seed(0)
    # rows of the decode's widths (656 FP8 bytes, 576 bf16 values) whose 32-bit words are
    # small, so that no int32 sum overflows (how the interpreter's numpy treats an overflow
    # differs between numpy versions)
    width = 656 if fp8 else 1152
    words = torch.randint(0, 1 << 16, (40, width // 4), generator=g, dtype=torch.int32)
    rows = words.view(torch.uint8 if fp8 else torch.bfloat16).view(40, 1, -1)
    if fp8:
        assert rows.shape[-1] == quantize_mla_latents(torch.zeros(1, 1, 576), kv_lora_rank=512).shape[-1]
    idx = torch.stack([torch.randperm(40, generator=g)[:16] for _ in range(3)]).int()
    for block_n, splits in ((4, 2), (8, 1), (2, 4)):
        got = gather_rows(rows, idx, block_n, 4, splits)
        assert got.shape == (3, splits)
        assert torch.equal(got, gather_rows_reference(rows, idx, splits))
    # a row left out changes the sums: the probe reads the rows it is given, not the pool
    other = idx.clone()
    other[0, 0] = int(torch.tensor([i for i in range(40) if i not in idx[0].tolist()][0]))
    assert not torch.equal(gather_rows(rows, other, 4, 4, 2)[0], gather_rows(rows, idx, 4, 4, 2)[0])


def test_gather_rows_refuses_a_split_that_does_not_divide_k():
    rows = torch.zeros(8, 1, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K=6"):
        gather_rows(rows, torch.zeros(1, 6, dtype=torch.int32), 4, 4, 1)
