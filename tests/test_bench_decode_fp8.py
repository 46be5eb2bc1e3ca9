"""bench_decode's ``sparse-hier-fp8`` mode: sparse-hier with FP8 host KV swept beside the
other modes (a CPU --quick run), its host bytes per request about half of bf16's, and its
rows in the summary."""
from __future__ import annotations

import json

import torch

from benchmarks import bench_decode
from benchmarks.decode.sizing import per_request_bytes
from sparsehi.config import SparseConfig
from sparsehi.runtime.model_config import get_model_config
from sparsehi.runtime.weights import build_model


def test_fp8_host_bytes_are_about_half():
    model = build_model(config=get_model_config("tiny-gqa", num_layers=2))
    sc = SparseConfig(page_size=16, top_k=64, device_buffer_size=128, sink_tokens=16, recent_tokens=16)
    gpu16, host16 = per_request_bytes(model, "sparse-hier", 4096, sc, 8, 0, 0, torch.bfloat16)
    gpu8, host8 = per_request_bytes(model, "sparse-hier-fp8", 4096, sc, 8, 0, 0, torch.bfloat16)
    assert gpu8 == gpu16  # the GPU buffer keeps the model's dtype
    assert 0.5 < host8 / host16 < 0.52  # one byte a value plus a page's scales


def test_quick_sweep_has_fp8_rows(tmp_path, one_thread):
    assert bench_decode.main(["--quick", "--modes", "sparse-hier,sparse-hier-fp8", "--skip-b", "--skip-dsv32",
                              "--contexts", "512", "--max-batch", "2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "decode.json").read_text())
    fp8 = [r for r in data["rows"] if r["mode"] == "sparse-hier-fp8"]
    assert fp8 and all(r["tokens_per_s"] > 0 and r["hit_rate"] is not None for r in fp8)
    assert data["summary"]["fp8_best_tok_s"] == max(r["tokens_per_s"] for r in fp8 if r["trace_source"] == "trace85")
    assert data["summary"]["batch_held"]["sparse-hier-fp8"] >= data["summary"]["batch_held"]["sparse-hier"]
