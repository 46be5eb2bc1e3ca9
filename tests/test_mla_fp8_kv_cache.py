"""FP8 latent KV cache end to end (``--kv-cache-dtype fp8_e4m3``, MLA): the device pool,
the host pool and L3 hold each token's row in the DeepSeek-V3.2 / FlashMLA FP8 layout;
offload and swap-in move those bytes unchanged; the dsa adapter hands them to the sparse
MLA decode kernel as uint8 rows. sparse-hier generates exactly what sparse-gpu generates
with the same setting; bad settings are refused by name."""
from __future__ import annotations

import pytest
import torch

from hicache import triton_support
from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.kv_page_format import KVPageFormat
from hicache.kv_spec import KVCacheSpec
from sparsehi.config import SparseConfig
from sparsehi.kernels.mla_fp8_latents import fp8_row_bytes, quantize_mla_latents
from sparsehi.runtime.model_config import get_model_config
from sparsehi.runtime.runner import ModelRunner
from sparsehi.runtime.runtime_config import RuntimeConfig
from sparsehi.runtime.weights import build_model
from test_e2e import prompts_of

pytestmark = pytest.mark.usefixtures("one_thread")
MODEL = "tiny-dsa-fp8"  # kv_lora_rank 128: one scale per row, 128 + 4 + 2 * 16 = 164 bytes a row
ROW = fp8_row_bytes(128, 16)
_MODELS: dict = {}


def model_for(device: str = "cpu", dtype=torch.bfloat16):
    key = (device, dtype)
    if key not in _MODELS:
        _MODELS[key] = build_model(config=get_model_config(MODEL, num_layers=3), device=device, dtype=dtype)
    return _MODELS[key]


def sparse(kv_cache_dtype="fp8_e4m3", **kw):
    base = dict(algorithm="dsa", page_size=1, top_k=32, device_buffer_size=64, sink_tokens=8, recent_tokens=8,
                min_sparse_prompt_len=0, io_backend="kernel")
    return SparseConfig(**{**base, **kw}, kv_cache_dtype=kv_cache_dtype)


def runtime(mode, sc, prompts, steps, **kw):
    kw = {"dtype": torch.bfloat16, "adapter": "auto", **kw}
    return RuntimeConfig(mode=mode, sparse=sc, max_num_reqs=len(prompts),
                         max_context_len=max(map(len, prompts)) + steps + 1, **kw)


def generate(mode, sc, prompts, steps=16, **kw):
    return ModelRunner(model_for(kw.get("device", "cpu")), runtime(mode, sc, prompts, steps, **kw)).generate(
        prompts, steps)


@pytest.mark.parametrize("dense_layers", [None, (0,)], ids=["all-sparse", "dense-layer-0"])
def test_fp8_rows_sparse_hier_generates_exactly_what_sparse_gpu_does(dense_layers):
    sc = sparse(dense_layers=dense_layers)
    prompts = prompts_of((160, 137))
    gpu = generate("sparse-gpu", sc, prompts)
    hier = generate("sparse-hier", sc, prompts)
    assert hier.tokens == gpu.tokens
    st = hier.stats
    assert st["misses"] > 0
    # a miss moved one FP8 row of one layer (page 1): its bytes, scales and rope included
    assert st["bytes_loaded"] == st["misses"] * ROW
    plain = generate("sparse-hier", sparse("auto", dense_layers=dense_layers), prompts)
    assert hier.memory["host_kv_bytes"] == plain.memory["host_kv_bytes"] * ROW // ((128 + 16) * 2)


def _spy_prefill_kv(runner) -> dict:
    """Record the latents each prefill layer stores (the model's own values, as they reach
    the pool); the mode's attention runs unchanged."""
    seen: dict = {}
    real = runner.mode.prefill_attention

    def prefill_attention(req, prefix_len):
        attn = real(req, prefix_len)

        def spy(layer, q, k, v, extra):
            seen.setdefault(req.rid, {})[layer] = k.clone()
            return attn(layer, q, k, v, extra)
        return spy

    runner.mode.prefill_attention = prefill_attention
    return seen


def test_pools_hold_the_quantised_rows_and_swap_in_moves_them_unchanged():
    prompts = prompts_of((150, 121), seed=3)
    sc = sparse()
    runner = ModelRunner(model_for(), runtime("sparse-hier", sc, prompts, 8))
    seen = _spy_prefill_kv(runner)
    reqs = runner.new_requests(prompts)
    for r in reqs:
        runner.prefill(r)
    mode = runner.mode
    assert mode.pool.kv_data.dtype == torch.uint8 and mode.pool.kv_data.shape[-2:] == (1, ROW)
    host = mode.host
    assert host.kv_data.dtype == torch.uint8 and not host.kv_format.quantized
    assert host.kv_format.page_bytes == 3 * ROW  # no page scales: each row carries its own
    view = host.paged_view()  # [pages, 1, layers, 1, 1, ROW]
    for r in reqs:
        n = len(r.prompt)
        rows = view[r.host_slots[:n], 0, :, 0, 0]  # [n, layers, ROW]
        for layer in range(3):
            want = quantize_mla_latents(seen[r.rid][layer], 128)[:, 0]
            assert torch.equal(rows[:, layer], want), f"host rows of layer {layer}"
    runner.decode_steps(reqs, 8)
    dec = mode.coord.decoder
    assert dec.stats()["misses"] > 0
    t = dec.tables
    checked = 0
    for li, layer in enumerate(dec.sparse_layers):
        resident = dec.lru.resident[li]
        for r in reqs:
            row = r.req_pool_idx
            slots = (resident[row] >= 0).nonzero()[:, 0]
            lids = resident[row, slots].long()
            dev_rows = mode.pool.kv_data[0, layer, t.lru_pages[row, slots].long(), 0]
            host_rows = view[t.host_pages[row, lids], 0, layer, 0, 0]
            assert torch.equal(dev_rows, host_rows)
            checked += slots.numel()
    assert checked > 0


def test_sparse_gpu_pool_holds_the_quantised_rows():
    prompts = prompts_of((90,), seed=4)
    runner = ModelRunner(model_for(), runtime("sparse-gpu", sparse(), prompts, 2))
    seen = _spy_prefill_kv(runner)
    (req,) = runner.new_requests(prompts)
    runner.prefill(req)
    slots = runner.mode.coord.decoder.tables.context_pages[req.req_pool_idx, :90].long()
    for layer in range(3):
        got = runner.mode.pool.kv_data[0, layer, slots, 0]
        assert torch.equal(got, quantize_mla_latents(seen[req.rid][layer], 128)[:, 0])


def test_the_fp8_decode_kernel_reads_the_uint8_rows(monkeypatch):
    """Through the real path with the Triton kernels (interpreter): the adapter hands the
    pool's uint8 rows to the fused kernel's FP8 form, never the reference's dequantised
    copy; and the result still equals sparse-gpu's."""
    monkeypatch.setenv("SPARSEHI_FORCE_TRITON", "1")
    monkeypatch.setattr(triton_support, "_announced", set())
    prompts = prompts_of((70, 57), seed=5)
    sc = sparse(top_k=16, device_buffer_size=32)
    hier = generate("sparse-hier", sc, prompts, steps=4)
    paths = set(triton_support._announced)
    assert ("sparse_mla_decode", "triton (fp8 latents)") in paths
    assert ("sparse_mla_decode", "reference") not in paths
    assert ("swap_in_copy", "triton") in paths or ("swap_in_copy_and_table", "triton") in paths
    assert hier.stats["misses"] > 0
    assert generate("sparse-gpu", sc, prompts, steps=4).tokens == hier.tokens


def _shared_prompts(n=200, shared=150):
    first, tail = prompts_of((n, n - shared), seed=7)
    return first, first[:shared] + tail


def _generate_one(runner, prompt, steps=12):
    (req,) = runner.new_requests([prompt])
    runner.prefill(req)
    for _ in range(steps):
        runner.decode_step([req])
    runner.mode.end_request(req)
    return req.output, req.prefix_hit


@pytest.mark.parametrize("tier", ["host", "l3"])
def test_a_reused_prefix_of_fp8_rows_generates_what_a_cold_run_does(tier, tmp_path):
    """The prefix comes back as bytes (host pool, or L3 into a fresh runner's empty host
    pool) and the prefill attends its dequantised rows: the cold run's tokens."""
    from hicache.storage.base import StorageConfig
    from hicache.storage.file_store import FileStorage
    from hicache.storage_controller import StoragePolicy

    first, second = _shared_prompts()
    sc = sparse()

    def runner(**kw):
        return ModelRunner(model_for(), runtime("sparse-hier", sc, [first], 13, host_layout="page_first", **kw))

    def store():
        return FileStorage(StorageConfig(is_mla=True, model_name="fp8-rows", extra={"file_path": str(tmp_path)}))

    l3 = dict(storage_policy=StoragePolicy(prefetch_policy="wait_complete", prefetch_threshold=16))
    warm = runner(**({"storage": store(), **l3} if tier == "l3" else {}))
    warm.generate([first], 4)
    if tier == "l3":
        assert warm.mode.l3_stats()["l3_pages_written"] >= 200
        warm.mode.close()
        warm = runner(storage=store(), **l3)  # an empty host pool: only L3 has the prefix
    tokens, hit = _generate_one(warm, second)
    assert hit == 150
    if tier == "l3":
        assert warm.mode.l3_stats()["l3_hit_tokens"] == 150
        warm.mode.close()
    cold_tokens, cold_hit = _generate_one(runner(prefix_cache=False), second)
    assert cold_hit == 0 and tokens == cold_tokens


def test_dense_mode_attends_the_fp8_rows_like_sparse_gpu_with_k_covering_the_context():
    prompts = prompts_of((60, 45), seed=6)
    sc = sparse(top_k=128, device_buffer_size=128, sink_tokens=0, recent_tokens=1)
    dense = generate("dense", sc, prompts, steps=6)
    assert generate("sparse-gpu", sc, prompts, steps=6).tokens == dense.tokens
    assert dense.memory["gpu_kv_bytes"] > 0


def test_settings_are_checked_by_name():
    with pytest.raises(ValueError, match=r"SparseConfig.kv_cache_dtype='fp8' is invalid: one of \('auto', 'fp8_e4m3'\)"):
        SparseConfig(algorithm="dsa", page_size=1, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype.*host_kv_dtype='fp8_e4m3'"):
        sparse(host_kv_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="kv_cache_dtype.*algorithm='quest'"):
        SparseConfig(algorithm="quest", kv_cache_dtype="fp8_e4m3")
    gqa = build_model(config=get_model_config("tiny-gqa", num_layers=2), dtype=torch.bfloat16)
    sc = SparseConfig(algorithm="oracle", page_size=16, top_k=32, device_buffer_size=64)
    sc.kv_cache_dtype = "fp8_e4m3"  # past SparseConfig's own check: the runtime refuses the GQA cache
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_e4m3' is for MLA models \(allowed: \('auto', "
                                         r"'fp8_e4m3'\).*host_kv_dtype='fp8_e4m3'"):
        ModelRunner(gqa, runtime("sparse-gpu", sc, [[1] * 40], 2))
    prompts = [[1] * 40]
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e4m3' needs a bfloat16 or float16 model"):
        ModelRunner(model_for(), runtime("sparse-gpu", sparse(), prompts, 2, dtype=torch.float32))
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e4m3' needs kv_lora_rank a multiple of 128"):
        ModelRunner(build_model(config=get_model_config("tiny-dsa", num_layers=1), dtype=torch.bfloat16),
                    runtime("sparse-gpu", sparse(), prompts, 2))
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e4m3' is not supported by mode 'offload-full'"):
        ModelRunner(model_for(), runtime("offload-full", sparse(), prompts, 2))
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e4m3' needs RuntimeConfig.adapter"):
        ModelRunner(model_for(), runtime("sparse-hier", sparse(), prompts, 2, adapter="none"))


def test_pools_refuse_what_does_not_fit_fp8_rows():
    spec = KVCacheSpec.mla_fp8(num_layers=2, kv_lora_rank=128, rope_dim=16, page_size=1)
    assert (spec.head_dim, spec.dtype, spec.value_dim, spec.rope_dim) == (ROW, torch.uint8, 128, 16)
    assert KVCacheSpec.mla_fp8(num_layers=1, kv_lora_rank=512, rope_dim=64, page_size=1).row_bytes == 656
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        KVCacheSpec(attention="mla", num_layers=1, kv_heads=1, head_dim=ROW, dtype=torch.uint8, page_size=1,
                    kv_lora_rank=128, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e4m3' is for MLA caches of uint8 rows"):
        KVCacheSpec(attention="mla", num_layers=1, kv_heads=1, head_dim=144, dtype=torch.bfloat16, page_size=1,
                    kv_lora_rank=128, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="head_dim=150 bytes must be kv_lora_rank"):
        KVCacheSpec(attention="mla", num_layers=1, kv_heads=1, head_dim=150, dtype=torch.uint8, page_size=1,
                    kv_lora_rank=128, kv_cache_dtype="fp8_e4m3")
    dev = DeviceKVPool(spec, 64, "cpu")
    with pytest.raises(ValueError, match="k must be uint8 FP8 latent rows"):
        dev.set_kv(0, torch.arange(2), torch.zeros(2, 1, 144, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="host_kv_dtype='fp8_e4m3' cannot be combined with kv_cache_dtype='fp8_e4m3'"):
        HostKVPool(dev, layout="page_first", pin_memory=False, host_kv_dtype="fp8_e4m3")
    from sparsehi.adapters import create_adapter
    from sparsehi.algorithms.registry import create_algorithm
    from sparsehi.coordinator import SparseCoordinator

    sc = sparse()
    sc.sparse_extra_config = {"index_head_dim": 32}
    with pytest.raises(ValueError, match="adapter must be given for a device pool of FP8 latent rows"):
        SparseCoordinator(sc, create_algorithm(sc, "cpu"), dev, mode="gpu_only", adapter=None, max_num_reqs=1,
                          max_context_len=64)
    with pytest.raises(ValueError, match="SparseConfig.kv_cache_dtype='auto' but the device pool holds"):
        SparseCoordinator(sparse("auto"), create_algorithm(sc, "cpu"), dev, mode="gpu_only",
                          adapter=create_adapter("dsa", kv_lora_rank=128), max_num_reqs=1, max_context_len=64)


def test_fp8_rows_have_their_own_l3_namespace():
    from sparsehi.runtime.demo import DemoConfig, l3_model_name

    mcfg = get_model_config(MODEL)
    names = {d: l3_model_name(DemoConfig(model=MODEL, sparse=sparse(d), host_layout="page_first"), mcfg, None)
             for d in ("auto", "fp8_e4m3")}
    assert names["fp8_e4m3"] == names["auto"] + "-kv-mla-fp8e4m3-t128"
    fmt = KVPageFormat(KVCacheSpec.mla_fp8(num_layers=2, kv_lora_rank=128, rope_dim=16, page_size=1))
    assert fmt.namespace_tag == "kv-mla-fp8e4m3-t128" and fmt.page_bytes == 2 * ROW and fmt.scale_bytes == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dense_layers", [None, (0,)], ids=["all-sparse", "dense-layer-0"])
def test_cuda_fp8_rows_sparse_hier_equals_sparse_gpu_in_graphs(dense_layers):
    """On CUDA (Triton kernels, bf16, decode in CUDA graphs): the FP8 latent rows through the
    host tier give sparse-gpu's tokens; the graphs really ran."""
    sc = sparse(top_k=64, device_buffer_size=128, dense_layers=dense_layers)
    prompts = prompts_of((700, 645))
    toks = {}
    for mode in ("sparse-gpu", "sparse-hier"):
        rt = runtime(mode, sc, prompts, 64, device="cuda", cuda_graph=True)
        runner = ModelRunner(model_for("cuda"), rt)
        res = runner.generate(prompts, 64)
        toks[mode] = res.tokens
        assert runner.graphs.enabled and runner.mode.pool.kv_data.dtype == torch.uint8
        if mode == "sparse-hier":
            assert res.stats["misses"] > 0 and res.stats["bytes_loaded"] == res.stats["misses"] * ROW
    assert toks["sparse-hier"] == toks["sparse-gpu"]
