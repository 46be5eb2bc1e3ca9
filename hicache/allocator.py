"""Page-aligned slot allocator with a free list; page 0 is reserved as the padding page."""
from __future__ import annotations

import torch


def _as_index_tensor(x: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of int64/int32, got {type(x).__name__}")
    if x.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must have dtype int64 or int32, got {x.dtype}")
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
    return x.to(device="cpu", dtype=torch.int64)


class PagedSlotAllocator:
    """Hands out whole pages of slots. Page ``p`` covers slots ``[p*page_size, (p+1)*page_size)``.

    Page 0 is never handed out: padded/dummy writes can target it safely. State lives on
    the CPU (one bool per page); returned slot tensors are int64 on ``device``.
    """

    def __init__(self, num_slots: int, page_size: int, device: torch.device | str = "cpu"):
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        if not isinstance(num_slots, int) or num_slots < 2 * page_size or num_slots % page_size:
            raise ValueError(
                f"num_slots must be a multiple of page_size={page_size} covering at least 2 pages "
                f"(page 0 is reserved), got {num_slots!r}")
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.device = torch.device(device)
        self._offsets = torch.arange(page_size, dtype=torch.int64)
        self.clear()

    def clear(self) -> None:
        """Free every page (except the reserved page 0)."""
        self._is_free = torch.ones(self.num_pages, dtype=torch.bool)
        self._is_free[0] = False
        # Lowest pages first: keeps a fresh pool's allocations contiguous.
        self._free_list = torch.arange(1, self.num_pages, dtype=torch.int64)

    def available_size(self) -> int:
        """Free tokens (whole free pages × page_size)."""
        return int(self._free_list.numel()) * self.page_size

    def num_free_pages(self) -> int:
        return int(self._free_list.numel())

    def alloc_pages(self, num_pages: int, on_host: bool = False) -> torch.Tensor | None:
        """``int64 [num_pages]`` page ids (on the allocator's device, or on the CPU with
        ``on_host``: no device copy for callers that only record them), or None when fewer
        pages are free."""
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 0:
            raise ValueError(f"num_pages must be a non-negative int, got {num_pages!r}")
        if num_pages > self._free_list.numel():
            return None
        pages = self._free_list[:num_pages]
        self._free_list = self._free_list[num_pages:]
        self._is_free[pages] = False
        return pages.clone() if on_host else pages.clone().to(self.device)

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """``int64 [ceil(num_tokens / page_size) * page_size]`` slots of whole pages, or None."""
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        pages = self.alloc_pages(-(-num_tokens // self.page_size))
        if pages is None:
            return None
        return self.pages_to_slots(pages)

    def pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """``int64 [P]`` pages → ``int64 [P * page_size]`` slots (same device)."""
        offsets = self._offsets.to(pages.device)
        return (pages.to(torch.int64)[:, None] * self.page_size + offsets[None, :]).reshape(-1)

    def free_pages(self, pages: torch.Tensor) -> None:
        """Return pages to the free list. Reserved, out-of-range, duplicate or already free
        pages raise ValueError and leave the allocator unchanged."""
        p = _as_index_tensor(pages, "pages")
        if p.numel() == 0:
            return
        if int(p.min()) < 1 or int(p.max()) >= self.num_pages:
            raise ValueError(f"pages must be in [1, {self.num_pages}) (page 0 is reserved), "
                             f"got range [{int(p.min())}, {int(p.max())}]")
        if torch.unique(p).numel() != p.numel():
            raise ValueError("pages contains duplicates")
        if not bool(self._is_free[p].logical_not().all()):
            bad = p[self._is_free[p]][:8].tolist()
            raise ValueError(f"pages contains pages that are already free: {bad}")
        self._is_free[p] = True
        self._free_list = torch.cat([self._free_list, p])

    def free(self, slots: torch.Tensor) -> None:
        """Free the pages covered by ``slots``, which must list whole pages, each page's slots
        in order (as ``alloc`` returned them)."""
        s = _as_index_tensor(slots, "slots")
        if s.numel() == 0:
            return
        if s.numel() % self.page_size:
            raise ValueError(f"slots must cover whole pages: length {s.numel()} is not a multiple "
                             f"of page_size={self.page_size}")
        rows = s.view(-1, self.page_size)
        pages = torch.div(rows[:, 0], self.page_size, rounding_mode="floor")
        if not torch.equal(rows, pages[:, None] * self.page_size + self._offsets[None, :]):
            raise ValueError("slots must be page-aligned runs: each group of page_size slots must be "
                             "p*page_size .. p*page_size+page_size-1")
        self.free_pages(pages)

    def is_free(self, pages: torch.Tensor) -> torch.Tensor:
        """``bool [P]``: which of these pages are free."""
        return self._is_free[_as_index_tensor(pages, "pages")]

    def __repr__(self) -> str:
        return (f"PagedSlotAllocator(num_slots={self.num_slots}, page_size={self.page_size}, "
                f"free_pages={self.num_free_pages()})")
