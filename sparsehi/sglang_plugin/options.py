"""The ``--sparsehi-*`` server options: their argparse surface and their check.

SGLang's ``ServerArgs`` is a closed msgspec record built from the parsed namespace by
``ServerArgs.from_cli_args`` (only its own fields are copied), so the plugin adds its
options to the parser and, when the record is built, turns them into a ``SparseConfig``
kept beside the record (``ServerArgs`` is declared with ``dict=True``, so an attribute
outside its fields survives). Nothing here imports SGLang: the hooks in
``sparsehi.sglang_plugin.hooks`` call these functions with SGLang's objects.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Optional

from sparsehi.config import SPARSE_BACKENDS, SparseConfig

ATTR = "sparsehi_config"
"""Name of the attribute set on SGLang's ``ServerArgs`` (None: sparsehi is off)."""

# (flag, SparseConfig field, type, help). The algorithm flag is the switch: without it
# every other option is ignored and every hook is a no-op.
_OPTIONS: tuple[tuple[str, str, type, str], ...] = (
    ("--sparsehi-algorithm", "algorithm", str,
     "Turns sparsehi on: a registered algorithm name (quest, dsa, oracle) or an import "
     "path 'package.module:ClassName' of a sparsehi algorithm or of a subclass of SGLang's own "
     "BaseSparseAlgorithm (e.g. sglang.srt.mem_cache.sparsity.algorithms.quest_algorithm:QuestAlgorithm). "
     "Without it the other --sparsehi-* options are ignored."),
    ("--sparsehi-backend", "backend", str,
     f"Attention backend adapter that rewrites the page table: one of {SPARSE_BACKENDS}."),
    ("--sparsehi-top-k", "top_k", int, "Tokens selected per decode step and layer (multiple of the page size)."),
    ("--sparsehi-device-buffer-size", "device_buffer_size", int,
     "Tokens of GPU LRU buffer per request and layer (>= top-k, multiple of the page size)."),
    ("--sparsehi-page-size", "page_size", int,
     "Selection page size in tokens (power of two <= 256; default 64), independent of SGLang's --page-size: "
     "host KV is addressed per token (with --sparsehi-host-kv-dtype fp8_e4m3 it must equal --page-size)."),
    ("--sparsehi-sink-tokens", "sink_tokens", int, "Leading tokens always attended."),
    ("--sparsehi-recent-tokens", "recent_tokens", int, "Trailing tokens always attended (>= 1)."),
    ("--sparsehi-min-sparse-prompt-len", "min_sparse_prompt_len", int,
     "Requests with a shorter prompt take SGLang's unmodified attention path."),
    ("--sparsehi-host-to-device-ratio", "host_to_device_ratio", float,
     "Host-backed KV slots over SGLang's GPU KV pool (> 1, default 2): SGLang's scheduler admits by them, "
     "pinned host memory holds them."),
    ("--sparsehi-max-sparse-requests", "max_sparse_requests", int,
     "Requests decoding sparsely at once (their GPU buffers come out of SGLang's KV memory); default: as many as "
     "half of it holds, at most --max-running-requests."),
    ("--sparsehi-lookahead-tokens", "lookahead_tokens", int,
     "Tokens (whole selection pages) ranked after the top-k that each sparse layer loads into its GPU buffer on a "
     "side stream for the next decode step, off the critical path (top-k plus this must fit the device buffer); "
     "default 0: off."),
    ("--sparsehi-host-kv-dtype", "host_kv_dtype", str,
     "KV dtype of the pinned host pool: auto (the model's) or fp8_e4m3 (whole pages with one power-of-two scale per "
     "page, layer and head: about half the host bytes and PCIe bytes of bf16; needs --page-size equal to "
     "--sparsehi-page-size). A complete page is rounded in place on the GPU too, so every later reader (sparse "
     "decoding, SGLang's own attention for short requests, later prefill chunks, prefix hits) sees the FP8 values."),
    ("--sparsehi-dense-layers", "dense_layers", str,
     "Comma-separated layers that attend densely (their whole context stays on the GPU for each sparse request); "
     "default: none, every layer sparse."),
)


@dataclass(frozen=True)
class OptionSpec:
    flag: str
    field: str
    type: type
    help: str

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


OPTIONS: tuple[OptionSpec, ...] = tuple(OptionSpec(*o) for o in _OPTIONS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``--sparsehi-*`` options (all default to None: unset) in their own group."""
    group = parser.add_argument_group("sparsehi (hierarchical sparse attention)")
    for o in OPTIONS:
        if any(o.flag in a.option_strings for a in parser._actions):
            continue  # a second add_cli_args call on the same parser
        group.add_argument(o.flag, dest=o.dest, type=o.type, default=None, help=o.help)


def config_from_namespace(ns: Any, sglang_page_size: Optional[int] = None) -> Optional[SparseConfig]:
    """The ``SparseConfig`` the parsed options ask for; None when ``--sparsehi-algorithm`` is unset.
    ``sglang_page_size`` (SGLang's ``--page-size``; None: not given) matters only with
    ``--sparsehi-host-kv-dtype fp8_e4m3``, whose whole FP8 pages need it equal to the
    selection page size; otherwise the selection page size is the plugin's own (host KV is
    addressed per token).

    Raises ``ValueError`` naming the flag (not the dataclass field) on a bad value.
    """
    values = {o.field: getattr(ns, o.dest, None) for o in OPTIONS}
    if values["algorithm"] is None:
        given = [o.flag for o in OPTIONS if values[o.field] is not None]
        if given:
            raise ValueError(f"{', '.join(given)} given without --sparsehi-algorithm, which turns sparsehi on")
        return None
    if isinstance(values["dense_layers"], (tuple, list)):  # a config dict (sgl.Engine) names them as a sequence
        pass
    elif values["dense_layers"] is not None:
        text = str(values["dense_layers"]).strip()
        try:
            values["dense_layers"] = tuple(int(x) for x in text.split(",") if x.strip()) if text else ()
        except ValueError:
            raise ValueError(f"--sparsehi-dense-layers={text!r} is invalid: comma-separated layer ids, e.g. 0,1") from None
    else:
        values["dense_layers"] = ()  # GPU memory follows the buffer: no layer keeps a whole context there
    kwargs = {k: v for k, v in values.items() if v is not None}
    # defaults whose budgets must follow a page size other than SparseConfig's 64
    page = kwargs.get("page_size", SparseConfig.page_size)
    for f in ("sink_tokens", "recent_tokens"):
        kwargs.setdefault(f, max(page, getattr(SparseConfig, f)))
    try:
        cfg = SparseConfig(**kwargs)
    except ValueError as e:
        msg = str(e)
        for o in OPTIONS:
            msg = msg.replace(f"SparseConfig.{o.field}=", f"{o.flag}=")
        raise ValueError(msg) from None
    from sparsehi.sglang_plugin.bridge_host_kv import check_fp8_page_size
    from sparsehi.sglang_plugin.sglang_algorithm import check_algorithm_name

    check_fp8_page_size(cfg, sglang_page_size)

    try:  # a name or import path of ours, or an SGLang algorithm class (imported now, not at first request)
        check_algorithm_name(cfg.algorithm)
    except ValueError as e:
        raise ValueError(f"--sparsehi-{e}") from None
    return cfg


def check_sglang_features(ns: Any, cfg: SparseConfig) -> None:
    """SGLang settings sparsehi cannot run with, checked on the parsed namespace when
    sparsehi is on (ValueError naming the flag).

    CUDA graphs: decode graphs record the plugin's layer path (its capture hooks), so they
    stay SGLang's choice, unless the algorithm must run eagerly (an SGLang algorithm not
    declared capture safe): then ``--cuda-graph-backend-decode`` left unset becomes
    ``disabled`` (logged) and any other explicit choice, or a ``--cuda-graph-config`` JSON,
    is an error. Prefill graphs are SGLang's choice either way: extend forwards are
    SGLang's own (a prompt is registered at its first decode forward).
    ``--enable-mixed-chunk`` puts decode rows in extend batches, which the plugin cannot
    follow; speculative decoding verifies drafts in batches the plugin cannot follow either,
    nor the split micro-batches of two-batch overlap or DP attention's padded batches.
    A quantised ``--kv-cache-dtype`` (fp8 / fp4) is refused: the plugin's pools and copies
    carry SGLang's KV in the model's dtype.
    """
    import logging

    from sparsehi.sglang_plugin.sglang_algorithm import algorithm_requires_eager

    if getattr(ns, "enable_mixed_chunk", False):
        raise ValueError("--enable-mixed-chunk cannot be used with --sparsehi-algorithm (decode rows inside "
                         "extend batches); leave it off")
    if getattr(ns, "speculative_algorithm", None) is not None:
        raise ValueError(f"--speculative-algorithm={ns.speculative_algorithm!r} cannot be used with "
                         f"--sparsehi-algorithm (draft verification batches); leave it unset")
    kv_dtype = str(getattr(ns, "kv_cache_dtype", None) or "auto")
    if kv_dtype.startswith(("fp8", "fp4")):
        raise ValueError(f"--kv-cache-dtype={kv_dtype!r} cannot be used with --sparsehi-algorithm (the plugin moves "
                         f"SGLang's KV in the model's dtype; FP8 latent rows end to end are the sparsehi runtime's "
                         f"--kv-cache-dtype fp8_e4m3, FP8 host KV here is --sparsehi-host-kv-dtype); allowed: auto")
    if getattr(ns, "enable_two_batch_overlap", False):
        raise ValueError("--enable-two-batch-overlap cannot be used with --sparsehi-algorithm (its layers run on "
                         "split micro-batches the plugin cannot follow); leave it off")
    # SGLang features that move KV by SGLang's slot ids themselves (its host tier, PD
    # transfer, another sparse tier): with the plugin those ids are host-backed virtual
    # slots whose KV already lives in the plugin's host pool.
    for flag, attr in (("--enable-hierarchical-cache", "enable_hierarchical_cache"),
                       ("--enable-hisparse", "enable_hisparse"), ("--enable-lmcache", "enable_lmcache")):
        if getattr(ns, attr, False):
            raise ValueError(f"{flag} cannot be used with --sparsehi-algorithm: the plugin's host pool already holds "
                             f"every token's KV and SGLang's radix cache reuses prefixes from it; leave {flag} off")
    mode = getattr(ns, "disaggregation_mode", "null")
    if mode not in (None, "null"):
        raise ValueError(f"--disaggregation-mode={mode!r} cannot be used with --sparsehi-algorithm (PD transfer "
                         f"addresses SGLang's GPU slots); allowed: null")
    if int(getattr(ns, "pp_size", 1) or 1) > 1:
        raise ValueError(f"--pp-size={ns.pp_size} cannot be used with --sparsehi-algorithm (pipeline parallel layer "
                         f"slices); allowed: 1")
    dp = int(getattr(ns, "attn_dp_size", 1) or 1)
    if dp > 1 or getattr(ns, "enable_dp_attention", False):
        flag = f"--attn-dp-size={dp}" if dp > 1 else "--enable-dp-attention"
        raise ValueError(f"{flag} (DP attention) cannot be used with --sparsehi-algorithm (its decode batches are "
                         f"padded after the plugin's forward hook); allowed: --attn-dp-size 1")
    if not algorithm_requires_eager(cfg.algorithm) or getattr(ns, "disable_cuda_graph", False):
        return
    why = f"--sparsehi-algorithm {cfg.algorithm} is not CUDA-graph capture safe, so decode runs eagerly"
    if getattr(ns, "cuda_graph_config", None) is not None:
        raise ValueError(f"--cuda-graph-config cannot be used with this algorithm: {why} (decode CUDA graphs are "
                         f"turned off; set --cuda-graph-backend-prefill for prefill)")
    graph_backend = getattr(ns, "cuda_graph_backend_decode", None)
    if graph_backend is None:
        ns.cuda_graph_backend_decode = "disabled"
        logging.getLogger(__name__).warning("sparsehi: decode CUDA graphs disabled (--cuda-graph-backend-decode "
                                            "disabled): %s", why)
    elif graph_backend != "disabled":
        raise ValueError(f"--cuda-graph-backend-decode={graph_backend!r} cannot be used with this algorithm: {why}; "
                         f"allowed 'disabled'")
