"""The coordinator inside SGLang's model runner: one :class:`SGLangSparseBridge` per
model runner, built when its memory pools are allocated.

SGLang keeps owning its pools, allocator, radix cache and scheduling. The bridge only
watches. Extend (prefill) forwards are SGLang's own, untouched: a prompt may come in
several chunks (chunked prefill) or partly from the radix cache, and only its first decode
forward tells that it is complete. There, every row whose prompt reaches
``min_sparse_prompt_len`` is registered with the coordinator from the KV SGLang's pool
holds (representations built, hierarchical mode: the prompt offloaded to a host pool once
and its sparse buffer set up in a region reserved after SGLang's slots, see
:mod:`sparsehi.sglang_plugin.pool_view`); then the step runs for the registered rows.
SGLang freeing a ``ReqToTokenPool`` row ends the request.
SGLang's own KV of a registered request stays where SGLang put it (its decode tokens
are written there too), so its radix cache can still reuse and cache the request's
prefix; a prompt shorter than ``min_sparse_prompt_len`` is never registered and takes
SGLang's unmodified attention path.

Attention of registered rows goes through our backend adaptor (``--sparsehi-backend``:
the Triton ``kv_indptr`` / ``kv_indices`` or the FlashAttention page-table metadata,
built from the selection by :mod:`sparsehi.adapters`) over the shared KV memory.
Batches mixing short and registered rows run SGLang's dense attention as well, for
the short rows only: the coordinator sees the short rows as padding rows (-1).

Per step, the host part (which rows are ours, their lengths, ``prepare_decode``) runs in
the model runner's forward hook and writes the static row / length buffers allocated here;
the layer hooks do device work only over views of them (no host sync, no allocation of
Python data). So the layer path is what SGLang's decode CUDA graphs record: the model
runner's capture head / tail hooks (``ModelRunner.capture_head_hooks`` /
``capture_tail_hooks``) hand the bridge each captured forward, whose rows are all padding
while it records; at replay the host part of the forward hook has filled the buffers the
graph reads. A recorded forward cannot know which rows will be ours, so it always runs
SGLang's attention too and keeps its output for the rows that are not; for ours, SGLang's
attention sees a length of one token (``sglang_lengths``), so it reads next to nothing.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from hicache.host_pool import HostKVPool
from sparsehi.sglang_plugin.sglang_algorithm import create_plugin_algorithm
from sparsehi.config import SparseConfig
from sparsehi.coordinator import SparseCoordinator
from sparsehi.forward_batch import ForwardBatch as SparseBatch
from sparsehi.sglang_plugin.pool_view import adopt_kv_pool, req_to_token_rows

logger = logging.getLogger(__name__)


ATTEND_WITH = ("adaptor", "sglang_triton")


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass
class DecodeState:
    """One decode forward over B rows, eager or recorded into a CUDA graph: static views
    of the bridge's row buffers (rows that are not ours are padding rows, -1) and, from its
    first layer on, the coordinator's step over them."""

    rows: torch.Tensor  # [B] int64: request rows, -1 where not ours
    seq: torch.Tensor  # [B] int32: lengths with the new token (1 where not ours)
    ours: torch.Tensor  # [B] bool
    all_ours: bool  # host fact of an eager forward: no row takes SGLang's dense path
    recorded: bool = False  # a CUDA-graph capture's forward: no host fact holds at replay
    batch: Optional[SparseBatch] = None  # the coordinator's step, begun at the first layer
    host_rows: Optional[np.ndarray] = None  # [B] int64 on the host: the forward's rows (eager and replayed)
    host_ours: Optional[np.ndarray] = None  # [B] bool on the host: which of them are ours


ROWS_CPU_ATTR = "sparsehi_req_pool_indices_cpu"
"""Attribute of a decode ``ForwardBatch``: the scheduler's host copy of its row ids, which
SGLang's ``ForwardBatch.init_new`` keeps for extend batches only (set by the plugin's hook
on ``init_new``), so that the forward hook never reads ``req_pool_indices`` back from the
device."""

_READ_BACKS: set[str] = set()


def _host_ints(name: str, cpu: Any, dev: Optional[torch.Tensor]) -> np.ndarray:
    """Host copy of a per-row value: a CPU copy when SGLang has one, else a read-back from
    the device (a host sync: the host then waits for the device's queued work, so it can
    no longer run ahead of it; logged once per value)."""
    if cpu is not None:
        return np.asarray(cpu.tolist() if isinstance(cpu, torch.Tensor) else cpu, dtype=np.int64)
    if dev.device.type != "cpu" and name not in _READ_BACKS:
        _READ_BACKS.add(name)
        logger.warning("sparsehi: the forward batch has no host copy of %s; reading it back from the device "
                       "(a host sync each forward: the host no longer runs ahead of the device)", name)
    return dev.cpu().numpy().astype(np.int64)


def host_rows(fb: Any) -> np.ndarray:
    """[B] int64: a forward batch's ``ReqToTokenPool`` rows on the host (SGLang's
    ``req_pool_indices_cpu``, else the scheduler's copy the ``init_new`` hook kept)."""
    cpu = getattr(fb, "req_pool_indices_cpu", None)
    if cpu is None:
        cpu = getattr(fb, ROWS_CPU_ATTR, None)
        if cpu is not None and len(cpu) != len(fb.req_pool_indices):  # padded since (e.g. by SGLang's DP sync)
            cpu = None
    return _host_ints("req_pool_indices", cpu, fb.req_pool_indices)


class SGLangSparseBridge:
    """Coordinator over SGLang's ``ReqToTokenPool`` and KV pool (MHA or MLA).

    config: the parsed ``--sparsehi-*`` options. req_to_token_pool / kv_pool: SGLang's.
    max_running_requests: requests decoding at once (sizes the reserved buffer region and
    the dense-layer pool). adaptor_impl: the adaptor's kernel choice (``auto``: Triton on
    CUDA, torch reference on CPU). attend_with: ``adaptor`` (the adaptor's own decode
    kernel) or ``sglang_triton`` (``--sparsehi-backend triton`` only: SGLang's Triton decode
    kernel over the adaptor's rewritten ``kv_indptr`` / ``kv_indices``). validate: the
    coordinator's host-side value checks (syncs; tests only).
    """

    def __init__(self, config: SparseConfig, req_to_token_pool: Any, kv_pool: Any, *, max_running_requests: int,
                 adaptor_impl: str = "auto", attend_with: str = "adaptor", validate: bool = False) -> None:
        if not isinstance(max_running_requests, int) or max_running_requests < 1:
            raise ValueError(f"max_running_requests must be an int >= 1, got {max_running_requests!r}")
        if config.algorithm == "dsa":
            raise ValueError("--sparsehi-algorithm dsa needs the DeepSeek indexer's queries and keys, which SGLang's "
                             "RadixAttention does not hand the plugin: use quest, oracle or package.module:ClassName")
        if attend_with not in ATTEND_WITH:
            raise ValueError(f"attend_with must be one of {ATTEND_WITH}, got {attend_with!r}")
        if attend_with == "sglang_triton" and config.backend != "triton":
            raise ValueError(f"attend_with='sglang_triton' reads Triton metadata: needs --sparsehi-backend triton, "
                             f"got {config.backend!r}")
        self.attend_with = attend_with
        self.config = config
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        rows, max_ctx = req_to_token_rows(req_to_token_pool)
        ps = config.page_size
        if int(kv_pool.page_size) != ps:
            raise ValueError(f"--sparsehi-page-size={ps} must equal SGLang's --page-size={kv_pool.page_size} "
                             f"(the selection works on SGLang's pages)")
        max_ctx = _round_up(max_ctx, ps)
        per_req = (config.sink_units + config.recent_units + config.buffer_units + 1) * ps
        self.device_pool = adopt_kv_pool(kv_pool, max_running_requests * per_req)
        dev = self.device_pool.device
        self.kv_kind = self.device_pool.spec.attention
        # ours by name, or an SGLang BaseSparseAlgorithm subclass wrapped with SGLang's own pools
        self.algorithm = create_plugin_algorithm(config, dev, req_to_token_pool=req_to_token_pool,
                                                 token_to_kv_pool=kv_pool)
        self.host_pool = HostKVPool(self.device_pool, hicache_ratio=config.host_to_device_ratio)
        if self.kv_kind == "mla":
            from sparsehi.adapters import create_adaptor

            adaptor = create_adaptor("dsa", kv_lora_rank=self.device_pool.spec.kv_lora_rank, impl=adaptor_impl)
        else:
            if config.backend == "dsa":
                raise ValueError("--sparsehi-backend=dsa needs an MLA model; this model has an MHA cache: use "
                                 "'flashattention' or 'triton'")
            from sparsehi.adapters import create_adaptor

            adaptor = create_adaptor(config.backend, impl=adaptor_impl)
        self.coord = SparseCoordinator(
            config, self.algorithm, self.device_pool, mode="hierarchical", host_pool=self.host_pool,
            adaptor=adaptor, max_num_reqs=rows, max_context_len=max_ctx, validate=validate,
            dense_pool_tokens=max_running_requests * (max_ctx + ps) + 2 * ps,
        )
        self.registered = np.zeros(rows, dtype=bool)
        self.declined = np.zeros(rows, dtype=bool)
        """Rows whose prompt was too short (``min_sparse_prompt_len``): SGLang's path until freed."""
        self.registrations = 0
        """Prompts registered (each offloaded once, at its first decode forward)."""
        # static per-step buffers (the layer hooks and recorded graphs read views of them;
        # never reallocated), filled from two pinned host slots used in turn: a slot is
        # rewritten two steps later, when its copy has long run (an event makes sure)
        self._packed = torch.empty(3, rows, dtype=torch.int64, device=dev)  # rows, lengths, ours
        self._rows = self._packed[0]
        self._seq = torch.ones(rows, dtype=torch.int32, device=dev)
        self._ours = torch.zeros(rows, dtype=torch.bool, device=dev)
        pin = torch.device(dev).type == "cuda"
        self._host_slots = [torch.empty(3, rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._copied = [torch.cuda.Event() if pin else None for _ in range(2)]
        self._turn = 0
        self._staged = rows  # buffer rows that may hold a previous step's values
        self._stage(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool))
        logger.info("sparsehi: coordinator over SGLang's %s pool (%d slots + %d reserved), algorithm %s, adaptor %s",
                    self.kv_kind.upper(), self.device_pool.num_slots - max_running_requests * per_req,
                    max_running_requests * per_req, type(self.algorithm).__name__, adaptor.name)

    # ------------------------------------------------------------------ forwards
    def begin_forward(self, fb: Any) -> Optional[DecodeState]:
        """Host part before SGLang's forward; None when the forward is none of ours (every
        layer hook then calls SGLang's own attention)."""
        mode = fb.forward_mode
        if mode.is_decode():
            return self._begin_decode(fb)
        if mode.is_mixed():
            rows = host_rows(fb)
            if self.registered[rows].any():
                raise ValueError("sparsehi does not run mixed chunked-prefill/decode batches: leave "
                                 "--enable-mixed-chunk off")
            return None
        if mode.is_extend():
            self._note_extend(fb)
        return None

    def _note_extend(self, fb: Any) -> None:
        """An extend forward (a prompt, one chunk of it, or a prompt after a radix hit): its
        rows are new again; they are registered at their first decode forward."""
        rows = host_rows(fb)
        self.release_rows([int(r) for r in rows[self.registered[rows]]])
        self.declined[rows] = False

    def _begin_decode(self, fb: Any) -> Optional[DecodeState]:
        rows = host_rows(fb)
        seq = _host_ints("seq_lens", getattr(fb, "seq_lens_cpu", None), fb.seq_lens)
        b = len(rows)
        if b > self._rows.shape[0]:
            raise ValueError(f"decode batch of {b} rows exceeds the ReqToTokenPool's {self._rows.shape[0]} rows")
        new = ~(self.registered[rows] | self.declined[rows])
        if new.any():
            self._register(rows[new], seq[new] - 1)  # the prompt: every token but the one decoded now
        ours = self.registered[rows]
        # A step number of its own even with none of ours: a replayed graph closes a
        # (padding-only) step too, which must not overwrite the last real step's counters.
        has_dense = self.coord.prepare_decode(rows[ours], seq[ours])
        if has_dense:  # registered prompts reach min_sparse_prompt_len, so none decodes densely
            raise RuntimeError("sparsehi: a registered row decodes densely; the plugin's decode path has no dense rows")
        self._stage(rows, seq, ours)
        if not ours.any():
            return None
        return DecodeState(self._rows[:b], self._seq[:b], self._ours[:b], bool(ours.all()), host_rows=rows,
                           host_ours=ours)

    def _stage(self, rows: np.ndarray, seq: np.ndarray, ours: np.ndarray) -> None:
        """The step's rows into the static buffers: ours with their lengths, every other row
        up to the last step's size padding (a graph of a larger batch bucket reads them).
        One non-blocking copy from a pinned slot and two conversions, on the current stream."""
        b = len(rows)
        n = max(b, self._staged)
        i, self._turn = self._turn, self._turn ^ 1
        host, done = self._host_slots[i], self._copied[i]
        if done is not None:
            done.synchronize()  # the copy out of this slot two steps ago
        h = host.numpy()
        h[0, :n], h[1, :n], h[2, :n] = -1, 1, 0
        h[0, :b] = np.where(ours, rows, -1)
        h[1, :b] = np.where(ours, seq, 1)
        h[2, :b] = ours
        self._packed[:, :n].copy_(host[:, :n], non_blocking=True)
        if done is not None:
            done.record()
        self._seq[:n].copy_(self._packed[1, :n])
        self._ours[:n].copy_(self._packed[2, :n])
        self._staged = b

    def sglang_lengths(self, fb: Any, state: DecodeState) -> dict[str, Any]:
        """SGLang's decode lengths with ours cut to one token, for its attention backend
        (``seq_lens``, ``seq_lens_cpu``, ``seq_lens_sum``: new objects, SGLang's own are
        shared with its scheduler). Its attention output for our rows is replaced, so it
        need not read their context; the rows that are not ours keep their lengths."""
        out: dict[str, Any] = {"seq_lens": torch.where(state.ours, torch.ones_like(fb.seq_lens), fb.seq_lens)}
        ours_cpu = torch.from_numpy(state.host_ours)
        cpu = getattr(fb, "seq_lens_cpu", None)
        if cpu is not None:
            cpu = torch.where(ours_cpu, torch.ones_like(cpu), cpu)
            out["seq_lens_cpu"] = cpu
            out["seq_lens_sum"] = int(cpu.sum())
        elif getattr(fb, "seq_lens_sum", None) is not None:
            host = _host_ints("seq_lens", None, fb.seq_lens)
            out["seq_lens_sum"] = int(np.where(ours_cpu.numpy(), 1, host).sum())
        return out

    # ------------------------------------------------------------------ CUDA-graph capture
    def begin_capture(self, fb: Any) -> DecodeState:
        """A decode CUDA-graph capture's forward (SGLang's capture head hook): the layer
        path is recorded over the static buffers, whatever rows are ours at replay. A
        warm-up run (executed, not recorded) sees padding rows only."""
        mode = fb.forward_mode
        if not mode.is_decode():
            raise NotImplementedError(f"sparsehi: CUDA graphs of {mode} forwards (speculative decoding) are not "
                                      f"supported; allowed: decode")
        b = int(fb.batch_size)
        if b > self._rows.shape[0]:
            raise ValueError(f"captured batch of {b} rows exceeds the ReqToTokenPool's {self._rows.shape[0]} rows")
        if not (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()):
            empty = np.zeros(0, dtype=np.int64)
            self._stage(empty, empty, np.zeros(0, dtype=bool))
        return DecodeState(self._rows[:b], self._seq[:b], self._ours[:b], all_ours=False, recorded=True)

    def _register(self, rows: np.ndarray, lens: np.ndarray) -> None:
        """Register ``rows`` whose prompts of ``lens`` tokens sit complete in SGLang's pool
        (their ``req_to_token`` rows): the long ones get the coordinator's prefill end
        (representations of every layer from the pool's keys, one offload to the host pool,
        their buffers); the short ones are declined. On error nothing is registered."""
        long = lens >= max(1, self.config.min_sparse_prompt_len)
        self.declined[rows[~long]] = True
        if not long.any():
            return
        r, s = rows[long], lens[long]
        dev = self.device_pool.device
        rt = torch.from_numpy(r).to(dev)
        st = torch.from_numpy(s.astype(np.int32)).to(dev)
        slots = self.req_to_token_pool.req_to_token[rt, : int(s.max())].long()
        cols = torch.arange(slots.shape[1], device=dev)[None, :]
        slots = torch.where(cols < st[:, None], slots, -1)
        begun = []
        try:
            for row in r:
                self.coord.on_request_begin(int(row))
                begun.append(int(row))
            batch = SparseBatch.prefill(rt, st, slots, prefix_lens=torch.zeros_like(st),
                                        seq_lens_cpu=[int(x) for x in s], prefix_lens_cpu=[0] * len(s))
            for layer in range(self.coord.num_layers):
                self.coord.attention_end(layer, batch)
            # SGLang's slots stay SGLang's (its radix cache holds them): nothing is freed
            self.coord.forward_end(batch, free_device_kv=False)
        except BaseException:
            for row in begun:
                self.coord.on_request_end(row)
            raise
        self.registered[r] = True
        self.registrations += len(r)

    def end_forward(self, state: Optional[DecodeState]) -> None:
        """After SGLang's forward (or a capture's tail hook): close the decode step begun by
        the first layer. A replayed graph closed it itself: nothing began in Python."""
        if state is not None and state.batch is not None:
            batch, state.batch = state.batch, None
            self.coord.forward_end(batch)

    def abort_forward(self, state: Optional[DecodeState]) -> None:
        """SGLang's forward raised part-way: the step's rows of ours may be half-advanced in
        the coordinator (lengths, pages, buffers), so they leave it: the decode step is
        closed, their requests end (host pages given back) and they take SGLang's own path
        from now on (declined). SGLang's slots hold every token of theirs (the decode
        tokens are written there too), so whether SGLang retries the step or frees the
        rows, no KV is lost."""
        try:
            self.end_forward(state)
        finally:
            if state is not None and state.host_rows is not None:
                rows = [int(r) for r in state.host_rows[state.host_ours]]
                self.release_rows(rows)
                self.declined[rows] = True
                if rows:
                    logger.warning("sparsehi: a decode forward raised; rows %s leave the sparse path and decode "
                                   "on SGLang's own attention", rows)

    # ------------------------------------------------------------------ attention
    def attention(self, state: DecodeState, layer: Any, q: torch.Tensor, k: Optional[torch.Tensor],
                  v: Optional[torch.Tensor], fb: Any, save_kv_cache: bool, original: Callable[[], torch.Tensor],
                  q_rope: Optional[torch.Tensor] = None, k_rope: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One ``RadixAttention.forward`` of a decode forward the bridge takes part in: k/v
        (MLA: the latent row ``k``) written to SGLang's slots and to the coordinator's
        buffer, attention over the selection; rows that are not ours keep SGLang's output.
        MLA's split form (``q_rope`` / ``k_rope``: the rope parts of q and k, which then
        hold the latent parts only) is the same row, joined. Returns SGLang's shape
        ``[B, Hq * Dv]``.
        """
        layer_id = int(layer.layer_id)
        if k is None or (self.kv_kind == "mha" and v is None):
            raise ValueError(f"layer {layer_id}: sparsehi decode needs the new token's k and v (MLA: the latent k)")
        if state.batch is None:  # the first layer: the coordinator's device part of the step
            state.batch = SparseBatch.decode(state.rows, state.seq, prepared=True, has_dense_rows=False)
            self.coord.forward_begin(state.batch)
        b = state.batch.batch_size
        hq, dv = int(layer.tp_q_head_num), int(layer.v_head_dim)
        d = int(layer.qk_head_dim)
        if q_rope is not None:
            if self.kv_kind != "mla":
                raise ValueError(f"layer {layer_id}: q_rope / k_rope are MLA's split form; this cache is MHA")
            q = torch.cat([q.reshape(b, hq, -1), q_rope.reshape(b, hq, -1)], dim=-1)
            k = torch.cat([k.reshape(b, -1), k_rope.reshape(b, -1)], dim=-1)
            if q.shape[-1] != d:
                raise ValueError(f"layer {layer_id}: q + q_rope give {q.shape[-1]} dims per head, the layer's "
                                 f"qk_head_dim is {d}")
        q3 = q.reshape(b, hq, d)
        if self.kv_kind == "mla":  # k is the whole latent + rope row; v (its latent part) is not stored
            k3, v3 = k.reshape(b, 1, d), None
        else:
            hkv = int(layer.tp_k_head_num)
            k3, v3 = k.reshape(b, hkv, d), v.reshape(b, hkv, dv)
        dense = None
        if state.recorded or not state.all_ours:
            dense = original()  # SGLang's attention for its rows; writes every row's KV to its slots
        elif save_kv_cache:
            self._write_sglang_slot(layer, layer_id, fb.out_cache_loc, k3, v3)
        plan = self.coord.attention_begin(layer_id, state.batch, q=q3)
        plan.write_kv(k3, v3)
        if self.attend_with == "sglang_triton" and plan.is_sparse:
            from sparsehi.sglang_plugin.sglang_kernels import sglang_triton_decode

            o = sglang_triton_decode(q3, plan.layer_cache[0], plan.layer_cache[1], plan.metadata, float(layer.scaling))
        else:
            o = plan.attend(q3, float(layer.scaling))
        self.coord.attention_end(layer_id, state.batch, k=k3, v=v3)
        if dense is not None:
            o = torch.where(state.ours[:, None, None], o, dense.reshape(b, hq, dv).to(o.dtype))
        return o.reshape(b, hq * dv)

    def _write_sglang_slot(self, layer: Any, layer_id: int, loc: torch.Tensor, k: torch.Tensor,
                           v: Optional[torch.Tensor]) -> None:
        """The new token into SGLang's own slot (what its backend would have written), so
        its radix cache holds the request's full KV. MHA through SGLang's writer; MLA
        straight into the shared buffer (SGLang's MLA writer needs its parallel context,
        and the unquantised row it would write is exactly ``k``)."""
        if self.kv_kind == "mha":
            self.kv_pool.set_kv_buffer(layer, loc, k, v)
        else:
            buf = self.device_pool.get_key_buffer(layer_id)
            buf.index_copy_(0, loc.long(), k.to(buf.dtype))

    # ------------------------------------------------------------------ requests
    def release_rows(self, rows: list[int]) -> None:
        """SGLang frees these ``ReqToTokenPool`` rows: end their requests in the coordinator
        and give their host pages back (rows that are not ours are ignored)."""
        for row in rows:
            row = int(row)
            if not 0 <= row < len(self.registered):
                continue
            self.declined[row] = False
            if not self.registered[row]:
                continue
            kv = self.coord.on_request_end(row)
            self.registered[row] = False
            if kv.host_pages is not None and kv.host_pages.numel():
                self.host_pool.allocator.free_pages(kv.host_pages)

    def release_all(self) -> None:
        self.release_rows([int(r) for r in np.flatnonzero(self.registered)])
        self.declined[:] = False
