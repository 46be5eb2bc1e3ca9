"""One step of a benchmark query trace's AR(1) process, in one launch.

``runtime.traces.QueryTrace`` drives a decode benchmark's selection queries with

    counter += 1;  state = rho * state + c * bank[counter % NB];  out = state in out's dtype

per layer and step (``state [N]`` float32, updated in place; ``bank [NB, N]`` float32 noise
draws; ``counter [1]`` int64 shared by every trace call). In torch that is six launches (the
counter's add and modulo, the draw's gather, two in-place updates, the cast); a benchmark
charges them to the sparse modes' steps, where the model's own index queries would be. Here
one grid does it all: every program reads the counter before it arrives at ``arrivals [1]``
int32, and the last to arrive advances the counter and resets the arrivals, so all read the
same draw (CUDA-graph safe: no host sync, fixed grid, no allocation).

The update rounds as the reference does (the product, then the sum, each to float32; the
cast to bf16 to nearest even, by hand since the CPU interpreter truncates there).

Entry points: ``query_trace_step`` (dispatch), ``query_trace_step_triton``,
``query_trace_step_reference``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hicache.triton_support import dispatch
from sparsehi.kernels.store_rounding import as_stored

BLOCK = 2048
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(state, bank, counter, arrivals, out) -> None:
    if not isinstance(state, torch.Tensor) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("state must be a contiguous float32 tensor")
    n = state.numel()
    if not isinstance(bank, torch.Tensor) or bank.dtype != torch.float32 or bank.dim() < 2 \
            or bank[0].numel() != n or not bank.is_contiguous():
        raise ValueError(f"bank must be a contiguous float32 [NB, *state.shape] tensor ({n} values a draw)")
    if not isinstance(counter, torch.Tensor) or counter.shape != (1,) or counter.dtype != torch.int64:
        raise ValueError("counter must be a [1] int64 tensor")
    if not isinstance(arrivals, torch.Tensor) or arrivals.shape != (1,) or arrivals.dtype != torch.int32:
        raise ValueError("arrivals must be a [1] int32 tensor (0 between calls)")
    if not isinstance(out, torch.Tensor) or out.numel() != n or out.dtype not in _OUT_DTYPES \
            or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor of state's {n} values in one of {_OUT_DTYPES}")
    if len({t.device for t in (state, bank, counter, arrivals, out)}) != 1:
        raise ValueError("state, bank, counter, arrivals and out must be on one device")


def query_trace_step_reference(state: torch.Tensor, bank: torch.Tensor, counter: torch.Tensor,
                               arrivals: torch.Tensor, out: torch.Tensor, rho: float, c: float) -> torch.Tensor:
    """Torch reference (in place on ``state``, ``counter`` and ``out``); returns ``out``."""
    _check(state, bank, counter, arrivals, out)
    counter.add_(1)
    noise = bank.index_select(0, counter % bank.shape[0])[0].view(state.shape)
    state.mul_(rho).add_(noise * c)
    out.copy_(state.view(out.shape))
    return out


@triton.jit
def _query_trace_step_kernel(state_ptr, bank_ptr, counter_ptr, arrive_ptr, out_ptr, N, NB, rho, c,
                             BLOCK: tl.constexpr):
    k = tl.load(counter_ptr)
    draw = (k + 1) % NB
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    s = tl.load(state_ptr + offs, mask=m, other=0.0)
    e = tl.load(bank_ptr + draw * N + offs, mask=m, other=0.0)
    # two roundings, as the reference's mul_ and add_ (no fused multiply-add)
    s = tl.fma(s, rho, 0.0)
    s = tl.fma(e, c, 0.0) + s
    tl.store(state_ptr + offs, s, mask=m)
    tl.store(out_ptr + offs, as_stored(s, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty), mask=m)
    # after every program read the counter (its load comes before its arrival): advance it once
    if tl.atomic_add(arrive_ptr, 1) == tl.num_programs(0) - 1:
        tl.store(counter_ptr, k + 1)
        tl.atomic_xchg(arrive_ptr, 0)


def query_trace_step_triton(state: torch.Tensor, bank: torch.Tensor, counter: torch.Tensor, arrivals: torch.Tensor,
                            out: torch.Tensor, rho: float, c: float) -> torch.Tensor:
    """Triton launcher: one launch, ``ceil(N / BLOCK)`` programs; same effect as the reference."""
    _check(state, bank, counter, arrivals, out)
    n = state.numel()
    if n == 0:
        counter.add_(1)
        return out
    _query_trace_step_kernel[(triton.cdiv(n, BLOCK),)](state, bank, counter, arrivals, out, n, bank.shape[0],
                                                        float(rho), float(c), BLOCK=BLOCK)
    return out


def query_trace_step(state: torch.Tensor, bank: torch.Tensor, counter: torch.Tensor, arrivals: torch.Tensor,
                     out: torch.Tensor, rho: float, c: float) -> torch.Tensor:
    """One trace step (module docstring): Triton on CUDA, the torch reference elsewhere."""
    impl = dispatch("query_trace_step", state, query_trace_step_triton, query_trace_step_reference)
    return impl(state, bank, counter, arrivals, out, rho, c)
