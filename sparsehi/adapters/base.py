"""BackendAdapter: turns a SparseSelection into an attention backend's own metadata, and
runs that backend. Adapters know nothing of selection policies or buffers.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from sparsehi.selection import SparseSelection


class BackendAdapter(ABC):
    """One attention backend's view of the sparse buffer."""

    name: str = "base"
    validate: bool = False
    """Debug mode: value checks of the selection and the tables against the pool
    (``sparsehi.adapters.checks``; host reads, skipped while a CUDA graph is captured)."""

    def _value_checks(self) -> bool:
        from sparsehi.input_checks import host_checks_enabled

        return host_checks_enabled(self.validate)

    def check_values(self, selection: SparseSelection) -> None:
        """``selection``'s values when this adapter validates (see ``validate``)."""
        if self._value_checks():
            from sparsehi.adapters.checks import check_selection_values

            check_selection_values(selection)

    @abstractmethod
    def build_metadata(self, selection: SparseSelection) -> Any:
        """Backend metadata for one decode layer, built on the selection's device without
        host synchronisation (no ``.item()`` / ``.tolist()``), fixed shapes for CUDA graphs."""

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, layer_cache: Any, metadata: Any, *, sm_scale: float) -> torch.Tensor:
        """Decode attention of ``q`` ``[B, Hq, D]`` over the layer's device cache as the
        metadata describes; returns ``[B, Hq, Dv]``."""
