"""What the sparse MLA decode kernels share (``sparse_mla_decode``'s fused kernel,
``sparse_mla_two_pass``, ``sparse_mla_gluon``): input checks, the split count, the split-K
launch and the index-tile / KV-row loads.

Every row attends to the latent KV rows ``kv[slot] = [c_kv (kv_lora_rank) | k_rope
(rope_dim)]`` named by ``indices[b]`` (``-1`` padding anywhere in the row; out-of-pool
slots are masked too, never read).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hicache.triton_support import cdiv
from sparsehi.kernels.flash_decoding import FLOAT_DTYPES, MAX_SPLITS, fail, merge_splits, split_buffers
from sparsehi.kernels.mla_fp8_latents import FP8_TILE, MlaFp8Layout, fp8_row_bytes


def mla_max_splits(num_idx: int, block_n: int) -> int:
    """The most splits of ``num_idx`` indices an MLA launch takes: each split >= 128
    indices (and one tile), at most ``MAX_SPLITS``."""
    return int(max(1, min(cdiv(num_idx, max(block_n, 128)), MAX_SPLITS)))


def mla_num_splits(work_items: int, num_idx: int, block_n: int, num_sms: int) -> int:
    """Split-K count for the MLA kernel: one program per SM is already a full wave (each
    program holds a large tile in shared memory), so split only while the grid is smaller
    than the SM count, and keep splits >= 128 indices."""
    want = max(1, num_sms // max(1, work_items))
    return min(want, mla_max_splits(num_idx, block_n))


@triton.jit
def load_rows(KV, idx, valid, stride_kvn, offs_d, d_mask, col0):
    """[N, D] rows ``KV[idx, col0 + offs_d]`` (zeros where not valid)."""
    base = tl.where(valid, idx, 0).to(tl.int64) * stride_kvn + col0
    return tl.load(KV + base[:, None] + offs_d[None, :], mask=valid[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def index_tile(Idx, b, stride_ib, n0, end, num_slots, BLOCK_N: tl.constexpr):
    """Slots ``idx`` of row ``b``'s tile at ``n0`` (``-1`` past ``end``) and where they are
    valid (in the row, ``>= 0``, inside the pool)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    in_row = offs_n < end
    idx = tl.load(Idx + b.to(tl.int64) * stride_ib + offs_n, mask=in_row, other=-1)
    valid = in_row & (idx >= 0) & (idx < num_slots)
    return idx, valid


def check_mla(q: torch.Tensor, kv_buffer: torch.Tensor, indices: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """Validate the arguments of a sparse MLA decode (``q [B, H, Dl + Dr]``, ``kv_buffer
    [num_slots, (1,) Dl + Dr]`` in q's dtype or ``[num_slots, (1,) bytes_per_token]`` uint8 in
    the FP8 latent layout (``mla_fp8_latents``), ``indices [B, K]``); returns kv as a 2-D
    ``[num_slots, last dim]`` view."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        fail("q", "a [B, H, kv_lora_rank + rope_dim] tensor", getattr(q, "shape", type(q)))
    if q.dtype not in FLOAT_DTYPES:
        fail("q", f"of dtype in {FLOAT_DTYPES}", q.dtype)
    if not isinstance(kv_buffer, torch.Tensor) or kv_buffer.dim() not in (2, 3) or (
            kv_buffer.dim() == 3 and kv_buffer.shape[1] != 1):
        fail("kv_buffer", "a [num_slots, 1, kv_lora_rank + rope_dim] tensor (or [num_slots, 1, bytes_per_token] "
             "uint8, the FP8 latent layout)", getattr(kv_buffer, "shape", type(kv_buffer)))
    kv = kv_buffer.reshape(kv_buffer.shape[0], kv_buffer.shape[-1]) if kv_buffer.dim() == 3 else kv_buffer
    if kv.dtype == torch.uint8:
        _check_fp8_rows(q, kv, kv_lora_rank)
    elif kv.dtype != q.dtype:
        fail("kv_buffer", f"of q's dtype {q.dtype} or uint8 (the FP8 latent layout)", kv.dtype)
    if kv.device != q.device:
        fail("kv_buffer", f"on q's device {q.device}", kv.device)
    if kv.dtype != torch.uint8 and kv.shape[1] != q.shape[2]:
        fail("kv_buffer", f"with last dim {q.shape[2]} (q's)", kv.shape[1])
    if not isinstance(kv_lora_rank, int) or not (0 < kv_lora_rank < q.shape[2]):
        fail("kv_lora_rank", f"an int in (0, {q.shape[2]})", kv_lora_rank)
    if kv.stride(1) != 1 or q.stride(2) != 1:
        fail("kv_buffer/q", "contiguous in the last dim", (kv.stride(), q.stride()))
    if not isinstance(indices, torch.Tensor) or indices.dim() != 2 or indices.shape[0] != q.shape[0]:
        fail("indices", f"a [B={q.shape[0]}, K] tensor", getattr(indices, "shape", type(indices)))
    if indices.dtype not in (torch.int32, torch.int64):
        fail("indices", "int32 or int64", indices.dtype)
    if indices.device != q.device:
        fail("indices", f"on q's device {q.device}", indices.device)
    return kv


def _check_fp8_rows(q: torch.Tensor, kv: torch.Tensor, kv_lora_rank: int) -> None:
    """The FP8 latent layout's constraints on ``kv [num_slots, bytes]`` uint8 and q."""
    if q.dtype not in (torch.bfloat16, torch.float16):
        fail("q", "bfloat16 or float16 with an FP8 (uint8) kv_buffer", q.dtype)
    if not isinstance(kv_lora_rank, int) or not (0 < kv_lora_rank < q.shape[2]) or kv_lora_rank % FP8_TILE:
        fail("kv_lora_rank", f"a multiple of {FP8_TILE} in (0, {q.shape[2]}) with an FP8 kv_buffer", kv_lora_rank)
    rope_dim = q.shape[2] - kv_lora_rank
    if rope_dim % 2:
        fail("q", "of an even rope_dim (q's last dim - kv_lora_rank) with an FP8 kv_buffer", rope_dim)
    want = fp8_row_bytes(kv_lora_rank, rope_dim)
    if kv.shape[1] != want:
        fail("kv_buffer", f"uint8 with last dim {want} (FP8 layout bytes for kv_lora_rank={kv_lora_rank}, "
             f"rope_dim={rope_dim})", kv.shape[1])
    if kv.stride(0) % 4 or kv.storage_offset() % 4:
        fail("kv_buffer", "FP8 rows starting on 4-byte boundaries (row stride and offset multiples of 4)",
             (kv.stride(), kv.storage_offset()))


def fp8_row_views(kv: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales [num_slots, Dl / 128] float32, rope [num_slots, rope_dim] bfloat16)`` views of
    the FP8 rows ``kv [num_slots, bytes]`` uint8 (checked by :func:`check_mla`)."""
    lay = MlaFp8Layout.of_row(kv_lora_rank, kv.shape[1], name="kv_buffer's last dim")
    return kv[:, lay.scale_offset:lay.rope_offset].view(torch.float32), kv[:, lay.rope_offset:].view(torch.bfloat16)


def launch_split(kernel, grid: tuple[int, int, int], q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                 out: torch.Tensor, sm_scale: float, tokens_per_split: int, splits: int, **meta) -> torch.Tensor:
    """Launch an MLA decode kernel (the fused Triton one or the Gluon one: same leading
    arguments) over ``grid = (head blocks, B, splits)``; with ``splits > 1`` each split writes
    fp32 partials ``[B, H, splits, Dl]`` and their log-sum-exp, merged into ``out``."""
    H, Dl = q.shape[1], out.shape[2]
    part, lse, pstr = split_buffers(out, splits)
    kernel[grid](
        q, kv, indices, out, part, lse,
        float(sm_scale) * 1.4426950408889634,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0),
        out.stride(0), out.stride(1),
        *pstr,
        H, indices.shape[1], tokens_per_split, kv.shape[0],
        SPLIT=splits > 1, **meta,
    )
    if splits > 1:
        merge_splits(part, lse, out, max(16, triton.next_power_of_2(Dl)))
    return out
