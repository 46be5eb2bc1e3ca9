"""What a per-row grid barrier costs against a kernel boundary in a CUDA graph, at the Top-k
radix grid's shape (``topk_radix_grid``: B rows x 16 chunks of 2048 float32 scores): six
phases, each loading its chunk, reading what every chunk of its row stored in the phase
before and storing a sum, run as six launches and as one launch whose programs wait at an
acquire-release counter of their row between phases (the last program of a row to leave
sets it back to zero). Each timed as 8 calls in one CUDA graph
(``common.graph_replay_best_us``); ``same``: both forms store the same sums and leave the
counters at zero.

    PYTHONPATH=. python benchmarks/grid_barrier_probe.py [--commit SHA] [--out DIR]
"""
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import graph_replay_best_us, result_parser, write_result  # noqa: E402

CH = 2048


@triton.jit
def _row_barrier(bar, target):
    """Wait until ``target`` programs of the row have arrived at ``bar`` (this one counted)."""
    tl.debug_barrier()
    tl.atomic_add(bar, 1, sem="release", scope="gpu")
    cur = tl.atomic_add(bar, 0, sem="acquire", scope="gpu")
    while cur < target:
        cur = tl.atomic_add(bar, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _phase(s_ptr, acc_ptr, b, p, N, P: tl.constexpr, CH: tl.constexpr, PH: tl.constexpr):
    offs = p * CH + tl.arange(0, CH)
    x = tl.load(s_ptr + b * N + offs, cache_modifier=".cg")
    # each phase reads what the phase before stored for the row (all chunks)
    prev = tl.sum(tl.load(acc_ptr + (b * 8 + PH) * P + tl.arange(0, P), cache_modifier=".cg"), 0)
    tl.store(acc_ptr + (b * 8 + PH + 1) * P + p, tl.sum(x, 0) + prev * 1e-9)


@triton.jit
def _phase_kernel(s_ptr, acc_ptr, N, P: tl.constexpr, CH: tl.constexpr, PH: tl.constexpr):
    _phase(s_ptr, acc_ptr, tl.program_id(1), tl.program_id(0), N, P, CH, PH)


@triton.jit
def _fused_kernel(s_ptr, acc_ptr, bar_ptr, N, P: tl.constexpr, CH: tl.constexpr, PHASES: tl.constexpr):
    b = tl.program_id(1)
    p = tl.program_id(0)
    bar = bar_ptr + b * 2
    for ph in tl.static_range(PHASES):
        _phase(s_ptr, acc_ptr, b, p, N, P, CH, ph)
        if ph + 1 < PHASES:
            _row_barrier(bar, (ph + 1) * P)
    gone = tl.atomic_add(bar + 1, 1, sem="acq_rel", scope="gpu")
    if gone == P - 1:
        tl.store(bar, 0)
        tl.store(bar + 1, 0)


def main(argv=None) -> int:
    a = result_parser(__doc__).parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    rows = [measure(B) for B in (1, 8, 39, 48)]
    print("wrote", write_result("grid_barrier_probe.json", {
        "what": "six phases over B rows x 16 chunks of 2048 float32 scores: six launches against one launch with "
                "per-row barriers between phases (us per call, 8 calls a CUDA graph)", "commit": a.commit,
        "rows": rows}, a.out))
    return 0 if all(r["same"] for r in rows) else 1


def measure(B: int) -> dict:
    P, N = 16, 16 * CH
    s = torch.randn(B, N, device="cuda")
    acc = torch.zeros(B, 8, P, device="cuda")
    bar = torch.zeros(B, 2, dtype=torch.int32, device="cuda")

    def phase(ph):
        _phase_kernel[(P, B)](s, acc, N, P=P, CH=CH, PH=ph, num_warps=4)

    def launches():
        for ph in range(6):
            phase(ph)

    def fused():
        _fused_kernel[(P, B)](s, acc, bar, N, P=P, CH=CH, PHASES=6, num_warps=4)

    launches()
    torch.cuda.synchronize()
    ref = acc.clone()
    acc.zero_()
    same = True
    for _ in range(4):
        fused()
        torch.cuda.synchronize()
        same = same and torch.allclose(acc, ref) and int(bar.abs().sum()) == 0
    r = dict(B=B, six_launches_us=round(graph_replay_best_us(launches, per_graph=8), 2),
             one_launch_barriers_us=round(graph_replay_best_us(fused, per_graph=8), 2),
             one_phase_us=round(graph_replay_best_us(lambda: phase(0), per_graph=8), 2), same=bool(same))
    print(r, flush=True)
    return r


if __name__ == "__main__":
    raise SystemExit(main())
