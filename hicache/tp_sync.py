"""Tensor-parallel agreement: every rank must take the same tree decision, so counts that
can differ between ranks (finished transfers, usable hit lengths, allocation success) are
reduced with ``all_reduce(MIN)`` before they are acted on, as SGLang's HiRadixCache does.

With ``torch.distributed`` not initialised, or a group of one rank, values pass through.
The reductions run on CPU tensors (gloo, or NCCL groups created with a CPU backend are the
caller's choice: pass the group SGLang calls ``tp_cache_group``).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist


def world_size(group: Optional["dist.ProcessGroup"] = None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group=group)


def agree_min_many(values: Sequence[int], group: Optional["dist.ProcessGroup"] = None) -> list[int]:
    """Element-wise minimum of ``values`` over the ranks of ``group`` (one collective)."""
    vals = [int(v) for v in values]
    if world_size(group) <= 1 or not vals:
        return vals
    t = torch.tensor(vals, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in t.tolist()]


def agree_min(value: int, group: Optional["dist.ProcessGroup"] = None) -> int:
    """Minimum of ``value`` over the ranks: e.g. acks every rank has received, or the hit
    length every rank can serve."""
    return agree_min_many([value], group)[0]


def all_ranks_true(flag: bool, group: Optional["dist.ProcessGroup"] = None) -> bool:
    """True only if ``flag`` holds on every rank (MIN over 0/1)."""
    return agree_min(1 if flag else 0, group) == 1
