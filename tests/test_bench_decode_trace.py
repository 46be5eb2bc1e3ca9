"""bench_decode's real-trace recording: a tiny HF checkpoint is loaded, a real prefill
and greedy decode run in sparse-gpu mode, and the per-layer adjacent-step Top-k overlap
is measured from the selections the algorithm made."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks.decode.traces import read_trace_prompt, record_real_trace, topk_overlap_per_layer
from sparsehi.config import SparseConfig
from sparsehi.runtime.model_config import ModelConfig
from sparsehi.runtime.traces import topk_overlap
from sparsehi.runtime.weights import build_model

LAYERS = 4


def _write_checkpoint(tmp_path) -> None:
    """A 4-layer Llama checkpoint (Quest keeps layers 0 and 1 dense, so two are sparse)."""
    from safetensors.torch import save_file

    from sparsehi.runtime.gqa_model import GQAModel

    hf = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": LAYERS,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48, "rope_theta": 10000.0,
          "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    cfg = ModelConfig(name="ckpt", family="gqa", vocab_size=96, hidden_size=32, num_layers=LAYERS, num_heads=4,
                      num_kv_heads=2, head_dim=8, intermediate_size=48, seed=7)
    src = GQAModel(cfg, qkv_bias=False)
    src.random_init()
    state = {("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v.contiguous()
             for k, v in src.state_dict().items()}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    save_file(state, str(tmp_path / "model.safetensors"))


pytestmark = pytest.mark.usefixtures("one_thread")


def test_recorded_real_trace_overlap_matches_its_selections(tmp_path):
    _write_checkpoint(tmp_path)
    model = build_model(model_path=tmp_path)
    sc = SparseConfig(algorithm="quest", page_size=16, top_k=64, device_buffer_size=128, sink_tokens=16,
                      recent_tokens=16, min_sparse_prompt_len=0, io_backend="direct")
    ctx, steps = 256, 6
    prompt = torch.randint(0, 96, (ctx,), generator=torch.Generator().manual_seed(0)).tolist()
    res = record_real_trace(model, sc, prompt, steps, torch.device("cpu"), torch.float32, model_path=str(tmp_path))
    assert res["source"] == "real" and res["context"] == ctx and res["steps"] == steps
    sparse = [layer for layer in range(LAYERS) if layer not in (0, 1)]
    assert sorted(res["selections"]) == sparse
    assert sorted(res["topk_overlap_per_layer"]) == [str(x) for x in sparse]
    lo, hi = torch.tensor([sc.sink_units]), torch.tensor([ctx // 16 - sc.recent_units])
    for layer in sparse:
        rec = res["selections"][layer]
        assert len(rec) == steps
        # the Top-k part is real: K = 4 pages chosen among the 14 between sink and recent
        topk_part = [((r >= lo[:, None]) & (r < hi[:, None])).sum().item() for r in rec]
        assert all(n > 0 for n in topk_part)
        want = sum(topk_overlap(a, b, lo, hi).item() for a, b in zip(rec[:-1], rec[1:])) / (steps - 1)
        got = res["topk_overlap_per_layer"][str(layer)]
        assert 0.0 <= got <= 1.0
        assert got == pytest.approx(want)
    vals = list(res["topk_overlap_per_layer"].values())
    assert res["topk_overlap_mean"] == pytest.approx(sum(vals) / len(vals))
    # the benchmark's helper gives the same numbers from the returned selections
    assert topk_overlap_per_layer(res["selections"], ctx, sc) == {int(k): v for k, v in
                                                                  res["topk_overlap_per_layer"].items()}


def test_trace_prompt_file_and_errors(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("1, 2 3\n4")
    assert read_trace_prompt(str(f), 96) == [1, 2, 3, 4]
    f.write_text(json.dumps([5, 6]))
    assert read_trace_prompt(str(f), 96) == [5, 6]
    f.write_text("1 200")
    with pytest.raises(ValueError, match="token ids"):
        read_trace_prompt(str(f), 96)
    _write_checkpoint(tmp_path)
    model = build_model(model_path=tmp_path)
    sc = SparseConfig(algorithm="quest", page_size=16, top_k=64, device_buffer_size=128, sink_tokens=16,
                      recent_tokens=16, min_sparse_prompt_len=0)
    with pytest.raises(ValueError, match="steps"):
        record_real_trace(model, sc, [1] * 64, 1, torch.device("cpu"), torch.float32)
