"""bench_decode's FP8 latent-row modes (``dense-fp8-latents``, ``sparse-hier-fp8-latents``
and its ``-ahead`` form: the MLA KV cache itself in the 656-byte DeepSeek-V3.2 rows):
what one request holds, a CPU --quick sweep of the MLA rows, and the llama-shape rows
leaving them out."""
from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from benchmarks import bench_decode
from benchmarks.decode.modes import kv_cache_dtype_of, runtime_mode_of
from benchmarks.decode.sizing import per_request_parts
from sparsehi.config import SparseConfig
from sparsehi.runtime.model_config import get_model_config

FP8_ROWS = ("dense-fp8-latents", "sparse-hier-fp8-latents", "sparse-hier-fp8-latents-ahead")


def test_mode_names():
    assert [runtime_mode_of(m) for m in FP8_ROWS] == [("dense", "auto"), ("sparse-hier", "auto"),
                                                      ("sparse-hier", "auto")]
    assert [kv_cache_dtype_of(m) for m in FP8_ROWS] == ["fp8_e4m3"] * 3
    assert kv_cache_dtype_of("sparse-hier-fp8") == "auto"  # FP8 host pages, bf16 rows on the GPU


def test_fp8_latent_rows_hold_656_of_1152_bytes_a_token():
    model = SimpleNamespace(cfg=get_model_config("dsv32-shape"))  # the sizes read the config alone
    sc = SparseConfig(algorithm="dsa", page_size=1, top_k=2048, device_buffer_size=4096, sink_tokens=64,
                      recent_tokens=64, min_sparse_prompt_len=0)

    def parts(mode):
        return per_request_parts(model, mode, 32768, sc, 8, 1000, 0, torch.bfloat16)

    dense, dense8 = parts("dense"), parts("dense-fp8-latents")
    assert dense8["gpu"]["kv"] * 1152 == dense["gpu"]["kv"] * 656
    hier, hier8 = parts("sparse-hier"), parts("sparse-hier-fp8-latents")
    assert hier8["gpu"]["buffer"] * 1152 == hier["gpu"]["buffer"] * 656
    assert hier8["host"]["kv"] * 1152 == hier["host"]["kv"] * 656
    assert hier8["gpu"]["representations"] == hier["gpu"]["representations"] == 1000  # index keys unchanged
    assert parts("sparse-hier-fp8-latents-ahead") == hier8


def test_quick_sweep_has_fp8_latent_rows(tmp_path, one_thread):
    assert bench_decode.main(["--quick", "--skip-b", "--contexts", "512", "--max-batch", "2",
                              "--modes", "dense,sparse-hier," + ",".join(FP8_ROWS), "--lookahead-pages", "16",
                              "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "decode.json").read_text())
    mla = [r for r in data["rows"] if r["model"] == "tiny-dsa-fp8"]
    assert not [r for r in data["rows"] if r["model"] == "tiny-gqa" and r["mode"] in FP8_ROWS]  # MLA only
    assert {r["mode"] for r in mla} == {"dense", "sparse-hier", *FP8_ROWS}
    assert all(r["tokens_per_s"] > 0 for r in mla)
    by_mode = {m: [r for r in mla if r["mode"] == m and r["trace_source"] == "trace85"] for m in FP8_ROWS}
    assert all(r["hit_rate"] is not None for m in FP8_ROWS[1:] for r in by_mode[m])
    assert all(r["prefetch_hidden_frac"] is not None for r in by_mode[FP8_ROWS[2]])
    # the same prompt and trace: the selections, so the buffer's hits, are those of bf16 rows
    hier = {r["batch"]: r["hit_rate"] for r in mla if r["mode"] == "sparse-hier" and r["trace_source"] == "trace85"}
    assert {r["batch"]: r["hit_rate"] for r in by_mode[FP8_ROWS[1]]} == hier
    cap = data["capacity"]["tiny-dsa-fp8|512|a"]
    assert cap["dense-fp8-latents"] > cap["dense"] and cap["sparse-hier-fp8-latents"] > cap["sparse-hier"]
