"""The synthesised prefill written chunk by chunk (a chunked prefill through the
coordinator, one chunk of device KV at a time) leaves every request exactly where the
whole-prompt prefill leaves it: the same host pages, representations, GPU buffer
contents, dense-layer pool and tables, and the same decoded tokens, for host KV in the
model's dtype and in FP8, with the sink spanning two chunks and the recent window spanning
the last two, and for FP8 latent rows. The chunked one fits a device pool smaller than
the prompt."""
from __future__ import annotations

import pytest
import torch

from hicache.device_pool import DeviceKVPool
from sparsehi.config import SparseConfig
from sparsehi.runtime.model_config import get_model_config
from sparsehi.runtime.runner import ModelRunner
from sparsehi.runtime.runtime_config import RuntimeConfig
from sparsehi.runtime.synth import synth_prefill
from sparsehi.runtime.weights import build_model

CHUNK = 256
STEPS = 6
pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [
    # name, algorithm, page size, host KV dtype, KV cache dtype, context (the last chunk
    # shorter than the recent window), sink / recent tokens (the sink longer than a chunk)
    pytest.param("tiny-gqa", "quest", 16, "auto", "auto", 2080, 320, 48, id="quest-model-dtype"),
    pytest.param("tiny-gqa", "quest", 16, "fp8_e4m3", "auto", 2080, 320, 48, id="quest-fp8"),
    pytest.param("tiny-dsa", "dsa", 1, "auto", "auto", 1312, 300, 48, id="dsa-model-dtype"),
    pytest.param("tiny-dsa-fp8", "dsa", 1, "auto", "fp8_e4m3", 1312, 300, 48, id="dsa-fp8-latent-rows"),
]


def _runner(model, sc: SparseConfig, context: int, batch: int, device_tokens=None) -> ModelRunner:
    # FP8 latent rows are read by the dsa adapter's decode kernel (its torch reference here)
    rt = RuntimeConfig(mode="sparse-hier", sparse=sc, dtype=torch.bfloat16, max_num_reqs=batch,
                       max_context_len=context + STEPS + 2, prefix_cache=False, host_layout="page_first",
                       device_kv_tokens=device_tokens, adapter="auto" if sc.kv_cache_dtype != "auto" else "none")
    return ModelRunner(model, rt)


def _slot_rows(pool: DeviceKVPool, pages, ps: int) -> torch.Tensor:
    """``[bufs, layers, len(pages) * ps, H, D]`` KV of device ``pages``."""
    p = torch.as_tensor(pages, dtype=torch.int64)
    return pool.kv_data[:, :, (p[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)].clone()


def _snapshot(runner: ModelRunner, reqs, context: int) -> dict[str, torch.Tensor]:
    """What a prefilled request is, by logical position (page ids aside): the host pool, the
    request's table rows, its sink / recent-ring / dense-pool contents, its representations."""
    mode = runner.mode
    ps = mode.rt.page_size
    kv = mode.coord.kv
    t = kv.requests
    out = {"host_kv": mode.host.kv_data.clone()}
    if mode.host.fp8_scales is not None:
        out["host_scales"] = mode.host.fp8_scales.clone()
    P = context // ps
    algo = mode.algorithm
    for i, r in enumerate(req.req_pool_idx for req in reqs):
        out[f"{i}.state"] = torch.tensor([int(t.state[r]), int(t.seq[r]), int(t.dense[r])])
        out[f"{i}.host_pages"] = torch.from_numpy(t.host[r, :P].copy())
        out[f"{i}.sink"] = _slot_rows(mode.pool, t.sink[r], ps)
        out[f"{i}.ring"] = _slot_rows(mode.pool, t.ring[r], ps)
        out[f"{i}.dense_pool"] = _slot_rows(kv.dense_pool, t.dense_pool[r, :P], ps)
        for layer in range(mode.cfg.num_layers):
            if not algo.is_sparse_layer(layer):
                continue
            if mode.is_dsa:
                out[f"{i}.{layer}.index_keys"] = algo._keys[layer][r, :context].clone()
                out[f"{i}.{layer}.indexed"] = algo._indexed[layer][r].clone()
            else:
                out[f"{i}.{layer}.kmin"] = algo._kmin[layer][r, :P].clone()
                out[f"{i}.{layer}.kmax"] = algo._kmax[layer][r, :P].clone()
    return out


def _prefill_and_decode(model, sc, context, batch, chunk, device_tokens=None):
    runner = _runner(model, sc, context, batch, device_tokens)
    reqs = runner.new_requests([[0]] * batch)
    synth_prefill(runner.mode, reqs, context, seed=3, chunk_tokens=chunk)
    snap = _snapshot(runner, reqs, context)
    for _ in range(STEPS):
        runner.decode_step(reqs)
    return snap, [list(r.output) for r in reqs], runner.mode.coord.stats()


@pytest.mark.parametrize("name,algo,ps,host_dtype,kv_dtype,context,sink,recent", CASES)
def test_chunked_synth_prefill_equals_the_whole_prompt_one(name, algo, ps, host_dtype, kv_dtype, context, sink,
                                                           recent):
    model = build_model(config=get_model_config(name, num_layers=3), dtype=torch.bfloat16)
    sc = SparseConfig(algorithm=algo, page_size=ps, top_k=32 if ps == 1 else 64,
                      device_buffer_size=64 if ps == 1 else 128, sink_tokens=sink, recent_tokens=recent,
                      min_sparse_prompt_len=0, host_kv_dtype=host_dtype, kv_cache_dtype=kv_dtype,
                      io_backend="kernel", dense_layers=(0,))
    batch = 2  # the second request takes the shared host pages (prefix_lens past its chunk start)
    rt = _runner(model, sc, context, batch).rt
    small_pool = batch * rt.buffer_tokens_per_request() + CHUNK + 4 * ps
    assert small_pool < context
    whole, whole_tokens, whole_stats = _prefill_and_decode(model, sc, context, batch, None)
    chunked, chunked_tokens, _ = _prefill_and_decode(model, sc, context, batch, CHUNK, device_tokens=small_pool)
    assert sorted(chunked) == sorted(whole)
    for key, value in whole.items():
        assert torch.equal(chunked[key], value), key
    assert chunked_tokens == whole_tokens
    assert whole_stats["misses"] > 0  # the decode steps loaded pages back from the host pool
    with pytest.raises(ValueError, match="device KV pool is full"):  # the whole prompt does not fit that pool
        _prefill_and_decode(model, sc, context, batch, None, device_tokens=small_pool)


def test_chunk_tokens_must_be_whole_blocks_of_random_kv():
    model = build_model(config=get_model_config("tiny-gqa", num_layers=3))
    sc = SparseConfig(algorithm="quest", page_size=16, top_k=64, device_buffer_size=128, sink_tokens=16,
                      recent_tokens=16, min_sparse_prompt_len=0)
    runner = ModelRunner(model, RuntimeConfig(mode="sparse-hier", sparse=sc, max_num_reqs=1, max_context_len=600,
                                              prefix_cache=False))
    with pytest.raises(ValueError, match="chunk_tokens=100 is invalid"):
        synth_prefill(runner.mode, runner.new_requests([[0]]), 512, chunk_tokens=100)


@pytest.mark.parametrize("chunk", [256, 512])
def test_fp8_latent_rows_are_the_stored_rows_of_the_bf16_prompt(chunk):
    """A pool of FP8 latent rows gets, position by position, the rows ``stored_kv`` makes of
    the values a bf16 pool gets from the same seed (so every mode sees one prompt), however
    the prompt is cut into blocks."""
    from hicache.kv_spec import KVCacheSpec
    from sparsehi.kernels.mla_fp8_latents import quantize_mla_latents
    from sparsehi.runtime.synth import fill_random

    cfg = get_model_config("tiny-dsa-fp8", num_layers=2)
    rank, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    bf16 = DeviceKVPool(KVCacheSpec(attention="mla", num_layers=2, kv_heads=1, head_dim=rank + rope,
                                    dtype=torch.bfloat16, page_size=1, kv_lora_rank=rank), 1024, "cpu")
    fp8 = DeviceKVPool(KVCacheSpec.mla_fp8(2, rank, rope, 1), 1024, "cpu")
    n = 768
    fill_random(bf16, torch.arange(n), seed=5)
    slots = torch.arange(100, 100 + n)
    for s in range(0, n, chunk):  # the same prompt written block-wise into other slots
        fill_random(fp8, slots[s:s + chunk], seed=5, first_position=s)
    assert fp8.kv_data.dtype == torch.uint8
    want = quantize_mla_latents(bf16.kv_data[:, :, :n], rank)
    assert torch.equal(fp8.kv_data[:, :, 100:100 + n], want)
    assert not fp8.kv_data[:, :, :100].any()  # slots outside the call untouched
