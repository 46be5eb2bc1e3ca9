"""Synthesised prefill for decode benchmarks: put ``context`` tokens of random KV (and the
algorithm's representations built from it) in place for every request without running
the model over the prompt, which a decode-throughput benchmark does not measure.

Host modes share one prompt's host KV between the batch's requests (as prefix reuse from
the HiRadixTree would); each request still has its own GPU buffer, representations,
decode pages and per-step loads, so the decode work is the same as with distinct
prompts, while pinned host memory stays within what the benchmark machine has. Capacity
(how many requests a host budget holds) is computed from per-request bytes, not from this
shared allocation.
"""
from __future__ import annotations

import torch

from hicache.device_pool import DeviceKVPool
from sparsehi.forward_batch import ForwardBatch
from sparsehi.runtime.runtime_mode import DenseMode, Request, RuntimeMode


def fill_random(pool: DeviceKVPool, slots: torch.Tensor, gen: torch.Generator) -> None:
    """Random N(0, 1) KV into ``slots`` of every layer (contiguous runs filled in place)."""
    s = slots.to(pool.device)
    n = s.numel()
    if n == 0:
        return
    s0 = int(s[0])
    if int(s[-1]) - s0 + 1 == n:
        view = pool.kv_data[:, :, s0:s0 + n]
        for b in range(view.shape[0]):
            for layer in range(view.shape[1]):
                view[b, layer].normal_(generator=gen)
        return
    for b in range(pool.kv_data.shape[0]):
        for layer in range(pool.kv_data.shape[1]):
            rows = torch.randn((n, *pool.kv_data.shape[3:]), generator=gen, device=pool.device,
                               dtype=torch.float32).to(pool.kv_data.dtype)
            pool.kv_data[b, layer].index_copy_(0, s, rows)


def copy_kv(pool: DeviceKVPool, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Every layer's KV of slots ``src`` into slots ``dst`` (device to device)."""
    s, d = src.to(pool.device), dst.to(pool.device)
    for b in range(pool.kv_data.shape[0]):
        for layer in range(pool.kv_data.shape[1]):
            buf = pool.kv_data[b, layer]
            buf.index_copy_(0, d, buf.index_select(0, s))


def _index_keys(mode, ctx: int, gen: torch.Generator) -> torch.Tensor:
    di = mode.cfg.index_head_dim
    return torch.randn((1, ctx, di), generator=gen, device=mode.device, dtype=torch.float32)


def synth_prefill(mode: RuntimeMode, reqs: list[Request], context: int, seed: int = 0) -> None:
    """Prefill every request of ``reqs`` (prompts of ``context`` tokens) with random KV."""
    from sparsehi.runtime.offload_mode import OffloadFullMode
    from sparsehi.runtime.sparse_mode import SparseCoordinatorMode

    ps = mode.rt.page_size
    if context % ps:
        raise ValueError(f"context={context} must be a multiple of page_size={ps} for a synthesised prefill")
    gen = torch.Generator(device=mode.device).manual_seed(seed)
    for r in reqs:
        r.prompt = [0] * context  # token ids are not used by decode; only the length matters
        if not r.output:
            r.output = [1]
    # every request gets the same prompt KV in every mode, so modes are comparable
    first: list[torch.Tensor] = []

    def fill(slots: torch.Tensor) -> None:
        if first:
            copy_kv(mode.pool, first[0], slots[:context])
        else:
            fill_random(mode.pool, slots[:context], gen)
            first.append(slots[:context])

    if isinstance(mode, DenseMode):
        _synth_dense(mode, reqs, context, fill)
        return
    if isinstance(mode, OffloadFullMode):
        _synth_offload(mode, reqs, context, fill)
        return
    if not isinstance(mode, SparseCoordinatorMode):
        raise ValueError(f"synth_prefill: unsupported mode {type(mode).__name__}")
    _synth_coordinator(mode, reqs, context, gen, fill)


def _synth_dense(mode, reqs: list[Request], context: int, fill) -> None:
    for r in reqs:
        mode.begin_request(r)
        fill(mode.prefill_slots(r, 0))
        r.seq_len = context


def _synth_offload(mode, reqs: list[Request], context: int, fill) -> None:
    """One prompt's KV written to the host pool, shared by every request."""
    dev = mode.device
    staging = mode._alloc_device(context)
    fill(staging)
    shared = mode.host.alloc(context)
    if shared is None:
        raise ValueError("host KV pool cannot hold the synthesised prompt")
    mode.transfer.backup(staging, shared.to(staging.device)).wait()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    mode.pool.allocator.free(staging)
    for r in reqs:
        mode.begin_request(r)
        mode.set_host_slots(r, shared)  # shared by the batch: the benchmark never ends these requests
        r.seq_len = context


def _synth_coordinator(mode, reqs: list[Request], context: int, gen: torch.Generator, fill) -> None:
    """The sparse modes: each request's prefill goes through the coordinator (which builds
    its representations); sparse-hier's requests share one host copy of the prompt."""
    ps = mode.rt.page_size
    dev = mode.device
    coord = mode.coord
    L = mode.cfg.num_layers
    staging = shared = None
    # index keys first: the random stream then matches in both coordinator modes
    ik = _index_keys(mode, context, gen) if mode.is_dsa else None
    if mode.hierarchical:
        staging = mode._alloc_device(context)
        fill(staging)
        shared = mode.host.alloc(context)
        if shared is None:
            raise ValueError("host KV pool cannot hold the synthesised prompt")
    for i, r in enumerate(reqs):
        mode.begin_request(r)
        if mode.hierarchical:
            slots, prefix = staging, (0 if i == 0 else context - ps)
        else:
            slots, prefix = mode._alloc_device(context), 0
            fill(slots)
            r.device_slots = slots
        batch = ForwardBatch.prefill(
            torch.tensor([r.req_pool_idx], device=dev), torch.tensor([context], dtype=torch.int32, device=dev),
            slots[:context][None, :], prefix_lens=torch.tensor([prefix], dtype=torch.int32, device=dev))
        for layer in range(L):
            kw = {"index_keys": ik} if ik is not None else {}
            coord.attention_end(layer, batch, **kw)
        if mode.hierarchical:
            coord.forward_end(batch, host_slots=[shared], free_device_kv=False)
            r.host_slots = shared
        else:
            coord.forward_end(batch)
            r.device_slots = None
        r.seq_len = context
    if mode.hierarchical:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        mode.pool.allocator.free(staging)
