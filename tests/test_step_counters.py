"""Closing a step's hit / miss counters (sparsehi/kernels/step_counters.py): the one-program
kernel against its torch reference, and SwapInCounters on top of it."""
import os

import pytest
import torch

from sparsehi.kernels.step_counters import (close_step_counts, close_step_counts_reference,
                                            close_step_counts_triton)
from sparsehi.swap_in_stats import StepCounts, SwapInCounters

needs_interp = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="interpreted Triton kernels need TRITON_INTERPRET=1")


def _state(L, H, dev, channels=2):
    g = torch.Generator().manual_seed(3)
    C = channels
    return [torch.randint(0, 50, (C, L), generator=g).to(dev), torch.randint(0, 50, (H, C, L), generator=g).to(dev),
            torch.randint(-1, 9, (H,), generator=g).to(dev), torch.tensor([5], device=dev)]


def _slots(L, sparse, dev):
    s = [-1] * L
    for i, layer in enumerate(sparse):
        s[layer] = i
    return torch.tensor(s, dtype=torch.int32, device=dev)


def _steps(dev, L=6, sparse=(1, 2, 4), B=5, H=3, fn=close_step_counts_triton, channels=2):
    g = torch.Generator().manual_seed(4)
    state = _state(L, H, dev, channels)
    slots = _slots(L, sparse, dev)
    for step, live in ((1, [True, False, True, False, False]), (2, [False] * B), (3, [True] * B),
                       (7, [False, True, False, False, False])):  # 7: the ring wraps
        v = torch.randint(0, 40, (len(sparse), B), generator=g, dtype=torch.int32)
        extra = [torch.randint(0, 9, v.shape, generator=g, dtype=torch.int32) for _ in range(channels - 2)]
        counts = torch.stack([v, torch.minimum(v, torch.randint(0, 40, v.shape, generator=g, dtype=torch.int32)),
                              *extra])
        fn(counts.to(dev), torch.tensor([step], dtype=torch.int32, device=dev), torch.tensor(live, device=dev),
           slots, *state)
    return state


@needs_interp
@pytest.mark.parametrize("channels", [2, 4])
@pytest.mark.parametrize("sparse", [(1, 2, 4), (0, 5), ()])
def test_close_step_kernel_matches_reference(sparse, channels):
    dev = torch.device("cpu")
    ref = _steps(dev, sparse=sparse, fn=close_step_counts_reference, channels=channels)
    got = _steps(dev, sparse=sparse, fn=close_step_counts_triton, channels=channels)
    for name, x, y in zip(("totals", "ring", "ring_step", "steps_closed"), ref, got):
        assert torch.equal(x, y), (name, x, y)
    assert int(ref[3]) == 5 + 3  # the step without a live row is not counted
    assert ref[2][2].item() == -1 and ref[2][1].item() == 7  # step 2: no live row; step 7 in slot 1


def test_close_step_reference_by_hand():
    dev = torch.device("cpu")
    totals, ring = torch.zeros(2, 3, dtype=torch.int64), torch.zeros(4, 2, 3, dtype=torch.int64)
    ring_step, closed = torch.full((4,), -1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    counts = torch.tensor([[[5, 3]], [[2, 0]]], dtype=torch.int32)  # one sparse layer (model layer 2)
    close_step_counts_reference(counts, torch.tensor([6], dtype=torch.int32), torch.tensor([True, False]),
                                _slots(3, (2,), dev), totals, ring, ring_step, closed)
    assert totals.tolist() == [[0, 0, 6], [0, 0, 2]] and ring[2].tolist() == [[0, 0, 6], [0, 0, 2]]
    assert ring_step.tolist() == [-1, -1, 6, -1] and closed.tolist() == [1]


def test_swap_in_counters_close_and_read():
    c = SwapInCounters(4, (1, 3), torch.device("cpu"), history=8)
    counts = StepCounts.empty(2, 3, torch.device("cpu"))
    assert counts.table.shape == (4, 2, 3) and counts.valid.data_ptr() == counts.table.data_ptr()
    counts.valid.copy_(torch.tensor([[4, 4, 0], [2, 0, 0]]))
    counts.loads.copy_(torch.tensor([[1, 0, 0], [2, 0, 0]]))
    counts.ahead_loads.copy_(torch.tensor([[3, 1, 0], [0, 0, 0]]))
    counts.hidden.copy_(torch.tensor([[2, 0, 0], [0, 1, 0]]))
    c.close_step(counts, torch.tensor([1], dtype=torch.int32), torch.tensor([True, True, False]))
    steps, hits, misses, kept = c.read()
    assert steps == 1 and hits == [0, 7, 0, 0] and misses == [0, 1, 0, 2]
    assert kept == [(1, [0, 7, 0, 0], [0, 1, 0, 2])]
    assert c.read_ahead() == ([0, 4, 0, 0], [0, 2, 0, 1])
    with pytest.raises(ValueError, match="table must be"):
        StepCounts.of(torch.zeros(3, 2, 3, dtype=torch.int32))


def test_close_step_rejects_bad_input():
    dev = torch.device("cpu")
    state = _state(3, 2, dev)
    with pytest.raises(ValueError, match="live must be"):
        close_step_counts(torch.zeros(2, 1, 4, dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                          torch.ones(3, dtype=torch.bool), _slots(3, (0,), dev), *state)


@pytest.mark.gpu
@pytest.mark.parametrize("channels", [2, 4])
@pytest.mark.parametrize("sparse", [(1, 2, 4), ()])
def test_close_step_cuda_matches_reference(sparse, channels):
    ref = _steps(torch.device("cuda"), sparse=sparse, fn=close_step_counts_reference, channels=channels)
    got = _steps(torch.device("cuda"), sparse=sparse, fn=close_step_counts, channels=channels)
    for x, y in zip(ref, got):
        assert torch.equal(x, y)
