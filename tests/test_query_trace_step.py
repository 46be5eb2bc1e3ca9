"""query_trace_step: one launch of a query trace's AR(1) step equals the torch reference
bit for bit (state, output, counter), over several programs that must all read the same
draw, over consecutive calls, and inside a CUDA graph on the GPU."""
from __future__ import annotations

import pytest
import torch

from sparsehi.kernels.query_trace_step import (BLOCK, query_trace_step, query_trace_step_reference,
                                               query_trace_step_triton)

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _inputs(shape, nb=7, seed=0, device="cpu", dtype=torch.bfloat16, start=3):
    g = torch.Generator().manual_seed(seed)
    state = torch.randn(shape, generator=g).to(device)
    bank = torch.randn((nb, *shape), generator=g).to(device)
    counter = torch.tensor([start], dtype=torch.int64, device=device)
    arrivals = torch.zeros(1, dtype=torch.int32, device=device)
    out = torch.empty(shape, dtype=dtype, device=device)
    return state, bank, counter, arrivals, out


def _run_both(fn, shape, steps, dtype, device="cpu", rho=0.93, c=0.37):
    a, b = _inputs(shape, dtype=dtype, device=device), _inputs(shape, dtype=dtype, device=device)
    for _ in range(steps):
        fn(*a, rho, c)
        query_trace_step_reference(*b, rho, c)
        for name, x, y in zip(("state", "bank", "counter", "arrivals", "out"), a, b):
            assert torch.equal(x, y), name
    return a


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(5, 4, 16), (3, 2 * BLOCK + 17)])
def test_kernel_steps_as_the_reference(dtype, shape):
    state, bank, counter, arrivals, out = _run_both(query_trace_step_triton, shape, 9, dtype)
    assert int(counter) == 3 + 9 and int(arrivals) == 0


def test_each_step_takes_the_next_draw():
    state, bank, counter, arrivals, out = _inputs((2, 3 * BLOCK), nb=5, dtype=torch.float32)
    state.zero_()
    query_trace_step_triton(state, bank, counter, arrivals, out, 0.0, 1.0)
    assert torch.equal(out, bank[4]) and int(counter) == 4  # counter 3 -> draw 4
    query_trace_step_triton(state, bank, counter, arrivals, out, 0.0, 1.0)
    assert torch.equal(out, bank[0]) and int(counter) == 5  # wraps around the bank


def test_bad_arguments_name_the_parameter():
    state, bank, counter, arrivals, out = _inputs((4, 8))
    with pytest.raises(ValueError, match="state"):
        query_trace_step(state.double(), bank, counter, arrivals, out, 0.5, 0.5)
    with pytest.raises(ValueError, match="bank"):
        query_trace_step(state, bank[:, :3], counter, arrivals, out, 0.5, 0.5)
    with pytest.raises(ValueError, match="counter"):
        query_trace_step(state, bank, counter.int(), arrivals, out, 0.5, 0.5)
    with pytest.raises(ValueError, match="arrivals"):
        query_trace_step(state, bank, counter, arrivals.long(), out, 0.5, 0.5)
    with pytest.raises(ValueError, match="out"):
        query_trace_step(state, bank, counter, arrivals, out[:2], 0.5, 0.5)


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 64, 128), (39, 64, 128), (3, 2 * BLOCK + 17)])
def test_gpu_kernel_steps_as_the_reference(dtype, shape):
    _run_both(query_trace_step, shape, 5, dtype, device="cuda")


@GPU
@pytest.mark.gpu
def test_gpu_replays_advance_the_trace():
    a, b = _inputs((39, 64, 128), device="cuda"), _inputs((39, 64, 128), device="cuda")
    query_trace_step(*a, 0.9, 0.4)
    query_trace_step_reference(*b, 0.9, 0.4)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        query_trace_step(*a, 0.9, 0.4)
    for _ in range(4):
        g.replay()
        query_trace_step_reference(*b, 0.9, 0.4)
    torch.cuda.synchronize()
    for name, x, y in zip(("state", "bank", "counter", "arrivals", "out"), a, b):
        assert torch.equal(x, y), name
