"""SGLang's own sparse algorithms inside the sparsehi coordinator (and so with offloading).

SGLang's sparse framework (``sglang.srt.mem_cache.sparsity``) has the hook names of ours
but another algorithm API: its ``BaseSparseAlgorithm`` is handed SGLang's
``token_to_kv_pool``, ``req_to_token_pool`` and a ``RequestTrackers`` once, and its
construct / update hooks read keys out of a whole-pool ``k_buffer`` through
``req_to_token`` (the *device slot* of every token of a request), with SGLang's
``ForwardBatch``. Its representations are indexed by those slots (Quest: one min/max per
``slot // page_size``), so the slot of a token must stay the same for the request's life.

:class:`SGLangAlgorithm` subclasses our ``BaseSparseAlgorithm`` and runs an instance of
any SGLang subclass unchanged:

* **Address space.** The wrapped algorithm sees the slots of SGLang's real
  ``ReqToTokenPool`` (the plugin hands SGLang's own; without one the adapter builds a real
  ``ReqToTokenPool`` whose row ``r`` holds the stable ids ``r * M + position``, ``M`` the
  page-rounded context bound). In sparse-hier a token's KV is no longer at that slot (it
  was offloaded to host and the device page reused), so the ids are *names*, never read.
* **Keys.** What the wrapped algorithm indexes as ``k_buffer`` is a
  :class:`SlotKeyView`: a tensor of the pool's shape that owns no memory and turns
  ``k_buffer[slots]`` into a gather from where those keys are right now: in prefill the
  device pool at the batch's ``token_slots``; in decode a per-request staging page of the
  page being written (the only keys an SGLang algorithm reads in decode are those of the
  pages completed since its last update: Quest folds a page in when it fills). Any other
  slot reads as zeros: SGLang's algorithms gather whole pages and mask the positions past
  a request's context, and an algorithm that needs older keys in decode is not served.
* **Calls.** Prefill: ``construct_representations(layer_id, req_pool_indices, seq_lens,
  k_buffer, forward_batch)`` with an EXTEND ``ForwardBatch`` (requests are registered in
  the trackers first, as SGLang's ``on_request_begin`` does). Decode:
  ``update_representations(..., seq_lens, k_buffer, forward_batch)`` with a DECODE batch;
  ``retrieve_topk(queries=, layer_id=, req_pool_indices=, sparse_mask=, forward_batch=,
  attn_metadata=None)``. The plugin may pass SGLang's own ``forward_batch`` as a keyword;
  otherwise one is built (SGLang's real class). Padding rows (``req_pool_index < 0``) are
  never handed to construct/update (SGLang would read row -1).
* **Selections.** SGLang returns logical page ids, ascending, its own recent window
  included, ``-1`` padded. Ours are the ids in ``[candidate_start, candidate_end)`` only
  (the coordinator adds sink and recent pages), at most ``top_k``: the adapter keeps those,
  and when the wrapped algorithm's own budget (Quest: ``sparsity_ratio`` of the history)
  exceeds ``top_k`` it keeps the ``top_k`` highest ids and logs that once.
  ``sparse_extra_config["num_recent_pages"]`` defaults to our recent window in pages, so
  both windows agree.

**Capture safety.** SGLang's algorithms read tensors back to the host (its Quest:
``.item()``, ``nonzero``, a per-row Python loop), which breaks a CUDA graph. The adapter
declares ``capture_safe = False`` unless the wrapped class sets
``sparsehi_capture_safe = True``; a caller that captures decode must then run it eagerly
(:func:`requires_eager`). The first decode call of each hook runs under the author kit's
host-sync detector in recording mode, and the log names the first offending call.
"""
from __future__ import annotations

import importlib
import logging
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from hicache.triton_support import INT32_MAX
from sparsehi.algorithms.base import BaseSparseAlgorithm, SparseMode, check_pool_args
from sparsehi.algorithms.graph_safety import CaptureFinding, HostSyncDetector, caller_location
from sparsehi.input_checks import host_checks_enabled

logger = logging.getLogger(__name__)

_SGLANG_BASE = "sglang.srt.mem_cache.sparsity.algorithms.base_algorithm"
_logged: set[tuple[str, str]] = set()
_THIS_NAME = os.path.basename(__file__)


def _log_once(cls: type, what: str, msg: str, *args: Any, level: int = logging.WARNING) -> None:
    key = (f"{cls.__module__}.{cls.__qualname__}", what)
    if key not in _logged:
        _logged.add(key)
        logger.log(level, msg, *args)


def sglang_base_class() -> Optional[type]:
    """SGLang's ``BaseSparseAlgorithm``, or None when SGLang is not installed."""
    try:
        return importlib.import_module(_SGLANG_BASE).BaseSparseAlgorithm
    except ImportError:
        return None


def is_sglang_algorithm(cls: Any) -> bool:
    """``cls`` is a subclass of SGLang's ``BaseSparseAlgorithm`` (False without SGLang)."""
    base = sglang_base_class()
    return base is not None and isinstance(cls, type) and issubclass(cls, base)


def requires_eager(algorithm: BaseSparseAlgorithm) -> bool:
    """The decode hooks of ``algorithm`` must not be captured in a CUDA graph."""
    return not getattr(algorithm, "capture_safe", True)


# ----------------------------------------------------------------------------- keys
class SlotKeyView(torch.Tensor):
    """A ``[num_slots, Hkv, D]`` stand-in for a layer's key buffer that owns no memory.

    ``view[slots]`` (any integer tensor, or a tuple whose first entry is one) returns the
    keys of those slots gathered from ``source`` through ``slot_map`` (``[num_slots]``
    int64: row of ``source`` holding that slot's key, ``-1``: not available here), as a
    real tensor; a slot not held reads as zeros (SGLang's algorithms gather whole pages and
    mask what lies past a request's context, which in SGLang's own pool is unrelated data
    too). ``index_select(0, slots)`` does the same. Metadata (``shape``, ``device``,
    ``dtype``, ``dim``, ``size``) is the pool's; any other use is a TypeError naming the
    algorithm (an SGLang algorithm reads keys by indexing ``k_buffer``).
    """

    _META = frozenset(("shape", "device", "dtype", "ndim", "size", "dim", "is_cuda", "numel", "__len__",
                       "element_size", "layout", "requires_grad", "is_floating_point"))

    @staticmethod
    def __new__(cls, num_slots: int, source: torch.Tensor, slot_map: torch.Tensor, owner: str) -> "SlotKeyView":
        shape = (num_slots, *source.shape[1:])
        view = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=source.dtype, device=source.device)
        view._source, view._slot_map, view._owner = source, slot_map, owner
        return view

    def _gather(self, slots: torch.Tensor) -> torch.Tensor:
        if slots.dtype in (torch.bool, torch.uint8) or slots.is_floating_point():
            raise TypeError(f"{self._owner}: k_buffer may be indexed by integer slot tensors only, got {slots.dtype}")
        if self._source.shape[0] == 0:  # a shape-only pool holds nothing
            return torch.zeros((*slots.shape, *self._source.shape[1:]), dtype=self._source.dtype,
                               device=self._source.device)
        rows = self._slot_map[slots.to(self._slot_map.device).long()]
        held = (rows >= 0).reshape(*rows.shape, *([1] * (self._source.dim() - 1)))
        # slots not held read as zeros: SGLang's algorithms gather whole pages and mask the
        # positions past a request's context (in SGLang's pool those hold unrelated data too)
        return torch.where(held, self._source[rows.clamp(min=0)], 0)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func is torch.Tensor.__getitem__:
            self, index = args[0], args[1]
            if isinstance(index, torch.Tensor):
                return self._gather(index)
            if isinstance(index, tuple) and index and isinstance(index[0], torch.Tensor):
                return self._gather(index[0])[(slice(None), *index[1:])]
        elif name == "index_select" and (args[1] if len(args) > 1 else kwargs.get("dim")) in (0, -len(args[0].shape)):
            idx = args[2] if len(args) > 2 else kwargs["index"]
            return args[0]._gather(idx)
        elif name in cls._META or name == "__get__" or func is torch.Tensor.__repr__:
            with torch._C.DisableTorchFunctionSubclass():
                if func is torch.Tensor.__repr__:
                    return f"SlotKeyView(shape={tuple(args[0].shape)}, dtype={args[0].dtype}, device={args[0].device})"
                return func(*args, **kwargs)
        owner = args[0]._owner if args and isinstance(args[0], SlotKeyView) else "the algorithm"
        raise TypeError(f"{owner}: k_buffer supports indexing by slot tensors (k_buffer[slots], "
                        f"index_select(0, slots)) and its metadata only, not {name or func}")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"k_buffer stand-in: {func} is not supported (index it by slot tensors)")


class _ShapeOnlyKVPool:
    """What the wrapped algorithm gets as ``token_to_kv_pool`` when no SGLang pool is given
    (our own runtime): the key buffers' shape over the adapter's stable ids, no memory."""

    def __init__(self, num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 page_size: int, start_layer: int, end_layer: int) -> None:
        self.size, self.page_size, self.dtype, self.device = num_slots, page_size, dtype, device
        self.head_num, self.head_dim = kv_heads, head_dim
        self.start_layer, self.end_layer, self.layer_num = start_layer, end_layer, end_layer - start_layer
        empty = torch.empty((0, kv_heads, head_dim), dtype=dtype, device=device)
        self._keys = SlotKeyView(num_slots, empty, torch.empty(0, dtype=torch.int64, device=device),
                                 "token_to_kv_pool (shape only)")

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self._keys


# ----------------------------------------------------------------------------- adapter
@dataclass
class _Probe:
    """First-call capture-safety findings per hook (recorded, not raised)."""

    done: set = field(default_factory=set)
    findings: list = field(default_factory=list)


class _Recorder(HostSyncDetector):
    """The author kit's detector, recording findings instead of raising."""

    def __init__(self, hook: str, out: list) -> None:
        super().__init__(hook)
        self.out = out

    def _raise(self, call: str, why: str) -> None:
        where = caller_location(traceback.extract_stack()[:-1])  # the frame that called torch, not this one
        if _THIS_NAME not in where:  # the adapter's own value checks are not the algorithm's
            self.out.append(CaptureFinding(self.hook, call, where, why))


class SGLangAlgorithm(BaseSparseAlgorithm):
    """Runs an SGLang ``BaseSparseAlgorithm`` subclass (page-wise) in our coordinator.

    ``algorithm_cls``: the SGLang class (or ``config.algorithm`` names it as
    ``'package.module:ClassName'``). ``req_to_token_pool`` / ``token_to_kv_pool``: SGLang's
    pools (the plugin passes the model runner's); given to the constructor or to
    ``initialize_representation_pool``. ``forward_batch``, when a hook gets one as a
    keyword, is passed to the wrapped algorithm instead of a built one.
    """

    mode = SparseMode.PAGE_WISE
    selects_ascending = True  # the id mapping below returns ascending ids
    default_dense_layers: tuple[int, ...] = ()  # SGLang's coordinator runs every layer sparsely

    def __init__(self, config: Any, device: torch.device, *, algorithm_cls: Optional[type] = None,
                 req_to_token_pool: Any = None, token_to_kv_pool: Any = None, **kwargs: Any) -> None:
        super().__init__(config, device)
        if algorithm_cls is None:
            algorithm_cls = resolve_sglang_algorithm(config.algorithm)
        if not is_sglang_algorithm(algorithm_cls):
            raise ValueError(f"algorithm_cls={algorithm_cls!r} is invalid: a subclass of SGLang's "
                             f"{_SGLANG_BASE}.BaseSparseAlgorithm")
        if config.page_size < 1:
            raise ValueError(f"SparseConfig.page_size={config.page_size} is invalid for {algorithm_cls.__name__}")
        self.page_size = config.page_size
        self.name = algorithm_cls.__name__
        self.sglang_config = sglang_config_of(config)
        self.inner = algorithm_cls(self.sglang_config, self.device, **kwargs)
        self.capture_safe = bool(getattr(algorithm_cls, "sparsehi_capture_safe", False))
        self.validate = bool(config.sparse_extra_config.get("validate", True))
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.states: Any = None
        self._probe = _Probe()
        self._staging: dict[int, torch.Tensor] = {}
        self._slot_map: Optional[torch.Tensor] = None
        self._first = self._last = -1
        if not self.capture_safe:
            _log_once(algorithm_cls, "eager",
                      "sparsehi: SGLang algorithm %s.%s is not CUDA-graph capture safe (SGLang's sparse algorithms "
                      "read tensors back to the host: .item(), nonzero, per-row Python loops); decode steps with "
                      "it run on the eager path, without CUDA graphs (requires_eager() is True; a capture raises). "
                      "A class that is safe may declare sparsehi_capture_safe = True",
                      algorithm_cls.__module__, algorithm_cls.__qualname__)

    # ------------------------------------------------------------------ memory
    def initialize_representation_pool(self, start_layer: int, end_layer: int, max_num_reqs: int,
                                       max_context_len: int, *, kv_heads: int, head_dim: int, dtype: torch.dtype,
                                       req_to_token_pool: Any = None, token_to_kv_pool: Any = None,
                                       **kwargs: Any) -> None:
        """Hand the wrapped algorithm SGLang's pools and a ``RequestTrackers`` over sparse
        layers ``[first, last + 1)`` of ``[start_layer, end_layer)`` (its bookkeeping runs at
        its ``end_layer - 1``, which must be a layer our coordinator calls); reserve one
        staging page ``[max_num_reqs, page_size, kv_heads, head_dim]`` per sparse layer."""
        check_pool_args(start_layer, end_layer, max_num_reqs=max_num_reqs, max_context_len=max_context_len,
                        kv_heads=kv_heads, head_dim=head_dim)
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.sparsity.core.sparse_coordinator import RequestTrackers

        sparse = [x for x in range(start_layer, end_layer) if self.is_sparse_layer(x)]
        if not sparse:
            raise ValueError(f"layers [start_layer={start_layer}, end_layer={end_layer}) hold no sparse layer "
                             f"(dense_layers={self.dense_layers()})")
        self._first, self._last = sparse[0], sparse[-1]
        ps = self.page_size
        self.req_to_token_pool = req_to_token_pool or self.req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool or self.token_to_kv_pool
        if self.req_to_token_pool is None:
            # stable ids r * M + position: a real ReqToTokenPool the adapter fills itself
            m = -(-max_context_len // ps) * ps
            if max_num_reqs * m >= INT32_MAX:
                raise ValueError(f"max_num_reqs={max_num_reqs} x max_context_len={max_context_len} exceeds the int32 "
                                 "slot ids of SGLang's ReqToTokenPool")
            pool = ReqToTokenPool(size=max_num_reqs, max_context_len=m, device=str(self.device),
                                  enable_memory_saver=False)
            rows = torch.arange(max_num_reqs, device=self.device, dtype=torch.int64)[:, None] * m
            pool.req_to_token[:max_num_reqs] = (rows + torch.arange(m, device=self.device)).to(torch.int32)
            self.req_to_token_pool = pool
        rtt = self.req_to_token_pool.req_to_token
        if rtt.shape[0] < max_num_reqs:
            raise ValueError(f"req_to_token_pool has {rtt.shape[0]} rows < max_num_reqs={max_num_reqs}")
        if self.token_to_kv_pool is None:
            num_slots = int(rtt[:max_num_reqs].max()) + 1
            num_slots = -(-num_slots // ps) * ps
            self.token_to_kv_pool = _ShapeOnlyKVPool(num_slots, kv_heads, head_dim, dtype, self.device, ps,
                                                     self._first, self._last + 1)
        kb = self.token_to_kv_pool.get_key_buffer(self._first)
        if tuple(kb.shape[1:]) != (kv_heads, head_dim):
            raise ValueError(f"token_to_kv_pool keys are [*, {', '.join(map(str, kb.shape[1:]))}], the model's "
                             f"[*, {kv_heads}, {head_dim}]")
        self.num_slots = kb.shape[0]
        self.max_num_reqs = max_num_reqs
        self.states = RequestTrackers(rtt.shape[0], self.device, self._last + 1 - self._first,
                                      self.config.min_sparse_prompt_len, max_context_len)
        self._slot_map = torch.full((self.num_slots,), -1, dtype=torch.int64, device=self.device)
        self._staging = {x: torch.zeros((max_num_reqs * ps, kv_heads, head_dim), dtype=dtype, device=self.device)
                         for x in sparse}
        self.inner.initialize_representation_pool(self._first, self._last + 1, self.token_to_kv_pool,
                                                  self.req_to_token_pool, self.states)

    def _need_init(self) -> None:
        if self.states is None:
            raise ValueError(f"{self.name}: initialize_representation_pool was not called")

    # ------------------------------------------------------------------ internals
    def _forward_batch(self, kwargs: dict, decode: bool, req: torch.Tensor, seq: torch.Tensor) -> Any:
        """SGLang's ``ForwardBatch`` for the rows handed to the wrapped algorithm."""
        given = kwargs.get("forward_batch")
        if given is not None:
            return given
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        b = int(req.shape[0])
        empty = torch.empty(0, dtype=torch.int64, device=req.device)
        return ForwardBatch(forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND, batch_size=b,
                            input_ids=empty, req_pool_indices=req, seq_lens=seq,
                            out_cache_loc=empty, seq_lens_sum=int(seq.sum()) if b else 0)

    def _with_keys(self, slots: torch.Tensor, rows: torch.Tensor, source: torch.Tensor, call):
        """Run ``call(k_buffer)`` with ``k_buffer[slots[i]] == source[rows[i]]``; the slot map
        is cleared after (also when ``call`` raises)."""
        sm = self._slot_map
        sm[slots] = rows
        try:
            return call(SlotKeyView(self.num_slots, source, sm, self.name))
        finally:
            sm[slots] = -1

    def _refuse_capture(self, hook: str) -> None:
        """Under CUDA-graph capture, a wrapped algorithm not declared safe raises here, before
        any host sync could break the capture half-way."""
        if not self.capture_safe and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{self.name}.{hook} is not CUDA-graph capture safe: run decode eagerly with it "
                               "(sparsehi.sglang_plugin.sglang_algorithm.requires_eager)")

    def _probed(self, hook: str, fn):
        """Run ``fn`` (first call of ``hook``: under the recording host-sync detector)."""
        if hook in self._probe.done:
            return fn()
        self._probe.done.add(hook)
        found: list = []
        with _Recorder(hook, found):
            out = fn()
        if found:
            self._probe.findings.extend(found)
            _log_once(type(self.inner), f"probe:{hook}",
                      "sparsehi: %s.%s is not capture safe, so it runs eagerly; first finding: %s (%d host syncs in "
                      "its first call)", self.name, hook, found[0], len(found))
        return out

    # ------------------------------------------------------------------ build / update
    def construct_representations(self, layer_id: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                                  key_buffer: torch.Tensor, token_slots: torch.Tensor, **kwargs: Any) -> None:
        """Prefill of one layer: the wrapped ``construct_representations`` reads the prompt's
        keys from ``key_buffer`` at ``token_slots`` by their SGLang slots; the keys of the
        partial last page go to the staging page, for the decode updates that finish it."""
        self._need_init()
        if not self.is_sparse_layer(layer_id):
            return
        dev = self.device
        req_all, seq_all = req_pool_indices.to(dev).long(), seq_lens.to(dev).long()
        live = (req_all >= 0) & (seq_all > 0)
        req, seq, tslots = req_all[live], seq_all[live], token_slots.to(dev).long()[live]
        if req.numel() and int(req.max()) >= self.max_num_reqs:
            raise ValueError(f"req_pool_indices must be < max_num_reqs={self.max_num_reqs}")
        if layer_id == self._first:  # SGLang's on_request_begin, once per prefill
            for r, n in zip(req.tolist(), seq.tolist()):
                self.states.register(r, n)
        rtt = self.req_to_token_pool.req_to_token
        n_max = tslots.shape[1]
        pos = torch.arange(n_max, device=dev)[None, :]
        have = pos < seq[:, None]
        slots = rtt[req[:, None], pos.expand(len(req), -1).clamp(max=rtt.shape[1] - 1)].long()[have]
        rows = tslots[have]
        fb = self._forward_batch(kwargs, False, req, seq)  # int64, as SGLang keeps seq_lens
        self._with_keys(slots, rows, key_buffer, lambda kb: self.inner.construct_representations(
            layer_id, req, seq, kb, fb))
        # keys of the open (partial) page, for update_representations
        ps = self.page_size
        start = seq // ps * ps
        in_tail = have & (pos >= start[:, None])
        if bool(in_tail.any()):
            j = (pos - start[:, None]).expand_as(in_tail)[in_tail]
            r = req[:, None].expand_as(in_tail)[in_tail]
            self._staging[layer_id][r * ps + j] = key_buffer[tslots[in_tail].to(key_buffer.device)].to(
                self._staging[layer_id].dtype).to(dev)

    def update_representations(self, layer_id: int, req_pool_indices: torch.Tensor, positions: torch.Tensor,
                               new_keys: torch.Tensor, **kwargs: Any) -> None:
        """Decode of one layer: the new keys join their request's staging page, then the
        wrapped ``update_representations`` runs with ``seq_lens = positions + 1`` and may read
        every key of that page by its SGLang slot. Padding rows are left out."""
        self._need_init()
        self._refuse_capture("update_representations")
        if not self.is_sparse_layer(layer_id):
            return
        dev, ps = self.device, self.page_size
        req_all, pos_all = req_pool_indices.to(dev).long(), positions.to(dev).long()
        live = req_all >= 0
        req, pos, keys = req_all[live], pos_all[live], new_keys.to(dev)[live]
        staging = self._staging[layer_id]
        staging[req * ps + pos % ps] = keys.to(staging.dtype)
        # every written position of each row's open page
        rtt = self.req_to_token_pool.req_to_token
        j = torch.arange(ps, device=dev)[None, :]
        have = j <= (pos % ps)[:, None]
        tok = (pos // ps * ps)[:, None] + j
        slots = rtt[req[:, None].expand_as(tok), tok.clamp(max=rtt.shape[1] - 1)].long()[have]
        rows = (req[:, None] * ps + j).expand_as(tok)[have]
        seq = (pos + 1).to(torch.int64)
        fb = self._forward_batch(kwargs, True, req, seq)
        self._with_keys(slots, rows, staging, lambda kb: self._probed(
            "update_representations", lambda: self.inner.update_representations(layer_id, req, seq, kb, fb)))

    # ------------------------------------------------------------------ select
    def retrieve_topk(self, queries: torch.Tensor, layer_id: int, req_pool_indices: torch.Tensor,
                      sparse_mask: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The wrapped ``retrieve_topk`` for the whole batch (as SGLang's coordinator calls
        it), then its ids restricted to ``[candidate_start, candidate_end)`` and to
        ``top_k`` per row (the highest ids when it picked more), ascending, ``-1`` padded."""
        self._need_init()
        self._refuse_capture("retrieve_topk")
        for k in ("seq_lens", "candidate_start", "candidate_end", "top_k"):
            if k not in kwargs:
                raise ValueError(f"retrieve_topk needs the keyword {k!r} (the coordinator passes it)")
        dev = self.device
        top_k = int(kwargs["top_k"])
        req = req_pool_indices.to(dev).long()
        mask = sparse_mask.to(dev).bool() & (req >= 0)
        seq = kwargs["seq_lens"].to(dev).to(torch.int64)
        fb = self._forward_batch(kwargs, True, req, seq)
        extra = {k: v for k, v in kwargs.items()
                 if k not in ("seq_lens", "candidate_start", "candidate_end", "top_k", "forward_batch")}
        extra.setdefault("attn_metadata", None)
        sel, val = self._probed("retrieve_topk", lambda: self.inner.retrieve_topk(
            queries=queries, layer_id=layer_id, req_pool_indices=req, sparse_mask=mask, forward_batch=fb, **extra))
        if not isinstance(sel, torch.Tensor) or not isinstance(val, torch.Tensor):
            raise ValueError(f"{self.name}.retrieve_topk returned ({type(sel).__name__}, {type(val).__name__}), not "
                             "(selected_indices, valid_lengths) tensors of logical page ids: not supported here "
                             "(SGLang's DeepSeekDSAAlgorithm returns its indexer's physical token indices; use "
                             "--sparsehi-algorithm dsa)")
        return self._to_candidates(sel, val, mask, kwargs["candidate_start"], kwargs["candidate_end"], top_k)

    def _to_candidates(self, sel: torch.Tensor, val: torch.Tensor, mask: torch.Tensor, cs: torch.Tensor,
                       ce: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.device
        b = mask.shape[0]
        sel = torch.as_tensor(sel, device=dev).long().reshape(b, -1)
        val = torch.as_tensor(val, device=dev).long().reshape(b)
        cols = torch.arange(sel.shape[1], device=dev)[None, :]
        keep = ((cols < val[:, None]) & (sel >= cs.to(dev).long()[:, None]) & (sel < ce.to(dev).long()[:, None])
                & mask[:, None])
        count = keep.sum(1)
        if host_checks_enabled(self.validate) and bool((count > top_k).any()):
            _log_once(type(self.inner), "budget",
                      "sparsehi: %s selected more than top_k=%d pages in a row; the %d highest ids are kept (raise "
                      "--sparsehi-top-k or lower the algorithm's own budget, e.g. sparsity_ratio)",
                      self.name, top_k, top_k)
        # highest kept ids first, cut to top_k, then ascending with -1 padding last
        key = torch.where(keep, sel, torch.full_like(sel, -1))
        if key.shape[1] < top_k:
            key = torch.nn.functional.pad(key, (0, top_k - key.shape[1]), value=-1)
        key = torch.sort(key, dim=1, descending=True).values[:, :top_k]
        n = count.clamp(max=top_k)
        colk = torch.arange(top_k, device=dev)[None, :]
        asc = torch.sort(torch.where(colk < n[:, None], key, INT32_MAX), dim=1).values
        out = torch.where(asc == INT32_MAX, -1, asc).to(torch.int32)
        return out, n.to(torch.int32)

    # ------------------------------------------------------------------ lifecycle
    def on_request_end(self, req_pool_index: int) -> None:
        """SGLang's ``on_request_end``: the request's trackers are cleared."""
        if self.states is not None and req_pool_index >= 0:
            self.states.clear(int(req_pool_index))

    def representation_bytes(self) -> int:
        """The wrapped algorithm's tensors (attributes, or dicts of them) plus the staging
        pages and slot map."""
        own = [*self._staging.values()] + ([self._slot_map] if self._slot_map is not None else [])
        total = sum(t.numel() * t.element_size() for t in own)
        for v in vars(self.inner).values():
            ts = v.values() if isinstance(v, dict) else [v]
            total += sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))
        return total


# ----------------------------------------------------------------------------- config / resolve
def sglang_config_of(config: Any) -> Any:
    """SGLang's ``SparseConfig`` for our ``config`` (the same budgets; its
    ``sparse_extra_config`` gets ``num_recent_pages`` = our recent window in pages unless
    given)."""
    from sglang.srt.mem_cache.sparsity.core.sparse_coordinator import SparseConfig as SGLangSparseConfig

    extra = dict(config.sparse_extra_config)
    extra.setdefault("num_recent_pages", config.recent_units)
    return SGLangSparseConfig(top_k=config.top_k, device_buffer_size=config.device_buffer_size,
                              host_to_device_ratio=config.host_to_device_ratio, algorithm=config.algorithm,
                              backend=config.backend, page_size=config.page_size,
                              min_sparse_prompt_len=config.min_sparse_prompt_len, sparse_extra_config=extra)


def resolve_sglang_algorithm(name: str) -> type:
    """The SGLang ``BaseSparseAlgorithm`` subclass a ``'package.module:ClassName'`` names."""
    if not isinstance(name, str) or ":" not in name:
        raise ValueError(f"algorithm={name!r} is invalid: 'package.module:ClassName' of an SGLang "
                         "BaseSparseAlgorithm subclass")
    mod_name, _, cls_name = name.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"algorithm={name!r}: cannot import module {mod_name!r} ({e})") from e
    cls = getattr(mod, cls_name, None)
    if not is_sglang_algorithm(cls):
        raise ValueError(f"algorithm={name!r} must name a subclass of SGLang's BaseSparseAlgorithm, got {cls!r}")
    return cls


def create_plugin_algorithm(config: Any, device: torch.device | str, **kwargs: Any) -> BaseSparseAlgorithm:
    """The algorithm ``config.algorithm`` names: an SGLang ``BaseSparseAlgorithm`` subclass
    wrapped in :class:`SGLangAlgorithm` (``kwargs``: SGLang's ``req_to_token_pool`` /
    ``token_to_kv_pool``), else ours through the registry."""
    from sparsehi.algorithms.registry import create_algorithm

    cls = _sglang_class(config.algorithm)
    if cls is not None:
        return SGLangAlgorithm(config, torch.device(device), algorithm_cls=cls, **kwargs)
    return create_algorithm(config, device)


def _sglang_class(name: str) -> Optional[type]:
    """The SGLang ``BaseSparseAlgorithm`` subclass ``name`` (``module:Class``) imports, or
    None (not an import path, not importable, or not an SGLang algorithm)."""
    if ":" not in name:
        return None
    mod_name, _, cls_name = name.partition(":")
    try:
        cls = getattr(importlib.import_module(mod_name), cls_name, None)
    except ImportError:
        return None
    return cls if is_sglang_algorithm(cls) else None


def algorithm_requires_eager(name: str) -> bool:
    """Whether the algorithm ``name`` (a registered name or an import path) must run its
    decode hooks eagerly: an SGLang algorithm not declared ``sparsehi_capture_safe``, or a
    class of ours with ``capture_safe = False``."""
    cls = _sglang_class(name)
    if cls is not None:
        return not getattr(cls, "sparsehi_capture_safe", False)
    from sparsehi.algorithms.registry import resolve_algorithm

    return not getattr(resolve_algorithm(name), "capture_safe", True)


def check_algorithm_name(name: str) -> str:
    """``'sparsehi'`` or ``'sglang'``: which API ``name`` (a registered name or an import
    path) is written for. ValueError when it is neither."""
    from sparsehi.algorithms.registry import resolve_algorithm

    if _sglang_class(name) is not None:
        return "sglang"
    try:
        resolve_algorithm(name)
    except ValueError as e:
        raise ValueError(f"{e} (or a subclass of SGLang's BaseSparseAlgorithm)") from None
    return "sparsehi"
