"""`sparsehi` console script: ``sparsehi run`` (the long-context decode demo, every mode
side by side) and ``sparsehi bench`` (sweeps of context x batch x mode)."""
from __future__ import annotations

import argparse
import sys
from typing import Optional

import torch

from hicache.config import HOST_LAYOUTS, HiCacheConfig, check_layout_io
from hicache.host_kv_dtype import HOST_KV_DTYPES, KV_CACHE_DTYPES
from sparsehi.config import IO_BACKENDS, SparseConfig
from sparsehi.kernels.lru_diff import MAX_SLOTS

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FLAG_OF = {"device_buffer_size": "--buffer-size", "top_k": "--top-k", "page_size": "--page-size",
            "sink_tokens": "--sink-tokens", "recent_tokens": "--recent-tokens", "io_backend": "--io-backend",
            "host_to_device_ratio": "--hicache-ratio", "host_kv_dtype": "--host-kv-dtype",
            "lookahead_tokens": "--lookahead-tokens", "kv_cache_dtype": "--kv-cache-dtype"}


def _positive(name: str):
    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be > 0, got {v}")
        return v
    return conv


def _nonneg(name: str):
    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if v < 0:
            raise argparse.ArgumentTypeError(f"{name} must be >= 0, got {v}")
        return v
    return conv


def _fraction(name: str):
    def conv(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not 0.0 <= v < 1.0:
            raise argparse.ArgumentTypeError(f"{name} must be in [0, 1), got {v}")
        return v
    return conv


def _int_list(name: str):
    def conv(text: str) -> list[int]:
        try:
            vals = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a comma list of integers, got {text!r}") from None
        if not vals or any(v <= 0 for v in vals):
            raise argparse.ArgumentTypeError(f"{name} must hold integers > 0, got {text!r}")
        return vals
    return conv


def _salt(text: str) -> str:
    if not text or "\x00" in text:
        raise argparse.ArgumentTypeError(f"--cache-salt must be a non-empty string without NUL, got {text!r}")
    return text


def _modes(text: str) -> list[str]:
    from sparsehi.runtime.runtime_config import parse_modes

    try:
        return parse_modes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_common(p: argparse.ArgumentParser) -> None:
    """The flags ``run`` and ``bench`` share, in four groups (their order in --help)."""
    _add_model_args(p)
    _add_sparse_args(p)
    _add_tier_args(p)
    _add_execution_args(p)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from sparsehi.runtime.model_config import BUILTIN_CONFIGS

    g = p.add_argument_group("model")
    g.add_argument("--model", choices=sorted(BUILTIN_CONFIGS), default="tiny-gqa",
                   help="built-in config with fixed-seed random weights (default: tiny-gqa). tiny-gqa / tiny-dsa "
                        "are CPU-sized; llama-8b-shape and dsv32-shape have real attention shapes (fewer layers / "
                        "smaller MLP, stated in the output)")
    g.add_argument("--model-path", default=None,
                   help="local HF-layout Llama / Qwen2 / Mistral checkpoint directory (config.json + "
                        "model*.safetensors; plain RoPE or Llama-3.1 llama3 rope scaling; no sliding window); "
                        "checked before the run starts; overrides --model")
    g.add_argument("--num-layers", type=_positive("--num-layers"), default=None,
                   help="override the built-in config's layer count")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the random prompt token ids (default 0); the built-in models' random weights "
                        "have their own fixed seed")


def _add_sparse_args(p: argparse.ArgumentParser) -> None:
    from sparsehi.runtime.runtime_config import ADAPTERS, MODE_HELP

    g = p.add_argument_group("sparse attention")
    g.add_argument("--modes", type=_modes, default=None,
                   help="comma list or 'all' (default all): " + "; ".join(f"{k}: {v}" for k, v in MODE_HELP.items()))
    g.add_argument("--algorithm", default="auto",
                   help="Top-k algorithm: quest, oracle, dsa or 'module:Class' (default auto: quest for GQA "
                        "models, dsa for MLA models)")
    g.add_argument("--top-k", type=_positive("--top-k"), default=None,
                   help="tokens selected per step and layer, sink and recent window excluded; below the context "
                        "(bench: below every --contexts value) (default: context/16, at least 64, at most 2048, "
                        "below the context)")
    g.add_argument("--buffer-size", type=_positive("--buffer-size"), default=None,
                   help="tokens of GPU LRU buffer per request and layer, >= --top-k (default 4 x top-k, at most "
                        "the longest prompt + decode tokens)")
    g.add_argument("--page-size", type=_positive("--page-size"), default=None,
                   help="tokens per KV page, a power of two (default 16 for GQA, 1 for MLA/DSA, which is token-wise)")
    g.add_argument("--sink-tokens", type=_nonneg("--sink-tokens"), default=64,
                   help="leading tokens always attended (default 64)")
    g.add_argument("--recent-tokens", type=_positive("--recent-tokens"), default=64,
                   help="trailing tokens always attended (default 64)")
    g.add_argument("--lookahead-tokens", type=_nonneg("--lookahead-tokens"), default=0,
                   help="sparse-hier: tokens (whole pages) ranked after the top-k that each sparse layer loads into "
                        "its GPU buffer on a side stream for the next step, off the critical path; top-k plus this "
                        "must fit in --buffer-size (default 0: off)")
    g.add_argument("--adapter", choices=ADAPTERS, default=None,
                   help="attention backend adapter for sparse decode: none = the coordinator's torch attention over "
                        "the selected pages; auto = flashattention (GQA) / dsa (MLA) (default: auto on CUDA, none "
                        "on CPU)")


def _add_tier_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("memory tiers")
    g.add_argument("--host-layout", choices=HOST_LAYOUTS, default=None,
                   help="host KV pool layout (default layer_first; SGLang's name: --hicache-mem-layout)")
    g.add_argument("--io-backend", choices=IO_BACKENDS, default=None,
                   help="host->device loads: kernel (Triton zero-copy gather) or direct (default kernel; SGLang's "
                        "name: --hicache-io-backend)")
    g.add_argument("--host-kv-dtype", choices=HOST_KV_DTYPES, default=None,
                   help="KV in the host pool and L3: auto (the model's dtype, the default) or fp8_e4m3 (E4M3 pages "
                        "with per-page, per-head power-of-two scales: half the host and PCIe bytes; the host layout "
                        "defaults to page_first; also spelt --hicache-host-kv-dtype)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="the KV cache on GPU, host "
                   "and L3: auto or fp8_e4m3 (MLA: FP8 latent rows, FlashMLA's layout; docs/fp8_host_kv.md)")
    HiCacheConfig.add_cli_args(p)
    # The layout and io flags above are the same settings under SGLang's names: unset here,
    # so _hicache_config can tell a given flag from a default and reject two that disagree.
    p.set_defaults(hicache_mem_layout=None, hicache_io_backend=None, hicache_host_kv_dtype=None)
    # unset too, so a flag the user gave can be checked against the modes it applies to
    p.set_defaults(hicache_ratio=None, hicache_size=None)
    _reword_hicache_help(p)


def _reword_hicache_help(p: argparse.ArgumentParser) -> None:
    """HiCacheConfig's flags keep SGLang's names; their help says what each means here."""
    for a in p._actions:
        if a.dest == "hicache_storage_backend":
            a.help = ("L3 storage below the host pool (sparse-hier): prefixes written by one run are prefetched by "
                      "the next instead of recomputed (default: none)")
        elif a.dest == "hicache_storage_prefetch_policy":
            a.help = "when a prefetch from L3 is taken: best_effort, wait_complete or timeout (default best_effort)"
        elif a.dest in ("hicache_mem_layout", "hicache_io_backend", "hicache_host_kv_dtype"):
            ours = {"hicache_mem_layout": "host-layout", "hicache_io_backend": "io-backend",
                    "hicache_host_kv_dtype": "host-kv-dtype"}[a.dest]
            a.help = (f"the --hicache-* spelling of --{ours}" if a.dest == "hicache_host_kv_dtype"
                      else f"SGLang's name for --{ours}")
        elif a.dest == "hicache_write_policy":
            a.help = ("when device KV is copied to host: only write_through here (the host modes write every "
                      "prefilled page to the host pool at once; write_through_selective and write_back need a "
                      "device-resident prefix cache, which no mode has)")
        elif a.dest == "enable_hierarchical_cache":
            a.help = ("SGLang's switch for the host tier; here the host modes (sparse-hier, offload-full) always have "
                      "it: accepted when --modes runs one of them")
        elif a.dest == "hicache_ratio":
            a.help = ("host pool size / the KV the running requests can hold (SGLang: / the device pool), > 1 "
                      "(default 2); host modes")
        elif a.dest == "hicache_size":
            a.help = "host pool size in GB (1e9 bytes); overrides --hicache-ratio (default 0: use the ratio); host modes"


def _add_execution_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("execution")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: cuda when available)")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="auto",
                   help="model and KV dtype (default auto: bfloat16 on CUDA, float32 on CPU)")
    g.add_argument("--no-cuda-graph", action="store_true",
                   help="run decode steps eagerly instead of replaying CUDA graphs (for debugging; the same "
                        "kernels run, only launched one by one; graphs need a CUDA device)")
    g.add_argument("--disable-overlap-schedule", action="store_true",
                   help="wait for every decode step before preparing the next (SGLang's flag); by default the "
                        "host part of step t+1 runs while step t runs on the device, with the same tokens")
    g.add_argument("--threads", type=_positive("--threads"), default=1,
                   help="torch CPU threads (default 1: the tiny models' small matmuls run fastest, and "
                        "unaffected by other load, on one thread)")
    g.add_argument("--output-dir", default="outputs",
                   help="where JSON and PNG files go, created if missing and checked for writing before the run "
                        "starts (default outputs/)")


def _fail(parser: argparse.ArgumentParser, message: str) -> None:
    """Stop with one line and exit code 2 (argparse's code for bad arguments). For files
    and directories that are wrong, where the usage text would not help."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def _sizes(args: argparse.Namespace, parser: argparse.ArgumentParser, page: int, context_flag: str,
           shortest: int, longest: int) -> tuple[int, int]:
    """(top_k, device_buffer_size) in tokens. ``shortest`` is the smallest prompt the run
    decodes (``context_flag`` sets it), ``longest`` the largest sequence (prompt + decode).

    A given ``--top-k`` must be below the context: at or above it, sparse attention selects
    every token and only costs more GPU memory than dense. The default top-k (context/16,
    in [64, 2048]) is lowered below the context. A given top-k above the LRU diff kernel's
    buffer limit is blamed on --top-k. The default buffer (4 x top-k) is capped at the
    kernel limit and at the longest sequence, where more slots could never be used.
    """
    limit = MAX_SLOTS * page
    below = (shortest - 1) // page * page  # largest whole-page top-k below the context
    if args.top_k is not None:
        if args.top_k % page:
            parser.error(f"--top-k {args.top_k} must be a multiple of --page-size {page} (tokens, whole pages)")
        if args.top_k >= shortest:
            where = f"--context {shortest}" if context_flag == "--context" else \
                f"every --contexts value (the smallest is {shortest})"
            parser.error(f"--top-k {args.top_k} must be below {where}: it selects tokens out of the prompt, and "
                         f"at or above it every token is attended (use --modes dense for that)")
        if args.top_k > limit:
            parser.error(f"--top-k {args.top_k} is above the LRU buffer limit of {MAX_SLOTS} pages of "
                         f"--page-size {page} = {limit} tokens")
        top_k = args.top_k
    else:
        if below < page:
            parser.error(f"{context_flag} {shortest} is too short for sparse attention with --page-size {page}: "
                         f"top-k needs at least one page below the context")
        top_k = min(max(64, min(2048, shortest // 16)) // page * page, below)
        top_k = max(page, top_k)
    if args.buffer_size is not None:
        return top_k, args.buffer_size
    rounded_longest = -(-longest // page) * page
    return top_k, max(top_k, min(4 * top_k, limit, rounded_longest))


def _resolve(args: argparse.Namespace, parser: argparse.ArgumentParser, context_flag: str, shortest: int,
             longest: int, output_files: tuple[str, ...]):
    """Check every option against the others before any work: device, checkpoint, sizes,
    algorithm, output directory. Returns (device, dtype, SparseConfig)."""
    from sparsehi.runtime.model_config import get_model_config
    from sparsehi.runtime.report import prepare_output_dir
    from sparsehi.runtime.weights import CheckpointError, check_hf_checkpoint

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {device}: CUDA is not available on this machine (use --device cpu)")
    if not (device == "cpu" or device.startswith("cuda")):
        parser.error(f"--device must be cpu, cuda, cuda:N or auto, got {device!r}")
    fp8_rows = args.kv_cache_dtype == "fp8_e4m3"  # the FP8 decode kernel's dots run in bf16 / fp16: its default
    dtype = DTYPES[args.dtype] or (torch.bfloat16 if device.startswith("cuda") or fp8_rows else torch.float32)
    if args.model_path is None:
        family = get_model_config(args.model).family
    else:
        try:
            family = check_hf_checkpoint(args.model_path).family
        except CheckpointError as e:
            _fail(parser, f"--model-path {e}")
    if fp8_rows and (family != "mla" or "offload-full" in (args.modes or ())):
        parser.error("--kv-cache-dtype fp8_e4m3 is for MLA models in the modes dense, sparse-gpu and sparse-hier "
                     "(FP8 host KV for GQA models: --host-kv-dtype fp8_e4m3)")
    algorithm = args.algorithm if args.algorithm != "auto" else ("dsa" if family == "mla" else "quest")
    page = args.page_size or (1 if family == "mla" else 16)
    if family == "mla" and page != 1:
        parser.error(f"--page-size must be 1 for the MLA/DSA model {args.model} (DSA selects tokens)")
    top_k, buf = _sizes(args, parser, page, context_flag, shortest, longest)
    args.hicache_config = _hicache_config(args, parser, page)
    try:
        hc = args.hicache_config
        ratio = {} if hc.hicache_size > 0 else {"host_to_device_ratio": float(hc.hicache_ratio)}
        sc = SparseConfig(algorithm=algorithm, top_k=top_k, device_buffer_size=buf, page_size=page,
                          min_sparse_prompt_len=0, sink_tokens=args.sink_tokens, recent_tokens=args.recent_tokens,
                          io_backend=args.io_backend, host_kv_dtype=args.host_kv_dtype,
                          lookahead_tokens=args.lookahead_tokens, kv_cache_dtype=args.kv_cache_dtype, **ratio)
    except ValueError as e:
        msg = str(e)
        for field_name, flag in _FLAG_OF.items():
            msg = msg.replace(f"SparseConfig.{field_name}", flag).replace(field_name, flag)
        parser.error(msg)
    from sparsehi.algorithms.dsa import DSAAlgorithm
    from sparsehi.algorithms.registry import create_algorithm, resolve_algorithm

    try:
        cls = resolve_algorithm(algorithm)
        # constructing checks the algorithm's own constraints (Quest: page >= 2; token-wise: page 1)
        create_algorithm(sc, "cpu")
    except ValueError as e:
        parser.error(f"--algorithm {algorithm}: {e}")
    model_name = args.model_path or args.model
    if family == "mla" and not issubclass(cls, DSAAlgorithm):
        parser.error(f"--algorithm {algorithm}: the MLA model {model_name} selects with its lightning indexer, "
                     f"so it runs only dsa (or a DSAAlgorithm subclass)")
    if family != "mla" and issubclass(cls, DSAAlgorithm):
        parser.error(f"--algorithm {algorithm}: dsa needs an MLA model with a lightning indexer "
                     f"(tiny-dsa, dsv32-shape); {model_name} is GQA")
    try:
        prepare_output_dir(args.output_dir, output_files)
    except ValueError as e:
        _fail(parser, f"--output-dir {e}")
    if args.adapter is None:
        args.adapter = "auto" if device.startswith("cuda") or fp8_rows else "none"
    return device, dtype, sc


def _same_setting(args: argparse.Namespace, parser: argparse.ArgumentParser, ours: str, sglang: str,
                  default: str) -> str:
    """One setting given under our flag name or SGLang's: both given must agree."""
    a, b = getattr(args, ours), getattr(args, sglang)
    if a is not None and b is not None and a != b:
        parser.error(f"--{ours.replace('_', '-')} {a} and --{sglang.replace('_', '-')} {b} name the same setting "
                     f"and disagree: give one of them")
    return a or b or default


def _check_hicache_modes(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Each ``--hicache-*`` flag the user gave must apply to a mode this command runs (with
    SGLang's meaning), else it is rejected naming the flag and the modes it applies to."""
    from sparsehi.runtime.runtime_config import HOST_MODES, RUNTIME_MODES

    modes = args.modes or list(RUNTIME_MODES)
    given = [flag for flag, on in (("--enable-hierarchical-cache", args.enable_hierarchical_cache),
                                   ("--hicache-ratio", args.hicache_ratio is not None),
                                   ("--hicache-size", args.hicache_size is not None)) if on]
    if given and not any(m in HOST_MODES for m in modes):
        parser.error(f"{given[0]} sizes the host KV tier, which only the modes {', '.join(HOST_MODES)} have; "
                     f"--modes {','.join(modes)} runs none of them")
    if args.hicache_write_policy != "write_through":
        parser.error(f"--hicache-write-policy {args.hicache_write_policy} cannot apply: the host modes "
                     f"({', '.join(HOST_MODES)}) copy every prefilled page to the host pool at once, as their decode "
                     f"reads KV there (write_through); write_through_selective and write_back keep KV on the device "
                     f"until a hit or an eviction, which needs a device-resident prefix cache that no mode of "
                     f"sparsehi {args.command} has. Use write_through (the default)")
    if args.hicache_storage_backend is not None:
        if args.command != "run":
            parser.error(f"--hicache-storage-backend applies to sparsehi run (its sparse-hier mode reuses prompt "
                         f"prefixes through the prefix tree and L3); sparsehi {args.command} runs without the "
                         f"prefix tree")
        if "sparse-hier" not in modes:
            parser.error(f"--hicache-storage-backend applies to the sparse-hier mode (its prefix tree reads and "
                         f"writes L3); --modes {','.join(modes)} does not run it")


def _check_checkpoint_identity(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """``--l3-checkpoint-identity`` (default metadata); given, it must have a checkpoint to
    name and an L3 backend to name it in."""
    mode = args.l3_checkpoint_identity
    if mode is not None and (args.model_path is None or args.hicache_storage_backend is None):
        missing = "--model-path" if args.model_path is None else "--hicache-storage-backend"
        parser.error(f"--l3-checkpoint-identity {mode} names a --model-path checkpoint in an L3 backend's "
                     f"namespace; without {missing} there is none (built-in models have a fixed name)")
    return mode or "metadata"


def _check_host_size(args: argparse.Namespace, parser: argparse.ArgumentParser, sc: SparseConfig,
                     device: str, dtype: torch.dtype, batch: int, max_context_len: int) -> None:
    """``--hicache-size`` must hold the live requests' KV and the algorithm's per-token state
    (the runtime's own rule, checked before any work)."""
    hc = args.hicache_config
    if hc.hicache_size <= 0:
        return
    from dataclasses import replace as _replace

    from sparsehi.runtime.runtime_mode import host_token_bytes
    from sparsehi.runtime.model_config import get_model_config
    from sparsehi.runtime.runtime_config import RuntimeConfig
    from sparsehi.runtime.weights import check_hf_checkpoint

    mcfg = get_model_config(args.model) if args.model_path is None else check_hf_checkpoint(args.model_path)
    if args.num_layers is not None:
        mcfg = _replace(mcfg, num_layers=args.num_layers)
    from sparsehi.algorithms.registry import create_algorithm

    extra = dict(sc.sparse_extra_config)
    if mcfg.family == "mla":
        extra.setdefault("index_head_dim", mcfg.index_head_dim)
    state = create_algorithm(_replace(sc, sparse_extra_config=extra), device).token_state_bytes()
    rt = RuntimeConfig(mode="sparse-hier", sparse=sc, max_num_reqs=batch, max_context_len=max_context_len,
                       host_kv_gb=hc.hicache_size, host_layout=args.host_layout)
    try:
        kv = host_token_bytes(mcfg, dtype, sc.host_kv_dtype, sc.page_size, sc.kv_cache_dtype)
        rt.host_tokens(kv + mcfg.num_layers * state, mcfg.name)
    except ValueError as e:
        parser.error(str(e))


def _hicache_config(args: argparse.Namespace, parser: argparse.ArgumentParser, page: int) -> HiCacheConfig:
    """The ``--hicache-*`` flags as a validated HiCacheConfig (page size: the run's). Also
    settles ``args.host_layout`` / ``args.io_backend`` from either name of each."""
    _check_hicache_modes(args, parser)
    args.host_kv_dtype = _same_setting(args, parser, "host_kv_dtype", "hicache_host_kv_dtype", "auto")
    fp8 = args.host_kv_dtype == "fp8_e4m3"  # FP8 page records live in page_first
    args.host_layout = _same_setting(args, parser, "host_layout", "hicache_mem_layout",
                                     "page_first" if fp8 else "layer_first")
    args.io_backend = _same_setting(args, parser, "io_backend", "hicache_io_backend", "kernel")
    try:
        check_layout_io(args.host_layout, args.io_backend, "--host-layout", "--io-backend")
    except ValueError as e:
        parser.error(str(e))
    try:
        hc = HiCacheConfig(
            enable_hierarchical_cache=args.enable_hierarchical_cache,
            hicache_ratio=2.0 if args.hicache_ratio is None else args.hicache_ratio,
            hicache_size=0 if args.hicache_size is None else args.hicache_size, page_size=page, hicache_write_policy=args.hicache_write_policy,
            hicache_io_backend=args.io_backend, hicache_mem_layout=args.host_layout,
            hicache_host_kv_dtype=args.host_kv_dtype,
            hicache_storage_backend=args.hicache_storage_backend,
            hicache_storage_prefetch_policy=args.hicache_storage_prefetch_policy,
            hicache_storage_backend_extra_config=args.hicache_storage_backend_extra_config)
        if hc.hicache_storage_backend is not None:
            from hicache.storage_controller import StoragePolicy

            from hicache.storage_setup import check_backend_options

            StoragePolicy.from_config(hc)  # bad prefetch keys fail here, before any work
            check_backend_options(hc)
    except ValueError as e:
        parser.error(str(e))
    if hc.hicache_storage_backend is not None and hc.hicache_mem_layout == "layer_first":
        parser.error(f"--hicache-storage-backend {hc.hicache_storage_backend} stores whole pages of the host pool: "
                     "use --host-layout (--hicache-mem-layout) page_first with --io-backend kernel, or "
                     "page_first_direct with --io-backend direct, not layer_first")
    return hc


def build_parser() -> argparse.ArgumentParser:
    from sparsehi.runtime.checkpoint_identity import IDENTITY_MODES

    parser = argparse.ArgumentParser(
        prog="sparsehi",
        description="Hierarchical sparse attention: full KV in host memory, a per-request LRU buffer of Top-k "
                    "pages on the GPU. 'run' compares the four modes on one batch; 'bench' sweeps.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,bench}")
    run = sub.add_parser("run", help="long-context decode demo: every mode on one batch, summary table, JSON, PNG",
                         description="Prefill a batch of long random prompts, decode greedily in each mode "
                                     "(dense, sparse-gpu, sparse-hier, offload-full) and compare tokens/s, buffer "
                                     "hit rate, load volume, KV memory and token agreement.")
    run.add_argument("--context", type=_positive("--context"), default=4096, help="prompt tokens (default 4096)")
    run.add_argument("--batch", type=_positive("--batch"), default=2, help="requests decoded together (default 2)")
    run.add_argument("--decode-tokens", type=_positive("--decode-tokens"), default=64,
                     help="decode steps per request (default 64)")
    run.add_argument("--shared-prefix", type=_fraction("--shared-prefix"), default=0.5,
                     help="share of request 0's prompt that later requests start with (default 0.5); sparse-hier "
                          "reuses it from the host tier through the HiRadixTree")
    run.add_argument("--no-forced", action="store_true",
                     help="skip the teacher-forced re-runs that measure next-token agreement with dense")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    run.add_argument("--cache-salt", type=_salt, default=None,
                     help="cache salt of every request (tenant isolation, as vLLM's cache_salt): cached KV, "
                          "also in an L3 backend, is shared only with requests of the same salt")
    run.add_argument("--l3-checkpoint-identity", choices=IDENTITY_MODES, default=None,
                     help="how a --model-path checkpoint is named in the L3 namespace, so that checkpoints "
                          "sharing a store never read each other's KV: metadata = digest of config.json and "
                          "the weight files' safetensors headers, sizes and modification times (no weights "
                          "read; a copy with other time stamps misses), content = digest of config.json and "
                          "every weight byte (reads the checkpoint once more; identical copies share KV) "
                          "(default metadata; needs --model-path and --hicache-storage-backend)")
    _add_common(run)
    _add_disaggregation_args(run)
    run.set_defaults(subparser=run)
    bench = sub.add_parser("bench", help="sweep contexts x batches x modes; JSON of tokens/s, hit rate, memory",
                           description="Decode throughput sweep with the runtime (synthetic prompts). For the GPU "
                                       "benchmark of the issue see benchmarks/bench_decode.py.")
    bench.add_argument("--contexts", type=_int_list("--contexts"), default=[1024, 2048],
                       help="comma list of prompt lengths (default 1024,2048)")
    bench.add_argument("--batches", type=_int_list("--batches"), default=[1, 2],
                       help="comma list of batch sizes (default 1,2)")
    bench.add_argument("--decode-tokens", type=_positive("--decode-tokens"), default=16,
                       help="decode steps per point (default 16)")
    bench.add_argument("--cache-salt", type=_salt, default=None,
                       help="cache salt of every request, as in sparsehi run; the sweep runs without the prefix "
                            "tree and L3, so no request reuses KV with or without one")
    _add_common(bench)
    bench.set_defaults(subparser=bench)
    return parser


def _add_disaggregation_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)")
    g.add_argument("--disaggregation", choices=("prefill", "decode"), default=None,
                   help="run one side of a prefill/decode split over --hicache-storage-backend (sparse-hier only): "
                        "prefill computes the prompts and publishes their KV; decode takes it into its host pool "
                        "without a prefill, decodes, and writes its decode pages back to L3")
    g.add_argument("--disaggregation-wait-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="decode: longest wait for a prompt's KV to be published (default 30)")
    g.add_argument("--disaggregation-on-missing", choices=("recompute", "refuse"), default="recompute",
                   help="decode, when a prompt's KV is not published in time or a page is missing or fails its "
                        "digest: recompute the prompt here (default) or refuse the request (exit code 3)")


def _disaggregation(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """``--disaggregation*`` as a DisaggregationConfig (None without ``--disaggregation``);
    without ``--modes`` the command runs sparse-hier only."""
    if args.disaggregation is None:
        given = [f for f, on in (("--disaggregation-wait-timeout", args.disaggregation_wait_timeout != 30.0),
                                 ("--disaggregation-on-missing", args.disaggregation_on_missing != "recompute"))
                 if on]
        if given:
            parser.error(f"{given[0]} applies with --disaggregation decode")
        return None
    if args.modes is None:
        args.modes = ["sparse-hier"]
    if args.modes != ["sparse-hier"]:
        parser.error(f"--disaggregation runs the sparse-hier mode only: --modes sparse-hier, got "
                     f"{','.join(args.modes)}")
    if args.hicache_storage_backend is None:
        parser.error("--disaggregation needs --hicache-storage-backend (e.g. mooncake): the KV is handed over "
                     "through it")
    from sparsehi.runtime.disaggregation import DisaggregationConfig

    try:
        return DisaggregationConfig(args.disaggregation, args.disaggregation_wait_timeout,
                                    args.disaggregation_on_missing)
    except ValueError as e:
        parser.error(f"--disaggregation-wait-timeout: {e}")


def _setup_kwargs(args: argparse.Namespace, modes: list[str], sparse, device: str, dtype: torch.dtype) -> dict:
    """The :class:`~sparsehi.runtime.run_setup.RunSetup` fields both commands take from the
    common options."""
    return dict(model=args.model, model_path=args.model_path, num_layers=args.num_layers, modes=modes,
                sparse=sparse, device=device, dtype=dtype, adapter=args.adapter, host_layout=args.host_layout,
                seed=args.seed, output_dir=args.output_dir, cuda_graph=not args.no_cuda_graph,
                overlap_schedule=not args.disable_overlap_schedule,
                hicache=args.hicache_config)


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    pd = _disaggregation(args, args.subparser) if args.command == "run" else None
    from sparsehi.runtime.runtime_config import RUNTIME_MODES
    from sparsehi.runtime.weights import CheckpointError

    modes = args.modes or [m for m in RUNTIME_MODES if m != "offload-full" or args.kv_cache_dtype == "auto"]
    try:
        if args.command == "run":
            from sparsehi.runtime.demo import RUN_FILES, DemoConfig, run_demo

            device, dtype, sc = _resolve(args, args.subparser, "--context", args.context,
                                         args.context + args.decode_tokens, RUN_FILES)
            _check_host_size(args, args.subparser, sc, device, dtype, args.batch, args.context + args.decode_tokens + 1)
            identity = _check_checkpoint_identity(args, args.subparser)
            cfg = DemoConfig(**_setup_kwargs(args, modes, sc, device, dtype),
                             context=args.context, batch=args.batch, decode_tokens=args.decode_tokens,
                             shared_prefix=args.shared_prefix, forced=not args.no_forced,
                             cache_salt=args.cache_salt, l3_checkpoint_identity=identity,
                             progress=not args.no_progress)
            if pd is None:
                run_demo(cfg)
            else:
                from sparsehi.runtime.pd_run import run_disaggregated

                run_disaggregated(cfg, pd)
            return 0
        from sparsehi.runtime.bench import BENCH_FILES, BenchConfig, run_bench

        device, dtype, sc = _resolve(args, args.subparser, "--contexts", min(args.contexts),
                                     max(args.contexts) + args.decode_tokens, BENCH_FILES)
        _check_host_size(args, args.subparser, sc, device, dtype, max(args.batches),
                         max(args.contexts) + args.decode_tokens + 1)
        run_bench(BenchConfig(**_setup_kwargs(args, modes, sc, device, dtype),
                              contexts=args.contexts, batches=args.batches, decode_tokens=args.decode_tokens,
                              cache_salt=args.cache_salt))
        return 0
    except CheckpointError as e:  # found only while loading the tensors, after the up-front header check
        _fail(args.subparser, f"--model-path {e}")
    except Exception as e:
        from hicache.storage.kv_handoff import HandoffError

        if not isinstance(e, HandoffError):
            raise
        print(f"sparsehi run --disaggregation {args.disaggregation}: {e}", file=sys.stderr)
        return 3
    return 2


if __name__ == "__main__":
    sys.exit(main())
