"""Long-context decode throughput: dense vs sparse-gpu vs sparse-hier vs offload-full.

llama-8b-shape (all 32 layers; MLP 4096 wide instead of 14336, stated in the output) at
contexts 16k / 32k / 64k, Quest page 16, K = 2048 tokens, LRU buffer 2 x K; plus
dsv32-shape (8 of 61 layers, budgets scaled by 8/61) with DSA at 32k. Two memory scenarios:

  a  serving a large model: GPU KV budget 16 GiB (the rest of HBM stands for weights),
     host KV budget 96 GiB;
  b  the whole free HBM (after this run's weights, minus a working margin) for KV.

Per mode the batch is swept in powers of two up to what the mode holds (GPU budget for
dense / sparse-gpu; GPU and host budgets for sparse-hier / offload-full), computed from
per-request bytes. Prefill is synthesised (random KV written straight into the pools and
the algorithm's representations built from it; see sparsehi/runtime/synth.py): a decode
benchmark does not time prefill. Host modes share one prompt's host pages across the
batch (as prefix reuse would), so pinned memory fits the benchmark machine; every request
still has its own GPU buffer, representations, decode pages and loads.

Contexts larger than a GPU holds (``--modes sparse-hier-fp8 --contexts 1048576``): a host
mode synthesises such a prompt chunk by chunk (64k tokens of device KV at a time); one
request that the scenario's GPU budget cannot hold is still measured at batch 1 when the
device and the host budget hold it (its row says ``over_gpu_budget`` and what it holds),
and the query trace is calibrated on that point's own representations when a sparse-gpu
calibration (the whole context on the GPU) does not fit.

Queries. ``trace85``: each sparse layer's selection query (GQA q; DSA index q) follows an
AR(1) drift whose rho is calibrated per context so that the algorithm's own adjacent-step
Top-k overlap on these representations is 85 % (003's figure for real models); every row
reports the overlap it measured (``topk_overlap``). ``model``: the random-weight model's
own queries (one sparse-hier row per context, for contrast).

Real weights. ``--model-path DIR`` (a local HF-layout Llama/Qwen2/Mistral checkpoint) replaces the
llama-shape model; its own-query rows are then ``real``, and the benchmark first RECORDS a
real trace: a real prefill of ``--trace-prompt`` (token ids; default fixed-seed random ids of
the largest context, capped at ``--trace-context``) and ``--trace-steps`` greedy decode
steps in sparse-gpu mode with the benchmark's SparseConfig, keeping every sparse layer's
selection per step; ``real_trace`` in the result holds the measured adjacent-step Top-k
overlap per layer (sink and recent window excluded).

Per step: tokens/s over the timed steps (eager PyTorch, no CUDA graphs: Python launch
overhead is part of every mode), then a profiled step split with CUDA events into
attention, lru_diff, io (host<->device), scoring (Quest bound / DSA indexer + top-k) and
other (projections, MLP, norms, selection bookkeeping, launch gaps).

    PYTHONPATH=. python benchmarks/bench_decode.py            # GPU run (~6 min)
    PYTHONPATH=. python benchmarks/bench_decode.py --quick    # tiny CPU smoke run
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS_DIR, device_info, hbm_copy_gbps, large_h2d_copy_gbps, write_result  # noqa: E402
from benchmarks.decode import point  # noqa: E402
from benchmarks.decode import modes  # noqa: E402
from benchmarks.decode.point import (ALL_MODES, FILL_STEPS_MAX, FP8_MODE, HOST_POOLS, MODES,  # noqa: E402
                                     free_memory, log, run_point, shared_host_pool)
from benchmarks.decode.report import SECTION_SUMMARY_KEYS, plot, summary, summary_context, targets  # noqa: E402
from benchmarks.decode.sections import write_section  # noqa: E402
from benchmarks.decode.sizing import (GIB, LIMITS, admits_one_over_budget, batches_up_to, capacity,  # noqa: E402
                                      device_room, gib_parts, per_request_bytes, per_request_parts,
                                      representation_bytes_per_request, sparse_extra_config)
from benchmarks.decode.traces import (calibrate, calibrate_on, calibration_fits, read_trace_prompt,  # noqa: E402
                                      record_real_trace)
from sparsehi.config import SparseConfig  # noqa: E402
from sparsehi.runtime.model_config import get_model_config  # noqa: E402
from sparsehi.runtime.runtime_config import round_up  # noqa: E402
from sparsehi.runtime.weights import build_model  # noqa: E402

TRACE_SOURCES = {
    "trace85": "synthetic AR(1) drift of each layer's selection query (GQA q / DSA index q), rho calibrated per "
               "context so the algorithm's own adjacent-step Top-k overlap on the synthesised representations is "
               "0.85 (003's figure for real models); topk_overlap is what the row measured",
    "model": "the random-weight model's own queries (no trace)",
    "real": "the real-weight model's own queries (--model-path); real_trace holds the adjacent-step Top-k "
            "overlap measured on a real prefill + greedy decode",
}
PREFILL_NOTE = ("prefill synthesised: random KV written into the pools and the algorithm's representations built from "
                "it; host modes share one prompt's host pages across the batch (capacity computed per request)")


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.t0 = time.perf_counter()
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)


# ----------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny models, tiny contexts: a CPU smoke run of every path")
    ap.add_argument("--time-budget", type=float, default=390.0, help="seconds; later points are skipped past it")
    ap.add_argument("--out", default=None, help="result directory (default benchmarks/results)")
    ap.add_argument("--skip-b", action="store_true", help="skip scenario b")
    ap.add_argument("--no-cuda-graph", action="store_true",
                    help="run decode steps eagerly (default: CUDA-graph replays, as the runtime does)")
    ap.add_argument("--modes", default=None,
                    help=f"comma list of modes to sweep (default: the four of {MODES}; also sparse-hier-fp8: "
                         "sparse-hier with FP8 host KV; sparse-hier-ahead, sparse-hier-fp8-ahead: loading "
                         "--lookahead-pages pages ahead per layer)")
    ap.add_argument("--lookahead-pages", type=int, default=modes.LOOKAHEAD_PAGES,
                    help="pages ranked after the top-k that the -ahead modes load per layer for the next step "
                         f"(default {modes.LOOKAHEAD_PAGES}; top-k plus these must fit the buffer of 2 x top-k)")
    ap.add_argument("--section", default=None,
                    help="keep this run as decode.json[SECTION] beside the file's full run (lifting "
                         "fp8_best_tok_s_64k, b1_tok_s_1m and prefetch_hidden_frac into its summary) "
                         "instead of replacing the file")
    ap.add_argument("--max-batch", type=int, default=None, help="largest batch swept per mode")
    ap.add_argument("--index-query-dtype", default="auto", choices=("auto", "fp8", "native"),
                    help="the dsv32-shape DSA indexer's queries (sparse_extra_config['index_query_dtype']): auto "
                         "(FP8 over FP8 index keys, as DeepSeek-V3.2), fp8, or native (the model's bf16)")
    ap.add_argument("--skip-dsv32", action="store_true", help="skip the dsv32-shape rows")
    ap.add_argument("--skip-llama", action="store_true",
                    help="skip the llama-shape rows (scenario a and b; no llama-shape model is built)")
    ap.add_argument("--contexts", default=None, help="comma list overriding the llama contexts")
    ap.add_argument("--model-path", default=None,
                    help="local HF-layout Llama/Qwen2/Mistral checkpoint: real weights replace the llama-shape model "
                         "and a real query trace is recorded")
    ap.add_argument("--trace-prompt", default=None,
                    help="token-id file (JSON list or whitespace/comma separated) for the real trace; default "
                         "fixed-seed random ids of the largest context")
    ap.add_argument("--trace-context", type=int, default=None,
                    help="cap on the real trace's prompt length (default 8192; 256 with --quick)")
    ap.add_argument("--trace-steps", type=int, default=None,
                    help="greedy decode steps of the real trace (default 32; 6 with --quick)")
    args = ap.parse_args(argv)
    point.CUDA_GRAPH = not args.no_cuda_graph
    modes.LOOKAHEAD_PAGES = args.lookahead_pages
    sweep_modes = tuple(args.modes.split(",")) if args.modes else MODES
    bad = [m for m in sweep_modes if m not in ALL_MODES]
    if bad:
        raise SystemExit(f"--modes: {bad} unknown; allowed {ALL_MODES}")
    if args.skip_llama and (args.model_path or args.skip_dsv32):
        raise SystemExit("--skip-llama leaves only the dsv32-shape rows: it takes neither --model-path nor "
                         "--skip-dsv32")
    deadline = Deadline(args.time_budget)
    cuda = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if not cuda:
        torch.set_num_threads(1)
    out_dir = Path(args.out or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.quick:
        llama = get_model_config("tiny-gqa", num_layers=4)
        dsv = get_model_config("tiny-dsa", num_layers=2)
        contexts = [512, 1024]
        dsv_ctx = 512
        K, ps = 64, 16
        budget_a = (2 * (1024 + 64) * llama.kv_bytes_per_token(dtype), 16 * (1024 + 64) * llama.kv_bytes_per_token(dtype))
        warmup, timed, profiled = 1, 2, 1
        fill_max = 8
        cal_iters = 3
        max_batch = 8
    else:
        llama = get_model_config("llama-8b-shape")
        dsv = get_model_config("dsv32-shape")
        contexts = [65536, 32768, 16384]
        dsv_ctx = 32768
        K, ps = 2048, 16
        budget_a = (16 * GIB, 96 * GIB)
        warmup, timed, profiled = 2, 8, 1
        fill_max = FILL_STEPS_MAX
        cal_iters = 8
        max_batch = 256
    if args.contexts:
        contexts = [int(x) for x in args.contexts.split(",")]
    if args.skip_llama:
        contexts = []
    if args.max_batch:
        max_batch = args.max_batch
    trace_context = args.trace_context if args.trace_context is not None else (256 if args.quick else 8192)
    trace_steps = args.trace_steps if args.trace_steps is not None else (6 if args.quick else 32)
    if trace_context < 1:
        raise ValueError(f"--trace-context must be >= 1, got {trace_context}")
    if trace_steps < 2:
        raise ValueError(f"--trace-steps must be >= 2, got {trace_steps}")
    gqa = None
    if args.model_path:
        gqa = build_model(model_path=args.model_path, device=device, dtype=dtype)
        llama = gqa.cfg
    info = device_info()
    log(f"device {info['device']}; budget {args.time_budget:.0f}s")
    h2d = large_h2d_copy_gbps(1 << 30) if cuda else None
    hbm = hbm_copy_gbps(2 << 30) if cuda else None
    LIMITS.update(h2d_gbps=h2d, hbm_gbps=hbm)
    if h2d:
        log(f"pinned host->device copy: {h2d:.1f} GB/s; device->device copy (read + write): {hbm:.0f} GB/s")
    rows: list[dict] = []
    caps: dict = {}
    notes: list[str] = []
    calib: dict = {}
    real_trace: Optional[dict] = None

    def save(final: bool = False) -> None:
        payload = {
            "model": dsv.name if args.skip_llama else llama.name,
            "models": {llama.name: llama.note, dsv.name: dsv.note},
            "prefill": PREFILL_NOTE, "rows": rows, "capacity": {f"{m}|{c}|{s}": v for (m, c, s), v in caps.items()},
            "calibration": calib, "h2d_gbps": h2d, "hbm_gbps": hbm, "notes": notes, "trace_sources": TRACE_SOURCES,
            "summary": (summary(rows, caps, dsv_ctx, dsv.name, point.CUDA_GRAPH and cuda) if args.skip_llama
                        else summary(rows, caps, summary_context(contexts), llama.name, point.CUDA_GRAPH and cuda)),
            "roofline": "roofline_ms = (weights + the KV the mode reads + selection representations + loaded "
                        "pages written) / hbm_gbps + host->device bytes (sparse-hier misses, offload-full's whole "
                        "context) / h2d_gbps, both limits measured in this run; frac_roofline = roofline_ms / step_ms",
            "host_time": "host_ms_per_step: host time of a decode step outside the device's work (host part, input "
                         "copy, graph launch or eager launches, bookkeeping after the tokens came back), mean and max "
                         "over the timed steps; with the overlap schedule it runs while the previous step replays, "
                         "and device_gap_ms_max is what the device waited between two steps (CUDA events)",
            "settings": {"graphs": point.CUDA_GRAPH and cuda, "top_k_tokens": K, "buffer_tokens": 2 * K,
                         "lookahead_pages": modes.LOOKAHEAD_PAGES, "page_size_gqa": ps, "sink_tokens": 64,
                         "recent_tokens": 64, "warmup_steps": warmup, "timed_steps": timed,
                         "buffer_fill_steps_max": fill_max,
                         "warmup": "every mode decodes warmup_steps; hierarchical modes then decode until every "
                                   "sparse layer's LRU buffer of every request is full, plus 2 steps, at most "
                                   "buffer_fill_steps_max (each row's warmup_steps and buffer_fill_at_timing)",
                         "profiled_steps": profiled, "quick": args.quick,
                         "dsa_index_query_dtype": args.index_query_dtype,
                         "scenario_a": {"gpu_kv_gib": budget_a[0] / GIB, "host_kv_gib": budget_a[1] / GIB}},
            "complete": final,
        }
        if real_trace is not None:
            payload["real_trace"] = real_trace
        if args.section:
            # the file's summary describes the llama-shape model: a dsv32-only run lifts nothing
            write_section(out_dir / "decode.json", args.section,
                          {"device": info["device"], "date": info["date"], "env": info, **payload},
                          lift=() if args.skip_llama else SECTION_SUMMARY_KEYS)
        else:
            write_result("decode.json", payload, out_dir)

    def sweep(model, ctx: int, sc: SparseConfig, scen: str, gpu_budget: float, host_budget: float,
              modes=MODES, scale: float = 1.0, real: bool = False) -> None:
        cfg = model.cfg
        dtype = next(model.parameters()).dtype  # --quick: the MLA model of FP8 latent rows runs in bf16
        steps = warmup + timed + profiled
        room = device_room(device)  # before the probe below reserves (and caches) its representation pools
        rep = representation_bytes_per_request(model, sc, ctx + steps + 2, device)
        n_dense = len(create_probe(model, sc).dense_layers())
        parts = {m: per_request_parts(model, m, ctx, sc, steps, rep, n_dense, dtype) for m in modes}
        cap: dict[str, int] = {}
        over: list[str] = []  # measured at batch 1 beyond the GPU budget (sizing.admits_one_over_budget)
        for mode in modes:
            g, h = (sum(parts[mode][k].values()) for k in ("gpu", "host"))
            cap[mode] = capacity(g, h, gpu_budget, host_budget)
            if not cap[mode] and scen == "a" and admits_one_over_budget(g, h, host_budget, room):
                over.append(mode)
                notes.append(f"{cfg.name} {ctx} {scen}: one {mode} request holds {g / GIB:.2f} GiB on the GPU "
                             f"({gib_parts(parts[mode]['gpu'])}) > the {gpu_budget / GIB:.1f} GiB budget; measured "
                             "at batch 1 anyway (row over_gpu_budget)")
        caps[(cfg.name, ctx, scen)] = {**cap, "gpu_budget_gib": gpu_budget / GIB, "host_budget_gib": host_budget / GIB}
        log(f"{cfg.name} {ctx} scenario {scen}: capacity {cap}" + (f"; over the GPU budget at batch 1: {over}"
                                                                    if over else ""))
        key = f"{cfg.name}|{ctx}"
        rho = calib.get(key, {}).get("rho")
        in_point = None
        if rho is None and calibration_fits(model, ctx, dtype, room):
            rho, got = calibrate(model, ctx, sc, 0.85, cal_iters, device, dtype)
            calib[key] = {"rho": rho, "calibrated_overlap": got}
            log(f"trace calibrated: rho={rho:.5f} -> overlap {got:.3f}")
        elif rho is None:  # sparse-gpu with all KV on the device does not fit: the first point's own representations
            def in_point(runtime_mode, reqs):
                return calibrate_on(runtime_mode, reqs, model, ctx, sc, 0.85, cal_iters, device, dtype)
        plan = [(mode, b, True) for mode in modes
                for b in batches_up_to(cap[mode], 4 if mode == "offload-full" else max_batch)]
        plan += [(mode, 1, True) for mode in over]
        if scen == "a" and cap.get("sparse-hier"):
            plan.append(("sparse-hier", batches_up_to(cap["sparse-hier"], max_batch)[-1], False))
        for mode, b, trace in plan:
            if deadline.left() < 20:
                notes.append(f"skipped {cfg.name} {ctx} {scen} {mode} B={b}: time budget")
                continue
            t = time.perf_counter()
            cal = in_point if trace and rho is None else None
            try:
                t_steps = timed if mode != "offload-full" else max(2, timed // 4)
                row = run_point(model, mode, ctx, b, sc, rho if trace else None, warmup if mode != "offload-full" else 1,
                                t_steps, profiled if mode != "offload-full" else 1, device, dtype, calibrate=cal,
                                fill_max=fill_max)
            except Exception as e:  # a point that does not fit or fails is reported, not fatal
                notes.append(f"{cfg.name} {ctx} {scen} {mode} B={b} failed: {type(e).__name__}: {e}")
                log(notes[-1])
                traceback.print_exc()
                free_memory(device)
                continue
            if cal is not None and row.get("trace_rho") is not None:
                rho = row["trace_rho"]
                calib[key] = {"rho": rho, "calibrated_overlap": row["calibrated_overlap"], "calibrated_on": f"{mode} B={b}"}
                log(f"trace calibrated on the point's representations: rho={rho:.5f} -> overlap "
                    f"{row['calibrated_overlap']:.3f}")
            src = "trace85" if trace and rho is not None else ("real" if real else "model")
            row.update({"scenario": scen, "model": cfg.name, "trace_source": src,
                        "host_kv_gib": sum(parts[mode]["host"].values()) * b / GIB, "capacity": cap[mode],
                        "budget_scale": scale, "over_gpu_budget": b > cap[mode], "gpu_budget_gib": gpu_budget / GIB,
                        "holds_per_request_gib": {k: gib_parts(v) for k, v in parts[mode].items()}})
            rows.append(row)
            sp = row["split_ms"]
            log(f"{scen} {cfg.name} {ctx:>6} {mode:>12} B={b:<4} {row['tokens_per_s']:9.1f} tok/s  "
                f"step {row['step_ms']:.1f} ms  hit {row['hit_rate']}  ov {row['topk_overlap']}  "
                f"split " + " ".join(f"{k}={v:.2f}" for k, v in sp.items()) + f"  ({time.perf_counter() - t:.1f}s)")
            save()

    def pin_host_pools(model, sc: SparseConfig, ctxs: list[int], host_budget: float) -> None:
        """One pinned host pool per host KV dtype the swept modes use, sized once (pinning
        tens of GiB takes a while) for the largest context one of their requests fits in
        the host budget, before any point."""
        groups = ((("sparse-hier", "sparse-hier-ahead", "offload-full"), "auto", "auto"),
                  ((FP8_MODE, FP8_MODE + modes.AHEAD_SUFFIX), "fp8_e4m3", "auto"),
                  (modes.FP8_LATENT_MODES[1:], "auto", "fp8_e4m3"))
        if not ctxs:  # --skip-llama: no llama-shape model
            return
        mdtype = next(model.parameters()).dtype
        for group, host_dtype, kv_dtype in groups:
            fit = [c for c in ctxs for m in group if m in modes_for(model)
                   and per_request_bytes(model, m, c, sc, steps_all, 0, 0, mdtype)[1] <= host_budget]
            if fit:
                pps = sc.page_size
                shared_host_pool(model, replace(sc, host_kv_dtype=host_dtype, kv_cache_dtype=kv_dtype),
                                 max(fit) + max_batch * round_up(steps_all + 2 * pps, pps) + 4 * pps, device, mdtype)

    def modes_for(model) -> tuple[str, ...]:
        """The swept modes a model takes: FP8 latent rows are for MLA models only."""
        return tuple(m for m in sweep_modes if model.cfg.family == "mla" or modes.kv_cache_dtype_of(m) == "auto")

    def create_probe(model, sc):
        from sparsehi.algorithms.registry import create_algorithm

        return create_algorithm(replace(sc, sparse_extra_config=sparse_extra_config(model, sc)), device)

    if gqa is None and contexts:  # --skip-llama: no llama-shape model at all
        gqa = build_model(config=llama, device=device, dtype=dtype)
    sc_gqa = SparseConfig(algorithm="quest", top_k=K, device_buffer_size=2 * K, page_size=ps, min_sparse_prompt_len=0,
                          sink_tokens=64 if not args.quick else 16, recent_tokens=64 if not args.quick else 16)
    free_b = None
    steps_all = warmup + timed + profiled
    pin_host_pools(gqa, sc_gqa, contexts, budget_a[1])
    real = args.model_path is not None
    if real:
        if args.trace_prompt:
            prompt = read_trace_prompt(args.trace_prompt, llama.vocab_size)[:trace_context]
        else:
            g = torch.Generator().manual_seed(0)
            prompt = torch.randint(0, llama.vocab_size, (min(max(contexts), trace_context),), generator=g).tolist()
        t = time.perf_counter()
        rt_full = record_real_trace(gqa, sc_gqa, prompt, trace_steps, device, dtype, model_path=args.model_path)
        real_trace = {k: v for k, v in rt_full.items() if k != "selections"}
        real_trace["prompt"] = args.trace_prompt or f"fixed-seed random token ids (seed 0), {len(prompt)} tokens"
        del rt_full
        log(f"real trace: {len(prompt)} tokens, {trace_steps} steps, Top-k overlap mean "
            f"{real_trace['topk_overlap_mean']:.3f} ({time.perf_counter() - t:.1f}s)")
        notes.append(f"real trace recorded from {args.model_path}: real prefill of {len(prompt)} tokens and "
                     f"{trace_steps} greedy decode steps in sparse-gpu mode (benchmark SparseConfig); measured "
                     f"adjacent-step Top-k overlap {real_trace['topk_overlap_mean']:.3f} (mean over sparse layers; "
                     "per layer in real_trace) vs the 0.85 the trace85 rows are calibrated to")
        save()
    for ctx in contexts:
        sweep(gqa, ctx, sc_gqa, "a", *budget_a, modes=modes_for(gqa), real=real)
    if not args.skip_dsv32 and deadline.left() > 60:
        del gqa
        free_memory(device)
        HOST_POOLS.clear()
        free_memory(device)
        fp8_rows = any(m in modes.FP8_LATENT_MODES for m in sweep_modes)
        if args.quick and fp8_rows:  # FP8 latent rows: a latent of whole 128-value tiles, a 16-bit model
            dsv = get_model_config("tiny-dsa-fp8", num_layers=2)
        mla = build_model(config=dsv, device=device, dtype=torch.bfloat16 if fp8_rows else dtype)
        scale = dsv.num_layers / 61 if not args.quick else 1.0
        sc_dsa = SparseConfig(algorithm="dsa", top_k=K if not args.quick else 64,
                              device_buffer_size=2 * (K if not args.quick else 64), page_size=1,
                              min_sparse_prompt_len=0, sink_tokens=64 if not args.quick else 8,
                              recent_tokens=64 if not args.quick else 8,
                              sparse_extra_config={"index_query_dtype": args.index_query_dtype})
        notes.append(f"dsv32-shape: {dsv.num_layers} of 61 layers, so its GPU/host budgets are scaled by "
                     f"{scale:.3f} (capacity as for the full model)")
        pin_host_pools(mla, sc_dsa, [dsv_ctx], budget_a[1] * scale)
        sweep(mla, dsv_ctx, sc_dsa, "a", budget_a[0] * scale, budget_a[1] * scale, modes=modes_for(mla), scale=scale)
        del mla
        HOST_POOLS.clear()
        free_memory(device)
        gqa = None
    if not args.skip_b and contexts and deadline.left() > 60:
        if gqa is None:
            gqa = build_model(model_path=args.model_path, config=llama, device=device, dtype=dtype)
        pin_host_pools(gqa, sc_gqa, contexts, budget_a[1])
        if cuda:
            free_b = torch.cuda.mem_get_info()[0] - 8 * GIB
        else:
            free_b = 4 * budget_a[0]
        notes.append(f"scenario b: GPU KV budget = free HBM after weights minus an 8 GiB working margin = "
                     f"{free_b / GIB:.1f} GiB; host budget 96 GiB")
        notes.append("scenario b has no offload-full rows: offload-full keeps its KV in host memory and "
                     "stages one layer on the GPU, so a larger GPU budget changes nothing for it; its rows "
                     "in scenario a stand for both scenarios")
        for ctx in contexts:
            sweep(gqa, ctx, sc_gqa, "b", free_b, budget_a[1],
                  modes=tuple(m for m in modes_for(gqa) if m != "offload-full"), real=real)
    notes.append("offload-full is swept only up to batch 4 (its capacity is larger): it loads every page "
                 "every step, so its step time grows linearly with batch (PCIe-bound) and its tokens/s is "
                 "flat past batch 2; larger batches would spend the time budget without changing the picture")
    if real:
        notes.append("query traces: 'trace85' (synthetic, calibrated to 85 % adjacent-step Top-k overlap) and "
                     "'real' (the real-weight model's own queries); the dsv32-shape rows keep random weights "
                     "('model'); real_trace holds the recorded real trace's measured overlap")
    else:
        notes.append("query traces: 'trace85' (synthetic, calibrated to 85 % adjacent-step Top-k overlap) and "
                     "'model' (the random-weight model's own queries); no real-weight traces were recorded "
                     "(no --model-path given)")
    lines = []
    for ctx in contexts:
        lines += [f"[{llama.name} {ctx}] " + t for t in targets(rows, caps, ctx, llama.name)]
    notes.extend(lines)
    for line in lines:
        log(line)
    save(final=True)
    png = f"decode_{args.section}.png" if args.section else "decode.png"
    plot(rows, out_dir / png)
    where = f"section {args.section!r} of " if args.section else ""
    log(f"wrote {where}{out_dir / 'decode.json'} and {png}; {deadline.left():.0f}s of budget left")
    return 0


if __name__ == "__main__":
    sys.exit(main())