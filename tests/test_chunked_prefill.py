"""Chunked prefill through the SparseCoordinator (SGLang's chunked prefill: each chunk an
extend whose ``prefix_lens`` are the tokens done): in hierarchical mode each chunk's KV
leaves the GPU at its ``forward_end(more_chunks=...)``, yet after the last chunk the
request is where a whole-prompt prefill leaves it (host copy, representations, GPU
buffer, dense-layer pool) and decodes the same attention outputs; gpu_only builds the
same representations; misuse is refused by name."""
from __future__ import annotations

import math

import pytest
import torch

from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.kv_spec import KVCacheSpec
from hicache.transfer import KVTransferEngine
from sparsehi.algorithms.registry import create_algorithm
from sparsehi.config import SparseConfig
from sparsehi.coordinator import SparseCoordinator
from sparsehi.forward_batch import ForwardBatch

L, HKV, HQ, D, PS = 3, 2, 4, 8, 4
PROMPT = 38  # chunks of 16, 16 and 6 tokens: the sink (20) spans two, the recent window (16) the last two


def _coord(mode: str = "hierarchical", algorithm: str = "quest", **kw):
    kw = {"min_sparse_prompt_len": 0, **kw}
    cfg = SparseConfig(algorithm=algorithm, page_size=PS, top_k=12, device_buffer_size=16, sink_tokens=20,
                       recent_tokens=16, dense_layers=(0,), io_backend="direct", **kw)
    spec = KVCacheSpec("mha", L, HKV, D, torch.float32, PS)
    pool = DeviceKVPool(spec, num_slots=PS * 128, device="cpu")
    host = transfer = None
    if mode == "hierarchical":
        host = HostKVPool(pool, hicache_ratio=2.0, pin_memory=False)
        transfer = KVTransferEngine(pool, host, io_backend="direct")
    coord = SparseCoordinator(cfg, create_algorithm(cfg, "cpu"), pool, mode=mode, host_pool=host, transfer=transfer,
                              max_num_reqs=2, max_context_len=96)
    coord.on_request_begin(0)
    return coord, pool


def _kv(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(L, 96, HKV, D, generator=g), torch.randn(L, 96, HKV, D, generator=g),
            torch.randn(L, 96, HQ, D, generator=g))


def _prefill(coord, pool, k, v, chunks: list[int], keep_earlier: bool = False,
             last_is_final: bool = True) -> list[torch.Tensor]:
    """Prefill row 0 in chunks ending at ``chunks`` (the last ends the prompt unless
    ``last_is_final`` is False): each chunk's KV written into fresh device slots, ``-1``
    before it (``keep_earlier``: every earlier chunk's slots, as gpu_only callers keep
    them). Returns each chunk's slots."""
    got, start = [], 0
    for end in chunks:
        slots = pool.allocator.alloc(end - start)[: end - start]
        got.append(slots)
        ts = torch.full((1, end), -1, dtype=torch.int64)
        ts[0, start:] = slots
        if keep_earlier and start:
            ts[0, :start] = torch.cat(got[:-1])
        batch = ForwardBatch.prefill(torch.tensor([0]), torch.tensor([end], dtype=torch.int32), ts,
                                     prefix_lens=torch.tensor([start], dtype=torch.int32))
        for layer in range(L):
            pool.set_kv(layer, slots, k[layer, start:end], v[layer, start:end])
            coord.attention_end(layer, batch)
        coord.forward_end(batch, more_chunks=[end < chunks[-1] or not last_is_final])
        start = end
    return got


def _decode(coord, k, v, q, steps: int) -> torch.Tensor:
    outs = []
    for t in range(PROMPT, PROMPT + steps):
        batch = ForwardBatch.decode(torch.tensor([0]), torch.tensor([t + 1], dtype=torch.int32))
        coord.forward_begin(batch)
        for layer in range(L):
            plan = coord.attention_begin(layer, batch, q=q[layer, t][None])
            plan.write_kv(k[layer, t][None], v[layer, t][None])
            outs.append(plan.attend(q[layer, t][None], 1 / math.sqrt(D)))
            coord.attention_end(layer, batch, k=k[layer, t][None], v=v[layer, t][None])
        coord.forward_end(batch)
    return torch.stack(outs)


def _state(coord, pool) -> dict[str, torch.Tensor]:
    """Row 0 by logical position: host KV, buffer and dense-pool contents, Quest bounds."""
    t, kv = coord.kv.requests, coord.kv
    P = -(-PROMPT // PS)

    def rows(p, data):
        p = torch.as_tensor(p, dtype=torch.int64)
        return data[:, :, (p[:, None] * PS + torch.arange(PS)[None, :]).reshape(-1)].clone()

    algo = coord.algorithm
    out = {"host": rows(t.host[0, :P], coord.host_pool.kv_data), "sink": rows(t.sink[0], pool.kv_data),
           "ring": rows(t.ring[0], pool.kv_data), "dense_pool": rows(t.dense_pool[0, :P], kv.dense_pool.kv_data),
           "seq": torch.tensor([int(t.seq[0]), int(t.state[0])])}
    for layer in (1, 2):
        out[f"kmin{layer}"], out[f"kmax{layer}"] = algo._kmin[layer][0, :P].clone(), algo._kmax[layer][0, :P].clone()
    return out


def test_hierarchical_chunks_end_where_the_whole_prompt_does():
    k, v, q = _kv()
    whole, pool_w = _coord()
    _prefill(whole, pool_w, k, v, [PROMPT])
    chunked, pool_c = _coord()
    _prefill(chunked, pool_c, k, v, [16, 32, PROMPT])
    assert chunked.kv.reqs[0].prefilled
    # every chunk's device pages went back: only the request's GPU buffer is held
    assert pool_c.allocator.num_free_pages() == pool_w.allocator.num_free_pages()
    a, b = _state(whole, pool_w), _state(chunked, pool_c)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    out_w, out_c = _decode(whole, k, v, q, 6), _decode(chunked, k, v, q, 6)
    assert torch.equal(out_w, out_c)
    assert chunked.stats()["misses"] > 0


def test_gpu_only_chunks_build_the_same_representations():
    k, v, _ = _kv(1)
    whole, pool_w = _coord("gpu_only")
    _prefill(whole, pool_w, k, v, [PROMPT])
    chunked, pool_c = _coord("gpu_only")
    _prefill(chunked, pool_c, k, v, [16, 32, PROMPT], keep_earlier=True)
    for layer in (1, 2):
        assert torch.equal(whole.algorithm._kmin[layer][0], chunked.algorithm._kmin[layer][0])
        assert torch.equal(whole.algorithm._kmax[layer][0], chunked.algorithm._kmax[layer][0])
    assert chunked.kv.reqs[0].prefilled and chunked.kv.reqs[0].seq_len == PROMPT


def test_a_row_part_way_through_its_prompt():
    k, v, _ = _kv(2)
    coord, pool = _coord()
    free0 = pool.allocator.num_free_pages()
    _prefill(coord, pool, k, v, [16, 32], last_is_final=False)
    assert coord.kv.reqs[0].chunked and coord.kv.reqs[0].seq_len == 32
    with pytest.raises(ValueError, match="has not been prefilled"):
        coord.prepare_decode([0], [33])
    end = coord.on_request_end(0)  # its chunks' host pages go back to the caller, its GPU pages to the pool
    assert end.seq_len == 32 and end.host_pages.numel() == 32 // PS
    assert pool.allocator.num_free_pages() == free0
    assert coord.kv.dense_pool.allocator.num_free_pages() == coord.kv.dense_pool.allocator.num_pages - 1


def _chunk_batch(start: int, end: int, prefix: int | None = None) -> ForwardBatch:
    ts = torch.full((1, end), -1, dtype=torch.int64)
    ts[0, start:] = torch.arange(PS * 100, PS * 100 + end - start)
    return ForwardBatch.prefill(torch.tensor([0]), torch.tensor([end], dtype=torch.int32), ts,
                                prefix_lens=torch.tensor([start if prefix is None else prefix], dtype=torch.int32))


def test_chunked_prefill_misuse_is_refused_by_name():
    coord, _ = _coord()
    with pytest.raises(ValueError, match="multiple of page_size=4"):
        coord.forward_end(_chunk_batch(0, 18), more_chunks=[True])
    coord.forward_end(_chunk_batch(0, 16), more_chunks=[True], free_device_kv=False)
    with pytest.raises(ValueError, match="prefix_lens must be >= 16"):
        coord.forward_end(_chunk_batch(8, 32, prefix=8), more_chunks=[False])
    with pytest.raises(ValueError, match="more_chunks is for prefill batches"):
        coord.forward_end(ForwardBatch.decode(torch.tensor([0]), torch.tensor([17], dtype=torch.int32)),
                          more_chunks=[False])
    coord.algorithm.supports_chunked_prefill = False
    with pytest.raises(ValueError, match="supports_chunked_prefill is False"):
        coord.attention_end(1, _chunk_batch(16, 32))
    short, _ = _coord(min_sparse_prompt_len=64)
    short.forward_end(_chunk_batch(0, 16), more_chunks=[True], free_device_kv=False)
    with pytest.raises(ValueError, match="below min_sparse_prompt_len=64"):
        short.forward_end(_chunk_batch(16, 32))
