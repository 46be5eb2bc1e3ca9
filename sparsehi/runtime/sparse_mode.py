"""``sparse-gpu`` and ``sparse-hier``: decode through the SparseCoordinator hooks (see
docs/coordinator.md). Both modes run the same algorithm and selection logic; only the
coordinator mode differs (``gpu_only`` vs ``hierarchical``).

sparse-hier also keeps a HiRadixTree over the host pool: a prompt's longest host-resident
prefix is matched, loaded back into device slots for the prefill, and handed to the
coordinator as tree-owned host slots, so prefix reuse and hierarchical sparsity work
together. Algorithm state that cannot be rebuilt from the KV (DSA's index keys:
``BaseSparseAlgorithm.token_state_bytes``) is part of the tiered KV: the host pool keeps
it per token in an extra buffer (``STATE_BUFFER``, in the same page records L3 stores),
written at prefill end (prompt) and request end (decoded tokens), and a reused prefix's
state is restored into the algorithm at its prefill, layer by layer.

With an L3 backend (``RuntimeConfig.storage``) the tree attaches it: a prompt whose prefix
continues in L3 beyond the host hit is prefetched into host pages before its prefill, and
a finished request's pages are written to L3 (only those L3 lacks). A request is admitted
once, right after its prefetch is issued, and the prefetch policy decides how long that
admission waits, as SGLang's scheduler does: ``best_effort`` never waits (it takes what
has arrived by then, which here is usually nothing: the request computes its prefix, and
pages that arrive later are released, not adopted); ``timeout`` waits until the fetch is
done or its deadline (the timeout formula over the pages the existence check found) has
passed; ``wait_complete`` waits until the fetch is done (each backend call is bounded by
``backend_call_timeout_s``, so it ends).

The tree caches finished requests in the same host pool the running ones write: when an
allocation would not fit, the least recently used unlocked host prefixes are evicted first.
Every prefill and decode step retires the tree's finished transfers (``step_events``), so an
acknowledged L3 write releases its host lock at once rather than when the run ends.

An ``lmcache`` backend with ``interop_model_path`` also shares the L3 with LMCache's own
serving-engine connectors: imported before each prefetch, exported at each request's end
(``sparsehi.runtime.l3_interop``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional

import numpy as np
import torch

from hicache.layer_sync import LayerLoadCounter
from hicache.transfer import KVTransferEngine
from sparsehi.algorithms.registry import create_algorithm
from sparsehi.coordinator import SparseCoordinator
from sparsehi.forward_batch import ForwardBatch
from sparsehi.runtime.kv_cache_format import stored_kv
from sparsehi.runtime.l3_interop import LMCacheL3Interop, lmcache_interop_for
from sparsehi.runtime.runtime_mode import Request, RuntimeMode, host_token_bytes
from sparsehi.runtime.model_config import ModelConfig
from sparsehi.runtime.runtime_config import RuntimeConfig, round_up

logger = logging.getLogger(__name__)

STATE_BUFFER = "sparse_token_state"
"""The host pool's extra per-token buffer of the algorithm's state: ``uint8 [layers, bytes]``."""
_PREFETCH_POLL_S = 0.005
"""How often a waiting admission asks the prefetch policy again (the ``timeout`` deadline's
resolution)."""


@dataclass(frozen=True)
class SparseGraphKey:
    """The host facts a sparse decode step's CUDA graph depends on (one graph per value).

    has_dense_rows:  a row of the batch decodes densely (``SparseCoordinator.prepare_decode``).
    recorded_layers: layers whose selection the step keeps (``record_layers``).
    """

    has_dense_rows: bool
    recorded_layers: frozenset


def adapter_name(cfg: ModelConfig, sc) -> str:
    """The adapter ``auto`` means: ``SparseConfig.backend`` for an MHA (GQA) cache
    (``flashattention`` or ``triton``); ``dsa`` for the MLA latent cache, whatever
    ``backend`` says (as SGLang does for its DSA algorithm)."""
    if cfg.family != "gqa":
        if sc.backend != "dsa":
            logger.info("MLA latent cache: sparse attention through the dsa adapter (SparseConfig.backend=%s "
                        "applies to MHA caches)", sc.backend)
        return "dsa"
    if sc.backend == "dsa":
        raise ValueError(f"SparseConfig.backend='dsa' needs an MLA model; {cfg.name} has an MHA (GQA) cache: "
                         f"use 'flashattention' or 'triton'")
    return sc.backend


class SparseCoordinatorMode(RuntimeMode):
    def __init__(self, cfg: ModelConfig, rt: RuntimeConfig) -> None:
        super().__init__(cfg, rt)
        self.hierarchical = rt.mode == "sparse-hier"
        ps = rt.page_size
        sc = rt.sparse
        extra = dict(sc.sparse_extra_config)
        if cfg.family == "mla" and sc.algorithm == "dsa":
            extra.setdefault("index_head_dim", cfg.index_head_dim)
        if not rt.value_checks:
            # the algorithms' value checks read tensors back to the host: two syncs per
            # sparse layer and step, which serialise CPU launches with GPU work (and a
            # replayed graph cannot run them)
            extra.setdefault("validate", False)
        sc.sparse_extra_config = extra
        self.algorithm = create_algorithm(sc, self.device)
        self.is_dsa = cfg.family == "mla"
        adapter = None
        if rt.adapter != "none":
            from sparsehi.adapters import create_adapter

            name = adapter_name(cfg, sc) if rt.adapter == "auto" else rt.adapter
            kw = {"kv_lora_rank": cfg.kv_lora_rank} if name == "dsa" else {}
            adapter = create_adapter(name, validate=rt.value_checks, **kw)
        self.host = self.transfer = self.tree = None
        self.l3_interop: Optional[LMCacheL3Interop] = None
        """Set: the L3 is shared with LMCache's serving-engine connectors (runtime.l3_interop)."""
        max_ctx = round_up(rt.max_context_len, ps)
        self.state_bytes = self.algorithm.token_state_bytes() if self.hierarchical and rt.prefix_cache else 0
        if self.hierarchical:
            n_host = rt.host_tokens(self.host_token_bytes(), cfg.name)
            extra = {STATE_BUFFER: ((cfg.num_layers, self.state_bytes), torch.uint8)} if self.state_bytes else None
            self.host = self._host_pool(n_host, extra, sc.host_kv_dtype)
            if self.state_bytes and STATE_BUFFER not in self.host.extra:
                logger.info("RuntimeConfig.host_pool has no %s buffer: %s prefixes are recomputed, not reused",
                            STATE_BUFFER, sc.algorithm)
            self.transfer = KVTransferEngine(self.pool, self.host, sc.io_backend, validate=rt.validate)
            if rt.prefix_cache:
                from hicache.controller import HiCacheController
                from hicache.radix_tree import HiRadixTree

                self.controller = HiCacheController(self.pool, self.host, io_backend=sc.io_backend,
                                                    transfer=self.transfer)
                self.tree = HiRadixTree(self.controller)
                if rt.storage is not None:
                    self.tree.attach_storage_backend(rt.storage, rt.storage_policy)
                    self.l3_interop = lmcache_interop_for(rt.storage, self.spec, self.host)
        self.keeps_state = self.host is not None and STATE_BUFFER in self.host.extra
        self.reuse_prefix = self.tree is not None and (not self.state_bytes or self.keeps_state)
        """Prompts are matched in the tree (an algorithm with per-token state needs the
        host pool's state buffer for that)."""
        self.coord = SparseCoordinator(
            sc, self.algorithm, self.pool, mode="hierarchical" if self.hierarchical else "gpu_only",
            host_pool=self.host, transfer=self.transfer, adapter=adapter, max_num_reqs=rt.max_num_reqs,
            max_context_len=max_ctx, validate=rt.value_checks,
            dense_pool_tokens=rt.max_num_reqs * (max_ctx + ps) + 2 * ps,
            # the step writes the new pages' table entries itself (runner: DecodeInputs.page_entries)
            defer_page_entries=True,
        )
        self.layer_loads = LayerLoadCounter(cfg.num_layers)
        """Reused prefixes loading back while their prefill runs (one producer per request)."""
        self.peak_host_tokens = 0
        self.peak_dense_tokens = 0
        self._batch: dict[int, ForwardBatch] = {}
        self.record_layers: frozenset[int] = frozenset()
        """Layers whose selection each decode step keeps in ``recorded[layer]`` (``[B, N]``
        logical ids, on the device; benchmarks measure adjacent-step Top-k overlap)."""
        self.recorded: dict[int, list[torch.Tensor]] = {}

    # -- accounting ---------------------------------------------------------------------
    @property
    def reads_index_inputs(self) -> bool:
        """DSA selection reads the MLA model's indexer outputs."""
        return self.is_dsa

    def sample_memory(self) -> None:
        super().sample_memory()
        dp = self.coord.dense_pool
        if dp is not None:
            a = dp.allocator
            self.peak_dense_tokens = max(self.peak_dense_tokens, (a.num_pages - 1 - a.num_free_pages()) * a.page_size)
        if self.host is not None:
            a = self.host.allocator
            self.peak_host_tokens = max(self.peak_host_tokens, (a.num_pages - 1 - a.num_free_pages()) * a.page_size)

    def host_token_bytes(self) -> int:
        """KV (FP8 pages with their scales, under ``--host-kv-dtype fp8_e4m3``) plus the
        algorithm's per-token state of every layer."""
        return self.host_kv_token_bytes() + self.cfg.num_layers * self.state_bytes

    def host_kv_token_bytes(self) -> int:
        """Host bytes of one token's KV, all layers, in the host pool's page format."""
        sc = self.rt.sparse
        return host_token_bytes(self.cfg, self.rt.dtype, sc.host_kv_dtype, self.rt.page_size, sc.kv_cache_dtype)

    def extra_gpu_bytes(self) -> int:
        dp = self.coord.dense_pool
        return 0 if dp is None else self.peak_dense_tokens * dp.spec.token_bytes

    def memory(self) -> dict[str, float]:
        out = super().memory()
        out["host_kv_bytes"] = float(self.peak_host_tokens * self.host_kv_token_bytes())
        out["representation_bytes"] = float(self.algorithm.representation_bytes())
        return out

    def stats(self) -> dict[str, Any]:
        return self.coord.stats()

    # -- requests -------------------------------------------------------------------------
    def begin_request(self, req: Request) -> int:
        super().begin_request(req)
        self.coord.on_request_begin(req.req_pool_idx)
        if not self.reuse_prefix:
            return 0
        self.step_events()
        ps = self.rt.page_size
        n = len(req.prompt)
        m = self.tree.match_prefix(req.prompt, cache_salt=req.cache_salt)
        if self.tree.storage_backend is not None and self._prefetch(req, m):
            m = self.tree.match_prefix(req.prompt, cache_salt=req.cache_salt)
        h = min(m.backed_length, (n - 1) // ps * ps)  # at least one token left to prefill
        if h > 0:
            self.tree.inc_host_lock(m.last_backed_node)
            req.tree_node = m.last_backed_node
            req.host_slots = m.backed_host_indices[:h].clone()
        req.prefix_hit = h
        return h

    def _prefetch(self, req: Request, m) -> int:
        """Fetch the prompt's continuation from L3 into the tree (see the module docstring).
        Returns the tokens fetched."""
        tree = self.tree
        if self.l3_interop is not None:
            self.l3_interop.import_prefix(req.prompt, req.cache_salt)
        want = tree.prefetch_from_storage(req.rid, m.last_backed_node, req.prompt[m.backed_length:])
        if not want:
            return 0
        before = tree.storage_stats["l3_hit_tokens"]
        # The policy decides (StorageController.can_terminate); between polls, wake up as
        # soon as the fetch is done.
        while not tree.check_prefetch_progress(req.rid):
            tree.wait_prefetch(req.rid, _PREFETCH_POLL_S)
        return tree.storage_stats["l3_hit_tokens"] - before

    def l3_stats(self) -> dict[str, int]:
        """L3 counters of the prefix tree after its writes in flight finished ({} without a
        backend)."""
        if self.tree is None or self.tree.storage_backend is None:
            return {}
        self.tree.flush_storage()
        st = self.tree.stats()
        out = {k: st[k] for k in ("l3_hit_tokens", "l3_bytes_fetched", "l3_pages_fetched", "l3_pages_written",
                                  "l3_bytes_written", "l3_write_skipped_existing", "l3_fetch_faults",
                                  "l3_fetch_miss_pages", "prefetch_reserved_pages")}
        return {**out, **self.l3_interop.stats()} if self.l3_interop is not None else out

    def close(self) -> None:
        if self.tree is not None:
            self.tree.close()  # drains L3 writes; the backend itself stays open (its owner closes it)
        super().close()

    def prefill_slots(self, req: Request, prefix_len: int) -> torch.Tensor:
        slots = super().prefill_slots(req, prefix_len)
        if prefix_len > 0:
            # The host-resident prefix comes back layer by layer on the transfer stream:
            # prefill layer n waits for layer n only (before_prefill_layer), not for all.
            handle = self.transfer.load(req.host_slots[:prefix_len], slots[:prefix_len])
            req.prefix_load = self.layer_loads.register(handle)
            self.layer_loads.set_consumer(req.prefix_load)
            if self.keeps_state:
                req.prefix_state = self.host.read_extra(STATE_BUFFER, req.host_slots[:prefix_len].cpu()).to(
                    self.device, non_blocking=True)
        n = len(req.prompt)
        self._batch[req.rid] = ForwardBatch.prefill(
            torch.tensor([req.req_pool_idx], device=self.device), torch.tensor([n], dtype=torch.int32, device=self.device),
            slots[:n][None, :], prefix_lens=torch.tensor([prefix_len], dtype=torch.int32, device=self.device),
            out_cache_loc=slots[prefix_len:n])
        return slots

    def before_prefill_layer(self, req: Request, layer: int) -> None:
        if req.prefix_load is not None:
            self.layer_loads.wait_until(layer)

    def after_prefill_layer(self, req, layer, k, v, extra, prefix_len) -> None:
        kw = {}
        if self.is_dsa:
            ik = extra["index_k"]  # [new tokens, Di]; a reused prefix's keys are restored below
            if prefix_len:
                ik = torch.cat([ik.new_zeros((prefix_len, ik.shape[-1])), ik])
            kw = {"index_keys": ik[None]}
        self.coord.attention_end(layer, self._batch[req.rid], k=k, v=v, **kw)
        if req.prefix_state is not None and self.algorithm.is_sparse_layer(layer):
            self.algorithm.import_token_state(layer, req.req_pool_idx, 0, req.prefix_state[:, layer])

    def _export_state(self, row: int, start: int, end: int) -> torch.Tensor:
        """``uint8 [end - start, layers, bytes]`` (CPU): the algorithm's per-token state of
        positions ``[start, end)`` of request slot ``row`` (dense layers: zeros). Prefill
        end and request end only (a host sync)."""
        st = torch.zeros((end - start, self.cfg.num_layers, self.state_bytes), dtype=torch.uint8)
        for layer in range(self.cfg.num_layers):
            if self.algorithm.is_sparse_layer(layer):
                st[:, layer] = self.algorithm.export_token_state(layer, row, start, end).cpu()
        return st

    def _save_state(self, row: int, start: int, end: int, host_slots: torch.Tensor) -> None:
        """Positions ``[start, end)`` of slot ``row``: their state into the host pool's state
        buffer at ``host_slots[: end - start]``."""
        if end > start and self.keeps_state:
            self.host.write_extra(STATE_BUFFER, host_slots[: end - start].cpu(), self._export_state(row, start, end))

    def end_prefill(self, req: Request, prefix_len: int) -> None:
        batch = self._batch.pop(req.rid)
        if req.prefix_load is not None:  # every layer waited for its part: the load is consumed
            self.layer_loads.release(req.prefix_load)
            self.layer_loads.set_consumer(-1)
            req.prefix_load = None
        n = len(req.prompt)
        if self.hierarchical:
            self._make_host_room(n - prefix_len)
            new = self.host.alloc(n - prefix_len)
            if new is None:
                raise ValueError(f"host KV pool is full ({self.host.num_slots} slots): raise host_kv_tokens")
            prefix = req.host_slots[:prefix_len] if prefix_len else new[:0]
            hs = torch.cat([prefix.cpu(), new])
            self.coord.forward_end(batch, host_slots=[hs])
            req.prefix_state = None
            if self.reuse_prefix:
                self._save_state(req.req_pool_idx, prefix_len, n, new)
            if prefix_len:  # the prefix's device copy was ours, only needed by the prefill
                self.pool.allocator.free(req.device_slots[:prefix_len])
            req.device_slots = None
            req.host_slots = hs
            if self.reuse_prefix:
                self._hold_prompt_in_tree(req)
        else:
            self.coord.forward_end(batch)
            req.device_slots = None  # the coordinator owns them until on_request_end
        req.seq_len = n

    def adopt_host_prompt(self, req: Request, fill_host_pages: Callable[[list[int]], None]) -> None:
        """Begin ``req`` with its whole prompt's KV taken from host pages instead of a
        prefill (prefill/decode disaggregation, ``sparsehi.runtime.disaggregation``):
        host pages are allocated and ``fill_host_pages(page ids)`` writes them; the KV is
        loaded to the device once, the algorithm builds its representations from it (the
        calls a prefill makes, no model forward), the GPU buffers are set up and the
        prompt's whole pages enter the prefix tree. When ``fill_host_pages`` raises, the
        pages are given back and the request is not begun."""
        n, ps = len(req.prompt), self.rt.page_size
        self._make_host_room(n)
        hs = self.host.alloc(n)
        if hs is None:
            raise ValueError(f"host KV pool is full ({self.host.num_slots} slots): raise --hicache-size / "
                             f"--hicache-ratio")
        try:
            fill_host_pages((hs[::ps] // ps).tolist())
        except BaseException:
            self.host.free(hs)
            raise
        super().begin_request(req)  # the row; no prefix match: the whole prompt is the hand-off's
        self.coord.on_request_begin(req.req_pool_idx)
        req.host_slots, req.prefix_hit = hs[:n], n
        try:
            slots = self.prefill_slots(req, 0)  # the whole prompt's device slots and its batch
            self.transfer.load(req.host_slots, slots[:n]).wait()
            if self.keeps_state:
                req.prefix_state = self.host.read_extra(STATE_BUFFER, req.host_slots).to(self.device)
            extra = ({"index_k": torch.zeros((n, self.cfg.index_head_dim), dtype=self.rt.dtype, device=self.device)}
                     if self.is_dsa else {})  # DSA's index keys come back from the state buffer
            for layer in range(self.cfg.num_layers):
                self.after_prefill_layer(req, layer, None, None, extra, 0)
        except BaseException:
            self.host.free(hs)
            req.host_slots = None
            raise
        batch = self._batch.pop(req.rid)
        # the manager writes [prefix, seq) to the host: nothing here (a ForwardBatch cannot be
        # built with an empty new part, so its prefix is set after the layers ran)
        batch.prefix_lens = batch.seq_lens.clone()
        batch.prefix_lens_cpu = list(batch.seq_lens_cpu)
        self.coord.forward_end(batch, host_slots=[req.host_slots])
        req.prefix_state = None
        self.pool.allocator.free(req.device_slots)  # the manager copied what it keeps
        req.device_slots = None
        self._hold_prompt_in_tree(req)
        req.seq_len = n

    def _hold_prompt_in_tree(self, req: Request) -> None:
        """The prompt's whole pages (host slots ``req.host_slots``) into the prefix tree,
        host-locked by ``req`` in place of the node it held. Slots the tree does not adopt
        (it held the prefix already) are reported again by the insert at request end, which
        frees them (the request still reads them until then)."""
        n_al = len(req.prompt) // self.rt.page_size * self.rt.page_size
        if not n_al:
            return
        res = self.tree.insert(req.prompt[:n_al], host_indices=req.host_slots[:n_al], cache_salt=req.cache_salt)
        self.tree.inc_host_lock(res.last_node)
        if req.tree_node is not None:
            self.tree.dec_host_lock(req.tree_node)
        req.tree_node = res.last_node

    def prepare_decode(self, reqs: list[Request]) -> Hashable:
        """Coordinator host part; the graph key: whether a row decodes densely, and the layers
        whose selections are recorded (both change what a graph holds)."""
        self._check_decode_lengths(reqs)
        if self.hierarchical:
            self.step_events()
            ps = self.rt.page_size
            self._make_host_room(ps * sum(1 for r in reqs if r.seq_len % ps == 0))  # pages this step opens
        has_dense = self.coord.prepare_decode([r.req_pool_idx for r in reqs], [r.seq_len + 1 for r in reqs])
        return SparseGraphKey(has_dense, frozenset(self.record_layers))

    def decode_graph_key(self, reqs: list[Request]) -> Hashable:
        return SparseGraphKey(self.coord.has_dense_rows([r.req_pool_idx for r in reqs]), frozenset(self.record_layers))

    def page_entry_tables(self) -> Optional[tuple[list[torch.Tensor], int]]:
        return self.coord.page_entry_tables(), 1

    def take_page_entries(self) -> Optional[np.ndarray]:
        return self.coord.take_page_entries()

    def decode_device(self, rows: torch.Tensor, seq_lens: torch.Tensor, graph_key: SparseGraphKey):
        has_dense, record = graph_key.has_dense_rows, graph_key.recorded_layers
        batch = ForwardBatch.decode(rows, seq_lens, prepared=True, has_dense_rows=has_dense)
        coord = self.coord
        coord.forward_begin(batch)
        scale = self.cfg.sm_scale
        outputs: dict = {}

        def attn(layer: int, q, k, v, extra):
            if self.query_hook is not None:
                q = self.query_hook(layer, q, extra)
            if self.is_dsa:
                plan = coord.attention_begin(layer, batch, q=extra["index_q"], weights=extra["index_w"])
                k = stored_kv(self.spec, k)  # FP8 latent rows: quantised once, here; backed up as stored
                plan.write_kv(k)
            else:
                plan = coord.attention_begin(layer, batch, q=q)
                plan.write_kv(k, v)
            if layer in record:
                outputs[layer] = plan.selection.logical_ids
            with self.timer.section("attention"):
                o = plan.attend(q, scale)
            if self.is_dsa:
                coord.attention_end(layer, batch, k=k, v=None, index_keys=extra["index_k"])
            else:
                coord.attention_end(layer, batch, k=k, v=v)
            return o

        def close() -> dict:
            coord.forward_end(batch)
            return outputs

        return attn, close

    def end_decode(self, reqs: list[Request], outputs: Optional[dict] = None) -> None:
        for layer, ids in (outputs or {}).items():
            self.recorded.setdefault(layer, []).append(ids[: len(reqs)].clone())
        super().end_decode(reqs, outputs)

    def end_request(self, req: Request) -> None:
        if req.prefix_load is not None:  # failed inside its prefill: the load is no one's now
            for layer in range(self.layer_loads.num_layers):  # later users of its slots wait for it
                self.layer_loads.wait_until(layer)
            self.layer_loads.release(req.prefix_load)
            self.layer_loads.set_consumer(-1)
            req.prefix_load = None
        if req.device_slots is not None:  # failed before the coordinator took the prefill's slots
            self.pool.allocator.free(req.device_slots)
            req.device_slots = None
        n_prompt = len(req.prompt)
        decoded_state = None
        if self.reuse_prefix and self.keeps_state and req.seq_len > n_prompt:
            # the decoded tokens' state, read before the algorithm forgets the slot
            decoded_state = self._export_state(req.req_pool_idx, n_prompt, req.seq_len)
        kv = self.coord.on_request_end(req.req_pool_idx)
        ps = self.rt.page_size
        if self.hierarchical:
            hs = kv.host_slots
            pages = kv.host_pages
            keep = 0
            if decoded_state is not None:
                self.host.write_extra(STATE_BUFFER, hs[n_prompt:req.seq_len], decoded_state)
            if self.reuse_prefix:
                seq_al = kv.seq_len // ps * ps
                if req.aborted:
                    # a failed step may have left its token's KV incomplete in some layers:
                    # keep only the prompt, whose prefill finished (seq_len is 0 otherwise)
                    seq_al = min(seq_al, len(req.prompt) if req.seq_len else 0) // ps * ps
                toks = req.all_tokens()[:seq_al]
                if seq_al:
                    res = self.tree.insert(toks, host_indices=hs[:seq_al], cache_salt=req.cache_salt)
                    self._free_host_slots(res.host_unused)
                    keep = seq_al // ps
                    if self.tree.storage_backend is not None and not req.aborted:
                        if str(self.device).startswith("cuda"):
                            torch.cuda.synchronize(self.device)  # host pages complete before L3 reads them
                        self.tree.write_backup_storage(res.last_node)
                        if self.l3_interop is not None:
                            self.l3_interop.export_prefix(self.tree, toks, req.cache_salt)
                if req.tree_node is not None:
                    self.tree.dec_host_lock(req.tree_node)
                    req.tree_node = None
            tail = pages[keep:]
            if tail.numel():
                self.host.allocator.free_pages(tail)
        elif kv.device_pages is not None and kv.device_pages.numel():
            self.pool.allocator.free_pages(kv.device_pages)
        req.host_slots = None
        super().end_request(req)

    def _make_host_room(self, tokens: int) -> None:
        """Evict the prefix tree's least recently used host nodes (those no request or L3
        write holds) until ``tokens`` host slots are free: the tree caches finished requests
        in the same pool the running ones write, so without this a long run fills the pool
        with cached prefixes and new requests fail."""
        short = tokens - self.host.available_size()
        if short <= 0 or self.tree is None:
            return
        self.tree.evict_host(short)
        short = tokens - self.host.available_size()
        if short > 0 and self.tree.storage_ctl is not None:
            # the rest may be pinned by L3 writes, in flight or done but not yet retired (their
            # host locks go only with their acknowledgements): flushing waits for the first and
            # retires both. Decided by the pool alone, which every TP rank shares.
            self.tree.flush_storage()
            self.tree.evict_host(short)

    def step_events(self) -> None:
        """Per scheduler step (each prefill and decode step): retire the tree's finished
        transfers, above all acknowledged L3 writes, whose host locks would otherwise pin
        their pages until the run ends, and orphaned prefetch reservations."""
        if self.tree is not None:
            self.tree.check_hicache_events()

    def _free_host_slots(self, slots) -> None:
        if slots is None or slots.numel() == 0:
            return
        pages = torch.unique(slots.cpu() // self.rt.page_size)
        self.host.allocator.free_pages(pages)
