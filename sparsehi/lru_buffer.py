"""State of the per-request, per-layer GPU LRU buffers (pure data, no policy).

One *state row* per request slot (``req_pool_index``); one state plane per sparse layer.
Units are selection units: pages (tokens when ``page_size == 1``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LruState:
    """Buffer bookkeeping of every sparse layer for ``R`` request rows.

    resident:  ``[L, R, S] int32`` logical id held by each buffer slot, ``-1`` empty.
    last_used: ``[L, R, S] int32`` step of last use, ``-1`` never.
    slot_of:   ``[L, R, M] int32`` reverse map logical id -> slot it was last installed in,
               ``-1`` never; valid only where ``resident`` agrees (see kernels/lru_diff.py).
    """

    resident: torch.Tensor
    last_used: torch.Tensor
    slot_of: torch.Tensor

    @classmethod
    def empty(cls, num_layers: int, num_rows: int, slots: int, num_ids: int, device: torch.device) -> "LruState":
        st = cls(
            resident=torch.empty(num_layers, num_rows, slots, dtype=torch.int32, device=device),
            last_used=torch.empty(num_layers, num_rows, slots, dtype=torch.int32, device=device),
            slot_of=torch.empty(num_layers, num_rows, num_ids, dtype=torch.int32, device=device),
        )
        st.reset_rows(torch.arange(num_rows, device=device))
        return st

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Empty the buffers of ``rows`` (``[n] int64``) in every layer."""
        self.resident[:, rows] = -1
        self.last_used[:, rows] = -1
        self.slot_of[:, rows] = -1

    def layer(self, li: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(resident, last_used, slot_of)`` planes of sparse layer index ``li``."""
        return self.resident[li], self.last_used[li], self.slot_of[li]

    def fill(self, rows: torch.Tensor) -> float:
        """Share of occupied slots in the least-filled buffer of ``rows`` (``[n] int64``)
        over every layer; 1.0 with no rows, layers or slots. Syncs with the device."""
        if rows.numel() == 0 or self.resident.numel() == 0:
            return 1.0
        held = (self.resident[:, rows.to(self.resident.device)] >= 0).float().mean(dim=-1)  # [L, n]
        return float(held.min())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.resident, self.last_used, self.slot_of))
