"""``sparsehi run``: one batch of long prompts through every requested mode, then the
summary table, a JSON file and a PNG plot.

What the agreement columns mean. ``same as dense`` is the free-running share of each
request's generated tokens that match dense before the first difference; greedy decoding
of a random-weight model is chaotic (near-tied logits), so one small attention difference
changes every later token and this number is mostly about luck. ``top-1 vs dense
(forced)`` feeds every mode dense's tokens and compares next-token predictions step by
step: the quality of the sparse approximation itself. ``same as sparse-gpu`` must be
1.000 for sparse-hier: the tiering adds no error, it only moves where the KV lives.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from hicache.host_kv_dtype import kv_cache_namespace_suffix
from hicache.kv_page_format import namespace_suffix
from sparsehi.runtime.checkpoint_identity import check_identity_mode, load_with_identity
from sparsehi.runtime.model_config import ModelConfig
from sparsehi.runtime.runtime_config import RuntimeConfig
from sparsehi.runtime.report import (MIB, RECORDED_SPARSE_FIELDS, forced_agreement, free_running_agreement, plot_run,
                                     prepare_output_dir, summary_table, write_json)
from sparsehi.runtime.run_setup import RunSetup
from sparsehi.runtime.runner import GenerationResult, ModelRunner
from sparsehi.runtime.weights import build_model

logger = logging.getLogger(__name__)

RUN_FILES = ("run.json", "run.png")
"""What ``run_demo`` writes under ``output_dir``."""
CPU_THROUGHPUT_NOTE = (
    "On CPU, tok/s measures the Python overhead of the eager per-layer path, not attention or memory "
    "traffic: it moves by tens of percent between identical runs and can put sparse-gpu ahead of dense. It "
    "is not a stand-in for GPU throughput; the GPU comparison is benchmarks/results/decode.json.")


@dataclass
class DemoConfig(RunSetup):
    context: int = 4096
    batch: int = 2
    decode_tokens: int = 64
    shared_prefix: float = 0.5
    """Share of request 0's prompt that every later request starts with (a common system
    prompt / document): sparse-hier reuses it from the host tier via the HiRadixTree."""
    forced: bool = True
    progress: bool = True
    cache_salt: Optional[str] = None
    """Every request's cache salt (one tenant): its KV is shared only with requests of the
    same salt, in this run and in an L3 backend shared with other runs."""
    l3_checkpoint_identity: str = "metadata"
    """How a ``model_path`` checkpoint is named in the L3 namespace: ``metadata`` or
    ``content`` (``sparsehi.runtime.checkpoint_identity``)."""


def _uses_l3(cfg: DemoConfig) -> bool:
    return ("sparse-hier" in cfg.modes and cfg.hicache is not None
            and cfg.hicache.hicache_storage_backend is not None)


def l3_model_name(cfg: DemoConfig, mcfg: ModelConfig, checkpoint: Optional[str]) -> str:
    """The L3 namespace: everything that changes a page's bytes for the same tokens. The
    model part is a built-in model's fixed name, or a checkpoint's directory name and its
    digest ``checkpoint`` (``checkpoint_identity.checkpoint_digest``), so two checkpoints
    never read each other's pages; then layers, dtype, page size, host layout and, for FP8
    host KV or FP8 latent rows, the page format (an FP8 page is never read as the model's
    dtype)."""
    model = mcfg.name if checkpoint is None else f"{mcfg.name}-{checkpoint[:32]}"
    dtype = str(cfg.dtype).replace("torch.", "")
    name = f"{model}-L{mcfg.num_layers}-{dtype}-p{cfg.sparse.page_size}-{cfg.host_layout}"
    return name + namespace_suffix(cfg.sparse.host_kv_dtype) + kv_cache_namespace_suffix(cfg.sparse.kv_cache_dtype)


def _l3_backend(cfg: DemoConfig, name: str, is_mla: bool) -> tuple[Any, Any]:
    """The ``--hicache-storage-backend`` backend (namespace ``name``) and prefetch policy
    for sparse-hier."""
    from hicache.storage_controller import StoragePolicy
    from hicache.storage_setup import backend_from_config

    hc = cfg.hicache
    return backend_from_config(hc, is_mla=is_mla, model_name=name), StoragePolicy.from_config(hc)


def _load_model(cfg: DemoConfig) -> tuple[Any, Optional[str]]:
    """The model and, for a ``model_path`` checkpoint this run stores in L3, its digest."""
    def load():
        return build_model(cfg.model, model_path=cfg.model_path, device=cfg.device, dtype=cfg.dtype,
                           num_layers=cfg.num_layers)

    if cfg.model_path is None or not _uses_l3(cfg):
        return load(), None
    if cfg.l3_checkpoint_identity == "content":
        print(f"reading every weight of {cfg.model_path} for its L3 namespace (--l3-checkpoint-identity content)")
    return load_with_identity(cfg.model_path, cfg.l3_checkpoint_identity, load)


def make_prompts(vocab: int, batch: int, context: int, seed: int, shared_prefix: float = 0.0) -> list[list[int]]:
    """Fixed-seed random prompts (token ids uniform over the vocabulary); requests after
    the first start with the first one's leading ``shared_prefix`` share."""
    if not 0.0 <= shared_prefix < 1.0:
        raise ValueError(f"shared_prefix must be in [0, 1), got {shared_prefix}")
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(0, vocab, (context,), generator=g).tolist() for _ in range(batch)]
    n = int(context * shared_prefix)
    for p in out[1:]:
        p[:n] = out[0][:n]
    return out


def _mode_row(mode: str, res: GenerationResult, spec_token_bytes: int) -> dict[str, Any]:
    st = res.stats or {}
    row: dict[str, Any] = {
        "mode": mode, "decode_tokens_per_s": res.decode_tokens_per_s, "prefill_s": res.prefill_s,
        "decode_s": res.decode_s, "gpu_kv_mib": res.memory.get("gpu_kv_bytes", 0) / MIB,
        "host_kv_mib": res.memory.get("host_kv_bytes", 0) / MIB,
        "representation_mib": res.memory.get("representation_bytes", 0) / MIB,
        "hit_rate": None, "mib_loaded_per_step": None,
    }
    series: Optional[list[float]] = None
    if mode == "sparse-hier" and st.get("per_step") is not None:
        row["hit_rate"] = st["hit_rate"]
        row["per_layer_hit_rate"] = st["per_layer_hit_rate"]
        series = [sum(s["bytes_loaded"]) / MIB for s in st["per_step"]]
    elif mode == "offload-full" and "per_step_bytes" in st:
        series = [b / MIB for b in st["per_step_bytes"]]
    elif mode in ("dense", "sparse-gpu"):
        series = None
        row["mib_loaded_per_step"] = 0.0
    if series:
        row["mib_loaded_per_step"] = sum(series) / len(series)
        row["mib_loaded_per_step_series"] = series
    return row


def _kernel_path_note(cfg: DemoConfig, on_cpu: bool) -> str:
    """Which kernels the run's decode steps use, for the header and the JSON."""
    return ("CPU: kernels run their plain-torch reference implementations (by design; the Triton "
            "kernels run on CUDA and are tested under the interpreter)") if on_cpu else \
        ("CUDA: Triton kernels (paged decode, LRU diff, swap-in copy, scoring); decode steps "
         + ("replay CUDA graphs (one per batch bucket)" if cfg.cuda_graph else "run eagerly (--no-cuda-graph)"))


def _runtime_config(cfg: DemoConfig, mode: str, max_ctx: int, storage: Any, policy: Any) -> RuntimeConfig:
    """The runner's config for ``mode``; ``storage`` / ``policy`` are the L3 backend and its
    prefetch policy, or None."""
    return RuntimeConfig(mode=mode, sparse=replace(cfg.sparse), device=cfg.device, dtype=cfg.dtype,
                         max_num_reqs=cfg.batch, max_context_len=max_ctx, adapter=cfg.adapter,
                         host_layout=cfg.host_layout, prefix_cache=True, cuda_graph=cfg.cuda_graph,
                         overlap_schedule=cfg.overlap_schedule,
                         storage=storage, storage_policy=policy,
                         host_kv_gb=float(cfg.hicache.hicache_size) if cfg.hicache is not None else 0.0)


def _generate_mode(cfg: DemoConfig, model: Any, mode: str, rt: RuntimeConfig, prompts: list[list[int]],
                   dense_tokens: Optional[list[list[int]]], tqdm: Any, l3: bool
                   ) -> tuple[GenerationResult, Optional[GenerationResult], dict[str, Any], int]:
    """``mode``'s free-running generation and, given ``dense_tokens``, its forced one (every
    step fed dense's token). Returns (result, forced result or None, L3 stats, KV bytes per
    token)."""
    do_forced = dense_tokens is not None
    total = (cfg.batch + cfg.decode_tokens) * (2 if do_forced else 1)
    bar = tqdm(total=total, desc=f"{mode:>12}", unit="step", leave=True, disable=not cfg.progress) if tqdm else None
    progress = (lambda phase, n: bar.update(n)) if bar is not None else None
    runner = ModelRunner(model, rt)
    token_bytes = runner.mode.spec.token_bytes
    salts = [cfg.cache_salt] * len(prompts)
    res = runner.generate(prompts, cfg.decode_tokens, progress=progress, cache_salts=salts)
    forced_res = None
    if do_forced:
        fr = ModelRunner(model, replace(rt, sparse=replace(cfg.sparse)))
        forced_res = fr.generate(prompts, cfg.decode_tokens, progress=progress, cache_salts=salts,
                                 force_tokens=[t[:-1] for t in dense_tokens])
        fr.mode.close()
    l3_stats = runner.mode.l3_stats() if l3 else {}
    runner.mode.close()
    if bar is not None:
        bar.close()
    return res, forced_res, l3_stats, token_bytes


def _result_row(mode: str, res: GenerationResult, token_bytes: int, l3_stats: dict[str, Any], storage: Any,
                results: dict[str, GenerationResult], forced: dict[str, GenerationResult]) -> dict[str, Any]:
    """``mode``'s summary row: its numbers, L3 counters and agreement with the modes run so far."""
    row = _mode_row(mode, res, token_bytes)
    row["prefix_reused_tokens"] = sum(res.prefix_hits)
    if l3_stats:
        row.update(l3_stats)
        # the backend's own counters over the command (gets, hits, faults, corrupt pages
        # served as misses, ...): what a later process reads to tell a torn store from a clean one
        row["l3_storage_stats"] = storage.stats.as_dict()
    if "dense" in results:
        row["agree_dense_free"] = free_running_agreement(res.tokens, results["dense"].tokens)
        row["agree_dense_forced"] = (forced_agreement(forced[mode].tokens, results["dense"].tokens)
                                     if mode in forced else (1.0 if mode == "dense" else None))
    if "sparse-gpu" in results:
        row["agree_sparse_gpu"] = free_running_agreement(res.tokens, results["sparse-gpu"].tokens)
    return row


def _run_notes(cfg: DemoConfig, mcfg: ModelConfig, rows: list[dict[str, Any]],
               results: dict[str, GenerationResult], l3_name: Optional[str], on_cpu: bool) -> list[str]:
    """The notes printed under the table and stored in the JSON."""
    notes = [
        "tok/s: decode tokens per second over the batch (prefill excluded)." + (" " + CPU_THROUGHPUT_NOTE if on_cpu else ""),
        "hit rate: share of Top-k pages already in the request's GPU LRU buffer (sparse-hier only).",
        "loaded MiB/step: host->device bytes per decode step, all layers (offload-full loads the whole context).",
        "GPU KV MiB: peak KV held on the device during decode (device pool pages in use; sparse-hier: sink + "
        "recent ring + LRU buffer pages, plus the dense layers' full KV; offload-full: its one-layer staging). "
        "Algorithm representations are extra (JSON: representation_mib).",
        "same as dense / same as sparse-gpu: free-running share of identical leading tokens. Greedy decoding "
        "of random weights is chaotic (near-tied logits), so any attention difference soon changes all later "
        "tokens; 'top-1 vs dense (forced)' feeds every mode dense's tokens and compares next-token "
        "predictions step by step, which measures the sparse approximation. sparse-hier must equal sparse-gpu "
        "(1.000): tiering moves the KV, it adds no error.",
    ]
    if mcfg.qk_tie > 0:
        notes.append(f"{mcfg.name} is initialised with tied, scaled q/k projections (qk_tie={mcfg.qk_tie}, "
                     f"qk_gain={mcfg.qk_gain}) so attention is peaky like a trained model's; random prompts make "
                     f"Top-k track the current token, so adjacent-step overlap is lower than in real models.")
    hier = next((r for r in rows if r["mode"] == "sparse-hier"), None)
    if hier is not None and "l3_hit_tokens" in hier:
        notes.append(f"L3 ({cfg.hicache.hicache_storage_backend}, {cfg.hicache.hicache_storage_prefetch_policy}): "
                     f"sparse-hier prefetched {hier['l3_hit_tokens']} prompt tokens "
                     f"({hier['l3_bytes_fetched'] / MIB:.2f} MiB) from L3 instead of recomputing them and wrote "
                     f"{hier['l3_pages_written']} new pages ({hier['l3_bytes_written'] / MIB:.2f} MiB) to it, "
                     f"namespace {l3_name}")
    if hier is not None and "lmcache_imported_tokens" in hier:
        notes.append(f"LMCache interop: {hier['lmcache_imported_tokens']} tokens of KV LMCache held in its "
                     f"connectors' chunk format were imported into L3 before the prefetch; "
                     f"{hier['lmcache_exported_tokens']} tokens were written to LMCache as its chunks (its own "
                     f"lookup/retrieve find them)")
    if "sparse-hier" in results and cfg.shared_prefix > 0 and cfg.batch > 1:
        notes.append(f"prefix reuse: requests 1.. share {cfg.shared_prefix:.0%} of request 0's prompt; sparse-hier "
                     f"matched {sum(results['sparse-hier'].prefix_hits)} prompt tokens in the HiRadixTree and loaded "
                     f"their KV from the host tier instead of recomputing it; the host keeps one copy of the "
                     f"shared pages (host KV MiB)" + (
                         ". On CUDA (bf16) prefilling only the new tokens rounds differently from the other modes' "
                         "full prefill (different GEMM/attention kernel shapes), so late tokens can drift from "
                         "sparse-gpu; --shared-prefix 0 gives bit-identical sparse-hier and sparse-gpu tokens"
                         if not on_cpu and sum(results["sparse-hier"].prefix_hits) else ""))
    return notes


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Run every mode; print the table; write ``run.json`` and ``run.png`` under
    ``cfg.output_dir`` (checked before any work). Returns the JSON payload."""
    check_identity_mode(cfg.l3_checkpoint_identity)
    out = prepare_output_dir(cfg.output_dir, RUN_FILES)
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    model, checkpoint = _load_model(cfg)
    mcfg = model.cfg
    if mcfg.family == "mla" and cfg.sparse.page_size != 1:
        raise ValueError(f"--page-size must be 1 for the MLA/DSA model {mcfg.name} (token-wise selection)")
    prompts = make_prompts(mcfg.vocab_size, cfg.batch, cfg.context, cfg.seed, cfg.shared_prefix)
    max_ctx = cfg.context + cfg.decode_tokens + 1
    order = [m for m in ("dense", "sparse-gpu", "sparse-hier", "offload-full") if m in cfg.modes]
    on_cpu = torch.device(cfg.device).type == "cpu"
    path_note = _kernel_path_note(cfg, on_cpu)
    print(f"sparsehi run: model {mcfg.name} ({mcfg.note}); context {cfg.context}, batch {cfg.batch}, "
          f"{cfg.decode_tokens} decode steps; algorithm {cfg.sparse.algorithm}, top_k {cfg.sparse.top_k} tokens, "
          f"buffer {cfg.sparse.device_buffer_size} tokens, page {cfg.sparse.page_size}")
    print(path_note)
    results: dict[str, GenerationResult] = {}
    forced: dict[str, GenerationResult] = {}
    rows: list[dict[str, Any]] = []
    per_mode: dict[str, dict[str, Any]] = {}
    l3_name = l3_model_name(cfg, mcfg, checkpoint) if _uses_l3(cfg) else None
    storage, policy = _l3_backend(cfg, l3_name, mcfg.family == "mla") if l3_name else (None, None)
    for mode in order:
        l3 = mode == "sparse-hier" and storage is not None
        rt = _runtime_config(cfg, mode, max_ctx, storage if l3 else None, policy if l3 else None)
        do_forced = cfg.forced and mode != "dense" and "dense" in results
        dense_tokens = results["dense"].tokens if do_forced else None
        res, forced_res, l3_stats, token_bytes = _generate_mode(cfg, model, mode, rt, prompts, dense_tokens, tqdm, l3)
        results[mode] = res
        if forced_res is not None:
            forced[mode] = forced_res
        row = _result_row(mode, res, token_bytes, l3_stats, storage, results, forced)
        rows.append(row)
        per_mode[mode] = {**row, "per_step": (res.stats or {}).get("per_step")}
    if storage is not None:
        storage.close()  # connections only: what this run wrote stays for the next one
    print()
    print(summary_table(rows))
    notes = _run_notes(cfg, mcfg, rows, results, l3_name, on_cpu)
    for n in notes:
        if n:
            print("  * " + n)
    payload = {
        "model": mcfg.name, "model_note": mcfg.note, "context": cfg.context, "batch": cfg.batch,
        "decode_tokens": cfg.decode_tokens, "device": str(cfg.device),
        "device_name": torch.cuda.get_device_name() if not on_cpu else "cpu",
        "sparse_config": {k: getattr(cfg.sparse, k) for k in RECORDED_SPARSE_FIELDS},
        "kernel_path": path_note, "rows": rows, "notes": notes,
        "per_step": {m: d.get("per_step") for m, d in per_mode.items() if d.get("per_step")},
        "tokens": {m: r.tokens for m, r in results.items()},
        "l3_model_name": l3_name,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    jp = write_json(out / "run.json", payload)
    pp = plot_run(out / "run.png", per_mode, f"{mcfg.name}, context {cfg.context}, batch {cfg.batch}, "
                                               f"{cfg.sparse.algorithm} top_k {cfg.sparse.top_k}")
    print(f"\nwrote {jp}" + (f" and {pp}" if pp else ""))
    return payload
