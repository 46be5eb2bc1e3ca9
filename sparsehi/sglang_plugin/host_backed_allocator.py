"""SGLang's KV allocator over host-backed slots: what the scheduler allocates with the plugin on.

With the plugin, SGLang's ``token_to_kv_pool_allocator`` hands out *virtual* KV slots: ids
``1..V`` that ``req_to_token``, the radix tree and every request hold exactly as before,
each with its home in the plugin's pinned host pool (host slot = virtual slot). A GPU page
holds a virtual page only while SGLang's own kernels need it there
(:class:`hicache.residency.KVResidency`, ``v2p``); SGLang's attention reads and KV writes
go through ``v2p`` (the model runner's ``KVIndexTranslator`` is switched to translate,
``sglang_api.make_translating``). So SGLang's bookkeeping stays whole and exact — a slot is
allocated, shared by the tree, freed once, by SGLang — while GPU memory holds only what is
pinned: prompts being prefilled, the requests SGLang itself decodes (short ones), pages a
prefix hit brought back; a sparse request's registered prompt is on the host only.

The allocator is a subclass of SGLang's own (token or paged, made at run time by
:func:`host_backed_allocator_class`): the virtual free list is SGLang's, sized by the host
pool; every allocation also maps its new pages to GPU pages (it fails, returning None like
SGLang's, when the GPU pages may be short); every free also returns their GPU pages. What
the scheduler reads: ``available_size()`` is the virtual free list (SGLang's idle check
adds it to the tree's sizes and expects ``V``); the GPU side enters admission through the
scheduler-facing capacity hooks SGLang's allocators have for composite pools:
``create_prefill_budget`` (:class:`PhysicalPrefillBudget`: the smaller of the virtual
budget and the free GPU tokens), ``check_decode_capacity``, ``max_new_tokens_for_memory``
and ``request_slot_reserve``.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from hicache.residency import KVResidency

logger = logging.getLogger(__name__)

_CLASSES: dict[type, type] = {}
_BUDGETS: dict[type, type] = {}


def _prefill_budget_class(base: type) -> type:
    if base in _BUDGETS:
        return _BUDGETS[base]

    class PhysicalPrefillBudget(base):
        """SGLang's prefill budget, with the free GPU tokens as a second limit: an admitted
        prompt is prefilled in GPU memory (cached tree content is host-backed, so evicting
        it frees virtual slots only, no GPU pages). On the GPU side the decode headroom of
        running requests that decode sparsely is not charged (``gpu_exempt``, set by the
        plugin's hook on ``PrefillAdder._get_running_request_total_token_offset``): their
        new tokens need host slots, and one GPU page at a time."""

        gpu_exempt = 0

        def _gpu(self) -> int:
            gpu = getattr(self, "_gpu_tokens", None)
            if gpu is None:  # once per admission round: allocations come after it
                gpu = self._gpu_tokens = self.allocator.admission_gpu_tokens()
            return gpu

        @property
        def remaining_total(self):
            return min(super().remaining_total, self._gpu() - (self.total_offset - self.gpu_exempt))

        @property
        def remaining_current(self):
            return min(super().remaining_current, self._gpu() - self.current_offset)

    PhysicalPrefillBudget.__name__ = PhysicalPrefillBudget.__qualname__ = f"Physical{base.__name__}"
    _BUDGETS[base] = PhysicalPrefillBudget
    return PhysicalPrefillBudget


class HostBackedSlots:
    """The host-backed behaviour over an SGLang allocator class, which follows it in the MRO
    (see the module docstring). ``bind_residency`` must run before the first allocation
    (construction only sets SGLang's own state)."""

    residency: Optional[KVResidency] = None
    physical_tokens: int = 0
    """GPU tokens the residency can hold (what one prompt's prefill may use at most)."""
    settle_tag: Callable[[], Optional[int]] = staticmethod(lambda: None)
    """Newest snapshot tag that is certainly complete (the bridge's forward count - 1)."""

    def bind_residency(self, residency: KVResidency, *, settle_tag: Callable[[], Optional[int]]) -> None:
        self.residency = residency
        self.physical_tokens = residency.physical_pages * self.page_size
        self.settle_tag = settle_tag

    # ------------------------------------------------------------ GPU pages
    def gpu_tokens_free(self, need: int = 0) -> int:
        """Free GPU tokens, a lower bound that every rank computes alike; when it is
        below ``need`` the device's own count is read once (a host sync)."""
        r = self.residency
        r.settle(self.settle_tag())
        free = r.free_pages_lower_bound() * self.page_size
        if free < need:
            free = r.settle(exact=True) * self.page_size
        return free

    def admission_gpu_tokens(self) -> int:
        """Free GPU tokens for an admission round: the lower bound, or, when no forward
        ran since the previous round (nothing in flight could free more), the device's
        own count (a host sync while the device waits anyway): a bound left stale by an
        idle server would hold admission off for good."""
        tag = self.settle_tag()
        stale = tag == getattr(self, "_admission_tag", object())
        self._admission_tag = tag
        r = self.residency
        if stale:
            return r.settle(exact=True) * self.page_size
        r.settle(tag)
        return r.free_pages_lower_bound() * self.page_size

    def _pages(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.page_size == 1 else torch.div(ids, self.page_size, rounding_mode="floor")

    def _map(self, ids: torch.Tensor, new_pages: int) -> bool:
        if new_pages == 0:
            return True
        if self.gpu_tokens_free(new_pages * self.page_size) < new_pages * self.page_size:
            return False
        self.residency.map(self._pages(ids), upper=new_pages)
        return True

    # ------------------------------------------------------------ allocation
    def alloc(self, need_size: int):
        ids = super().alloc(need_size)
        if ids is None:
            return None
        if not self._map(ids, -(-need_size // self.page_size)):
            self._give_back(ids)
            return None
        return ids

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens,
                     *args, **kwargs):
        ids = super().alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                                   extend_num_tokens, *args, **kwargs)
        if ids is None:
            return None
        ps = self.page_size
        new = int((-(-seq_lens_cpu // ps) - (-(-prefix_lens_cpu // ps))).sum())
        if not self._map(ids, new):
            self._give_back(ids)
            return None
        return ids

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc, *args, **kwargs):
        ids = super().alloc_decode(seq_lens, seq_lens_cpu, last_loc, *args, **kwargs)
        if ids is None:
            return None
        new = int(((seq_lens_cpu - 1) % self.page_size == 0).sum())
        if not self._map(ids, new):
            self._give_back(ids)
            return None
        return ids

    def _give_back(self, ids: torch.Tensor) -> None:
        """An allocation that could not get its GPU pages: its virtual slots go back."""
        group, self.free_group = self.free_group, None
        try:
            self.free(ids)
        finally:
            self.free_group = group

    # ------------------------------------------------------------ frees
    def clear(self) -> None:
        super().clear()
        if self.residency is not None:
            self.residency.reset()

    # ------------------------------------------------------------ scheduler-facing capacity
    def create_prefill_budget(self, tree_cache, *args, **kwargs):
        budget = super().create_prefill_budget(tree_cache, *args, **kwargs)
        budget.__class__ = _prefill_budget_class(type(budget))
        return budget

    def request_slot_reserve(self, *, has_req_pool_slot: bool, prefill_tokens: int = 0) -> int:
        # A continuing chunk gets one token of reserve, which makes SGLang check that
        # the chunk fits the budget (GPU tokens included) before it allocates; with a
        # zero reserve it would allocate unchecked.
        return super().request_slot_reserve(has_req_pool_slot=has_req_pool_slot,
                                            prefill_tokens=prefill_tokens) + int(bool(has_req_pool_slot))

    def check_decode_capacity(self, *, num_tokens: int, tree_cache, **kwargs) -> bool:
        if not super().check_decode_capacity(num_tokens=num_tokens, tree_cache=tree_cache, **kwargs):
            return False
        need = -(-num_tokens // self.page_size) * self.page_size
        return self.gpu_tokens_free(need) >= need

    def max_new_tokens_for_memory(self, input_tokens: int, max_new_tokens: int, **kwargs):
        if -(-input_tokens // self.page_size) * self.page_size + self.page_size > self.physical_tokens:
            return None  # the prompt's prefill can never fit the GPU pages
        return super().max_new_tokens_for_memory(input_tokens, max_new_tokens, **kwargs)

    # ------------------------------------------------------------ translation (KVIndexTranslator)
    @property
    def full_v2p_page_table(self) -> torch.Tensor:
        return self.residency.v2p

    def translate_write_loc(self, loc: torch.Tensor, *, out: Optional[torch.Tensor] = None,
                            out_width: Optional[int] = None) -> torch.Tensor:
        """Virtual token slots -> GPU token slots; 0 (the padding slot every writer
        skips) where the page is not on the GPU or the slot is padding."""
        ids = self.residency.physical_slots(loc.reshape(-1), self.page_size).clamp(min=0).view(loc.shape)
        if out_width is not None and out_width > ids.numel():
            ids = torch.cat([ids.reshape(-1), ids.new_zeros(out_width - ids.numel())])
        if out is None:
            return ids
        out.view(-1)[: ids.numel()].copy_(ids.reshape(-1))
        return out

    translate_kv_loc = translate_write_loc


class _ReleaseOnPageRelease:
    """Frees for allocators that return whole pages through ``_release_page_ids``."""

    def _release_page_ids(self, *page_ids: torch.Tensor) -> None:
        if self.residency is not None and page_ids:
            self.residency.release(torch.cat([p.reshape(-1) for p in page_ids]))
        super()._release_page_ids(*page_ids)


class _ReleaseOnFree:
    """Frees for allocators without ``_release_page_ids``: each ``free`` outside a free group."""

    def free(self, free_index: torch.Tensor) -> None:
        if self.free_group is None and self.residency is not None and free_index.numel():
            self.residency.release(free_index.reshape(-1))
        super().free(free_index)


def host_backed_allocator_class(base: type) -> type:
    """The host-backed subclass of SGLang allocator class ``base`` (``TokenToKVPoolAllocator``
    or ``PagedTokenToKVPoolAllocator``), made once per class."""
    if base in _CLASSES:
        return _CLASSES[base]
    release = _ReleaseOnPageRelease if hasattr(base, "_release_page_ids") else _ReleaseOnFree

    class HostBackedAllocator(release, HostBackedSlots, base):
        __doc__ = HostBackedSlots.__doc__

    HostBackedAllocator.__name__ = HostBackedAllocator.__qualname__ = f"HostBacked{base.__name__}"
    _CLASSES[base] = HostBackedAllocator
    return HostBackedAllocator


def is_host_backed(allocator: Any) -> bool:
    return type(allocator) in _CLASSES.values()
