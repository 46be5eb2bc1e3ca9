"""The row-invariant matmul and prefill attention kernels: equal to their torch references,
and each row bitwise the same whatever rows are computed beside it (Triton interpreted on
CPU at small sizes, native on GPU at a prefill's sizes)."""
from __future__ import annotations

import pytest
import torch

from sparsehi.kernels.prefill_attention import (prefill_attention, prefill_attention_reference,
                                                prefill_attention_triton)
from sparsehi.kernels.row_invariant_matmul import (row_invariant_linear, row_invariant_matmul_reference,
                                                   row_invariant_matmul_triton)

DEVS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _sizes(device: str, cpu: int, gpu: int) -> int:
    return cpu if device == "cpu" else gpu


@pytest.mark.parametrize("device", DEVS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_matches_reference_and_rows_do_not_depend_on_their_neighbours(device, dtype):
    g = torch.Generator().manual_seed(0)
    M, K, N = _sizes(device, 45, 3001), _sizes(device, 72, 1024), _sizes(device, 80, 1536)
    x = torch.randn(2, M, K, generator=g).to(device, dtype)
    w = torch.randn(2, N, K, generator=g).to(device, dtype) / K ** 0.5
    bias = torch.randn(N, generator=g).to(device, dtype)
    y = row_invariant_matmul_triton(x, w, bias)
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.float(), row_invariant_matmul_reference(x, w, bias).float(), atol=tol, rtol=tol)
    # the same rows computed in other company: a short run starting mid-tile, one row alone
    for lo, hi in ((5, 9), (M - 21, M), (M // 2, M // 2 + 1)):
        part = row_invariant_matmul_triton(x[:, lo:hi].contiguous(), w, bias)
        assert torch.equal(part, y[:, lo:hi]), (lo, hi)


def test_matmul_strided_input_and_bad_shapes():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 3, 40, generator=g)  # [T, H, K]: per head through a transposed view
    w = torch.randn(3, 24, 40, generator=g)
    y = row_invariant_matmul_triton(x.transpose(0, 1), w)
    torch.testing.assert_close(y, torch.einsum("thk,hnk->htn", x, w), atol=1e-4, rtol=1e-4)
    lin = row_invariant_linear(x[:, 0], w[0])
    torch.testing.assert_close(lin, x[:, 0] @ w[0].T, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"x must be \[B, M, K\] and w \[B, N, K\]"):
        row_invariant_matmul_triton(x, w)
    with pytest.raises(ValueError, match=r"bias must be \[N\]"):
        row_invariant_matmul_triton(x.transpose(0, 1), w, torch.zeros(5))


@pytest.mark.parametrize("device", DEVS)
@pytest.mark.parametrize("heads", [(4, 2, 32, 32), (4, 1, 80, 64)], ids=["gqa", "mla"])
def test_prefill_attention_matches_reference(device, heads):
    Hq, Hkv, D, Dv = heads
    g = torch.Generator().manual_seed(2)
    S, off = _sizes(device, 70, 2500), _sizes(device, 29, 2111)
    q = torch.randn(S - off, Hq, D, generator=g).to(device)
    k = torch.randn(S, Hkv, D, generator=g).to(device)
    # MLA: the values are the latent entry's first Dv columns
    v = torch.randn(S, Hkv, D, generator=g).to(device) if Dv == D else k[..., :Dv]
    got = prefill_attention_triton(q, k, v, D ** -0.5, off)
    want = prefill_attention_reference(q, k, v, D ** -0.5, off)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("device", DEVS)
def test_prefill_attention_suffix_rows_equal_whole_prompt_rows(device):
    """A prompt prefilled whole, and its last tokens prefilled after a reused prefix: the
    suffix's outputs are bitwise equal (the property prefix reuse needs)."""
    g = torch.Generator().manual_seed(3)
    Hq, Hkv, D = 4, 2, 32
    S = _sizes(device, 77, 4133)
    q = torch.randn(S, Hq, D, generator=g).to(device)
    k = torch.randn(S, Hkv, D, generator=g).to(device)
    v = torch.randn(S, Hkv, D, generator=g).to(device)
    whole = prefill_attention_triton(q, k, v, D ** -0.5, 0)
    for off in (S - 21, S - 1, S // 3, 32):
        part = prefill_attention_triton(q[off:].contiguous(), k, v, D ** -0.5, off)
        assert torch.equal(part, whole[off:]), off


def test_prefill_attention_rejects_bad_arguments():
    q = torch.zeros(4, 4, 32)
    kv = torch.zeros(10, 2, 32)
    with pytest.raises(ValueError, match="q_offset must be an int with q_offset \\+ T == S"):
        prefill_attention(q, kv, kv, 1.0, 5)
    with pytest.raises(ValueError, match="query heads \\(4\\) must be a multiple of KV heads \\(3\\)"):
        prefill_attention(q, torch.zeros(10, 3, 32), torch.zeros(10, 3, 32), 1.0, 6)
