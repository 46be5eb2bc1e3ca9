"""A 1,048,576-token context on the CPU with a tiny model: the page tables, request tables,
Quest's bound pools, the Top-k select over 4,096 candidate pages and the benchmark's
synthesised prefill all work at that length, and sparse-hier (the prompt in the host pool,
4 pages a step in the GPU buffer) generates exactly what sparse-gpu does."""
from __future__ import annotations

import pytest
import torch

from sparsehi.config import SparseConfig
from sparsehi.runtime.model_config import get_model_config
from sparsehi.runtime.runtime_config import RuntimeConfig
from sparsehi.runtime.runner import ModelRunner
from sparsehi.runtime.synth import synth_prefill
from sparsehi.runtime.weights import build_model

CONTEXT = 1 << 20
pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_million_token_context_decodes_the_same_in_both_sparse_modes():
    model = build_model(config=get_model_config("tiny-gqa", num_layers=1))
    sc = SparseConfig(algorithm="quest", page_size=256, top_k=1024, device_buffer_size=2048, sink_tokens=256,
                      recent_tokens=256, min_sparse_prompt_len=0, io_backend="direct", dense_layers=())
    out = {}
    for mode in ("sparse-hier", "sparse-gpu"):
        rt = RuntimeConfig(mode=mode, sparse=sc, max_num_reqs=1, max_context_len=CONTEXT + 8, prefix_cache=False)
        runner = ModelRunner(model, rt)
        reqs = runner.new_requests([[0]])
        synth_prefill(runner.mode, reqs, CONTEXT, seed=1)
        for _ in range(3):
            runner.decode_step(reqs)
        out[mode] = list(reqs[0].output)
        assert reqs[0].seq_len == CONTEXT + 3
        if mode == "sparse-hier":
            st = runner.mode.coord.stats()
            assert st["misses"] > 0 and runner.mode.host.num_slots >= CONTEXT
        del runner, reqs
    assert out["sparse-hier"] == out["sparse-gpu"]
