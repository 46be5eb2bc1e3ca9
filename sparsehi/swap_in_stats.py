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
from typing import Optional

import torch

from sparsehi.kernels.step_counters import close_step_counts


@dataclass
class StepCounts:
    """One decode step's per-layer tables (built once per step, shared by its layers).

    valid: ``[n_sparse, B] int32`` ids each sparse layer attended per row (0 for layers
           that did not run the diff this step).
    loads: ``[n_sparse, B] int32`` of them loaded from host.
    table: ``[2, n_sparse, B] int32`` the one allocation ``valid`` and ``loads`` view, or None.
    """

    valid: torch.Tensor
    loads: torch.Tensor
    table: Optional[torch.Tensor] = None

    @classmethod
    def empty(cls, n_sparse: int, batch: int, device: torch.device) -> "StepCounts":
        """Zeroed tables (one allocation and one fill)."""
        return cls.of(torch.zeros(2, n_sparse, batch, dtype=torch.int32, device=device))

    @classmethod
    def uninitialized(cls, n_sparse: int, batch: int, device: torch.device) -> "StepCounts":
        """Tables to be zeroed by the caller (``begin_step`` zeroes them in its own launch)."""
        return cls.of(torch.empty(2, n_sparse, batch, dtype=torch.int32, device=device))

    @classmethod
    def of(cls, table: torch.Tensor) -> "StepCounts":
        """Views of a ``[2, n_sparse, B] int32`` table (valid, loads)."""
        if table.dim() != 3 or table.shape[0] != 2 or table.dtype != torch.int32 or not table.is_contiguous():
            raise ValueError(f"table must be a contiguous [2, n_sparse, B] int32 tensor, got {tuple(table.shape)} "
                             f"{table.dtype}")
        return cls(table[0], table[1], table)


class SwapInCounters:
    """Per-layer hits and misses: running totals and the last ``history`` steps."""

    def __init__(self, num_layers: int, sparse_layers: tuple[int, ...], device: torch.device,
                 history: int = 4096) -> None:
        if not isinstance(history, int) or history < 1:
            raise ValueError(f"history={history!r} is invalid: an integer >= 1")
        self.num_layers = num_layers
        self.history = history
        self.device = device
        slot = [-1] * num_layers  # sparse index of each layer, -1 for the others
        for i, layer in enumerate(sparse_layers):
            slot[layer] = i
        self._layer_slot = torch.tensor(slot, dtype=torch.int32, device=device)
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
        """Fold one step in one launch (graph-safe: fixed shapes, no host sync; see
        sparsehi/kernels/step_counters.py).

        counts: the step's tables; step_t: ``[1] int32`` device step number;
        live: ``[B] bool`` rows that are real requests (padding rows count nothing anyway).
        """
        table = counts.table if counts.table is not None else torch.stack([counts.valid, counts.loads])
        close_step_counts(table, step_t, live, self._layer_slot, self.totals, self.ring, self.ring_step,
                          self.steps_closed)

    def read(self) -> tuple[int, list[int], list[int], list[tuple[int, list[int], list[int]]]]:
        """Host copy (syncs): ``(steps closed, total hits per layer, total misses per layer,
        [(step, hits per layer, misses per layer)] of the kept steps in step order)``."""
        tot = self.totals.tolist()
        ring = self.ring.tolist()
        steps = self.ring_step.tolist()
        kept = sorted((s, i) for i, s in enumerate(steps) if s >= 0)
        per_step = [(s, ring[i][0], ring[i][1]) for s, i in kept]
        return int(self.steps_closed.item()), tot[0], tot[1], per_step
