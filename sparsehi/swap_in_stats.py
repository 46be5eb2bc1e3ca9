"""Hit / miss counters of the LRU buffers, kept on the device so a CUDA-graph-captured
decode step updates them without a host sync.

Each sparse layer's swap-in records how many ids it attended (``valid``) and how many it
loaded (``num_loads``) into the open step's ``[n_sparse, B]`` tables; ``close_step`` folds
them into per-layer totals and into a ring of the last ``history`` steps (written at
``step % history``, the step number read from the device step counter). Steps whose batch
had no live row (the padded warm-up runs of graph capture) are marked and left out of
``read``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepCounts:
    """One decode step's per-layer tables (built once per step, shared by its layers).

    valid: ``[n_sparse, B] int32`` ids each sparse layer attended per row (0 for layers
           that did not run the diff this step).
    loads: ``[n_sparse, B] int32`` of them loaded from host.
    """

    valid: torch.Tensor
    loads: torch.Tensor

    @classmethod
    def empty(cls, n_sparse: int, batch: int, device: torch.device) -> "StepCounts":
        return cls(torch.zeros(n_sparse, batch, dtype=torch.int32, device=device),
                   torch.zeros(n_sparse, batch, dtype=torch.int32, device=device))


class SwapInCounters:
    """Per-layer hits and misses: running totals and the last ``history`` steps."""

    def __init__(self, num_layers: int, sparse_layers: tuple[int, ...], device: torch.device,
                 history: int = 4096) -> None:
        if not isinstance(history, int) or history < 1:
            raise ValueError(f"history={history!r} is invalid: an integer >= 1")
        self.num_layers = num_layers
        self.history = history
        self.device = device
        self._sparse_idx = torch.tensor(sparse_layers, dtype=torch.int64, device=device)
        L, H, dev = num_layers, history, device
        self.totals = torch.zeros(2, L, dtype=torch.int64, device=dev)  # [hits, misses]
        self.ring = torch.zeros(H, 2, L, dtype=torch.int64, device=dev)
        self.ring_step = torch.full((H,), -1, dtype=torch.int64, device=dev)
        self.steps_closed = torch.zeros(1, dtype=torch.int64, device=dev)

    def reset(self) -> None:
        """Zero every counter in place: a captured decode graph keeps updating these very
        tensors (replacing them would leave the graph writing freed memory)."""
        self.totals.zero_()
        self.ring.zero_()
        self.ring_step.fill_(-1)
        self.steps_closed.zero_()

    def close_step(self, counts: StepCounts, step_t: torch.Tensor, live: torch.Tensor) -> None:
        """Fold one step (graph-safe: fixed shapes, no host sync).

        counts: the step's tables; step_t: ``[1] int32`` device step number;
        live: ``[B] bool`` rows that are real requests (padding rows count nothing anyway).
        """
        if counts.valid.shape[0] == 0:
            hm = torch.zeros(2, self.num_layers, dtype=torch.int64, device=self.device)
        else:
            v = counts.valid.sum(1, dtype=torch.int64)
            nl = counts.loads.sum(1, dtype=torch.int64)
            hm = torch.zeros(2, self.num_layers, dtype=torch.int64, device=self.device)
            hm[0].index_add_(0, self._sparse_idx, v - nl)
            hm[1].index_add_(0, self._sparse_idx, nl)
        any_live = live.any().to(torch.int64)
        self.totals += hm
        self.steps_closed += any_live
        slot = (step_t.to(torch.int64) % self.history)
        self.ring.index_copy_(0, slot, hm[None])
        # a step with no live row (capture warm-up) is recorded as -1: read() skips it
        step_id = torch.where(any_live > 0, step_t.to(torch.int64), torch.full_like(any_live, -1))
        self.ring_step.index_copy_(0, slot, step_id)

    def read(self) -> tuple[int, list[int], list[int], list[tuple[int, list[int], list[int]]]]:
        """Host copy (syncs): ``(steps closed, total hits per layer, total misses per layer,
        [(step, hits per layer, misses per layer)] of the kept steps in step order)``."""
        tot = self.totals.tolist()
        ring = self.ring.tolist()
        steps = self.ring_step.tolist()
        kept = sorted((s, i) for i, s in enumerate(steps) if s >= 0)
        per_step = [(s, ring[i][0], ring[i][1]) for s, i in kept]
        return int(self.steps_closed.item()), tot[0], tot[1], per_step
