"""Sparse MLA decode on one GPU: the fused Triton kernel (old default) vs the Hopper Gluon
kernel (:class:`MlaGluonConfig`) variants.

For each variant: correctness against the torch reference on fresh random inputs (with
``-1`` padding, an out-of-pool index and an empty row) and the CUDA-graph time (two
timings) at Dl=512, Dr=64, K=2048 for the cases (B, H) in ``--cases`` (default 64x128,
16x128, 1x128, 64x16). Prints a compact table; writes ``mla_experiments.json`` under
``--out`` (default benchmarks/results).

Usage: ``PYTHONPATH=. python3 benchmarks/mla_experiments.py [--cases 64x128,64x16] [--only a,b]``;
``--profile VARIANT`` runs one variant 3x for ``ncu -k regex:_mla --launch-skip 1 -c 1``.
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback

import torch

from benchmarks.bench_attention import mla_bytes, mla_case, mla_flops
from benchmarks.common import cuda_time_us, device_info, write_result
from sparsehi.kernels.sparse_mla_decode import (MlaGluonConfig, default_mla_config, sparse_mla_decode_reference,
                                                sparse_mla_decode_triton)

DL, DR, K = 512, 64, 2048


def variants(B: int, H: int) -> list[tuple[str, object]]:
    dev = torch.device("cuda")
    G = MlaGluonConfig
    out = [("fused", default_mla_config(dev, H, B, K)), ("default", None)]
    if B == 1:
        return out
    out += [("gl_n64_b2", G(64, 2)), ("gl_n64_b2_late", G(64, 2, late_issue=True))]
    if H <= 32:
        out += [("gl_n64_b2_sp4", G(64, 2, num_splits=4)), ("gl_n32_b3_late", G(32, 3, late_issue=True))]
    return out


def _dump(rows, out_dir, env=None) -> None:
    write_result("mla_experiments.json", {"rows": rows, "env": env}, out_dir)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="64x128,16x128,1x128,64x16", help="BxH list")
    ap.add_argument("--only", default=None, help="comma list of variant names")
    ap.add_argument("--profile", default=None, help="run this variant 3x at the first batch (for ncu) and exit")
    ap.add_argument("--out", default=None, help="result directory (default benchmarks/results)")
    args = ap.parse_args()
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    if args.profile:
        B, H = cases[0]
        q, kv, idx = mla_case(B, K, H, DL, DR)
        cfg = dict(variants(B, H))[args.profile]
        for _ in range(3):
            sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=DL, sm_scale=0.1, config=cfg)
        torch.cuda.synchronize()
        return 0
    rows = []
    # odd shapes: H not a multiple of the head block, K not a multiple of the tile, empty and
    # short rows, padding, an out-of-pool slot
    for H2, cfg in ((80, MlaGluonConfig()), (80, MlaGluonConfig(32, 3, late_issue=True, num_splits=3)),
                    (16, MlaGluonConfig(num_splits=1)), (16, None)):
        r = {"check": "odd", "H": H2, "cfg": cfg.__dict__ if cfg is not None else None}
        try:
            q, kv, idx = mla_case(3, 1000, H2, DL, DR, seed=7)
            idx[0] = -1
            idx[1, 13:] = -1
            idx[2, ::5] = -1
            idx[2, 7] = kv.shape[0] + 5
            out = sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=DL, sm_scale=192 ** -0.5, config=cfg)
            bad = idx.clone()
            bad[2, 7] = -1
            ref = sparse_mla_decode_reference(q, kv, bad, kv_lora_rank=DL, sm_scale=192 ** -0.5)
            r["rel_err"] = rel_err(out, ref)
            r["ok"] = bool(r["rel_err"] < 1e-2 and torch.all(out[0] == 0) and not torch.isnan(out).any())
        except Exception as e:  # noqa: BLE001
            r["error"] = repr(e)[:300]
            traceback.print_exc()
        print(json.dumps(r), flush=True)
        rows.append(r)
    for B, H in cases:
        q, kv, idx = mla_case(B, K, H, DL, DR)
        # correctness on fresh inputs with padding and an out-of-pool index
        q2, kv2, idx2 = mla_case(B, K, H, DL, DR, seed=123)
        idx2[:, 5::7] = -1
        idx2[0, 3] = kv2.shape[0] + 10
        if B > 1:
            idx2[1] = -1
        ref2 = sparse_mla_decode_reference(q2, kv2, idx2, kv_lora_rank=DL, sm_scale=192 ** -0.5)
        ref = sparse_mla_decode_reference(q, kv, idx, kv_lora_rank=DL, sm_scale=0.1)
        for name, cfg in variants(B, H):
            if args.only and name not in args.only.split(","):
                continue
            r = {"B": B, "H": H, "K": K, "variant": name, "cfg": cfg.__dict__ if cfg is not None else None}
            try:
                o2 = sparse_mla_decode_triton(q2, kv2, idx2, kv_lora_rank=DL, sm_scale=192 ** -0.5, config=cfg)
                r["rel_err_pad"] = rel_err(o2, ref2)
                r["nan"] = bool(torch.isnan(o2).any())
                r["empty_row_zero"] = bool(B == 1 or torch.all(o2[1] == 0))
                fn = lambda: sparse_mla_decode_triton(q, kv, idx, kv_lora_rank=DL, sm_scale=0.1, config=cfg)  # noqa: E731
                r["rel_err"] = rel_err(fn(), ref)
                r["max_err"] = (fn().float() - ref.float()).abs().max().item()
                us = cuda_time_us(fn, iters=20, warmup=3, graph=True)
                us2 = cuda_time_us(fn, iters=20, warmup=1, graph=True)
                r["us"] = round(min(us, us2), 2)
                r["us_runs"] = [round(us, 2), round(us2, 2)]
                r["tflops"] = round(mla_flops(B, K, H, DL, DR) / (r["us"] * 1e-6) / 1e12, 1)
                r["gbps"] = round(mla_bytes(B, K, H, DL, DR) / (r["us"] * 1e-6) / 1e9, 1)
            except Exception as e:  # noqa: BLE001
                r["error"] = repr(e)[:300]
                traceback.print_exc()
            print(json.dumps(r), flush=True)
            rows.append(r)
            _dump(rows, args.out)
        del q, kv, idx, q2, kv2, idx2
        torch.cuda.empty_cache()
    _dump(rows, args.out, device_info())
    print(f"\n{'B':>3} {'H':>4} {'variant':<16} {'us':>8} {'TF/s':>7} {'GB/s':>7} {'rel_err':>9} {'rel_pad':>9} ok")
    for r in rows:
        if "check" in r:
            print(f"odd H={r['H']} {r['cfg']}: {r.get('ok', r.get('error'))} {r.get('rel_err')}")
            continue
        if "error" in r:
            print(f"{r['B']:>3} {r['H']:>4} {r['variant']:<16} ERROR {r['error'][:90]}")
            continue
        ok = r["rel_err"] < 1e-2 and r["rel_err_pad"] < 1e-2 and not r["nan"] and r["empty_row_zero"]
        print(f"{r['B']:>3} {r['H']:>4} {r['variant']:<16} {r['us']:>8.2f} {r['tflops']:>7.1f} {r['gbps']:>7.0f} "
              f"{r['rel_err']:>9.2e} {r['rel_err_pad']:>9.2e} {'ok' if ok else 'BAD'} {r['us_runs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
