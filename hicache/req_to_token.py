"""Request → token-slot map: row ``r`` holds the device slot of each token position."""
from __future__ import annotations

import torch


class ReqToTokenPool:
    """``req_to_token int64 [max_reqs, max_context_len]`` plus a free list of rows."""

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str):
        for name, value in (("max_reqs", max_reqs), ("max_context_len", max_context_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((max_reqs, max_context_len), dtype=torch.int64, device=self.device)
        self.clear()

    def clear(self) -> None:
        self._free = list(range(self.max_reqs - 1, -1, -1))  # pop() hands out row 0 first
        self._in_use = [False] * self.max_reqs

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """A free row index, or None when all rows are taken."""
        if not self._free:
            return None
        idx = self._free.pop()
        self._in_use[idx] = True
        return idx

    def free(self, idx: int) -> None:
        if not isinstance(idx, int) or isinstance(idx, bool) or not 0 <= idx < self.max_reqs:
            raise ValueError(f"idx must be an int in [0, {self.max_reqs}), got {idx!r}")
        if not self._in_use[idx]:
            raise ValueError(f"idx {idx} is not allocated (double free?)")
        self._in_use[idx] = False
        self._free.append(idx)

    def write(self, idx: int, positions: slice | torch.Tensor, slots: torch.Tensor) -> None:
        """Set ``req_to_token[idx, positions] = slots``."""
        if not isinstance(idx, int) or not 0 <= idx < self.max_reqs or not self._in_use[idx]:
            raise ValueError(f"idx must be an allocated row in [0, {self.max_reqs}), got {idx!r}")
        self.req_to_token[idx, positions] = slots.to(device=self.device, dtype=torch.int64)
