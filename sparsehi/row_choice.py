"""A per-row choice between two Top-k selections, read by the kernels that consume one.

A sparse layer's selection takes, per batch row, either the algorithm's Top-k (rows that
are sparse and live) or the row's plain candidate list (rows whose candidates fit in
top-k, dense rows, padding rows). Materialising that choice costs two element-wise
launches per sparse layer (a ``torch.where`` over ``[B, K]`` and one over ``[B]``); the
kernels that read the selection next (the LRU diff, the selection table, the fused copy
and table: ``sparsehi.kernels.lru_diff``, ``selection_table``, ``swap_in_fused``) take a
``RowChoice`` as their ``choice`` argument instead and read each row from the side it
chose. What they compute is what they compute on ``RowChoice.apply``'s output, which is
also the torch reference of the substitution (their references call it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowChoice:
    """Row ``b`` of a selection is ``(topk[b], valid[b])`` where ``use[b]``, else
    ``(ids[b], count[b])``.

    use:   ``[B] bool`` rows that take the given selection.
    ids:   ``[B, K] int32`` the other selection (e.g. every candidate, -1 padded), last dim
           contiguous.
    count: ``[B] int32`` its valid entries per row.
    """

    use: torch.Tensor
    ids: torch.Tensor
    count: torch.Tensor

    def check(self, topk: torch.Tensor, valid: torch.Tensor) -> None:
        """Shapes, dtypes and devices against the selection it stands beside (no host sync)."""
        b, k = topk.shape
        if self.use.shape != (b,) or self.use.dtype != torch.bool:
            raise ValueError(f"RowChoice.use must be [B={b}] bool, got {tuple(self.use.shape)} {self.use.dtype}")
        if self.ids.shape != (b, k) or self.ids.dtype != torch.int32 or (k and self.ids.stride(1) != 1):
            raise ValueError(f"RowChoice.ids must be [B={b}, K={k}] int32 with a contiguous last dim, got "
                             f"{tuple(self.ids.shape)} {self.ids.dtype} strides {self.ids.stride()}")
        if self.count.shape != (b,) or self.count.dtype != torch.int32:
            raise ValueError(f"RowChoice.count must be [B={b}] int32, got {tuple(self.count.shape)} {self.count.dtype}")
        for name, t in (("use", self.use), ("ids", self.ids), ("count", self.count)):
            if t.device != topk.device:
                raise ValueError(f"RowChoice.{name} is on {t.device}, topk on {topk.device}: all on one device")
        if valid.device != topk.device:
            raise ValueError(f"valid is on {valid.device}, topk on {topk.device}: all on one device")

    def apply(self, topk: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen selection, materialised: ``([B, K] int32, [B] int32)`` (the torch
        reference of what the kernels read)."""
        self.check(topk, valid)
        return torch.where(self.use[:, None], topk, self.ids), torch.where(self.use, valid, self.count)

