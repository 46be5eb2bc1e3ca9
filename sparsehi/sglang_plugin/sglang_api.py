"""Every place the plugin touches SGLang: hook targets, private attributes, the pool swap.

Written against SGLang ``TESTED_SGLANG`` (0.5.23); ``register()`` refuses any other version
(``check_sglang_version``). What each touch point relies on, checked in that version:

- Hook targets (dotted paths SGLang's ``HookRegistry`` resolves): the ``*_TARGET`` names
  below (``hooks.register_hooks`` installs them).
- ``ModelRunner`` after ``alloc_memory_pool``: ``req_to_token_pool``, ``token_to_kv_pool``,
  ``token_to_kv_pool_allocator``, ``max_total_num_tokens``, ``max_running_requests``,
  ``kv_index_translator``, ``capture_head_hooks`` / ``capture_tail_hooks``, ``server_args``.
  The scheduler reads the allocator and ``max_total_num_tokens`` from the runner after this
  point (``TpModelWorker.get_worker_info`` / ``get_memory_pool``).
- ``KVIndexTranslator`` (``make_translating``): the private fields its constructor sets for
  SGLang's own translating allocators (``is_translating``, ``_capture_page_size``,
  ``_full_v2p_table``, ``_translate_full``, ``defer_read_translate``, ``_spaces``,
  ``_rows``); attention backends keep a reference to the one object, so it is changed in
  place, before ``init_attention_backends``.
- KV pools (``swap_pool_buffers``): ``MHATokenToKVPool.k_buffer`` / ``v_buffer`` (one
  ``[size + page_size, heads, dim]`` tensor per layer), ``size`` (its KV store checks slots
  ``< size + page_size``), ``_build_kv_buffer_descs`` / ``_kv_buffer_descs`` and
  ``_init_data_ptrs_and_strides``; ``MLATokenToKVPool.kv_buffer`` and ``data_ptrs``.
- Allocators (``allocator_class_args``): ``TokenToKVPoolAllocator(size, dtype, device,
  kvcache, need_sort)``, ``PagedTokenToKVPoolAllocator(size, page_size, dtype, device,
  kvcache, need_sort)``; their ``free`` / ``_release_page_ids`` / ``alloc*`` /
  ``free_group`` behaviour (host_backed_allocator.py).
- ``ForwardBatch``: ``forward_mode``, ``req_pool_indices`` (+ ``req_pool_indices_cpu`` on
  extend batches), ``seq_lens`` / ``seq_lens_cpu`` / ``seq_lens_sum``,
  ``extend_prefix_lens_cpu``, ``out_cache_loc`` (GPU slots once the plan is bound) and
  ``out_cache_loc_virtual``; ``ScheduleBatch.req_pool_indices_cpu`` and ``reqs``
  (``Req.origin_input_ids``, ``output_ids``, ``kv.req_pool_idx``, ``prefix_len``,
  ``kv.cache_protected_len``).
- ``PrefillAdder._request_slot_reserve_for_req(req, *, extend_input_len=None)``: the
  extra KV tokens admission charges a request (the plugin adds the prefix a host-backed
  prefix hit must bring back to the GPU); ``PrefillAdder._get_running_request_total_token_offset(req)``:
  a running request's future tokens admission keeps room for (the plugin exempts a sparse
  request's from the GPU side: one page at a time); ``PrefillAdder.memory_budget``,
  ``PrefillBudget.total_offset`` / ``current_offset`` / ``remaining_total`` /
  ``remaining_current`` / ``_available_and_evictable``.
- ``Scheduler.get_new_batch_prefill(running_batch)`` and ``ScheduleBatch.batch_is_full``
  (``SCHEDULER``), and the scheduler's ``token_to_kv_pool_allocator``.
- Radix trees' ``checkpoint(req, *, up_to)``: may rewrite ``req_to_token[row,
  cache_protected_len_before:cache_protected_len_after]`` to the tree's own slots (a
  prefix another request inserted first) and free the request's duplicates.
- Server flags the plugin cannot run with (``options.check_sglang_features``).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

TESTED_SGLANG = "0.5.23"
"""The SGLang release every touch point here was checked against."""

SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
RADIX_ATTENTION = "sglang.srt.layers.radix_attention.RadixAttention"
REQ_TO_TOKEN_POOL = "sglang.srt.mem_cache.memory_pool.ReqToTokenPool"
FORWARD_BATCH = "sglang.srt.model_executor.forward_batch_info.ForwardBatch"
PREFILL_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
"""``Scheduler.get_new_batch_prefill(running_batch)`` skips admission while
``running_batch.batch_is_full`` (set when a request did not fit; cleared when a request
leaves). With the plugin GPU memory also comes back when a prompt is registered and leaves
the GPU, so the plugin clears the flag then (as SGLang's HiSparse does when its staged
requests are ready)."""
TREE_CACHES = ("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache",
               "sglang.srt.mem_cache.radix_cache.RadixCache")
"""Radix trees whose ``checkpoint`` the plugin follows (the default tree of 0.5.23, and
the plain one)."""


def installed_sglang_version() -> Optional[str]:
    """SGLang's installed distribution version, or None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def check_sglang_version(version: Optional[str]) -> Optional[str]:
    """None when ``version`` is the tested release (local builds of it, e.g.
    ``0.5.23+cu128`` or ``0.5.23.post1``, included); else the one-line reason to refuse."""
    if version is None:
        return f"sparsehi: SGLang is not installed (tested with {TESTED_SGLANG}); the plugin stays off"
    base = version.split("+", 1)[0]
    if base == TESTED_SGLANG or base.startswith(TESTED_SGLANG + ".post"):
        return None
    return (f"sparsehi: installed SGLang {version} is not the tested {TESTED_SGLANG}; the plugin is not "
            f"registered (install sglang=={TESTED_SGLANG}, e.g. pip install \"sparsehi[sglang]\")")


# ---------------------------------------------------------------------- model runner
def runner_pools(runner: Any) -> tuple[Any, Any, Any]:
    """``(req_to_token_pool, token_to_kv_pool, token_to_kv_pool_allocator)`` of a model runner."""
    return runner.req_to_token_pool, runner.token_to_kv_pool, getattr(runner, "token_to_kv_pool_allocator", None)


def install_allocator(runner: Any, allocator: Any, max_total_num_tokens: int) -> None:
    """Make ``allocator`` the runner's (what the scheduler, its tree and its admission read
    next) with ``max_total_num_tokens`` (SGLang's capacity: the allocator's size)."""
    runner.token_to_kv_pool_allocator = allocator
    runner.max_total_num_tokens = int(max_total_num_tokens)
    cfg = getattr(runner, "memory_pool_config", None)
    if cfg is not None and hasattr(cfg, "max_total_num_tokens"):
        try:
            cfg.max_total_num_tokens = int(max_total_num_tokens)
        except (AttributeError, TypeError):  # a frozen record: draft workers are refused anyway
            pass


def allocator_class_args(allocator: Any, size: int) -> tuple[type, tuple, dict]:
    """How to build another allocator of ``allocator``'s SGLang class with ``size`` slots:
    ``(class, args, kwargs)``. Raises ValueError for allocator classes not supported."""
    cls = type(allocator)
    common = dict(dtype=allocator.dtype, device=allocator.device, kvcache=allocator.get_kvcache(),
                  need_sort=allocator.need_sort)
    if cls.__name__ == "PagedTokenToKVPoolAllocator":
        return cls, (size, allocator.page_size), common
    if cls.__name__ == "TokenToKVPoolAllocator":
        return cls, (size,), common
    raise ValueError(f"sparsehi: SGLang allocator {cls.__name__} is not supported (allowed: TokenToKVPoolAllocator, "
                     f"PagedTokenToKVPoolAllocator: a plain full-attention KV pool)")


def make_translating(translator: Any, allocator: Any) -> None:
    """Switch the model runner's ``KVIndexTranslator`` (built for a plain pool) to translate
    through ``allocator`` (``full_v2p_page_table``, ``translate_write_loc``,
    ``translate_kv_loc``, ``page_size``), as SGLang's constructor does for its own
    translating allocators; in place (attention backends hold this object)."""
    from sglang.srt.mem_cache.kv_loc_plan import IdSpace, IdSpaceKind

    v2p = allocator.full_v2p_page_table
    translator.is_translating = True
    translator._capture_page_size = allocator.page_size
    translator._full_v2p_table = v2p
    translator._translate_full = allocator.translate_kv_loc
    translator.defer_read_translate = False
    translator._spaces[IdSpaceKind.FULL] = IdSpace(key=(IdSpaceKind.FULL, id(allocator)),
                                                   write=allocator.translate_write_loc, read_v2p=v2p)
    translator._rows = torch.arange(translator.req_to_token.shape[0], dtype=torch.int64, device=translator.device)


# ---------------------------------------------------------------------- KV pools
def is_mla_pool(kv_pool: Any) -> bool:
    """Whether an SGLang KV pool is MLA's (one latent tensor per layer, ``kv_buffer``)
    rather than MHA's (``k_buffer`` / ``v_buffer``)."""
    return hasattr(kv_pool, "kv_buffer") and hasattr(kv_pool, "kv_lora_rank")


def pool_buffers(kv_pool: Any) -> list[torch.Tensor]:
    """SGLang's per-layer KV tensors of ``kv_pool`` (MHA: k then v; MLA: the latent rows)."""
    if is_mla_pool(kv_pool):
        return list(kv_pool.kv_buffer)
    return list(kv_pool.k_buffer) + list(kv_pool.v_buffer)


def drop_pool_buffers(kv_pool: Any) -> None:
    """Release SGLang's own KV tensors (before the plugin's one allocation takes their place)."""
    if is_mla_pool(kv_pool):
        kv_pool.kv_buffer = []
    else:
        kv_pool.k_buffer, kv_pool.v_buffer = [], []
    for name in ("data_ptrs", "k_data_ptrs", "v_data_ptrs", "data_strides"):
        if hasattr(kv_pool, name):
            setattr(kv_pool, name, None)


def swap_pool_buffers(kv_pool: Any, per_layer: list[tuple[torch.Tensor, ...]], rows: int) -> None:
    """Point ``kv_pool``'s per-layer tensors at ``per_layer[l]`` (MHA ``(k, v)``, MLA
    ``(kv,)``, each ``[rows, heads, dim]``) and set its ``size`` to ``rows - page_size``;
    the pool's pointer tables are rebuilt."""
    kv_pool.size = int(rows) - int(kv_pool.page_size)
    if is_mla_pool(kv_pool):
        kv_pool.kv_buffer = [bufs[0] for bufs in per_layer]
        kv_pool.data_ptrs = torch.tensor([x.data_ptr() for x in kv_pool.kv_buffer], dtype=torch.uint64,
                                         device=kv_pool.device)
        return
    kv_pool.k_buffer = [bufs[0] for bufs in per_layer]
    kv_pool.v_buffer = [bufs[1] for bufs in per_layer]
    if hasattr(kv_pool, "_build_kv_buffer_descs"):
        kv_pool._kv_buffer_descs = kv_pool._build_kv_buffer_descs()
    refresh = getattr(kv_pool, "_init_data_ptrs_and_strides", None)
    if refresh is not None:
        refresh()


# ---------------------------------------------------------------------- batches and requests
def extend_prompt_lens(schedule_batch: Any) -> Optional[list[int]]:
    """Full prompt length of each request of a scheduler batch (origin input plus the
    output of a retracted request that resumes), in batch order; None when the batch
    holds no requests."""
    reqs = getattr(schedule_batch, "reqs", None)
    if not reqs:
        return None
    return [len(r.origin_input_ids) + len(getattr(r, "output_ids", ()) or ()) for r in reqs]


def req_row(req: Any) -> Optional[int]:
    """The ``ReqToTokenPool`` row of a scheduler request, None before it has one."""
    kv = getattr(req, "kv", None)
    idx = getattr(kv, "req_pool_idx", None) if kv is not None else getattr(req, "req_pool_idx", None)
    return None if idx is None else int(idx)


def req_protected_len(req: Any) -> int:
    """Tokens of the request's row the radix tree owns (``kv.cache_protected_len``)."""
    kv = getattr(req, "kv", None)
    return int(getattr(kv, "cache_protected_len", 0) or 0) if kv is not None else 0
