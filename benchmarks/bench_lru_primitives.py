"""What one program (one SM) pays for each primitive the LRU diff is built from.

One program per row, B rows, N elements per row (8 warps); each op is repeated REP times
inside the kernel, so (time at REP=4 - time at REP=1) / 3 is the op's own cost and REP=1
includes the launch. The LRU diff's design follows from these numbers: random stores cost
several times a random load, so the hits' stamps go to helper programs
(sparsehi/kernels/lru_diff.py).

Usage: ``PYTHONPATH=. python benchmarks/bench_lru_primitives.py`` on a GPU; result
``benchmarks/results/lru_primitives.json`` (``rows: [{B, N, op, rep, us}]`` plus ``per_op_us``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import cuda_time_us, write_result  # noqa: E402
from sparsehi.kernels.lru_diff import _exclusive_cumsum  # noqa: E402


@triton.jit
def _prim(idx_ptr, mask_ptr, dst_ptr, src_ptr, out_ptr, N: tl.constexpr, OP: tl.constexpr, REP: tl.constexpr):
    """One op of kind OP repeated REP times on [N] vectors of one row per program."""
    b = tl.program_id(0)
    i = tl.arange(0, N)
    idx = tl.load(idx_ptr + b * N + i)  # distinct random positions in [0, 2N)
    mk = tl.load(mask_ptr + b * N + i) != 0
    dst = dst_ptr + b * (2 * N)
    acc = idx
    for r in tl.static_range(REP):
        if OP == 0:   # nothing
            acc = acc + 1
        elif OP == 1:  # random scatter, all lanes
            tl.store(dst + idx, acc)
        elif OP == 2:  # contiguous store
            tl.store(dst + i, acc)
        elif OP == 3:  # masked random scatter (mask ~7 %)
            tl.store(dst + idx, acc, mask=mk)
        elif OP == 4:  # masked, no lane active
            tl.store(dst + idx, acc, mask=mk & (i < 0))
        elif OP == 5:  # random gather
            acc = acc + tl.load(src_ptr + b * (2 * N) + idx)
        elif OP == 6:  # register gather
            acc = tl.gather(acc, idx % N, 0)
        elif OP == 7:  # block sum
            acc = acc + tl.sum(acc, 0)
        elif OP == 8:  # exclusive scan (fold 4)
            acc = _exclusive_cumsum(acc, N, 4)
        elif OP == 9:  # tl.cumsum
            acc = tl.cumsum(acc, 0)
        elif OP == 10:  # masked contiguous store (~7 %)
            tl.store(dst + i, acc, mask=mk)
        elif OP == 11:  # int64 packed sum
            acc = acc + tl.sum(acc.to(tl.int64) << 16, 0).to(tl.int32)
        elif OP == 12:  # store then barrier then reload a row
            tl.store(dst + idx, acc)
            tl.debug_barrier()
            acc = acc + tl.load(dst + i)
    tl.store(out_ptr + b * N + i, acc)


NAMES = {0: "alu", 1: "scatter", 2: "store_contig", 3: "scatter_masked7", 4: "scatter_masked0", 5: "gather",
         6: "tl.gather", 7: "sum", 8: "scan_fold4", 9: "tl.cumsum", 10: "store_contig_masked7", 11: "sum_i64",
         12: "scatter_barrier_reload"}


def per_op_costs(rows: list[dict]) -> tuple[dict, dict]:
    """(per additional op, first op over the 'alu' floor) in us, keyed B{B}_N{N}_{op}."""
    at = {(r["B"], r["N"], r["op"], r["rep"]): r["us"] for r in rows}
    per_op, first_op = {}, {}
    for (b, n, op, rep), us in at.items():
        if rep == 4:
            per_op[f"B{b}_N{n}_{op}"] = round((us - at[(b, n, op, 1)]) / 3, 3)
            first_op[f"B{b}_N{n}_{op}"] = round(at[(b, n, op, 1)] - at[(b, n, "alu", 1)], 3)
    return per_op, first_op


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="result directory (default benchmarks/results)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for B in (64, 1):
        for N in (2048, 4096):
            idx = torch.stack([torch.randperm(2 * N, device=dev)[:N] for _ in range(B)]).int().contiguous()
            mask = (torch.rand(B, N, device=dev) < 0.07).int()
            dst = torch.zeros(B, 2 * N, dtype=torch.int32, device=dev)
            src = torch.randint(0, 100, (B, 2 * N), dtype=torch.int32, device=dev)
            out = torch.zeros(B, N, dtype=torch.int32, device=dev)
            for op, name in NAMES.items():
                for rep in (1, 4):
                    us = cuda_time_us(lambda: _prim[(B,)](idx, mask, dst, src, out, N=N, OP=op, REP=rep, num_warps=8),
                                      iters=64, graph=True)
                    rows.append({"B": B, "N": N, "num_warps": 8, "op": name, "rep": rep, "us": round(us, 3)})
                    print(rows[-1], flush=True)
    per_op, first_op = per_op_costs(rows)
    payload = {"rows": rows, "per_op_us": per_op, "first_op_us": first_op,
               "notes": "per_op_us = (REP=4 - REP=1) / 3: one more op's cost inside a program of 8 warps (repeated "
                        "gathers read the same addresses and hit L1, so theirs is ~0); first_op_us = REP=1 minus "
                        "'alu' REP=1: the first op including its latency. Random indices are distinct positions in "
                        "[0, 2N) per row (one 4-byte element per 32-byte sector, mostly); masked7 = 7 % of lanes "
                        "active, like the LRU diff's victims."}
    print(f"wrote {write_result('lru_primitives.json', payload, args.out)}")


if __name__ == "__main__":
    main()
