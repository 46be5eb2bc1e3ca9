"""Prefill attention at the soak's model shapes: the row-invariant Triton kernel
(``sparsehi/kernels/prefill_attention.py``) under each launch shape beside the library
path (SDPA), for a cold prompt and for a suffix after a reused prefix; each config's rows
are also checked bitwise-invariant (suffix rows == the whole prompt's rows).

Result: ``prefill_attention.json`` (``--out``, default benchmarks/results).

    PYTHONPATH=. python benchmarks/bench_prefill_attention.py
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path
from typing import Any

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS_DIR, cuda_time_us, device_info, write_result  # noqa: E402
from sparsehi.kernels.prefill_attention import PrefillAttentionConfig, prefill_attention_triton  # noqa: E402
from sparsehi.runtime.attention import causal_attention  # noqa: E402

SHAPES = {  # name: (query heads, KV heads, key dim, value dim), as tiny-gqa and tiny-dsa
    "gqa": (4, 2, 32, 32),
    "mla": (4, 1, 80, 64),
}
CONFIGS = [PrefillAttentionConfig(m, n, w) for m, n, w in
           ((32, 32, 4), (64, 32, 4), (64, 64, 4), (128, 64, 8), (128, 32, 4), (64, 128, 8))]


def _inputs(shape: str, S: int, off: int, dtype: torch.dtype):
    hq, hkv, d, dv = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(S - off, hq, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(S, hkv, d, device="cuda", dtype=dtype, generator=g)
    # MLA: the values are the latent entry's first dv columns, as the runtime passes them
    v = k[..., :dv] if dv != d else torch.randn(S, hkv, dv, device="cuda", dtype=dtype, generator=g)
    return q, k, v, d ** -0.5


def measure(shape: str, S: int, off: int, dtype: torch.dtype, iters: int) -> dict[str, Any]:
    """One case: SDPA's time, each config's time and whether its rows are invariant."""
    q, k, v, scale = _inputs(shape, S, off, dtype)
    row: dict[str, Any] = {"shape": shape, "context": S, "new_tokens": S - off, "dtype": str(dtype).split(".")[-1]}
    row["sdpa_us"] = round(cuda_time_us(lambda: causal_attention(q, k, v, scale, off), iters=iters), 1)
    qw, _, _, _ = _inputs(shape, S, 0, dtype)
    qw[off:] = q
    for cfg in CONFIGS:
        key = f"m{cfg.block_m}_n{cfg.block_n}_w{cfg.num_warps}"
        try:
            prefill_attention_triton(q, k, v, scale, off, cfg)
        except triton.runtime.errors.OutOfResources as e:  # a launch shape this head size cannot take
            row[key] = {"error": str(e).split(".")[0]}
            continue
        us = cuda_time_us(lambda: prefill_attention_triton(q, k, v, scale, off, cfg), iters=iters)
        whole = prefill_attention_triton(qw, k, v, scale, 0, cfg)
        part = prefill_attention_triton(q, k, v, scale, off, cfg)
        row[key] = {"us": round(us, 1), "vs_sdpa": round(us / row["sdpa_us"], 3),
                    "rows_invariant": bool(torch.equal(part, whole[off:]))}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="4096,32768", help="comma list of prompt lengths")
    ap.add_argument("--suffix", type=int, default=256, help="new tokens of the reused-prefix case")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None, help="result directory (default benchmarks/results)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    rows = []
    for shape in SHAPES:
        for S in (int(x) for x in a.contexts.split(",")):
            for off in (0, S - a.suffix):
                rows.append(measure(shape, S, off, torch.float32, a.iters))
                print(rows[-1], flush=True)
    payload = {"device": device_info()["device"], "date": datetime.date.today().isoformat(),
               "what": "prefill attention at the soak's model shapes (float32): SDPA vs the row-invariant kernel "
                       "per launch shape; us per call; rows_invariant: the suffix's rows equal the whole prompt's",
               "rows": rows}
    write_result("prefill_attention.json", payload, a.out or RESULTS_DIR)
    return 0


if __name__ == "__main__":
    sys.exit(main())
