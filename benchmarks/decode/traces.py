"""bench_decode's query traces: a real trace recorded from a real-weight model's own
queries, and the rho of the synthetic AR(1) trace calibrated to a target Top-k overlap."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks.decode.point import free_memory, make_runner
from benchmarks.decode.sizing import kv_bytes_per_token_layer
from sparsehi.config import SparseConfig
from sparsehi.runtime.synth import synth_prefill
from sparsehi.runtime.traces import QueryTrace, calibrate_rho, topk_overlap


def read_trace_prompt(path: str, vocab_size: int) -> list[int]:
    """Token ids from ``path``: a JSON list of ints, or ints separated by whitespace/commas."""
    text = Path(path).read_text()
    try:
        ids = json.loads(text)
    except json.JSONDecodeError:
        ids = [int(x) for x in text.replace(",", " ").split()]
    if not isinstance(ids, list) or not ids or any(isinstance(x, bool) or not isinstance(x, int) for x in ids):
        raise ValueError(f"--trace-prompt {path}: expected a non-empty list of integer token ids")
    if any(x < 0 or x >= vocab_size for x in ids):
        raise ValueError(f"--trace-prompt {path}: token ids must runtime_mode in [0, {vocab_size})")
    return ids


def record_real_trace(model, sc: SparseConfig, prompt: list[int], steps: int, device, dtype,
                      model_path: Optional[str] = None) -> dict[str, Any]:
    """Real prefill of ``prompt`` plus ``steps`` greedy decode steps in sparse-gpu mode,
    recording every sparse layer's selection per step; returns the measured
    adjacent-step Top-k overlap per sparse layer (sink and recent window excluded, as in
    run_point) and the selections themselves (``selections[layer]``: per step
    ``[1, N] int`` logical unit ids, -1 padded)."""
    if steps < 2:
        raise ValueError(f"steps must runtime_mode >= 2 to measure adjacent-step overlap, got {steps}")
    if len(prompt) < 1:
        raise ValueError("prompt must hold at least one token")
    runner = make_runner(model, "sparse-gpu", len(prompt), 1, sc, steps, device, dtype)
    runtime_mode = runner.mode
    sparse_layers = [layer for layer in range(model.cfg.num_layers) if runtime_mode.algorithm.is_sparse_layer(layer)]
    if not sparse_layers:
        raise ValueError(f"the model's {model.cfg.num_layers} layers are all dense under this SparseConfig: "
                         "nothing to record")
    runtime_mode.record_layers = frozenset(sparse_layers)
    runtime_mode.recorded.clear()
    try:
        runner.generate([prompt], steps)
    finally:
        runtime_mode.record_layers = frozenset()
    sel: dict[int, list[torch.Tensor]] = {layer: runtime_mode.recorded.get(layer, []) for layer in sparse_layers}
    per_layer = topk_overlap_per_layer(sel, len(prompt), sc)
    vals = list(per_layer.values())
    result = {"model_path": model_path, "context": len(prompt), "steps": steps,
              "topk_overlap_mean": sum(vals) / len(vals),
              "topk_overlap_per_layer": {str(k): v for k, v in per_layer.items()}, "source": "real",
              "selections": {layer: [t.cpu() for t in ts] for layer, ts in sel.items()}}
    del runner, runtime_mode
    free_memory(device)
    return result


def topk_overlap_per_layer(selections: dict[int, list[torch.Tensor]], ctx: int, sc: SparseConfig) -> dict[int, float]:
    """Mean adjacent-step Top-k overlap per layer of recorded selections (``[B, N] int``
    per step); the Top-k part is the units in ``[sink_units, ctx // page_size - recent_units)``."""
    out: dict[int, float] = {}
    for layer, rec in selections.items():
        if len(rec) < 2:
            raise ValueError(f"layer {layer}: {len(rec)} recorded steps, need >= 2")
        b = rec[0].shape[0]
        lo = torch.full((b,), sc.sink_units, device=rec[0].device)
        hi = torch.full((b,), ctx // sc.page_size - sc.recent_units, device=rec[0].device)
        ov = [topk_overlap(x, y, lo, hi).mean().item() for x, y in zip(rec[:-1], rec[1:])]
        out[layer] = sum(ov) / len(ov)
    return out


# ----------------------------------------------------------------------------- calibration
def calibrate(model, ctx: int, sc: SparseConfig, target: float, iters: int, device, dtype) -> tuple[float, float]:
    """rho of the query trace whose adjacent-step Top-k overlap (the algorithm's own, on
    synthesised representations, one sparse layer, 2 requests of a sparse-gpu runner) is
    ``target``."""
    runner = make_runner(model, "sparse-gpu", ctx, 2, sc, 4, device, dtype)
    reqs = runner.new_requests([[0]] * 2)
    synth_prefill(runner.mode, reqs, ctx, seed=1)
    out = calibrate_on(runner.mode, reqs, model, ctx, sc, target, iters, device, dtype)
    del runner, reqs
    free_memory(device)
    return out


def calibration_fits(model, ctx: int, dtype, room: Optional[int]) -> bool:
    """Whether ``calibrate``'s sparse-gpu runner (2 requests of ``ctx`` tokens, all KV on
    the device) fits in ``room`` device bytes (None: unknown, taken as yes)."""
    return room is None or 2 * (ctx + 8) * kv_bytes_per_token_layer(model, dtype) * model.cfg.num_layers <= room


class NothingToCalibrate(ValueError):
    """The model has no layer the algorithm selects in (every layer dense)."""


def calibrate_on(runtime_mode, reqs: list, model, ctx: int, sc: SparseConfig, target: float, iters: int, device,
                 dtype) -> tuple[float, float]:
    """``calibrate``'s search on the representations a runner holds for ``reqs`` (prefilled,
    ``ctx`` tokens each): ``(rho, overlap measured at it)``; :class:`NothingToCalibrate` where
    the algorithm selects in no layer."""
    algo = runtime_mode.algorithm
    layers = [x for x in range(model.cfg.num_layers) if algo.is_sparse_layer(x)]
    if not layers:
        raise NothingToCalibrate(f"{model.cfg.name}: {sc.algorithm} selects in none of its {model.cfg.num_layers} "
                                 "layers, so no trace rho changes a step")
    layer = layers[0]
    cfg = model.cfg
    dev = torch.device(device)
    B = len(reqs)
    ps = sc.page_size
    P = ctx // ps
    cs = torch.full((B,), sc.sink_units, dtype=torch.int32, device=dev)
    ce = torch.full((B,), P - sc.recent_units, dtype=torch.int32, device=dev)
    seq = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    rpi = torch.tensor([r.req_pool_idx for r in reqs], device=dev)
    mask = torch.ones(B, dtype=torch.bool, device=dev)
    if cfg.family == "mla":
        shape = (B, cfg.index_n_heads, cfg.index_head_dim)
        w = torch.ones(B, cfg.index_n_heads, device=dev) * (cfg.index_n_heads ** -0.5)
    else:
        shape = (B, cfg.num_heads, cfg.head_dim)
        w = None

    def measure(rho: float) -> float:
        tr = QueryTrace(rho, seed=3)
        like = torch.empty(shape, device=dev, dtype=torch.float32)
        prev, ovs = None, []
        for _ in range(10):
            q = tr.next(layer, like).to(dtype)
            kw = {"weights": w} if w is not None else {}
            sel, _ = algo.retrieve_topk(q, layer, rpi, mask, seq_lens=seq, candidate_start=cs, candidate_end=ce,
                                        top_k=sc.top_k_units, **kw)
            if prev is not None:
                ovs.append(topk_overlap(prev, sel, cs, ce).mean().item())
            prev = sel
        return sum(ovs) / len(ovs)

    return calibrate_rho(measure, target, iters=iters)
