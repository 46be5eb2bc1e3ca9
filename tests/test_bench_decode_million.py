"""bench_decode at contexts a GPU cannot hold whole (the 1,048,576-token row): the sizing of
one Llama-8B-shape sparse-hier-fp8 request at 1M (what it holds, and that scenario a's
budgets admit it at batch 1), a CPU --quick run of a context whose one request is over the
GPU budget and whose calibration does not fit the device (calibrated on the point's own
representations, host pools pinned once, memory reported per row), and the summary's
``b1_tok_s_1m``."""
from __future__ import annotations

import json

import pytest
import torch

import hicache.host_pool
from benchmarks import bench_decode
from benchmarks.decode.report import MILLION, summary
from benchmarks.decode.sizing import (GIB, admits_one_over_budget, capacity, per_request_parts,
                                      representation_bytes_per_request)
from sparsehi.config import SparseConfig
from sparsehi.runtime.model_config import get_model_config


class _LlamaShape:
    """What the sizing reads of the Llama-8B-shape model (its config and dtype), without
    its 6 GB of weights."""

    cfg = get_model_config("llama-8b-shape")

    def parameters(self):
        yield torch.empty(0, dtype=torch.bfloat16)


def test_a_million_token_llama_request_fits_scenario_a_at_batch_one():
    model = _LlamaShape()
    sc = SparseConfig(algorithm="quest", top_k=2048, device_buffer_size=4096, page_size=16, min_sparse_prompt_len=0,
                      sink_tokens=64, recent_tokens=64)
    steps = 11
    rep = representation_bytes_per_request(model, sc, MILLION + steps + 2, "meta")
    # Quest: min and max bounds of 65,537 pages x 8 heads x 128 dims in bf16, 30 sparse layers (0 and 1 dense)
    assert rep == 30 * 2 * (65537 + 1) * 8 * 128 * 2
    parts = per_request_parts(model, "sparse-hier-fp8", MILLION, sc, steps, rep, 2, torch.bfloat16)
    gpu, host = parts["gpu"], parts["host"]
    assert 7.4 < rep / GIB < 7.6 and 7.9 < gpu["dense_layer_pool"] / GIB < 8.1 and gpu["buffer"] / GIB < 0.6
    g, h = sum(gpu.values()), sum(host.values())
    # one request is just over the 16 GiB GPU budget; its FP8 host KV (64 GiB) is within the 96 GiB host budget
    assert 16 < g / GIB < 16.1 and 64 < h / GIB < 64.5
    assert capacity(g, h, 16 * GIB, 96 * GIB) == 0
    assert admits_one_over_budget(g, h, 96 * GIB, 70 * GIB)  # an H100's room after the weights
    assert not admits_one_over_budget(g, 128 * GIB, 96 * GIB, 70 * GIB)  # bf16 host KV would not fit the host
    assert not admits_one_over_budget(g, h, 96 * GIB, 12 * GIB)


def test_quick_run_over_the_gpu_budget_calibrates_in_point(tmp_path, monkeypatch, one_thread):
    pools = []
    init = hicache.host_pool.HostKVPool.__init__

    def counted_init(self, *a, **kw):  # the class itself stays: modules bind it at import
        init(self, *a, **kw)
        pools.append(kw.get("host_kv_dtype", "auto"))

    monkeypatch.setattr(hicache.host_pool.HostKVPool, "__init__", counted_init)
    # a device with 8 MiB free: a 4096-token request of the quick model fits, the
    # calibration's two sparse-gpu requests (17 MiB of KV) do not
    monkeypatch.setattr(bench_decode, "device_room", lambda device: 8 << 20)
    assert bench_decode.main(["--quick", "--modes", "sparse-hier-fp8", "--skip-b", "--skip-dsv32",
                              "--contexts", "4096,2048", "--max-batch", "2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "decode.json").read_text())
    assert pools == ["fp8_e4m3"]  # pinned once, for the largest context, before the first point
    row = next(r for r in data["rows"] if r["context"] == 4096)
    assert row["batch"] == 1 and row["capacity"] == 0 and row["over_gpu_budget"]
    assert row["trace_source"] == "trace85" and row["trace_rho"] == data["calibration"]["tiny-gqa|4096"]["rho"]
    assert data["calibration"]["tiny-gqa|4096"]["calibrated_on"] == "sparse-hier-fp8 B=1"
    held = row["holds_per_request_gib"]
    assert set(held["gpu"]) == {"buffer", "dense_layer_pool", "representations"} and held["host"]["kv"] > 0
    assert sum(held["gpu"].values()) > row["gpu_budget_gib"]
    assert row["gpu_peak_gib"] is None  # no CUDA device
    assert row["host_pinned_pool_gib"] > 0 and row["host_rss_gib"] > 0 and row["host_rss_peak_gib"] >= row["host_rss_gib"]
    assert row["tokens_per_s"] > 0 and row["timed_steps"] == 2 and row["synth_s"] > 0
    assert any("over the" in n or "> the" in n for n in data["notes"])
    assert data["summary"]["b1_tok_s_1m"] is None  # no 1,048,576-token row in this run


def _row(ctx: int, mode: str, batch: int, tok_s: float, source: str = "trace85") -> dict:
    return {"model": "llama-8b-shape", "context": ctx, "scenario": "a", "mode": mode, "batch": batch,
            "tokens_per_s": tok_s, "trace_source": source}


@pytest.mark.parametrize("rows,want", [
    ([_row(MILLION, "sparse-hier-fp8", 1, 41.5)], 41.5),
    ([_row(MILLION, "sparse-hier-fp8", 1, 30.0, "model"), _row(MILLION, "sparse-hier-fp8", 1, 41.5)], 41.5),
    ([_row(MILLION, "sparse-hier", 1, 41.5), _row(65536, "sparse-hier-fp8", 1, 90.0),
      _row(MILLION, "sparse-hier-fp8", 2, 60.0)], None),
])
def test_summary_b1_tok_s_1m(rows, want):
    assert summary(rows, {}, MILLION, "llama-8b-shape", True)["b1_tok_s_1m"] == want
