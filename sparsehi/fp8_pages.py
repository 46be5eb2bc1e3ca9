"""FP8 host KV on the GPU side: complete pages rounded to what the FP8 host pool stores.

With ``SparseConfig.host_kv_dtype="fp8_e4m3"`` a page is quantised once, when it is
complete (at the end of its prompt's prefill, or at the decode step that writes its last
token, after that layer's attention), and from then on every tier holds the same values:
the host pool and L3 the FP8 record, the GPU its copy rounded to ``q * scale``
(``KVTransferEngine.store_pages`` / ``store_completed_pages_now``). ``sparse-gpu`` has no
host pool; it rounds its pages at the same moments with ``round_pages``, which makes it the
exact reference of ``sparse-hier`` with FP8 host KV: both attend the same values at every
step.
"""
from __future__ import annotations

import torch

from hicache.kernels.fp8_page_store import ROUND_ONLY, fp8_page_store


def page_slots_of(token_slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """``token_slots [B] int64`` -> ``[B, page_size] int64``: every slot of the page holding
    each token (the page's rows in order). Fixed shapes, no host sync."""
    start = token_slots - token_slots % page_size
    return start[:, None] + torch.arange(page_size, dtype=start.dtype, device=start.device)[None, :]


def round_pages(view: torch.Tensor, slots: torch.Tensor, complete: torch.Tensor) -> None:
    """Round pages in place to their FP8 values, every layer of ``view``.

    view:     a 6-D paged pool view ``[pages, page_size, layers, buffers, heads, dim]``
              (``DeviceKVPool.paged_view``, or a slice of its layers).
    slots:    ``[P, page_size]`` int64, the token slots of each page.
    complete: ``[P]`` bool, the pages to round (the others are left as they are).

    No host sync, no data-dependent shape (CUDA-graph safe)."""
    L, B, H, D = view.shape[2:]
    ps = slots.shape[1]
    no_values = torch.empty((0, L, B, ps, H, D), dtype=torch.uint8, device=view.device)
    no_scales = torch.empty((0, L, B, H), dtype=torch.float32, device=view.device)
    host_pages = torch.where(complete, ROUND_ONLY, -1).to(torch.int64)
    fp8_page_store(view, slots, no_values, no_scales, host_pages, 0, L, round_device=True)
