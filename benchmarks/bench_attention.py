"""Sparse decode attention kernels vs the HBM roofline.

Kernels: ``paged_decode`` (Llama-8B layer shape: 32 q / 8 kv heads, d=128, pages of 64 and
16 tokens), ``ragged_decode`` (same shape, token slots = the TritonAdapter path),
``sparse_mla_decode`` (DeepSeek MLA: 128 heads, 576 = 512 latent + 64 rope, token mode;
``sparse_mla_decode_gluon`` = the same op through the Hopper Gluon kernel, ``MlaGluonConfig``),
and torch SDPA over the same KV already gathered dense (the bytes-equal baseline).
B in {1, 16, 64}, K in {512, 2048, 4096} attended tokens per request, KV scattered over a
pool 1.25x the working set (random pages / slots). Times are CUDA-graph replays (no
launch overhead). ``gbps`` counts the unique bytes a kernel must read (KV + q) and write
(out); ``roofline_gbps`` is a large device copy in the same run (read + write).
Working sets below the L2 size (B=1, small K) can run above the roofline: they are
L2-resident across replays.

FP8 latent rows (``--parts mla_fp8``, ``attention_mla_fp8.json``): sparse MLA decode over the
DeepSeek-V3.2 FP8 layout (656 bytes a token, ``mla_fp8_latents``) beside the same values in
bf16 (default dispatch and the fused kernel), at 128, 64 and 16 heads, 1 and 2 query tokens
per request (each its own top-k), K in {512, 2048, 8192, 32768}.

Usage: ``PYTHONPATH=. python benchmarks/bench_attention.py [--sweep] [--quick] [--parts main mla_fp8]``
(``--quick`` small shapes, runs on CPU under TRITON_INTERPRET=1 as a dry run).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from benchmarks.common import bf16_gemm_tflops, cuda_time_us, device_info, hbm_copy_gbps, write_result
from sparsehi.kernels.mla_fp8_latents import dequantize_mla_latents, fp8_row_bytes, quantize_mla_latents
from sparsehi.kernels.paged_decode import DecodeLaunchConfig, paged_decode_reference, paged_decode_triton
from sparsehi.kernels.ragged_decode import ragged_decode_triton
from sparsehi.kernels.sparse_mla_decode import (MlaGluonConfig, MlaLaunchConfig, default_mla_config,
                                                default_mla_fp8_config, sparse_mla_decode_reference,
                                                sparse_mla_decode_triton)
from sparsehi.kernels.sparse_mla_gluon import gluon_ok

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float16


def timed(fn: Callable[[], Any], iters: int = 20) -> float:
    if CUDA:
        return cuda_time_us(fn, iters=iters, warmup=3, graph=True)
    fn()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e6


# ----------------------------------------------------------------------------- cases
def mha_case(B: int, K: int, ps: int, Hq: int, Hkv: int, D: int, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    pages_per_row = K // ps
    num_pages = int(B * pages_per_row * 1.25) + 1
    k = torch.randn(num_pages * ps, Hkv, D, device=DEV, dtype=DTYPE, generator=g)
    v = torch.randn(num_pages * ps, Hkv, D, device=DEV, dtype=DTYPE, generator=g)
    q = torch.randn(B, Hq, D, device=DEV, dtype=DTYPE, generator=g)
    perm = torch.randperm(num_pages - 1, device=DEV, generator=g)[: B * pages_per_row] + 1
    pt = perm.view(B, pages_per_row).int()
    sl = torch.full((B,), K, dtype=torch.int32, device=DEV)
    return q, k, v, pt, sl


def mla_case(B: int, K: int, H: int, Dl: int, Dr: int, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    N = int(B * K * 1.25) + 1
    kv = torch.randn(N, 1, Dl + Dr, device=DEV, dtype=DTYPE, generator=g)
    q = torch.randn(B, H, Dl + Dr, device=DEV, dtype=DTYPE, generator=g)
    idx = torch.randperm(N, device=DEV, generator=g)[: B * K].view(B, K).int()
    return q, kv, idx


def mha_bytes(B, K, Hq, Hkv, D):
    return B * K * Hkv * D * 2 * 2 + 2 * B * Hq * D * 2


def kv_row_bytes(kv: torch.Tensor, Dl: int, Dr: int) -> int:
    """Bytes of one token's latent row in ``kv``: the FP8 layout's (656 at 512 + 64) for uint8
    rows, else ``Dl + Dr`` values of ``kv``'s dtype."""
    return fp8_row_bytes(Dl, Dr) if kv.dtype == torch.uint8 else (Dl + Dr) * kv.element_size()


def mla_bytes(B, K, H, Dl, Dr, row_bytes=None):
    """Unique bytes of a sparse MLA decode over ``B`` rows: each row's ``K`` KV rows of
    ``row_bytes`` (default bf16 ``(Dl + Dr) * 2``; 656 for the FP8 layout) and int32 indices,
    q in and out."""
    row_bytes = (Dl + Dr) * 2 if row_bytes is None else row_bytes
    return B * K * (row_bytes + 4) + B * H * (Dl + Dr + Dl) * 2


def mla_flops(B, K, H, Dl, Dr):
    return 2 * B * K * H * (Dl + Dr + Dl)


def mla_checked_time(fn: Callable[[], torch.Tensor], ref: torch.Tensor, B: int, K: int, H: int, Dl: int, Dr: int,
                     row_bytes: Optional[int] = None) -> dict:
    """One sparse MLA decode call ``fn`` (``[B, H, Dl]`` out, ``K`` indices a row) against the
    float32 reference ``ref`` and CUDA-graph timed (20 calls a graph): ``{us, tflops, gbps,
    rel_err}``, ``rel_err`` the largest difference over the reference's largest value,
    ``gbps`` over :func:`mla_bytes` of ``row_bytes``-byte KV rows."""
    err = ((fn().float() - ref).abs().max() / ref.abs().max()).item()
    us = cuda_time_us(fn, iters=20, warmup=3, graph=True)
    return {"us": round(us, 2), "tflops": round(mla_flops(B, K, H, Dl, Dr) / us / 1e6, 1),
            "gbps": round(mla_bytes(B, K, H, Dl, Dr, row_bytes) / us / 1e3, 1), "rel_err": round(err, 5)}


def row(kernel: str, B: int, K: int, us: float, nbytes: int, roof: float, **extra) -> dict:
    gbps = nbytes / (us * 1e-6) / 1e9
    r = {"kernel": kernel, "B": B, "K": K, "us": round(us, 2), "gbps": round(gbps, 1),
         "roofline_gbps": round(roof, 1), "frac_roofline": round(gbps / roof, 3) if roof else None}
    r.update(extra)
    print(json.dumps(r), flush=True)
    return r


# ----------------------------------------------------------------------------- sweep
# (block_h, block_n, num_warps, num_stages, row_load, num_splits); the first sweep (all
# [D, N] loads) found block_h=64/block_n=64/8 warps best at B=64 and 16/64/4 at B=1
MLA_SWEEP = [MlaLaunchConfig(bh, bn, nw, ns, sp, rl) for bh, bn, nw, ns, rl, sp in (
    (64, 64, 8, 2, False, None), (64, 64, 8, 2, True, None), (64, 32, 8, 2, True, None),
    (64, 64, 4, 2, True, None), (64, 64, 8, 3, False, None), (64, 64, 8, 3, True, None),
    (64, 128, 8, 1, False, None), (64, 128, 8, 1, True, None),
    (64, 64, 8, 2, False, 1), (64, 64, 8, 2, False, 2), (64, 64, 8, 2, False, 6),
    (32, 64, 4, 2, True, None), (32, 128, 4, 2, False, None), (32, 64, 4, 3, False, None),
    (16, 64, 4, 2, True, None), (16, 128, 4, 2, False, None), (16, 64, 4, 3, False, None),
    (128, 32, 8, 1, False, None), (128, 32, 16, 1, True, None), (128, 64, 16, 1, True, None),
)]
def sweep(roof: float, shapes: dict, big_b: int = 64, K: int = 2048, parts: tuple = ("paged", "mla")) -> dict:
    """Block-size sweep at the target point (B=64, K=2048) and at B=1 (split-K regime);
    used to pick the defaults in paged_decode.default_config / default_mla_config."""
    out: dict[str, list] = {"paged_p64": [], "mla": []}
    Hq, Hkv, D = shapes["mha"]
    H, Dl, Dr = shapes["mla"]
    for B in ((big_b, 1) if "paged" in parts else ()):
        q, k, v, pt, sl = mha_case(B, K, 64, Hq, Hkv, D)
        ref = paged_decode_reference(q, k, v, pt, sl, page_size=64, sm_scale=D ** -0.5).float()
        for bn in (32, 64, 128):
            for nw in (4, 8):
                for st in (2, 3):
                    for splits in ((None,) if B == 1 else (None, 2)):
                        cfg = DecodeLaunchConfig(block_n=bn, num_warps=nw, num_stages=st, num_splits=splits)
                        fn = lambda: paged_decode_triton(q, k, v, pt, sl, page_size=64, sm_scale=D ** -0.5, config=cfg)  # noqa: E731
                        try:
                            err = (fn().float() - ref).abs().max().item()
                            us = timed(fn)
                        except Exception as e:  # noqa: BLE001 - record and continue the sweep
                            out["paged_p64"].append({"B": B, "cfg": cfg.__dict__, "error": repr(e)[:200]})
                            continue
                        r = {"B": B, "cfg": cfg.__dict__, "us": round(us, 2), "max_err": err,
                             "frac_roofline": round(mha_bytes(B, K, Hq, Hkv, D) / (us * 1e-6) / 1e9 / roof, 3)}
                        print("sweep paged", json.dumps(r), flush=True)
                        out["paged_p64"].append(r)
        del q, k, v, pt, sl
    for B in ((big_b, 1) if "mla" in parts else ()):
        q, kv, idx = mla_case(B, K, H, Dl, Dr)
        ref = sparse_mla_decode_reference(q, kv, idx, kv_lora_rank=Dl, sm_scale=0.1).float()
        for cfg in MLA_SWEEP:
            fn = lambda: sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=Dl, sm_scale=0.1, config=cfg)  # noqa: E731
            try:
                err = (fn().float() - ref).abs().max().item()
                us = timed(fn)
            except Exception as e:  # noqa: BLE001
                out["mla"].append({"B": B, "cfg": cfg.__dict__, "error": repr(e)[:200]})
                continue
            r = {"B": B, "cfg": cfg.__dict__, "us": round(us, 2), "max_err": err,
                 "tflops": round(mla_flops(B, K, H, Dl, Dr) / (us * 1e-6) / 1e12, 1),
                 "frac_roofline": round(mla_bytes(B, K, H, Dl, Dr) / (us * 1e-6) / 1e9 / roof, 3)}
            print("sweep mla", json.dumps(r), flush=True)
            out["mla"].append(r)
        del q, kv, idx
    return out


# ----------------------------------------------------------------------------- FP8 latents
# (B requests, query tokens per request, K) of the FP8-vs-bf16 rows; each at 128, 64, 16 heads
MLA_FP8_CASES = [(b, t, k) for k in (512, 2048, 8192) for b in (1, 64) for t in (1, 2)] + \
                [(b, t, 32768) for b in (1, 16) for t in (1, 2)]
MLA_FP8_HEADS = (128, 64, 16)


def dsa_case(B: int, T: int, K: int, H: int, Dl: int, Dr: int, seed: int = 0):
    """DSA decode rows: ``B`` requests of ``T`` query tokens, each token its own top-``K``
    over its request's ``1.25 K`` pool slots (a request's tokens overlap, as DSA's do).
    Returns ``q [B*T, H, Dl+Dr]``, ``kv [N, 1, Dl+Dr]`` (the dequantised FP8 rows, so both
    layouts hold the same values), ``packed [N, 1, bytes]`` uint8, ``idx [B*T, K]`` int32."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    span = K + K // 4
    packed = quantize_mla_latents(torch.randn(B * span, 1, Dl + Dr, device=DEV, generator=g), kv_lora_rank=Dl)
    kv = dequantize_mla_latents(packed, kv_lora_rank=Dl).to(DTYPE)
    q = torch.randn(B * T, H, Dl + Dr, device=DEV, dtype=DTYPE, generator=g)
    idx = torch.stack([torch.randperm(span, device=DEV, generator=g)[:K] + (r // T) * span
                       for r in range(B * T)]).int()
    return q, kv, packed, idx


def time_mla_variants(B: int, T: int, K: int, H: int, variants: list, roof: float, gemm: Optional[float] = None,
                      diff_key: str = "max_diff_vs_first") -> list[dict]:
    """Each ``(name, fp8, config)`` of ``variants`` at one :func:`dsa_case` shape, in the
    same process, over the FP8 rows (``fp8``) or the bf16 rows of the same values: its
    CUDA-graph time, TFLOP/s, bytes/s (:func:`kv_row_bytes` a token), the fraction of the
    byte limit ``roof`` (GB/s) and, given the compute ceiling ``gemm`` (TFLOP/s), of the
    roofline model (the larger of the byte and the flop time over the time), and under
    ``diff_key`` the largest difference from the first variant's output."""
    q, kv, packed, idx = dsa_case(B, T, K, H, 512, 64)
    base = None
    rows = []
    for name, fp8, cfg in variants:
        buf = packed if fp8 else kv
        fn = lambda: sparse_mla_decode_triton(q, buf, idx, kv_lora_rank=512, sm_scale=0.1, config=cfg)  # noqa: E731
        out = fn().float()
        base = out if base is None else base
        us = cuda_time_us(fn, graph=True)
        nbytes, flops = mla_bytes(B * T, K, H, 512, 64, kv_row_bytes(buf, 512, 64)), mla_flops(B * T, K, H, 512, 64)
        r = dict(B=B, query_tokens=T, K=K, heads=H, variant=name, us=round(us, 1), tflops=round(flops / us / 1e6, 1),
                 gbps=round(nbytes / us / 1e3, 1), frac_byte_limit=round(nbytes / us / 1e3 / roof, 3))
        if gemm:
            r["frac_roofline_model"] = round(max(nbytes / (roof * 1e3), flops / (gemm * 1e6)) / us, 3)
        r[diff_key] = round((out - base).abs().max().item(), 4)
        rows.append(r)
        print(r, flush=True)
    return rows


def write_mla_variant_rows(result: str, args: argparse.Namespace, shapes: list, variants, roof: float,
                           gemm: Optional[float] = None, diff_key: str = "max_diff_vs_first") -> Path:
    """:func:`time_mla_variants` at each ``(B, query tokens, K, heads)`` of ``shapes`` (the
    ``variants`` list, or for each shape the list ``variants(B, T, K, H)`` gives), the rows
    written as ``result`` under ``args.out`` with ``args.commit``, the device and the limits
    measured in the run (``roof`` GB/s, and ``gemm`` TFLOP/s where given)."""
    rows = []
    for B, T, K, H in shapes:
        rows += time_mla_variants(B, T, K, H, variants(B, T, K, H) if callable(variants) else variants, roof, gemm,
                                  diff_key=diff_key)
        if CUDA:
            torch.cuda.empty_cache()
    limits = {"roofline_gbps": round(roof, 1)}
    if gemm:
        limits["compute_ceiling_tflops"] = round(gemm, 1)
    path = write_result(result, {"commit": args.commit, "env": device_info(), **limits, "rows": rows}, args.out)
    print("wrote", path)
    return path


def mla_fp8_rows(roof: float, gemm: float, quick: bool) -> list[dict]:
    """The FP8 latent layout beside bf16 rows: for every case and head count the default
    dispatch over bf16 rows (the Gluon kernel where it applies), the fused kernel over bf16
    rows, the default dispatch over the FP8 rows (656 bytes a token at 512 + 64; the Gluon
    FP8 kernel where it applies) and the fused kernel over them; where the Gluon FP8 kernel
    applies, also its form without producer warps (``sparse_mla_fp8_gluon_inloop``). Each row
    carries ``max_diff_vs_fused`` (the same values in either layout: the outputs agree up to
    bf16 rounding)."""
    Dl, Dr = 512, 64
    cases, heads_list = MLA_FP8_CASES, MLA_FP8_HEADS
    if quick:
        Dl, cases, heads_list = 128, [(1, 1, 64), (2, 2, 64)], (16,)
    out: list[dict] = []
    for B, T, K in cases:
        q_all, kv, packed, idx = dsa_case(B, T, K, max(heads_list), Dl, Dr)
        for H in heads_list:
            out += _mla_fp8_case_rows(q_all[:, :H].contiguous(), kv, packed, idx, B, T, Dl, roof, gemm)
        del q_all, kv, packed, idx
        if CUDA:
            torch.cuda.empty_cache()
    return out


def _mla_fp8_case_rows(q, kv, packed, idx, B: int, T: int, Dl: int, roof: float, gemm: float) -> list[dict]:
    rows, H, K, Dr = q.shape[0], q.shape[1], idx.shape[1], q.shape[2] - Dl
    fused = sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=Dl, sm_scale=0.1,
                                     config=default_mla_config(q.device, H, rows, K)).float()
    out = []
    variants = [("sparse_mla_bf16", kv, None),
                ("sparse_mla_bf16_fused", kv, default_mla_config(q.device, H, rows, K)),
                ("sparse_mla_fp8", packed, None),
                ("sparse_mla_fp8_fused", packed, default_mla_fp8_config(q.device, H, rows))]
    if gluon_ok(q, Dl, Dr, packed):     # the Gluon FP8 kernel whose MMA warps scale each tile themselves
        variants.append(("sparse_mla_fp8_gluon_inloop", packed, MlaGluonConfig(producer_warps=0)))
    for name, buf, cfg in variants:
        fn = lambda: sparse_mla_decode_triton(q, buf, idx, kv_lora_rank=Dl, sm_scale=0.1, config=cfg)  # noqa: E731
        diff = (fn().float() - fused).abs().max().item()
        us = timed(fn, iters=10)
        row_bytes = kv_row_bytes(buf, Dl, Dr)
        nbytes, flops = mla_bytes(rows, K, H, Dl, Dr, row_bytes), mla_flops(rows, K, H, Dl, Dr)
        bound_us = max(nbytes / (roof * 1e9), flops / (gemm * 1e12)) * 1e6
        out.append(row(name, B, K, us, nbytes, roof, heads=H, q_tokens=T, rows=rows, kv_bytes_per_token=row_bytes,
                       tflops=round(flops / (us * 1e-6) / 1e12, 1), frac_roofline_model=round(bound_us / us, 3),
                       max_diff_vs_fused=round(diff, 5)))
    return out


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU dry run)")
    ap.add_argument("--sweep", action="store_true", help="also sweep block sizes at B=64/1, K=2048")
    ap.add_argument("--out", default=None, help="result dir (default benchmarks/results)")
    ap.add_argument("--sweep-only", default=None, choices=["paged", "mla"],
                    help="only sweep this kernel (no main rows); writes attention_sweep.json")
    ap.add_argument("--parts", nargs="+", default=["main", "mla_fp8"], choices=["main", "mla_fp8"],
                    help="main: the rows of attention.json; mla_fp8: sparse MLA over FP8 latent rows beside "
                         "bf16 (128/64/16 heads, 1-2 query tokens, K 512..32768), attention_mla_fp8.json")
    args = ap.parse_args(argv)

    if args.quick:
        batches, ks = (1, 2), (64, 128)
        shapes = {"mha": (8, 2, 32), "mla": (16, 32, 16)}
        page_sizes = (16,)
    else:
        batches, ks = (1, 16, 64), (512, 2048, 4096)
        shapes = {"mha": (32, 8, 128), "mla": (128, 512, 64)}
        page_sizes = (64, 16)
    roof = hbm_copy_gbps() if CUDA else 1.0
    print(f"roofline (device copy) {roof:.1f} GB/s", flush=True)
    if args.sweep_only:
        sw = sweep(roof, shapes, big_b=batches[-1], K=ks[-1] if args.quick else ks[1], parts=(args.sweep_only,))
        print("wrote", write_result("attention_sweep.json", {"roofline_gbps": roof, "sweep": sw}, args.out))
        return 0
    Hq, Hkv, D = shapes["mha"]
    H, Dl, Dr = shapes["mla"]
    gemm = bf16_gemm_tflops() if CUDA else 1.0
    print(f"compute ceiling (bf16 GEMM) {gemm:.1f} TFLOP/s", flush=True)
    if "mla_fp8" in args.parts:
        fp8_rows = mla_fp8_rows(roof, gemm, args.quick)
        print("wrote", write_result("attention_mla_fp8.json", {
            "rows": fp8_rows, "roofline_gbps": round(roof, 1), "compute_ceiling_tflops": round(gemm, 1),
            "method": "CUDA-graph replays; gbps counts each row's K KV rows (kv_bytes_per_token) + int32 indices "
                      "+ q and out; frac_roofline_model = max(byte time at the copy rate, flop time at the bf16 "
                      "GEMM rate) / time; a request's query tokens share most of their rows, so re-reads hit L2",
            "dtype": str(DTYPE), "quick": args.quick}, args.out))
    if "main" not in args.parts:
        return 0

    def mla_row(name: str, B: int, K: int, heads: int, us: float) -> dict:
        # roofline model: the larger of the byte time at the copy rate and the flop time at
        # the GEMM rate measured above
        nbytes, flops = mla_bytes(B, K, heads, Dl, Dr), mla_flops(B, K, heads, Dl, Dr)
        bound_us = max(nbytes / (roof * 1e9), flops / (gemm * 1e12)) * 1e6
        return row(name, B, K, us, nbytes, roof, heads=heads, tflops=round(flops / (us * 1e-6) / 1e12, 1),
                   frac_roofline_model=round(bound_us / us, 3))

    rows: list[dict] = []
    for B in batches:
        for K in ks:
            nbytes = mha_bytes(B, K, Hq, Hkv, D)
            for ps in page_sizes:
                q, k, v, pt, sl = mha_case(B, K, ps, Hq, Hkv, D)
                us = timed(lambda: paged_decode_triton(q, k, v, pt, sl, page_size=ps, sm_scale=D ** -0.5))
                rows.append(row(f"paged_decode_p{ps}", B, K, us, nbytes, roof))
                if ps == page_sizes[-1]:
                    # token slots (TritonAdapter path) over the same pages
                    slots = (pt.long()[:, :, None] * ps + torch.arange(ps, device=DEV)).reshape(-1).int()
                    indptr = torch.arange(B + 1, device=DEV, dtype=torch.int32) * K
                    us = timed(lambda: ragged_decode_triton(q, k, v, indptr, slots, max_kv_len=K, sm_scale=D ** -0.5))
                    rows.append(row("ragged_decode_p1", B, K, us, nbytes + B * K * 4, roof))
                    kd = k[slots.long()].view(B, K, Hkv, D).transpose(1, 2).contiguous()
                    vd = v[slots.long()].view(B, K, Hkv, D).transpose(1, 2).contiguous()
                    # the q heads of one kv group as that group's query rows: exact GQA, no KV repeat
                    q4 = q.view(B, Hkv, Hq // Hkv, D)
                    try:
                        us = timed(lambda: F.scaled_dot_product_attention(q4, kd, vd, scale=D ** -0.5))
                        rows.append(row("torch_sdpa_dense_gqa", B, K, us, nbytes, roof))
                    except Exception as e:  # noqa: BLE001
                        print("sdpa gqa failed", repr(e)[:200])
                    del kd, vd
                del q, k, v, pt, sl
            q, kv, idx = mla_case(B, K, H, Dl, Dr)
            mla_variants = [("sparse_mla_decode", None),  # default dispatch
                            ("sparse_mla_decode_fused", default_mla_config(q.device, H, B, K))]
            if CUDA:
                mla_variants.append(("sparse_mla_decode_gluon", MlaGluonConfig()))
            for name, cfg in mla_variants:
                us = timed(lambda: sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=Dl, sm_scale=0.1, config=cfg))
                rows.append(mla_row(name, B, K, H, us))
            if CUDA and B == batches[-1] and K == ks[1]:
                # the per-GPU head count of DeepSeek under TP=8: 16 heads, memory-bound
                q16 = q[:, :16].contiguous()
                us = timed(lambda: sparse_mla_decode_triton(q16, kv, idx, kv_lora_rank=Dl, sm_scale=0.1))
                rows.append(mla_row("sparse_mla_decode_h16", B, K, 16, us))
                del q16
            kvd = kv[idx.long()].view(B, 1, K, Dl + Dr)
            vd = kvd[..., :Dl].contiguous()
            q4 = q.view(B, 1, H, Dl + Dr)  # all heads share the one latent KV: heads as query rows
            try:
                us = timed(lambda: F.scaled_dot_product_attention(q4, kvd, vd, scale=0.1))
                rows.append(row("torch_sdpa_dense_mla", B, K, us, mla_bytes(B, K, H, Dl, Dr), roof,
                                tflops=round(mla_flops(B, K, H, Dl, Dr) / (us * 1e-6) / 1e12, 1)))
            except Exception as e:  # noqa: BLE001
                print("sdpa mla failed", repr(e)[:200])
            del q, kv, idx, kvd, vd
            if CUDA:
                torch.cuda.empty_cache()

    payload: dict[str, Any] = {"rows": rows, "roofline_method": "benchmarks.common.hbm_copy_gbps (2 GiB d2d, read+write)",
                               "compute_ceiling_tflops": round(gemm, 1),
                               "compute_ceiling_method": "bf16 8192^3 torch.matmul, CUDA-graph timed (MLA rows: "
                                                         "frac_roofline_model = max(byte time, flop time) / time)",
                               "dtype": str(DTYPE), "shapes": shapes, "quick": args.quick}
    target_b, target_k = (batches[-1], ks[1])
    payload["target_check"] = {
        r["kernel"]: r["frac_roofline"] for r in rows if r["B"] == target_b and r["K"] == target_k}
    if args.sweep:
        payload["sweep"] = sweep(roof, shapes, big_b=target_b, K=ks[-1] if args.quick else target_k)
    path = write_result("attention.json", payload, args.out)
    print("wrote", path)
    try:
        _plot(rows, path.with_suffix(".png"), target_b)
    except Exception as e:  # noqa: BLE001 - the plot is optional
        print("plot skipped:", e)
    return 0


def _plot(rows: list[dict], path, B: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kernels = sorted({r["kernel"] for r in rows})
    ks = sorted({r["K"] for r in rows})
    fig, ax = plt.subplots(figsize=(9, 4))
    w = 0.8 / len(kernels)
    for i, kern in enumerate(kernels):
        vals = [next((r["frac_roofline"] for r in rows if r["kernel"] == kern and r["K"] == K and r["B"] == B), 0) for K in ks]
        ax.bar([j + i * w for j in range(len(ks))], vals, w, label=kern)
    ax.axhline(0.8, color="k", ls="--", lw=1)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(ks))], [f"K={K}" for K in ks])
    ax.set_ylabel("fraction of HBM copy roofline")
    ax.set_title(f"decode attention, B={B}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
