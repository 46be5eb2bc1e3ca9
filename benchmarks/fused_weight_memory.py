"""The stacked projection weights of the runtime models (``layers.fused_weight``): GPU
memory and forward time of the form that makes each weight a view of the stacked matrix's
rows (the current one) against the form that kept the stacked matrix as a second copy
(``copying_fused_weight`` below, its baseline), in one process, on freshly built
``llama-8b-shape`` and ``dsv32-shape`` models in bf16: memory allocated after the first
forward, the best eager forward of 5 rounds of 10 (16 tokens, attention stubbed out with
zeros) and a CUDA-graph replay of the same forward, whose output must equal the eager one.

    PYTHONPATH=. python benchmarks/fused_weight_memory.py [--commit SHA] [--out DIR]
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sparsehi.runtime.gqa_model as gqa_model  # noqa: E402
import sparsehi.runtime.layers as layers  # noqa: E402
import sparsehi.runtime.mla_model as mla_model  # noqa: E402
from benchmarks.common import result_parser, write_result  # noqa: E402
from sparsehi.runtime.model_config import get_model_config  # noqa: E402
from sparsehi.runtime.weights import build_model  # noqa: E402


def copying_fused_weight(owner: nn.Module, cache_attr: str, weights: list[torch.Tensor]) -> torch.Tensor:
    """The baseline: the weights stacked into a cached second copy, rebuilt when any weight's
    address or version changes."""
    key = tuple((w.data_ptr(), w._version) for w in weights)
    hit = getattr(owner, cache_attr, None)
    if hit is None or hit[0] != key:
        hit = (key, torch.cat([w.detach() for w in weights]))
        setattr(owner, cache_attr, hit)
    return hit[1]


def _use(fn) -> None:
    for mod in (layers, gqa_model, mla_model):
        mod.fused_weight = fn


def measure(name: str) -> dict:
    cfg = get_model_config(name)
    ids = torch.randint(0, cfg.vocab_size, (16,), device="cuda")
    pos = torch.arange(16, device="cuda")

    def attn(layer, q, k, v, extra):
        d = cfg.kv_lora_rank if v is None else v.shape[-1]
        return torch.zeros(q.shape[0], q.shape[1], d, dtype=q.dtype, device=q.device)

    row = {}
    current = layers.fused_weight
    try:
        for label, fn in (("copy", copying_fused_weight), ("views", current)):
            _use(fn)
            torch.cuda.empty_cache()
            model = build_model(name, device="cuda", dtype=torch.bfloat16)
            torch.cuda.synchronize()
            weights = torch.cuda.memory_allocated()
            with torch.no_grad():
                model(ids, pos, attn)
                torch.cuda.synchronize()
                after = torch.cuda.memory_allocated()
                rounds = []
                for _ in range(5):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(10):
                        model(ids, pos, attn)
                    torch.cuda.synchronize()
                    rounds.append((time.perf_counter() - t0) / 10 * 1e3)
                graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                    out = model(ids, pos, attn)
                torch.cuda.current_stream().wait_stream(stream)
                graph.replay()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(50):
                    graph.replay()
                torch.cuda.synchronize()
                replay = (time.perf_counter() - t0) / 50 * 1e3
                same = bool(torch.equal(out, model(ids, pos, attn)))
            row[label] = dict(built_gib=round(weights / 2**30, 3), after_first_forward_gib=round(after / 2**30, 3),
                              eager_forward_ms_best=round(min(rounds), 3),
                              eager_forward_ms_rounds=[round(t, 3) for t in rounds],
                              graph_replay_ms=round(replay, 3), graph_equals_eager=same)
            print(name, label, row[label], flush=True)
            del model, graph, out
    finally:
        _use(current)
    return row


def main(argv=None) -> int:
    ap = result_parser(__doc__)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    rows = {name: measure(name) for name in ("llama-8b-shape", "dsv32-shape")}
    bad = [n for n, r in rows.items() if not all(v["graph_equals_eager"] for v in r.values())]
    print("wrote", write_result("fused_weight_memory.json", {
        "what": "GPU memory after the first forward and forward times of the runtime models with the stacked "
                "projection weights as views of one matrix (views) against a cached second copy (copy)",
        "commit": a.commit, "rows": rows}, a.out))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
