"""What :func:`~sparsehi.algorithms.testing.check_algorithm` measured."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from sparsehi.algorithms.base import SparseMode


@dataclass
class AlgorithmReport:
    """What :func:`check_algorithm` measured."""

    algorithm: str
    mode: str
    page_size: int
    top_k_units: int
    """Selection budget in the algorithm's units (pages, or tokens when token-wise)."""
    top_k_tokens: int = 0
    """The same budget as configured, in tokens (``SparseConfig.top_k``)."""
    retrieve_calls: int = 0
    needle_recall: float = 0.0
    """Fraction of planted needles whose unit was selected (last decode step, all sparse layers)."""
    mass_recall: float = 0.0
    """Mean over rows/layers of selected attention mass / best top-k attention mass."""
    mean_fill: float = 0.0
    """Mean valid_lengths / min(top_k, candidates) over live rows (1.0: uses its budget)."""
    deterministic: bool = False
    content_dependent: Optional[bool] = None
    """Whether selections change with the key content (None: not probed)."""
    representation_bytes: int = 0
    capture: list[str] = field(default_factory=list)
    """One line per capture-safety check run (or skipped, and why)."""
    capture_findings: list[str] = field(default_factory=list)
    """Capture-safety problems found and not raised (``"report"`` settings)."""
    checks: list[str] = field(default_factory=list)

    @property
    def budget(self) -> str:
        """``"64 tokens (4 pages of 16)"``, or ``"16 tokens"`` for a token-wise algorithm."""
        if self.mode == SparseMode.TOKEN_WISE.value:
            return f"{self.top_k_tokens} tokens"
        pages = "page" if self.top_k_units == 1 else "pages"
        return f"{self.top_k_tokens} tokens ({self.top_k_units} {pages} of {self.page_size})"

    def __str__(self) -> str:
        capture = "; ".join(self.capture) if self.capture else "not checked"
        found = f" CAPTURE FINDINGS: {' | '.join(self.capture_findings)}" if self.capture_findings else ""
        return (f"{self.algorithm} ({self.mode}, page_size={self.page_size}, top_k={self.budget}): "
                f"needle_recall={self.needle_recall:.3f} mass_recall={self.mass_recall:.3f} "
                f"fill={self.mean_fill:.3f} deterministic={self.deterministic} "
                f"content_dependent={self.content_dependent} calls={self.retrieve_calls} "
                f"capture: {capture}; checks passed: {', '.join(self.checks)}{found}")
