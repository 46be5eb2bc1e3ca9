"""FP8 host KV on the GPU side: complete pages rounded to what the FP8 host pool stores.

With ``SparseConfig.host_kv_dtype="fp8_e4m3"`` a page is quantised once, when it is
complete (at the end of its prompt's prefill, or at the decode step that writes its last
token, after that layer's attention), and from then on every tier holds the same values:
the host pool and L3 the FP8 record, the GPU its copy rounded to ``q * scale``
(``KVTransferEngine.store_pages`` / ``completed_pages`` + ``store_pages_now``). ``sparse-gpu`` has no
host pool; it rounds its pages at the same moments with ``round_pages``, which makes it the
exact reference of ``sparse-hier`` with FP8 host KV: both attend the same values at every
step.
"""
from __future__ import annotations

import torch

from hicache.kernels.fp8_page_store import ROUND_ONLY, fp8_page_store


def round_pages(view: torch.Tensor, pages: torch.Tensor, page_size: int, complete: torch.Tensor) -> None:
    """Round pages in place to their FP8 values, every layer of ``view``.

    view:     a 6-D paged pool view ``[pages, view_page_size, layers, buffers, heads, dim]``
              (``DeviceKVPool.paged_view``, or a slice of its layers).
    pages:    ``[P]`` int, page ids of ``page_size`` tokens (token slots ``page * page_size + t``).
    complete: ``[P]`` bool, the pages to round (the others are left as they are).

    No host sync, no data-dependent shape (CUDA-graph safe)."""
    L, B, H, D = view.shape[2:]
    no_values = torch.empty((0, L, B, page_size, H, D), dtype=torch.uint8, device=view.device)
    no_scales = torch.empty((0, L, B, H), dtype=torch.float32, device=view.device)
    host_pages = torch.where(complete, ROUND_ONLY, -1).to(torch.int64)
    fp8_page_store(view, pages, no_values, no_scales, host_pages, 0, L, round_device=True)
