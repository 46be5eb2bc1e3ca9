"""Stand-ins for the parts of SGLang 0.5.23 the plugin's decode path touches, with the
plugin's real hooks around them: for GPU tests and benchmarks on a machine where SGLang
cannot be installed (``tests/sglang`` runs the same hooks over SGLang's real classes on CPU).

Each class carries only the attributes the bridge reads: ``ReqToTokenPool``
(``req_to_token``), an MHA token-to-KV pool (``k_buffer`` / ``v_buffer``, one
``[size + page_size, heads, dim]`` tensor per layer, ``set_kv_buffer``), SGLang's token
allocator at its default ``--page-size 1`` (``TokenToKVPoolAllocator``: a free list of
slots, ``free_group`` deferral; the plugin subclasses it, as it does SGLang's), ``ForwardBatch``
(mode, rows, lengths, write slots — GPU ones, and the virtual ones the scheduler
allocated — and their CPU copies) and ``RadixAttention``'s layer fields. SGLang's
attention is its decode contract read through the model runner's KV index translation:
the new token to ``out_cache_loc`` (GPU slots), then attention over every token of the row
at its GPU slot (``allocator.translate_kv_loc(req_to_token[row])``, identity without the
plugin) with ``cache_seqlens = seq_lens`` (this package's paged decode kernel at page size
1; its programs past a row's length do nothing). A prompt is prefilled through an extend
forward of the model runner (its KV written at its GPU slots), so the plugin prepares it
as in a server.

``SGLangWorld`` is a model runner of attention layers only: a forward runs the layers on
given q / k / v through ``hooks.around_radix_attention`` inside ``hooks.around_forward_raw``,
eagerly or, with ``graphs``, as SGLang's ``DecodeCudaGraphRunner`` does: per batch bucket a
capture batch of padding rows, the model runner's capture head hooks, the model and its
tail hooks recorded once (after warm-up runs); at each step the forward hook's host part,
then the step's inputs copied into the capture batch padded to the bucket (row 0, length 1,
slot 0), then the replay. Without CUDA the "replay" runs the recorded Python path again
under a simulated capture.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Optional

import torch

from sparsehi.algorithms.graph_safety import simulated_capture, sync_debug_errors
from sparsehi.config import SparseConfig
from sparsehi.kernels.paged_decode import paged_decode
from sparsehi.sglang_plugin import hooks


@dataclass(frozen=True)
class Shape:
    """Layers, heads, head dim, SGLang's page size, the longest context, request rows,
    KV slots of SGLang's pool and the KV dtype."""

    layers: int = 3
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    page_size: int = 1
    context: int = 96
    rows: int = 5
    pool_tokens: int = 640
    dtype: torch.dtype = torch.float32


class Mode:
    def __init__(self, name: str) -> None:
        self.name = name

    def is_decode(self) -> bool:
        return self.name == "decode"

    def is_extend(self) -> bool:
        return self.name == "extend"

    def is_mixed(self) -> bool:
        return False


@dataclass
class Batch:
    """``ForwardBatch`` fields the plugin reads in a forward."""

    forward_mode: Mode
    batch_size: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens_cpu: Optional[torch.Tensor] = None
    req_pool_indices_cpu: Optional[torch.Tensor] = None
    seq_lens_sum: Optional[int] = None
    out_cache_loc_virtual: Optional[torch.Tensor] = None
    extend_prefix_lens_cpu: Optional[list] = None


class TokenToKVPoolAllocator:
    """SGLang's token allocator (``--page-size 1``): slots ``1..size`` on a free list (slot
    0 is the padding slot), frees deferred inside a free group."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device, kvcache, need_sort: bool) -> None:
        self.size, self.page_size, self.dtype, self.device = size, 1, dtype, device
        self._kvcache, self.need_sort = kvcache, need_sort
        self.free_group = None
        self.clear()

    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        self.free_group = None

    def get_kvcache(self):
        return self._kvcache

    def available_size(self) -> int:
        return len(self.free_pages)

    def alloc(self, need_size: int):
        if need_size > len(self.free_pages):
            return None
        out, self.free_pages = self.free_pages[:need_size], self.free_pages[need_size:]
        return out

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(free_index.clone())
        else:
            self.free_pages = torch.cat((self.free_pages, free_index.to(self.device)))


class ReqToTokenPool:
    def __init__(self, rows: int, context: int, device: torch.device) -> None:
        self.size = rows
        self.req_to_token = torch.zeros(rows, context, dtype=torch.int32, device=device)


class MHAPool:
    def __init__(self, shape: Shape, device: torch.device) -> None:
        self.shape = shape
        self.size, self.page_size, self.device = shape.pool_tokens, shape.page_size, device
        self.dtype = self.store_dtype = shape.dtype
        n = shape.pool_tokens + shape.page_size
        self.k_buffer = [torch.zeros(n, shape.kv_heads, shape.head_dim, dtype=shape.dtype, device=device)
                         for _ in range(shape.layers)]
        self.v_buffer = [torch.zeros_like(self.k_buffer[0]) for _ in range(shape.layers)]

    def set_kv_buffer(self, layer, loc, k, v) -> None:
        s = self.shape
        self.k_buffer[layer.layer_id][loc.long()] = k.view(-1, s.kv_heads, s.head_dim).to(s.dtype)
        self.v_buffer[layer.layer_id][loc.long()] = v.view(-1, s.kv_heads, s.head_dim).to(s.dtype)


@dataclass
class Layer:
    layer_id: int
    tp_q_head_num: int
    tp_k_head_num: int
    qk_head_dim: int
    v_head_dim: int
    scaling: float


@dataclass
class Runner:
    server_args: object
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHAPool
    token_to_kv_pool_allocator: TokenToKVPoolAllocator
    max_running_requests: int
    capture_head_hooks: list
    capture_tail_hooks: list
    kv_index_translator: object = None
    max_total_num_tokens: int = 0


class SGLangWorld:
    """The stand-in model runner with the plugin's hooks (``cfg`` None: sparsehi off).
    ``buckets``: the graph batch sizes (``graphs`` only). A forward's inputs are per layer
    ``(q, k, v)``, or, with ``layer_inputs``, one ``[B, input_width]`` tensor from which the
    model computes them (``layer_inputs(x)``, inside the recorded graph too)."""

    def __init__(self, cfg: Optional[SparseConfig], device: torch.device, graphs: bool, shape: Shape = Shape(),
                 buckets: tuple[int, ...] = (2, 4), max_running_requests: int = 4,
                 layer_inputs: Optional[Callable[[torch.Tensor], list]] = None, input_width: int = 0) -> None:
        self.shape, self.device, self.graphs = shape, torch.device(device), graphs
        self.layer_inputs, self.input_width = layer_inputs, input_width
        if shape.page_size != 1:
            raise ValueError(f"the stand-ins model SGLang's token allocator: Shape.page_size must be 1, got "
                             f"{shape.page_size}")
        self.req_pool = ReqToTokenPool(shape.rows, shape.context, self.device)
        self.kv_pool = MHAPool(shape, self.device)
        alloc = TokenToKVPoolAllocator(shape.pool_tokens, shape.dtype, self.device, self.kv_pool, False)
        args = type("Args", (), {"sparsehi_config": cfg})()
        self.runner = Runner(args, self.req_pool, self.kv_pool, alloc, max_running_requests, [], [],
                             max_total_num_tokens=shape.pool_tokens)
        hooks.after_alloc_memory_pool(None, self.runner)
        s = shape
        self.layers = [Layer(i, s.q_heads, s.kv_heads, s.head_dim, s.head_dim, s.head_dim ** -0.5)
                       for i in range(s.layers)]
        self.lens: dict[int, int] = {}
        self.model_runner = self.runner  # what the capture hooks read off SGLang's graph runner
        self.buckets = tuple(sorted(buckets))
        self.captured: dict[int, tuple] = {}
        if graphs:
            for bs in self.buckets:
                self.captured[bs] = self._capture(bs)

    @property
    def bridge(self):
        return getattr(self.runner, hooks.BRIDGE_ATTR, None)

    # ------------------------------------------------------------------ SGLang's attention
    @property
    def allocator(self):
        return self.runner.token_to_kv_pool_allocator

    def gpu_slots(self, virtual: torch.Tensor) -> torch.Tensor:
        """GPU slots of virtual slots (the model runner's KV index translation; identity
        without the plugin)."""
        translate = getattr(self.allocator, "translate_kv_loc", None)
        return virtual.long() if translate is None else translate(virtual.long())

    def attend(self, layer: Layer, q, k, v, fb: Batch, save_kv_cache: bool = True) -> torch.Tensor:
        """SGLang's decode attention: ``[B, Hq * D]``."""
        s = self.shape
        if save_kv_cache:
            self.kv_pool.set_kv_buffer(layer, fb.out_cache_loc, k, v)
        b = q.shape[0]
        table = self.gpu_slots(self.req_pool.req_to_token[fb.req_pool_indices.long()])
        o = paged_decode(q.view(b, s.q_heads, s.head_dim).to(s.dtype), self.kv_pool.k_buffer[layer.layer_id],
                         self.kv_pool.v_buffer[layer.layer_id], table.int(), fb.seq_lens.int(),
                         page_size=1, sm_scale=layer.scaling)
        return o.reshape(b, s.q_heads * s.head_dim)

    # ------------------------------------------------------------------ the scheduler's side
    def _slots(self, rows: list[int], starts: list[int], ends: list[int]) -> torch.Tensor:
        """Slots ``[start, end)`` of each row from the allocator, written to ``req_to_token``."""
        ids = self.allocator.alloc(sum(e - a for a, e in zip(starts, ends)))
        if ids is None:
            raise RuntimeError("the allocator refused (out of KV slots)")
        k = 0
        for r, a, e in zip(rows, starts, ends):
            self.req_pool.req_to_token[r, a:e] = ids[k:k + e - a].to(torch.int32)
            self.lens[r] = e
            k += e - a
        return ids

    def prompt(self, row: int, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """SGLang's prefill of ``row`` (``k[layer]`` / ``v[layer]``: ``[n, Hkv * D]``): an extend
        forward through the model runner's hook that writes the prompt's KV at its GPU slots
        (the plugin pins it, copies it to host and builds the algorithm's representations);
        the plugin registers it at its first decode forward."""
        s, dev = self.shape, self.device
        n = k[0].shape[0]
        ids = self._slots([row], [0], [n])
        fb = Batch(Mode("extend"), 1, torch.tensor([row], device=dev), torch.tensor([n], device=dev),
                   self.gpu_slots(ids), seq_lens_cpu=torch.tensor([n]), req_pool_indices_cpu=torch.tensor([row]),
                   seq_lens_sum=n, out_cache_loc_virtual=ids, extend_prefix_lens_cpu=[0])
        scheduled = SimpleNamespace(reqs=[SimpleNamespace(origin_input_ids=[0] * n, output_ids=[])],
                                    req_pool_indices_cpu=torch.tensor([row]))
        hooks.after_forward_batch_init_new(fb, Batch, scheduled, self.runner)

        def write(runner, b):
            for i in range(s.layers):
                self.kv_pool.k_buffer[i][b.out_cache_loc] = k[i].view(-1, s.kv_heads, s.head_dim).to(s.dtype)
                self.kv_pool.v_buffer[i][b.out_cache_loc] = v[i].view(-1, s.kv_heads, s.head_dim).to(s.dtype)

        hooks.around_forward_raw(write, self.runner, fb)

    # ------------------------------------------------------------------ forwards
    def _model(self, fb: Batch, inputs) -> list[torch.Tensor]:
        qkv = self.layer_inputs(inputs) if self.layer_inputs is not None else inputs
        return [hooks.around_radix_attention(self.attend, self.layers[i], q, k, v, fb)
                for i, (q, k, v) in enumerate(qkv)]

    def _run_once(self, fb: Batch, qkv) -> list[torch.Tensor]:
        """One run of SGLang's capture closure: head hooks, the model, tail hooks."""
        for hook in self.runner.capture_head_hooks:
            hook(self, fb)
        out = self._model(fb, qkv)
        for hook in self.runner.capture_tail_hooks:
            hook(self, out, fb, fb.batch_size)
        return out

    def _capture(self, bs: int):
        dev, s = self.device, self.shape
        zeros = torch.zeros(bs, dtype=torch.int64, device=dev)
        fb = Batch(Mode("decode"), bs, zeros.clone(), torch.ones(bs, dtype=torch.int64, device=dev), zeros.clone())
        if self.layer_inputs is not None:
            qkv = torch.zeros(bs, self.input_width, dtype=s.dtype, device=dev)
        else:
            qkv = [tuple(torch.zeros(bs, h * s.head_dim, dtype=s.dtype, device=dev)
                         for h in (s.q_heads, s.kv_heads, s.kv_heads)) for _ in range(s.layers)]
        if dev.type != "cuda":
            self._run_once(fb, qkv)  # the warm-up (executed)
            return None, fb, qkv, None
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run_once(fb, qkv)
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._run_once(fb, qkv)
        return graph, fb, qkv, out

    def _replay(self, fb: Batch, qkv) -> list[torch.Tensor]:
        """SGLang's graph runner inside ``_forward_raw``: the step's inputs into the static
        tensors (padded to the bucket), then the replay."""
        b = fb.batch_size
        bs = next(x for x in self.buckets if x >= b)
        graph, sfb, sqkv, out = self.captured[bs]
        for name, pad in (("req_pool_indices", 0), ("seq_lens", 1), ("out_cache_loc", 0)):
            dst = getattr(sfb, name)
            dst.fill_(pad)
            dst[:b] = getattr(fb, name)  # seq_lens: what the forward hook left there (ours: one token)
        pairs = [(qkv, sqkv)] if self.layer_inputs is not None else \
            [(x, y) for src, dst in zip(qkv, sqkv) for x, y in zip(src, dst)]
        for x, y in pairs:
            y.zero_()
            y[:b] = x
        if graph is None:
            with simulated_capture():
                out = self._run_once(sfb, sqkv)
        else:
            graph.replay()
        return [o[:b] for o in out]

    def batch(self, rows: list[int], lens: list[int]) -> Batch:
        """The scheduler's decode batch: one new slot per row (``lens`` count it)."""
        dev = self.device
        if any(self.lens.get(r, 0) + 1 != n for r, n in zip(rows, lens)):
            raise ValueError("lens must be each row's length with the token decoded now")
        ids = self._slots(rows, [n - 1 for n in lens], lens)
        fb = Batch(Mode("decode"), len(rows), torch.tensor(rows, device=dev), torch.tensor(lens, device=dev),
                   self.gpu_slots(ids), seq_lens_cpu=torch.tensor(lens), seq_lens_sum=sum(lens),
                   out_cache_loc_virtual=ids)
        # as SGLang's ForwardBatch.init_new: no req_pool_indices_cpu on a decode batch, then
        # the plugin's hook on init_new keeps the scheduler batch's host copy
        hooks.after_forward_batch_init_new(fb, Batch, SimpleNamespace(req_pool_indices_cpu=torch.tensor(rows),
                                                                      reqs=None), self.runner)
        return fb

    def release(self, row: int) -> None:
        """A request ends as SGLang releases it (no tree): its slots back to the allocator
        (inside a free group, as result processing does), its row freed."""
        n = self.lens.pop(row)
        alloc = self.allocator
        alloc.free_group = []
        alloc.free(self.req_pool.req_to_token[row, :n].long())
        hooks.before_free_rows(self.req_pool, [row])
        pending, alloc.free_group = alloc.free_group, None
        if pending:
            alloc.free(torch.cat(pending))

    def forward(self, fb: Batch, qkv, no_sync: bool = False) -> list[torch.Tensor]:
        """One decode forward through the model runner's forward hook: per layer
        ``[B, Hq * D]`` (views of static outputs when graphed: read before the next step).
        ``no_sync``: under ``torch.cuda.set_sync_debug_mode("error")`` (CUDA), as SGLang's
        overlap scheduler needs the host part and the replay to leave the device running."""
        if self.graphs:
            step = lambda runner, b: self._replay(b, qkv)  # noqa: E731
        else:
            step = lambda runner, b: self._model(b, qkv)  # noqa: E731
        with sync_debug_errors() if no_sync and self.device.type == "cuda" else contextlib.nullcontext():
            return hooks.around_forward_raw(step, self.runner, fb)
