"""Kernel index arithmetic past 2**31, which a million-token context reaches: a host page
of a 1M-token FP8 pool lies ~64 GiB from the pool's start, a device pool holding one
prefill chunk puts its last layers more than 2**31 elements from its first, Quest's
bounds and the dense layers' KV grow with the context. Each kernel of that decode path
is given tensors whose addressed elements lie past 2**31 elements (or bytes) from their
base and must agree with its torch reference on a compact copy. The big tensors are
allocated, never filled: only the pages a kernel touches become resident. Each check runs
in a child process, where an offset wrapped in int32 is a wild address (a crash, not an
exception)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparsehi.kernels.quest_score import MAX_GRID_Y, score_block_pages

ROOT = Path(__file__).resolve().parents[1]
BEYOND = 1 << 31


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------- checks (child process)
def check_fp8_host_pages_and_layers_past_2_31() -> None:
    """FP8 page store (prefill end, decode backups) and swap-in (decode misses): host pages
    more than 2**31 bytes in, a device layer more than 2**31 elements in."""
    from hicache.kernels.fp8_page_store import fp8_page_store_reference, fp8_page_store_triton
    from sparsehi.kernels.swap_in_fp8 import swap_in_fp8_copy_reference, swap_in_fp8_copy_triton

    dev = _device()
    L, B, PS, H, D = 3, 2, 16, 1, 64
    page_bytes = L * B * PS * H * D
    n_host = BEYOND // page_bytes + 2  # the last two host pages start past 2**31 bytes
    values = torch.empty((n_host, L, B, PS, H, D), dtype=torch.uint8, device=dev)
    scales = torch.empty((n_host, L, B, H), dtype=torch.float32, device=dev)
    # device view [pages, page_size, layers, buffers, heads, dim] whose layer stride fits in
    # int32 while layer 2 starts past 2**31 elements (a kernel multiplying in int32 wraps)
    stride_l = (1 << 30) + 4096
    big = torch.empty(2 * stride_l + 8192, dtype=torch.bfloat16, device=dev)
    view = big.as_strided((4, PS, L, B, H, D), (PS * B * H * D, B * H * D, stride_l, H * D, D, 1))
    g = torch.Generator().manual_seed(0)
    view[1:3] = torch.randn((2, PS, L, B, H, D), generator=g).to(dev, torch.bfloat16)
    small = view.clone()
    i32 = dict(dtype=torch.int32, device=dev)  # int32 ids: the kernels must widen them before multiplying
    far = torch.tensor([n_host - 1, n_host - 2], **i32)
    fp8_page_store_triton(view, torch.tensor([1, 2], **i32), values, scales, far, 0, L, round_device=True)
    want_v = torch.zeros((3, L, B, PS, H, D), dtype=torch.uint8, device=dev)
    want_s = torch.zeros((3, L, B, H), dtype=torch.float32, device=dev)
    fp8_page_store_reference(small, torch.tensor([1, 2], device=dev), want_v, want_s, torch.tensor([1, 2], device=dev),
                             0, L, round_device=True)
    assert torch.equal(values[n_host - 1], want_v[1]) and torch.equal(values[n_host - 2], want_v[2])
    assert torch.equal(scales[n_host - 1], want_s[1]) and torch.equal(scales[n_host - 2], want_s[2])
    assert torch.equal(view[1:3], small[1:3])
    # the misses of layer 2 (past 2**31 elements) loaded back from those far host pages into device pages 3 and 0
    args = (torch.tensor([[0, 1]], **i32), torch.tensor([[0, 1]], **i32), torch.tensor([2], **i32),
            torch.tensor([0], **i32))
    swap_in_fp8_copy_triton(values, scales, view, 2, *args, far[None, :], torch.tensor([[3, 0]], **i32))
    swap_in_fp8_copy_reference(want_v, want_s, small, 2, *args, torch.tensor([[1, 2]], **i32),
                               torch.tensor([[3, 0]], **i32))
    assert torch.equal(view[:, :, 2], small[:, :, 2]) and bool(view[3, :, 2].abs().sum() > 0)


def check_quest_bounds_past_2_31() -> None:
    """Quest's page bounds: the decode step's fold of a new key into an entry more than
    2**31 elements in, and the score of a request row more than 2**31 elements in."""
    from sparsehi.kernels.quest_score import quest_score_reference, quest_score_triton
    from sparsehi.kernels.quest_update_bounds import quest_update_bounds_triton

    dev = _device()
    H, D, PS = 2, 16, 16
    entry = H * D
    i32 = dict(dtype=torch.int32, device=dev)  # int32 ids: the kernels must widen them before multiplying
    pages = BEYOND // entry + 512  # one request row: its last pages lie past 2**31 elements
    big = torch.empty((pages + 2) * entry, dtype=torch.bfloat16, device=dev)
    kmin_flat = big[: (pages + 1) * entry].view(pages + 1, H, D)
    kmax_flat = big[entry:].view(pages + 1, H, D)  # entry e of kmax is entry e + 1 of kmin: distinct memory
    g = torch.Generator().manual_seed(1)
    first = torch.randn((1, H, D), generator=g).to(dev, torch.bfloat16)
    second = torch.randn((1, H, D), generator=g).to(dev, torch.bfloat16)
    last = pages - 1
    for pos, key in ((last * PS, first), (last * PS + 1, second)):
        quest_update_bounds_triton(kmin_flat, kmax_flat, torch.tensor([0], **i32), torch.tensor([pos], **i32), key,
                                   max_num_reqs=1, max_pages=pages, page_size=PS)
    assert torch.equal(kmin_flat[last], torch.minimum(first, second)[0])
    assert torch.equal(kmax_flat[last], torch.maximum(first, second)[0])
    # score: request row 2 of [3, 4, H, D] bounds whose row stride fits in int32, row 2 past 2**31 elements
    stride_r = (1 << 30) + 4096
    kmin = big.as_strided((3, 4, H, D), (stride_r, entry, D, 1))
    kmax = big.as_strided((3, 4, H, D), (stride_r, entry, D, 1), storage_offset=8 * entry)
    lo = torch.randn((4, H, D), generator=g)
    kmin[2], kmax[2] = lo.to(dev, torch.bfloat16), (lo + torch.rand((4, H, D), generator=g)).to(dev, torch.bfloat16)
    q = torch.randn((1, 2 * H, D), generator=g).to(dev, torch.bfloat16)
    lens = torch.tensor([4 * PS], **i32)
    got = quest_score_triton(q, kmin, kmax, torch.tensor([2], **i32), lens, "sum", page_size=PS)
    want = quest_score_reference(q, kmin[2:].clone(), kmax[2:].clone(), torch.tensor([0], **i32), lens, "sum",
                                 page_size=PS)
    torch.testing.assert_close(got, want)


def check_paged_decode_slots_past_2_31() -> None:
    """The dense layers' decode attention over token slots more than 2**31 elements into
    the KV buffer."""
    from sparsehi.kernels.paged_decode import paged_decode_triton

    dev = _device()
    HKV, D, PS = 1, 16, 16
    slots = BEYOND // (HKV * D) + 4 * PS  # the last pages lie past 2**31 elements
    kv = torch.empty((slots, HKV, D), dtype=torch.bfloat16, device=dev)  # keys, and values too
    g = torch.Generator().manual_seed(2)
    page = slots // PS - 1
    kv[page * PS:] = torch.randn((PS, HKV, D), generator=g).to(dev, torch.bfloat16)
    q = torch.randn((1, 2, D), generator=g).to(dev, torch.bfloat16)
    out = paged_decode_triton(q, kv, kv, torch.tensor([[page]], dtype=torch.int32, device=dev),
                              torch.tensor([PS], dtype=torch.int32, device=dev), page_size=PS, sm_scale=D ** -0.5)
    k = kv[page * PS:, 0].float()  # [PS, D]
    want = torch.softmax(q[0].float() @ k.T * D ** -0.5, -1) @ k
    torch.testing.assert_close(out[0].float(), want, atol=2e-2, rtol=2e-2)


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("check", ["check_fp8_host_pages_and_layers_past_2_31", "check_quest_bounds_past_2_31",
                                   "check_paged_decode_slots_past_2_31"])
def test_kernel_offsets_past_2_31(check):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    code = f"import torch; torch.set_num_threads(1); import test_large_offsets as t; t.{check}()"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, (f"{check} exited with {res.returncode} (negative: killed by a signal, e.g. an "
                                 f"offset wrapped in int32)\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")


def test_quest_score_grid_stays_within_cuda_bounds():
    """The score kernel's page blocks are its grid's second dimension: past 4 x 65535 pages
    (4M tokens at page size 16, or 1M at page size 4) the small-batch tile doubles."""
    assert score_block_pages(65537, 4) == 4  # 1M tokens at page size 16: as before
    for pages in (4 * MAX_GRID_Y + 1, 1 << 20, 1 << 22):
        bp = score_block_pages(pages, 4)
        assert -(-pages // bp) <= MAX_GRID_Y and -(-pages // (bp // 2)) > MAX_GRID_Y
