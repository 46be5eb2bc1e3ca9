"""``sparsehi bench``: a decode-throughput sweep (contexts x batches x modes) with the
runtime on random prompts. Each point prefills the batch with the model and times the
decode steps; rows go to ``<output_dir>/bench.json``. The GPU benchmark of the issue
(memory scenarios, calibrated query traces, per-step time split) is
``benchmarks/bench_decode.py``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from sparsehi.runtime.demo import CPU_THROUGHPUT_NOTE, make_prompts
from sparsehi.runtime.runtime_config import RuntimeConfig
from sparsehi.runtime.report import MIB, RECORDED_SPARSE_FIELDS, prepare_output_dir, write_json
from sparsehi.runtime.run_setup import RunSetup
from sparsehi.runtime.runner import ModelRunner
from sparsehi.runtime.weights import build_model


BENCH_FILES = ("bench.json",)
"""What ``run_bench`` writes under ``output_dir``."""


@dataclass
class BenchConfig(RunSetup):
    contexts: list[int] = field(default_factory=lambda: [1024, 2048])
    batches: list[int] = field(default_factory=lambda: [1, 2])
    decode_tokens: int = 16
    cache_salt: Optional[str] = None
    """Every request's cache salt (``Request.cache_salt``), as ``sparsehi run --cache-salt``.
    The sweep runs without the prefix tree and L3 (each point prefills its prompts in full),
    so its requests share no KV with or without a salt."""


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Sweep; print one line per point; write ``bench.json`` under ``cfg.output_dir``
    (checked before any work). Returns the JSON payload."""
    out = prepare_output_dir(cfg.output_dir, BENCH_FILES)
    model = build_model(cfg.model, model_path=cfg.model_path, device=cfg.device, dtype=cfg.dtype,
                        num_layers=cfg.num_layers)
    rows: list[dict[str, Any]] = []
    print(f"sparsehi bench: {model.cfg.name}, algorithm {cfg.sparse.algorithm}, top_k {cfg.sparse.top_k}, "
          f"buffer {cfg.sparse.device_buffer_size}, page {cfg.sparse.page_size}, device {cfg.device}")
    if torch.device(cfg.device).type == "cpu":
        print(CPU_THROUGHPUT_NOTE)
    print(f"{'context':>8} {'batch':>5} {'mode':>12} {'tok/s':>9} {'hit':>6} {'GPU KV MiB':>11} {'host KV MiB':>11}")
    for ctx in cfg.contexts:
        sc = replace(cfg.sparse)
        if sc.top_k > ctx:
            sc = replace(sc, top_k=max(sc.page_size, ctx // sc.page_size * sc.page_size),
                         device_buffer_size=max(sc.device_buffer_size, ctx // sc.page_size * sc.page_size))
        for b in cfg.batches:
            prompts = make_prompts(model.cfg.vocab_size, b, ctx, cfg.seed)
            for mode in cfg.modes:
                rt = RuntimeConfig(mode=mode, sparse=replace(sc), device=cfg.device, dtype=cfg.dtype, max_num_reqs=b,
                                   max_context_len=ctx + cfg.decode_tokens + 1, adapter=cfg.adapter,
                                   host_layout=cfg.host_layout, prefix_cache=False, validate=False,
                                   cuda_graph=cfg.cuda_graph, overlap_schedule=cfg.overlap_schedule,
                                   host_kv_gb=float(cfg.hicache.hicache_size) if cfg.hicache is not None else 0.0)
                t0 = time.perf_counter()
                res = ModelRunner(model, rt).generate(prompts, cfg.decode_tokens,
                                                      cache_salts=[cfg.cache_salt] * len(prompts))
                hit = res.stats.get("hit_rate") if mode == "sparse-hier" else None
                row = {"context": ctx, "batch": b, "mode": mode, "tokens_per_s": res.decode_tokens_per_s,
                       "step_ms": 1e3 * res.decode_s / max(1, cfg.decode_tokens), "hit_rate": hit,
                       "gpu_kv_mib": res.memory.get("gpu_kv_bytes", 0) / MIB,
                       "host_kv_mib": res.memory.get("host_kv_bytes", 0) / MIB,
                       "wall_s": time.perf_counter() - t0}
                rows.append(row)
                print(f"{ctx:>8} {b:>5} {mode:>12} {row['tokens_per_s']:>9.1f} "
                      f"{'-' if hit is None else format(hit, '.3f'):>6} {row['gpu_kv_mib']:>11.2f} {row['host_kv_mib']:>11.2f}")
    payload = {"model": model.cfg.name, "model_note": model.cfg.note, "device": cfg.device,
               "device_name": torch.cuda.get_device_name() if str(cfg.device).startswith("cuda") else "cpu",
               "sparse_config": {k: getattr(cfg.sparse, k) for k in RECORDED_SPARSE_FIELDS},
               "decode_tokens": cfg.decode_tokens, "rows": rows, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    path = write_json(out / "bench.json", payload)
    print(f"wrote {path}")
    return payload
