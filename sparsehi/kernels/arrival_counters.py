"""Arrival counters of split-K launches that merge their splits in the kernel.

A program of such a launch stores its partial output, then adds one to its output tile's
counter; the program that arrives last reads every split's partial, writes the merged
output and sets the counter back to zero, so each launch finds the counters as the one
before left them: zero. :func:`arrival_counters` hands out one zeroed ``int32`` buffer per
(device, stream), allocated outside CUDA-graph capture and kept for the process: a graph
captured over it bakes its address in. Two launches in flight at once on different streams
get different buffers; graphs replayed concurrently on two streams must not share one
(they were captured on the same stream).
"""
from __future__ import annotations

from typing import Optional

import torch

MIN_COUNTERS = 1 << 16
"""Counters a buffer holds at least (256 KiB): a launch needs one per (request, head block,
storing warpgroup), so this covers any batch the decode kernels run before it must grow."""

_BUFFERS: dict[tuple[str, int], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []
"""Buffers replaced by larger ones: graphs captured over them still read their addresses."""


def _capturing() -> bool:
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def arrival_counters(device: torch.device, count: int) -> Optional[torch.Tensor]:
    """A zeroed ``int32`` buffer of at least ``count`` counters for launches on ``device``'s
    current stream, or None while a CUDA graph is being captured and no buffer large enough
    exists yet: a buffer allocated inside a capture would be zeroed only at replay and so
    hold garbage for an eager launch, so the caller merges in a separate launch instead."""
    if count < 0:
        raise ValueError(f"count={count!r} is invalid: a count of counters >= 0")
    device = torch.device(device)
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device).cuda_stream
    else:
        stream = 0
    key = (str(device), stream)
    buf = _BUFFERS.get(key)
    if buf is not None and buf.numel() >= count:
        return buf
    if device.type == "cuda" and _capturing():
        return None
    if buf is not None:
        _OUTGROWN.append(buf)
    size = max(MIN_COUNTERS, count if buf is None else max(count, 2 * buf.numel()))
    buf = torch.zeros(size, dtype=torch.int32, device=device)
    _BUFFERS[key] = buf
    return buf
