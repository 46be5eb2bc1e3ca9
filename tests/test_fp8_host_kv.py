"""FP8 host KV end to end (``--host-kv-dtype fp8_e4m3``): sparse-hier with FP8 host pages
generates exactly what sparse-gpu generates over the same FP8-rounded KV; the host pool
holds E4M3 page records (more tokens in the same bytes); FP8 and model-dtype pages never
share an L3 namespace; bad settings are refused by name."""
from __future__ import annotations

import pytest
import torch

from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.kv_spec import KVCacheSpec
from hicache.transfer import KVTransferEngine
from sparsehi.config import SparseConfig
from sparsehi.runtime.model_config import get_model_config
from sparsehi.runtime.runtime_config import RuntimeConfig
from sparsehi.runtime.weights import build_model
from test_e2e import prompts_of
from test_e2e import run as run_e2e

STEPS = 24
pytestmark = pytest.mark.usefixtures("one_thread")
_MODELS: dict = {}


def model_for(name: str, device: str = "cpu", dtype=torch.float32):
    key = (name, device, dtype)
    if key not in _MODELS:
        _MODELS[key] = build_model(config=get_model_config(name, num_layers=3), device=device, dtype=dtype)
    return _MODELS[key]


def run(model, mode, sc, prompts, steps=STEPS, **kw):
    """``test_e2e.run`` over the page_first host layout that FP8 pages need."""
    return run_e2e(model, mode, sc, prompts, steps, host_layout="page_first", **kw)


CASES = [
    # name, algorithm, page, top_k, buffer, sink/recent tokens, prompt lengths (not page multiples:
    # the last prompt page completes during decode, and leaves the recent window after it)
    pytest.param("tiny-gqa", "quest", 16, 48, 64, 16, (300, 333), id="gqa-quest-page16"),
    pytest.param("tiny-dsa", "dsa", 1, 32, 64, 8, (160, 137), id="mla-dsa-page1"),
]


@pytest.mark.parametrize("name,algo,ps,top_k,buf,fixed,lengths", CASES)
def test_fp8_sparse_hier_generates_exactly_what_fp8_sparse_gpu_does(name, algo, ps, top_k, buf, fixed, lengths):
    model = model_for(name)
    kw = dict(algorithm=algo, page_size=ps, top_k=top_k, device_buffer_size=buf, sink_tokens=fixed,
              recent_tokens=fixed, min_sparse_prompt_len=0, io_backend="kernel")
    fp8 = SparseConfig(**kw, host_kv_dtype="fp8_e4m3")
    prompts = prompts_of(lengths)
    steps = STEPS if ps > 1 else 16  # page 1: every token is a page, many more copies per step
    gpu = run(model, "sparse-gpu", fp8, prompts, steps)
    hier = run(model, "sparse-hier", fp8, prompts, steps)
    assert hier.tokens == gpu.tokens
    st = hier.stats
    assert st["misses"] > 0 and st["bytes_loaded"] > 0  # pages came back from the FP8 host pool
    # the bytes a miss moved are the FP8 page's (one byte a value, plus its scales)
    bf16_st = run(model, "sparse-hier", SparseConfig(**kw), prompts, steps).stats
    assert st["bytes_loaded"] / st["misses"] < 0.3 * bf16_st["bytes_loaded"] / bf16_st["misses"]
    plain = run(model, "sparse-hier", SparseConfig(**kw), prompts, steps=2)
    assert plain.memory["host_kv_bytes"] > hier.memory["host_kv_bytes"]
    if name == "tiny-gqa":  # the rounding is real: here it changes the tokens (tiny-dsa's it does not)
        assert run(model, "sparse-gpu", SparseConfig(**kw), prompts).tokens != gpu.tokens


def test_fp8_host_pool_holds_page_records_and_more_tokens():
    spec = KVCacheSpec(attention="mha", num_layers=2, kv_heads=2, head_dim=32, dtype=torch.bfloat16, page_size=16)
    dev = DeviceKVPool(spec, 16 * 8, "cpu")
    plain = HostKVPool(dev, hicache_size=0.001, layout="page_first", pin_memory=False)
    fp8 = HostKVPool(dev, hicache_size=0.001, layout="page_first", pin_memory=False, host_kv_dtype="fp8_e4m3")
    assert fp8.page_nbytes == 2 * 2 * 16 * 2 * 32 + 2 * 2 * 2 * 4
    assert fp8.num_slots > 1.9 * plain.num_slots  # the same GB hold about twice the tokens
    assert fp8.page_tensor(3).dtype == torch.uint8 and fp8.page_tensor(3).numel() == fp8.page_nbytes
    g = torch.Generator().manual_seed(0)
    pages = torch.randn(2, 2, 2, 16, 2, 32, generator=g).to(torch.bfloat16)
    fp8.write_pages(torch.tensor([5, 1]), pages)
    k, v = fp8.read_tokens(1, torch.tensor([5 * 16 + 3, 1 * 16 + 15]))
    assert torch.allclose(k[0].float(), pages[0, 1, 0, 3].float(), rtol=2 ** -3, atol=0)
    assert torch.allclose(v[1].float(), pages[1, 1, 1, 15].float(), rtol=2 ** -3, atol=0)
    with pytest.raises(ValueError, match="paged_view|no view in the model's dtype"):
        fp8.paged_view()
    with pytest.raises(ValueError, match="write_tokens cannot write single tokens of an FP8 host pool"):
        fp8.write_tokens(0, torch.tensor([0]), k[:1], v[:1])
    with pytest.raises(ValueError, match="needs layout='page_first'"):
        HostKVPool(dev, layout="layer_first", pin_memory=False, host_kv_dtype="fp8_e4m3")
    engine = KVTransferEngine(dev, fp8, "kernel")
    with pytest.raises(ValueError, match="backup writes single tokens, which an FP8 host pool cannot take"):
        engine.backup(torch.tensor([0]), torch.tensor([0]))
    # a whole-page store, then a load, returns the rounded rows the device now holds
    dev.kv_data.copy_(torch.randn(dev.kv_data.shape, generator=g).to(torch.bfloat16))
    engine.store_pages(torch.tensor([2]), torch.tensor([7]))
    before = dev.kv_data[:, :, 32:48].clone()
    dev.kv_data[:, :, 64:80] = 0
    engine.load(torch.arange(7 * 16, 8 * 16), torch.arange(64, 80)).wait()
    assert torch.equal(dev.kv_data[:, :, 64:80], before)


def test_settings_are_checked_by_name():
    with pytest.raises(ValueError, match=r"SparseConfig.host_kv_dtype='fp8' is invalid: one of \('auto', 'fp8_e4m3'\)"):
        SparseConfig(host_kv_dtype="fp8")
    with pytest.raises(ValueError, match="host_kv_dtype.*io_backend='direct'"):
        SparseConfig(host_kv_dtype="fp8_e4m3", io_backend="direct")
    sc = SparseConfig(host_kv_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="--host-kv-dtype fp8_e4m3 needs host_layout='page_first'"):
        RuntimeConfig(mode="sparse-hier", sparse=sc, max_num_reqs=1, max_context_len=64, host_layout="layer_first")


def test_fp8_pages_have_their_own_l3_namespace():
    from sparsehi.runtime.demo import DemoConfig, l3_model_name

    mcfg = get_model_config("tiny-gqa")
    names = {d: l3_model_name(DemoConfig(sparse=SparseConfig(host_kv_dtype=d), host_layout="page_first"), mcfg, None)
             for d in ("auto", "fp8_e4m3")}
    assert names["fp8_e4m3"] == names["auto"] + "-kv-fp8e4m3-p2s"


@pytest.mark.gpu
@pytest.mark.parametrize("name,algo,ps", [("tiny-gqa", "quest", 16), ("tiny-dsa", "dsa", 1)])
def test_cuda_fp8_sparse_hier_equals_fp8_sparse_gpu(name, algo, ps):
    """On CUDA (Triton kernels, bf16, graphs): the FP8 tier adds no error over its reference."""
    model = model_for(name, "cuda", torch.bfloat16)
    sc = SparseConfig(algorithm=algo, page_size=ps, top_k=64 if ps == 1 else 128,
                      device_buffer_size=128 if ps == 1 else 256, sink_tokens=max(ps, 8), recent_tokens=max(ps, 8),
                      min_sparse_prompt_len=0, host_kv_dtype="fp8_e4m3")
    prompts = prompts_of((700, 645))
    toks = {}
    for mode in ("sparse-gpu", "sparse-hier"):
        res = run(model, mode, sc, prompts, steps=64, device="cuda", dtype=torch.bfloat16, adapter="auto")
        toks[mode] = res.tokens
        if mode == "sparse-hier":
            assert res.stats["misses"] > 0
    assert toks["sparse-hier"] == toks["sparse-gpu"]


def _cli_run(out_dir, l3_dir, host_kv_dtype):
    import json

    from sparsehi.cli import main

    args = ["run", "--context", "96", "--batch", "1", "--decode-tokens", "4", "--num-layers", "2", "--modes",
            "sparse-hier", "--top-k", "32", "--sink-tokens", "16", "--recent-tokens", "16", "--page-size", "16",
            "--device", "cpu", "--no-forced", "--no-progress", "--host-kv-dtype", host_kv_dtype,
            "--hicache-mem-layout", "page_first", "--hicache-storage-backend", "file",
            "--hicache-storage-prefetch-policy", "wait_complete", "--hicache-storage-backend-extra-config",
            json.dumps({"prefetch_threshold": 32, "file_path": str(l3_dir)}), "--output-dir", str(out_dir)]
    assert main(args) == 0
    data = json.loads((out_dir / "run.json").read_text())
    return data, next(r for r in data["rows"] if r["mode"] == "sparse-hier")


def test_fp8_pages_round_trip_through_a_file_store_and_stay_in_their_namespace(tmp_path):
    """A second process-like run (fresh host memory) prefetches the FP8 pages the first wrote
    and generates its tokens; a run in the model's dtype over the same directory finds none
    of them."""
    first, r1 = _cli_run(tmp_path / "a", tmp_path / "l3", "fp8_e4m3")
    assert r1["l3_hit_tokens"] == 0 and r1["l3_pages_written"] > 0
    second, r2 = _cli_run(tmp_path / "b", tmp_path / "l3", "fp8_e4m3")
    assert r2["l3_hit_tokens"] == 96 and r2["l3_bytes_fetched"] > 0
    assert second["tokens"] == first["tokens"]
    assert first["l3_model_name"].endswith("-kv-fp8e4m3-p2s")
    third, r3 = _cli_run(tmp_path / "c", tmp_path / "l3", "auto")
    assert r3["l3_hit_tokens"] == 0 and not third["l3_model_name"].endswith("-kv-fp8e4m3-p2s")
