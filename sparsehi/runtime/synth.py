"""Synthesised prefill for decode benchmarks: put ``context`` tokens of random KV (and the
algorithm's representations built from it) in place for every request without running
the model over the prompt, which a decode-throughput benchmark does not measure.

A position's KV depends on the seed and the position alone (blocks of
``kv_block_tokens`` positions, each from its own seeded generator), so every mode, every
request and every way of cutting the prompt into chunks sees the same prompt.

Host modes share one prompt's host KV between the batch's requests (as prefix reuse from
the HiRadixTree would); each request still has its own GPU buffer, representations,
decode pages and per-step loads, so the decode work is the same as with distinct
prompts, while pinned host memory stays within what the benchmark machine has. Capacity
(how many requests a host budget holds) is computed from per-request bytes, not from this
shared allocation.

Host modes write the prompt through a device staging area of ``chunk_tokens`` tokens:
``sparse-hier`` as a chunked prefill through the coordinator (each chunk's KV offloaded,
its representations, sink / recent pages and dense-layer KV placed, then the next chunk
written over it), so a context far larger than the GPU (a million tokens) needs only one
chunk of device KV.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from hicache.device_pool import DeviceKVPool
from sparsehi.forward_batch import ForwardBatch
from sparsehi.runtime.kv_cache_format import stored_kv
from sparsehi.runtime.runtime_mode import DenseMode, Request, RuntimeMode

KV_BLOCK_TOKENS = 256
"""Positions per seeded block of random KV (with the page size: ``kv_block_tokens``)."""


def kv_block_tokens(page_size: int) -> int:
    """Positions per seeded block: whole pages, a multiple of ``KV_BLOCK_TOKENS``."""
    return math.lcm(KV_BLOCK_TOKENS, page_size)


def _block_seed(seed: int, block: int) -> int:
    return ((seed & 0xFFFFFFFF) << 32) | (block & 0xFFFFFFFF)


def fill_random(pool: DeviceKVPool, slots: torch.Tensor, seed: int, first_position: int = 0) -> None:
    """Random N(0, 1) KV of prompt positions ``[first_position, first_position + n)`` into
    ``slots [n]`` of every layer: the positions of block ``j`` (``kv_block_tokens`` of them)
    from a generator seeded by ``(seed, j)``. ``first_position`` starts a block. A pool of
    FP8 latent rows (``kv_cache_dtype="fp8_e4m3"``) stores the same values, rounded to bf16,
    as the rows ``stored_kv`` makes of them."""
    spec = pool.spec
    block = kv_block_tokens(pool.page_size)
    if first_position % block:
        raise ValueError(f"first_position={first_position} must be a multiple of {block} (a block of random KV)")
    s = slots.to(pool.device)
    n = s.numel()
    if n == 0:
        return
    kv = pool.kv_data  # [bufs, layers, slots, H, D]
    values_shape = (*kv.shape[3:-1], spec.value_dim + spec.rope_dim) if spec.fp8_latent_rows else kv.shape[3:]
    s0 = int(s[0])
    contiguous = int(s[-1]) - s0 + 1 == n
    gen = torch.Generator(device=pool.device)
    for off in range(0, n, block):
        m = min(block, n - off)
        gen.manual_seed(_block_seed(seed, (first_position + off) // block))
        rows = torch.randn((*kv.shape[:2], m, *values_shape), generator=gen, device=pool.device,
                           dtype=torch.float32)
        rows = stored_kv(spec, rows.to(torch.bfloat16)) if spec.fp8_latent_rows else rows.to(kv.dtype)
        if contiguous:
            kv[:, :, s0 + off:s0 + off + m] = rows
        else:
            kv[:, :, s[off:off + m]] = rows


def copy_kv(pool: DeviceKVPool, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Every layer's KV of slots ``src`` into slots ``dst`` (device to device)."""
    s, d = src.to(pool.device), dst.to(pool.device)
    for b in range(pool.kv_data.shape[0]):
        for layer in range(pool.kv_data.shape[1]):
            buf = pool.kv_data[b, layer]
            buf.index_copy_(0, d, buf.index_select(0, s))


def _index_keys(mode, ctx: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=mode.device).manual_seed(seed)
    return torch.randn((1, ctx, mode.cfg.index_head_dim), generator=gen, device=mode.device, dtype=torch.float32)


def synth_prefill(mode: RuntimeMode, reqs: list[Request], context: int, seed: int = 0,
                  chunk_tokens: Optional[int] = None) -> None:
    """Prefill every request of ``reqs`` (prompts of ``context`` tokens) with random KV.

    chunk_tokens: the host modes write the prompt through a device staging area of this
    many tokens (a multiple of ``kv_block_tokens(page_size)``), chunk after chunk; None:
    the whole prompt at once. The result does not depend on it."""
    from sparsehi.runtime.offload_mode import OffloadFullMode
    from sparsehi.runtime.sparse_mode import SparseCoordinatorMode

    ps = mode.rt.page_size
    if context % ps:
        raise ValueError(f"context={context} must be a multiple of page_size={ps} for a synthesised prefill")
    block = kv_block_tokens(ps)
    if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens <= 0 or chunk_tokens % block):
        raise ValueError(f"chunk_tokens={chunk_tokens!r} is invalid: None or a positive multiple of {block} "
                         f"(whole blocks of random KV)")
    chunk = context if chunk_tokens is None else min(chunk_tokens, context)
    for r in reqs:
        r.prompt = [0] * context  # token ids are not used by decode; only the length matters
        if not r.output:
            r.output = [1]
    if isinstance(mode, DenseMode):
        _synth_device(mode, reqs, context, seed, None)
    elif isinstance(mode, OffloadFullMode):
        _synth_offload(mode, reqs, context, seed, chunk)
    elif not isinstance(mode, SparseCoordinatorMode):
        raise ValueError(f"synth_prefill: unsupported mode {type(mode).__name__}")
    elif mode.hierarchical:
        _synth_hierarchical(mode, reqs, context, seed, chunk)
    else:
        _synth_device(mode, reqs, context, seed, _index_keys(mode, context, seed) if mode.is_dsa else None)


def _synth_device(mode, reqs: list[Request], context: int, seed: int, index_keys: Optional[torch.Tensor]) -> None:
    """dense and sparse-gpu: every request's whole prompt in device slots of its own (the
    first request's filled, copied to the others); sparse-gpu's prefill end goes through
    the coordinator, which builds its representations."""
    dev = mode.device
    first: Optional[torch.Tensor] = None
    for r in reqs:
        mode.begin_request(r)
        slots = mode.prefill_slots(r, 0) if isinstance(mode, DenseMode) else mode._alloc_device(context)
        if first is None:
            fill_random(mode.pool, slots[:context], seed)
            first = slots[:context]
        else:
            copy_kv(mode.pool, first, slots[:context])
        r.seq_len = context
        if isinstance(mode, DenseMode):
            continue
        r.device_slots = slots
        batch = ForwardBatch.prefill(torch.tensor([r.req_pool_idx], device=dev),
                                     torch.tensor([context], dtype=torch.int32, device=dev), slots[:context][None, :])
        for layer in range(mode.cfg.num_layers):
            mode.coord.attention_end(layer, batch, **({"index_keys": index_keys} if index_keys is not None else {}))
        mode.coord.forward_end(batch)
        r.device_slots = None  # the coordinator owns them until the request ends


def _shared_host_prompt(mode, context: int) -> torch.Tensor:
    shared = mode.host.alloc(context)
    if shared is None:
        raise ValueError("host KV pool cannot hold the synthesised prompt")
    return shared


def _synth_offload(mode, reqs: list[Request], context: int, seed: int, chunk: int) -> None:
    """One prompt's KV written to the host pool chunk by chunk, shared by every request."""
    shared = _shared_host_prompt(mode, context)
    staging = mode._alloc_device(chunk)
    for s in range(0, context, chunk):
        e = min(s + chunk, context)
        fill_random(mode.pool, staging[:e - s], seed, s)
        mode.transfer.backup(staging[:e - s], shared[s:e].to(staging.device)).wait()
    _release_staging(mode, staging)
    for r in reqs:
        mode.begin_request(r)
        mode.set_host_slots(r, shared)  # shared by the batch: the benchmark never ends these requests
        r.seq_len = context


def _release_staging(mode, staging: torch.Tensor) -> None:
    if mode.device.type == "cuda":
        torch.cuda.synchronize(mode.device)
    mode.pool.allocator.free(staging)


def _synth_hierarchical(mode, reqs: list[Request], context: int, seed: int, chunk: int) -> None:
    """sparse-hier: a chunked prefill of every request through the coordinator, one chunk
    of device KV (the staging area) at a time. Per chunk: its KV written once; every
    request's representations built from it (``attention_end``), then each request's
    chunk end (``forward_end`` with ``more_chunks`` until the last): the first request
    writes the chunk to the shared host pages, the others nothing (their ``prefix_lens``,
    set after the layers ran as a ``ForwardBatch`` cannot be built without new tokens, say
    the whole chunk is on host), and each places its own buffer and dense-layer pages."""
    dev = mode.device
    coord = mode.coord
    ik = _index_keys(mode, context, seed) if mode.is_dsa else None
    shared = _shared_host_prompt(mode, context)
    staging = mode._alloc_device(chunk)
    for r in reqs:
        mode.begin_request(r)
    rows = [torch.tensor([r.req_pool_idx], device=dev) for r in reqs]
    for s in range(0, context, chunk):
        e = min(s + chunk, context)
        fill_random(mode.pool, staging[:e - s], seed, s)
        slots = torch.full((1, e), -1, dtype=torch.int64, device=dev)  # earlier chunks are off the device
        slots[0, s:] = staging[:e - s]
        batches = []
        for i, r in enumerate(reqs):
            batch = ForwardBatch.prefill(rows[i], torch.tensor([e], dtype=torch.int32, device=dev), slots,
                                         prefix_lens=torch.tensor([s], dtype=torch.int32, device=dev),
                                         seq_lens_cpu=[e], prefix_lens_cpu=[s])
            for layer in range(mode.cfg.num_layers):
                coord.attention_end(layer, batch, **({"index_keys": ik[:, :e]} if ik is not None else {}))
            if i:  # the chunk is on host already (the first request wrote it): a prefix of the whole chunk
                batch.prefix_lens, batch.prefix_lens_cpu = batch.seq_lens.clone(), [e]
            batches.append(batch)
        for batch in batches:
            coord.forward_end(batch, host_slots=[shared], free_device_kv=False, more_chunks=[e < context])
    _release_staging(mode, staging)
    for r in reqs:
        r.host_slots = shared
        r.seq_len = context
