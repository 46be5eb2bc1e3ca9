"""How fast one Hopper GPU can gather the sparse MLA decode's KV rows at all: the bandwidth
bound of a decode kernel over those rows, beside the sequential copy rate.

A decode over top-k rows reads each request's ``K`` rows in the order of its indices, rows
scattered over the request's pool slots (``bench_attention.dsa_case``: ``1.25 K`` slots a
request, 656-byte FP8 rows or 1152-byte bf16 rows). :func:`gather_rows_kernel` reads exactly
those rows and nothing else (each program ``BLOCK_N`` rows a step over its share of a
request's indices, the rows' 32-bit words summed into one value a program, so no byte is
written back), over a grid of ``B x splits`` programs; the best of a few launch shapes is
the gather rate. Rows: for each case and row format the gather rate, its fraction of the
copy rate (``hbm_copy_gbps`` of the same run), the same for the indices sorted within each
request (the rows in pool order: what locality alone gains), and the decode kernel's time
over the same rows as a fraction of the gather rate. Writes ``attention_mla_gather_limit.json``.

Usage: ``PYTHONPATH=. python benchmarks/mla_gather_limit.py [--commit SHA] [--out DIR]``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from benchmarks.bench_attention import dsa_case, kv_row_bytes, mla_bytes
from benchmarks.common import cuda_time_us, device_info, hbm_copy_gbps, result_parser, write_result
from sparsehi.kernels.sparse_mla_decode import sparse_mla_decode_triton

CASES = [(64, 1, 2048), (16, 1, 32768), (64, 2, 2048)]
HEADS = (16, 128)
# (rows a program step, warps, splits of a request's indices): programs enough to fill the
# SMs several times over, steps of 4-32 rows
SHAPES = [(8, 4, 8), (16, 4, 8), (32, 8, 8), (16, 4, 16), (8, 4, 32), (4, 4, 64)]


@triton.jit
def gather_rows_kernel(Words, Idx, Out, stride_row, stride_ib, tokens_per_split, ROW_WORDS: tl.constexpr,
                       BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (request ``b``, split ``s``): the 32-bit words of rows ``Idx[b, s *
    tokens_per_split ..]`` of ``Words [N, stride_row]`` int32 (``ROW_WORDS`` a row), summed
    (wrapping) into ``Out[b, s]`` int32."""
    b = tl.program_id(0)
    s = tl.program_id(1)
    offs_w = tl.arange(0, BLOCK_W)
    w_ok = offs_w < ROW_WORDS
    acc = tl.zeros([BLOCK_N, BLOCK_W], tl.int32)
    lo = s * tokens_per_split
    for n0 in range(lo, lo + tokens_per_split, BLOCK_N):
        rows = tl.load(Idx + b.to(tl.int64) * stride_ib + n0 + tl.arange(0, BLOCK_N))
        base = tl.multiple_of(rows.to(tl.int64) * stride_row, 4)
        acc += tl.load(Words + base[:, None] + offs_w[None, :], mask=w_ok[None, :], other=0)
    tl.store(Out + b * tl.num_programs(1) + s, tl.sum(tl.sum(acc, axis=1), axis=0))


def gather_rows(rows: torch.Tensor, idx: torch.Tensor, block_n: int, num_warps: int, splits: int) -> torch.Tensor:
    """Sum of the 32-bit words of the rows ``idx [B, K]`` int32 selects from ``rows [N, ...]``
    (a row's bytes a multiple of 16), per ``(request, split)``: ``[B, splits]`` int32."""
    B, K = idx.shape
    words = rows.reshape(rows.shape[0], -1).view(torch.int32)
    if K % (splits * block_n):
        raise ValueError(f"K={K} must be a multiple of splits * block_n = {splits * block_n}")
    out = torch.empty(B, splits, dtype=torch.int32, device=rows.device)
    row_words = words.shape[1]
    gather_rows_kernel[(B, splits)](words, idx, out, words.stride(0), idx.stride(0), K // splits,
                                    ROW_WORDS=row_words, BLOCK_W=triton.next_power_of_2(row_words),
                                    BLOCK_N=block_n, num_warps=num_warps, num_stages=3)
    return out


def gather_rows_reference(rows: torch.Tensor, idx: torch.Tensor, splits: int) -> torch.Tensor:
    """:func:`gather_rows` in torch (int64 sums wrapped to int32)."""
    words = rows.reshape(rows.shape[0], -1).view(torch.int32).long()
    B, K = idx.shape
    per = words[idx.long()].sum(dim=-1).view(B, splits, K // splits).sum(dim=-1)
    return ((per + 2**31) % 2**32 - 2**31).int()


def best_gather_us(rows: torch.Tensor, idx: torch.Tensor) -> tuple[float, tuple]:
    """The fastest launch shape of :func:`gather_rows` over ``idx``: (us, shape)."""
    best = None
    for shape in SHAPES:
        if idx.shape[1] % (shape[0] * shape[2]):
            continue
        us = cuda_time_us(lambda: gather_rows(rows, idx, *shape), graph=True)  # noqa: B023
        best = (us, shape) if best is None or us < best[0] else best
    return best


def main(argv: list[str] | None = None) -> int:
    ap = result_parser(__doc__)
    args = ap.parse_args(argv)
    roof = hbm_copy_gbps()
    out = []
    for B, T, K in CASES:
        q, kv, packed, idx = dsa_case(B, T, K, max(HEADS), 512, 64)
        for name, buf in (("fp8", packed), ("bf16", kv)):
            row_bytes = kv_row_bytes(buf, 512, 64)
            nbytes = B * T * K * row_bytes
            us, shape = best_gather_us(buf, idx)
            us_sorted, _ = best_gather_us(buf, idx.sort(dim=1).values)
            row = dict(B=B, query_tokens=T, K=K, rows=name, row_bytes=row_bytes,
                       gather_us=round(us, 1), gather_gbps=round(nbytes / us / 1e3, 1),
                       gather_frac_copy=round(nbytes / us / 1e3 / roof, 3), gather_shape=shape,
                       sorted_gather_us=round(us_sorted, 1), sorted_frac_copy=round(nbytes / us_sorted / 1e3 / roof, 3))
            for H in HEADS:
                qh = q[:, :H].contiguous()
                dec = cuda_time_us(lambda qh=qh, buf=buf, idx=idx: sparse_mla_decode_triton(
                    qh, buf, idx, kv_lora_rank=512, sm_scale=0.1), graph=True)
                dec_bytes = mla_bytes(B * T, K, H, 512, 64, row_bytes)
                row[f"decode_h{H}_us"] = round(dec, 1)
                row[f"decode_h{H}_frac_copy"] = round(dec_bytes / dec / 1e3 / roof, 3)
                row[f"decode_h{H}_frac_gather"] = round(us / dec, 3)
            out.append(row)
            print(row, flush=True)
        del q, kv, packed, idx
        torch.cuda.empty_cache()
    print("wrote", write_result("attention_mla_gather_limit.json", {
        "commit": args.commit, "env": device_info(), "roofline_gbps": round(roof, 1),
        "block_n_warps_splits": SHAPES, "rows": out}, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
