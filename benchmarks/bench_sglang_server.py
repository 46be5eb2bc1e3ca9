"""SGLang's real server with and without the sparsehi plugin, one GPU, same flags: how many
long requests it holds, decode tok/s as a client sees it, time to first token, GPU and host
memory, and whether greedy tokens equal SGLang's own when the plugin's top-k covers the prompt.

Run on the GPU machine from the project root, after ``source .sglang-gpu/setup_site.sh``
(SGLang 0.5.23 and this project in /tmp/site, dummy-weight model configs in /tmp/tiny and
/tmp/l8b)::

    python3 benchmarks/bench_sglang_server.py --dry-run       # the plan and the commands, nothing started
    python3 benchmarks/bench_sglang_server.py                  # everything, four server starts (~11-14 min)
    # within a 10-minute limit per call, three calls filling one result file (--merge reads the
    # file in --out: copy sglang_server.json from the GPU machine into benchmarks/results between calls):
    python3 benchmarks/bench_sglang_server.py --only sglang --time-budget 540
    python3 benchmarks/bench_sglang_server.py --only plugin --skip-check --merge --time-budget 540
    python3 benchmarks/bench_sglang_server.py --only plugin --skip-measure --merge --time-budget 540

Model: ``--model-dir`` (default ``$MODEL_DIR`` or /tmp/l8b: Llama-3-8B's shape), loaded with
``--load-format dummy``. Servers: SGLang's ``launch_server`` with the common flags of
``common_flags()`` (triton attention, dummy weights, no tokenizer, prefill CUDA graphs off as
in serve_probe.py, decode CUDA graphs SGLang's default) and SGLang's default ``--page-size``
and ``--mem-fraction-static`` unless ``--page-size`` / ``--mem-fraction-static`` are given
(``--server-args`` adds flags to every server). The plugin server adds ``--plugin-args``
(default ``DEFAULT_PLUGIN_ARGS``) and runs with ``SGLANG_PLUGINS=sparsehi``; the SGLang
server runs with ``SGLANG_PLUGINS=__none__``, so SGLang loads no plugin at all
(``--baseline-plugin-loaded``: load it, without ``--sparsehi-*`` flags).

One server start per plugin setting serves every context (``--context-length`` is the
largest context + 4096 on both). Per context, on an idle server with its radix cache
flushed (every prompt is fresh random token ids, so no prefix hits; ``cached_tokens`` in
the row counts any):

- ``ttft_s``: one request of that context with ``max_new_tokens=1`` (the fastest of
  ``--ttft-reps``; all in ``ttft_reps_s``).
- ``b1_tok_s``: serve_probe's method, ``(N - 1) / (T(N) - T(1))``: T(N) the time of one
  fresh request with ``max_new_tokens=N`` (``--b1-new-tokens``), T(1) ``ttft_s``; so it
  includes the first decode step, where the plugin registers the prompt (copies its KV to
  host). Also ``b1_stream_tok_s``, the same request's steady rate (streamed, from its second
  token on, as the windows below) and ``sglang_b1_gen_tok_s`` (SGLang's "gen throughput" log
  lines at one running request).
- ``batch_held``: the largest ``#running-req`` of SGLang's "Decode batch" log lines while
  it is sent more requests than fit: the estimate ``max_total_num_tokens // context`` (its
  startup log line) plus ``--held-extra``, at most ``--batch-cap`` and
  ``max_running_requests``, each asking ``--held-new-tokens`` (more than the run lasts).
  SGLang admits one long prompt at a time (chunked prefill); with the plugin the batch keeps
  growing as registered prompts leave the GPU. Once a Decode batch line has shown a queue
  and the running requests have not grown for ``--held-settle-s``, the requests still
  waiting (no first token) are aborted (``/abort_request``), the held batch decodes for
  ``--held-measure-s`` and the run ends (the rest aborted). ``held_saturated``: a queue was
  seen (the batch is the server's limit, not the number sent).
- ``best_tok_s`` / ``best_batch``: client-side decode tok/s over the same run, streamed.
  A request counts from the arrival of its second token (``--start-token``: the first
  decode step, with the plugin's once-per-request registration, is left out of the steady
  rate). Between two consecutive start / last-token events the set of decoding requests is
  fixed: its rate is the tokens the client received in that window over its length
  (windows where a request advanced fewer than ``--min-window-steps`` tokens, e.g. while
  others prefill, are left out). ``tok_s_by_batch``: the best window per batch size;
  ``best_*``: the largest of them (``held_tok_s``: the one at ``batch_held``).
  ``sglang_gen_tok_s``: the median of SGLang's own "gen throughput" lines at the held batch
  (each line after the first such line of the run: the first one's interval may hold
  prefill time).
- ``peak_gpu_gib``: the largest ``nvidia-smi --query-gpu=memory.used`` seen while that
  context ran (polled every ``--poll-s``; the whole GPU, so SGLang's static pool counts);
  ``peak_host_gib``: the largest sum of RSS over the server's process tree (/proc). RSS
  counts pinned host memory (cudaHostAlloc / pin_memory) once its pages are touched, and
  pinning touches them, so the plugin's pinned host KV pool counts in full from the moment
  it is allocated; pages shared between the server's processes count once per process.
  The server records (``servers``) hold the same peaks over the server's whole life, and
  what its log says: KV tokens and GiB, max_running_requests, weights and CUDA-graph
  memory, start time, the lines that mention sparsehi.

``defaults_start``: the plugin server (``--plugin-args``) started without ``--page-size`` /
``--mem-fraction-static`` (SGLang's defaults) and served a request of 4096 tokens (16 new):
the measured plugin server when neither flag is given, else a server started for this alone
(``plugin_defaults``); None when neither ran (the check servers do not count).

``tokens_equal_full_topk``: ``--check-prompts`` random prompts of ``--check-len`` tokens,
greedy (temperature 0, ignore_eos), ``--check-new`` tokens each, one at a time: the plugin
with ``--check-plugin-args`` (top-k and buffer >= the whole context, so the selection is
every token) against SGLang's own tokens from the server without the plugin (its main
server; the reference is kept in the result file, so a later ``--merge`` run can compare
against it). Checked with decode CUDA graphs (``tokens_equal_full_topk_graphed``) and
eager (``--disable-decode-cuda-graph``: ``tokens_equal_full_topk_eager``, unless
``--skip-eager-check``); ``tokens_equal_full_topk`` is true when every check run is.

Robustness: every server is killed when its part ends or fails (SIGTERM, then SIGKILL of
its process tree; it also gets SIGKILL if this script dies), the next one starts only when
the GPU's memory is back to where it was; one JSON line is printed per measurement and the
result file is rewritten after each, so a timeout leaves what was measured;
``--time-budget`` stops starting work that would run past it; a server whose host memory
leaves less than ``--min-host-avail-gib`` available is killed (its row says so). Server
logs: ``--log-dir``, else the output directory (``server_<tag>.log``).

Device time (H100, Llama-3-8B shape, 32k and 64k, estimated; prefill dominates: every
admitted request of the held run is prefilled once, queued ones are aborted unprefilled):
each start 60-110 s; per server and context about (ttft reps + 1 + held batch) prefills plus
~256 + 32 x held decode steps: ~50 s at 32k (~12 held) and ~65 s at 64k (~6 held) without
the plugin, more if the plugin holds more; the reference and check prompts a few seconds.
Per full run: sglang ~3.5-4.5 min, plugin ~4-6 min, the two check servers ~3.5 min: about
11-14 min, in three calls of under 6 min each as above.

Result: ``sglang_server.json`` (``--out``, default benchmarks/results).
"""
from __future__ import annotations

import argparse
import bisect
import ctypes
import datetime as _dt
import hashlib
import json
import os
import platform
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

RESULT_NAME = "sglang_server.json"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
PLUGIN_NAME = "sparsehi"
NO_PLUGIN = "__none__"  # an SGLANG_PLUGINS whitelist no plugin is named by: SGLang loads none
DEFAULT_PLUGIN_ARGS = "--sparsehi-algorithm quest --sparsehi-top-k 2048 --sparsehi-device-buffer-size 4096"
DEFAULT_CHECK_PLUGIN_ARGS = "--sparsehi-algorithm quest --sparsehi-top-k 4096 --sparsehi-device-buffer-size 4096"
DEFAULT_CONTEXTS = "32768,65536"
EAGER_FLAGS = ("--disable-decode-cuda-graph",)
DEFAULTS_FLAGS = ("--page-size", "--mem-fraction-static")  # defaults_start: a plugin server without these
WARMUP_LEN, WARMUP_NEW = 4096, 16  # >= the plugin's default min_sparse_prompt_len: a sparse request
CONTEXT_MARGIN = 4096  # --context-length = largest context + this
ROW_FIELDS = ("context", "plugin", "batch_held", "b1_tok_s", "best_tok_s", "best_batch", "ttft_s",
              "peak_gpu_gib", "peak_host_gib")
TOP_FIELDS = ("device", "date", "rows", "defaults_start", "tokens_equal_full_topk")
GIB = 2 ** 30
CHECK_KEYS = ("prompts", "prompt_len", "new_tokens", "seed")  # what makes the check's prompts the same
FLAG_STRING_OPTIONS = ("--plugin-args", "--check-plugin-args", "--server-args")


# ---------------------------------------------------------------- server flags

def common_flags(model_dir: str, context_length: int, page_size: Optional[int] = None,
                 mem_fraction: Optional[float] = None, extra: Iterable[str] = ()) -> list[str]:
    """The flags every server of a run gets (plugin on or off): the one place they are set.
    --page-size / --mem-fraction-static only when given (else SGLang's defaults)."""
    flags = ["--model-path", model_dir, "--load-format", "dummy", "--skip-tokenizer-init",
             "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
             "--context-length", str(context_length), "--disable-prefill-cuda-graph",
             "--random-seed", "0", "--log-level", "info"]
    if page_size is not None:
        flags += ["--page-size", str(page_size)]
    if mem_fraction is not None:
        flags += ["--mem-fraction-static", str(mem_fraction)]
    return flags + list(extra)


def has_defaults_flags(flags: Iterable[str]) -> bool:
    """Whether ``flags`` set --page-size or --mem-fraction-static (either spelling)."""
    return any(f == d or f.startswith(d + "=") for f in flags for d in DEFAULTS_FLAGS)


def strip_defaults_flags(flags: list[str]) -> list[str]:
    """``flags`` without --page-size / --mem-fraction-static and their values."""
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
            continue
        if f in DEFAULTS_FLAGS:
            skip = True
            continue
        if any(f.startswith(d + "=") for d in DEFAULTS_FLAGS):
            continue
        out.append(f)
    return out


def server_cmd(python: str, flags: list[str], port: Any, host: str = "127.0.0.1") -> list[str]:
    return [python, "-m", "sglang.launch_server", *flags, "--host", host, "--port", str(port)]


def server_env(plugin: bool, baseline_plugin_loaded: bool = False, base: Optional[dict] = None) -> dict[str, str]:
    """The server's environment: SGLANG_PLUGINS names our plugin (plugin on) or nothing
    (SGLang without any plugin); PYTHONUNBUFFERED for a live log."""
    env = dict(os.environ if base is None else base)
    env["PYTHONUNBUFFERED"] = "1"
    if plugin or baseline_plugin_loaded:
        env["SGLANG_PLUGINS"] = PLUGIN_NAME
    else:
        env["SGLANG_PLUGINS"] = NO_PLUGIN
    return env


def plan_servers(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The servers this run starts, in order, each ``{tag, plugin, flags, env_plugins, tasks}``;
    tasks: ``warmup``, ``reference`` (check prompts on SGLang), ``measure`` (all contexts),
    ``check`` (check prompts on the plugin), ``defaults`` (one request). ``plugin_defaults``
    (the plugin's flags without --page-size / --mem-fraction-static) only when those are given:
    otherwise the measured plugin server tells defaults_start."""
    common = common_flags(args.model_dir, args.context_length, args.page_size, args.mem_fraction_static,
                          shlex.split(args.server_args))
    plugin_flags = shlex.split(args.plugin_args)
    check_flags = shlex.split(args.check_plugin_args)
    want = {"sglang", "plugin"} if args.only is None else {args.only}
    check = not args.skip_check
    servers: list[dict[str, Any]] = []

    def add(tag, plugin, flags, tasks):
        servers.append({"tag": tag, "plugin": plugin, "flags": flags, "tasks": tasks,
                        "env_plugins": PLUGIN_NAME if (plugin or args.baseline_plugin_loaded) else NO_PLUGIN,
                        # defaults_start: the measured plugin flags, SGLang's page size / memory fraction
                        "defaults_probe": tag in ("plugin", "plugin_defaults") and not has_defaults_flags(flags)})

    if "sglang" in want:
        tasks = ["warmup"] + (["reference"] if check else []) + ([] if args.skip_measure else ["measure"])
        add("sglang", False, common, tasks)
    if "plugin" in want:
        if not args.skip_measure:
            add("plugin", True, common + plugin_flags, ["warmup", "measure"])
        if check:
            add("check_graphed", True, common + check_flags, ["warmup", "check"])
            if not args.skip_eager_check:
                add("check_eager", True, common + check_flags + list(EAGER_FLAGS), ["warmup", "check"])
        if not args.skip_defaults and has_defaults_flags(common):
            add("plugin_defaults", True, strip_defaults_flags(common + plugin_flags), ["warmup", "defaults"])
    return servers


# ---------------------------------------------------------------- SGLang's log

_TS = r"^\[(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)(?P<ranks>[^\]]*)\]\s*"
# metrics_reporter.report_decode_stats: f"Decode batch{iter_msg}, #running-req: {n}, {usage}" ...
# f"{graph label}: {can_run_cuda_graph}, gen throughput (token/s): {x:.2f}, #queue-req: {q}"
DECODE_RE = re.compile(r"Decode batch(?: \[\d+\])?, #running-req: (?P<running>\d+), (?P<rest>.*?)"
                       r"gen throughput \(token/s\): (?P<gen>[0-9.]+|nan|inf), #queue-req: (?P<queue>\d+)")
_DECODE_TOKEN = re.compile(r"#(?:full )?token: (\d+)")
_DECODE_USAGE = re.compile(r"(?<!#)(?:full )?token usage: ([0-9.]+)")
_DECODE_GRAPH = re.compile(r"graph: (True|False)")
PREFILL_RE = re.compile(r"Prefill batch(?: \[\d+\])?, #new-seq: (?P<new_seq>\d+), #new-token: (?P<new_token>\d+), "
                        r"#cached-token: (?P<cached>\d+), .*?#running-req: (?P<running>\d+), #queue-req: (?P<queue>\d+)")
SCHED_RE = re.compile(r"max_total_num_tokens=(?P<max_total_num_tokens>\d+), chunked_prefill_size=(?P<chunked_prefill_size>-?\d+), "
                      r"max_prefill_tokens=(?P<max_prefill_tokens>\d+), max_running_requests=(?P<max_running_requests>\d+), "
                      r"context_len=(?P<context_len>\d+), available_(?:gpu|cpu)_mem=(?P<available_gpu_mem_gb>[0-9.]+) GB")
KV_RE = re.compile(r"KV Cache (?P<state>is allocated|VA upper bound)\. dtype: (?P<dtype>\S+), #tokens: (?P<tokens>\d+), "
                   r"(?:K size: (?P<k>[0-9.]+) GB, V size: (?P<v>[0-9.]+) GB|KV size: (?P<kv>[0-9.]+) GB)")
POST_KV_RE = re.compile(r"Post-capture KV sizing: KV cache allocated\. dtype: (?P<dtype>\S+), #tokens: (?P<tokens>\d+), "
                        r"KV size: (?P<kv>[0-9.]+) GB, avail mem=(?P<avail>[0-9.]+) GB")
WEIGHTS_RE = re.compile(r"Load weight end\. .*?avail mem=(?P<avail>[0-9.]+) GB, mem usage=(?P<mem>[0-9.]+) GB")
CAPTURE_RE = re.compile(r"Capture (?P<what>.+?) end\. (?:bs=(?P<bs>\[[^\]]*\]), )?elapsed=(?P<s>[0-9.]+) s, "
                        r"mem usage=(?P<mem>[0-9.]+) GB, avail mem=(?P<avail>[0-9.]+) GB")
RETRACT_RE = re.compile(r"KV cache pool is full\. Retract requests\. #retracted_reqs: (\d+)")
READY_MARK = "The server is fired up and ready to roll!"


def parse_decode_line(line: str) -> Optional[dict[str, Any]]:
    """One SGLang "Decode batch" log line as ``{running, queue, gen_tok_s, tokens, token_usage,
    cuda_graph, ts}``, or None for any other line."""
    m = DECODE_RE.search(line)
    if m is None:
        return None
    rest = m.group("rest")
    tok, use, graph = _DECODE_TOKEN.search(rest), _DECODE_USAGE.search(rest), _DECODE_GRAPH.search(rest)
    ts = re.match(_TS, line)
    return {"running": int(m.group("running")), "queue": int(m.group("queue")),
            "gen_tok_s": float(m.group("gen")), "tokens": int(tok.group(1)) if tok else None,
            "token_usage": float(use.group(1)) if use else None,
            "cuda_graph": None if graph is None else graph.group(1) == "True",
            "ts": ts.group("ts") if ts else None}


def parse_prefill_line(line: str) -> Optional[dict[str, int]]:
    m = PREFILL_RE.search(line)
    return None if m is None else {k: int(v) for k, v in m.groupdict().items()}


def decode_lines(lines: Iterable[str]) -> list[dict[str, Any]]:
    return [d for d in map(parse_decode_line, lines) if d is not None]


def held_batch(decodes: list[dict[str, Any]]) -> Optional[int]:
    """The largest #running-req of the Decode batch lines (None without any)."""
    return max((d["running"] for d in decodes), default=None)


def steady_gen_tok_s(decodes: list[dict[str, Any]], batch: Optional[int]) -> Optional[float]:
    """SGLang's steady "gen throughput" at ``batch`` running requests: the median of the lines
    at that batch after the first one (its interval may include prefill or idle time), or of
    that one line when it is the only one."""
    if batch is None:
        return None
    at = [d["gen_tok_s"] for d in decodes if d["running"] == batch]
    if not at:
        return None
    return round(statistics.median(at[1:] or at), 2)


def parse_startup(lines: Iterable[str]) -> dict[str, Any]:
    """What the server's log says about its start: KV pool, scheduler limits, weights and
    CUDA-graph memory, plugins loaded or skipped, the lines that mention sparsehi."""
    info: dict[str, Any] = {"plugins_loaded": [], "plugins_skipped": [], "sparsehi_lines": [],
                            "sparsehi_line_count": 0, "graph_captures": [], "ready": False}
    for line in lines:
        if m := SCHED_RE.search(line):
            for k, v in m.groupdict().items():
                info[k] = float(v) if "." in v else int(v)
        elif m := POST_KV_RE.search(line):
            info.update(kv_tokens=int(m["tokens"]), kv_gib=float(m["kv"]), kv_dtype=m["dtype"], kv_post_capture=True)
        elif m := KV_RE.search(line):
            size = float(m["kv"]) if m["kv"] is not None else float(m["k"]) + float(m["v"])
            if m["state"] == "is allocated":
                info.update(kv_tokens=int(m["tokens"]), kv_gib=round(size, 2), kv_dtype=m["dtype"])
            else:
                info.update(kv_va_upper_bound_tokens=int(m["tokens"]))
        elif m := WEIGHTS_RE.search(line):
            info.update(weights_gib=float(m["mem"]), avail_after_weights_gib=float(m["avail"]))
        elif m := CAPTURE_RE.search(line):
            info["graph_captures"].append({"what": m["what"], "bs": m["bs"], "s": float(m["s"]),
                                           "mem_gib": float(m["mem"]), "avail_gib": float(m["avail"])})
        elif m := re.search(r"Loaded plugin (\S+) from group", line):
            info["plugins_loaded"].append(m.group(1))
        elif m := re.search(r"Skipping plugin (\S+) ", line):
            info["plugins_skipped"].append(m.group(1))
        if READY_MARK in line:
            info["ready"] = True
        if "sparsehi" in line.lower():
            info["sparsehi_line_count"] += 1
            if len(info["sparsehi_lines"]) < 12:
                info["sparsehi_lines"].append(line.strip()[:400])
    return info


def phase_log_summary(lines: list[str]) -> dict[str, Any]:
    """A phase's Decode / Prefill lines: held batch, retractions, prefix-cache hits."""
    decs = decode_lines(lines)
    pre = [p for p in map(parse_prefill_line, lines) if p is not None]
    return {"decodes": decs, "held": held_batch(decs),
            "queue_seen": any(d["queue"] > 0 for d in decs),
            "cuda_graph": sorted({d["cuda_graph"] for d in decs if d["cuda_graph"] is not None}),
            "cached_tokens": sum(p["cached"] for p in pre),
            "retracted": sum(int(m.group(1)) for m in map(RETRACT_RE.search, lines) if m)}


# ---------------------------------------------------------------- client-side rates

def tokens_at(chunks: list[tuple[float, int]], t: float, times: Optional[list[float]] = None) -> int:
    """Tokens a stream had received by time ``t`` (chunks: (arrival, cumulative tokens), in
    arrival order; ``times``: their arrival times, if at hand)."""
    i = bisect.bisect_right(times if times is not None else [c[0] for c in chunks], t)
    return chunks[i - 1][1] if i else 0


def first_step(chunks: list[tuple[float, int]]) -> dict[str, Optional[float]]:
    """A streamed request's first decode step (its token 1 to token 2: the step in which the
    plugin registers the prompt) against its steady step (the mean from token 3 on), in ms,
    and their ratio (``first_step_ratio``); None where the stream does not resolve them
    (tokens arriving several to a chunk)."""
    at = {n: t for t, n in chunks}
    out: dict[str, Optional[float]] = {"first_step_ms": None, "steady_step_ms": None, "first_step_ratio": None}
    if 1 not in at or 2 not in at or 3 not in at:
        return out
    last_t, last_n = chunks[-1]
    if last_n <= 3:
        return out
    first = (at[2] - at[1]) * 1e3
    steady = (last_t - at[3]) * 1e3 / (last_n - 3)
    out.update(first_step_ms=round(first, 3), steady_step_ms=round(steady, 3),
               first_step_ratio=round(first / steady, 3) if steady > 0 else None)
    return out


def window_rates(streams: list[dict[str, Any]], min_steps: int = 16, start_token: int = 2) -> dict[int, float]:
    """Client-side decode tok/s per batch size from streamed requests that ran together.

    Each stream: ``{"chunks": [(arrival time, cumulative completion tokens), ...]}``; the
    arrival of its token ``start_token`` (2: after the prefill's token and the first decode
    step, the one where the plugin registers the prompt, a once-per-request cost) and its
    last chunk are events. Between two consecutive events the requests decoding (started
    before the window, last chunk after it) are fixed; the window's rate is the tokens they
    received in it over its length. Windows where a decoding request advanced fewer than
    ``min_steps`` tokens (others prefilling, too short to time) are left out. Per batch
    size: the best window."""
    live = []
    for s in streams:
        ch = [(t, n) for t, n in s.get("chunks", []) if n >= start_token]
        if len(ch) >= 2:
            live.append((ch[0][0], ch[-1][0], ch, [c[0] for c in ch]))
    times = sorted({t for f, d, _, _ in live for t in (f, d)})
    best: dict[int, float] = {}
    for a, b in zip(times, times[1:]):
        if b <= a:
            continue
        active = [(ch, ts) for f, d, ch, ts in live if f <= a and d >= b]
        if not active:
            continue
        adv = [tokens_at(ch, b, ts) - tokens_at(ch, a, ts) for ch, ts in active]
        if min(adv) < min_steps:
            continue
        rate = sum(adv) / (b - a)
        c = len(active)
        if rate > best.get(c, 0.0):
            best[c] = rate
    return {c: round(r, 1) for c, r in sorted(best.items())}


def best_rate(rates: dict[int, float]) -> tuple[Optional[float], Optional[int]]:
    """(best tok/s, its batch) over ``rates`` (the larger batch on a tie)."""
    if not rates:
        return None, None
    c = max(rates, key=lambda k: (rates[k], k))
    return rates[c], c


def b1_rate(t_one: Optional[float], t_n: Optional[float], n: int) -> Optional[float]:
    """serve_probe's decode tok/s at batch 1: (n - 1) / (T(n) - T(1))."""
    if t_one is None or t_n is None or t_n <= t_one or n < 2:
        return None
    return round((n - 1) / (t_n - t_one), 1)


def held_plan(max_total_tokens: Optional[int], max_running: Optional[int], context: int, extra: int,
              cap: int) -> int:
    """How many requests the held run sends: what the KV pool can hold at most
    (``max_total_tokens // context``) plus ``extra``, at most ``cap`` (and
    ``max_running + extra``); ``cap`` when the pool size is unknown."""
    if not max_total_tokens:
        return max(1, cap)
    est = max_total_tokens // context
    if max_running:
        est = min(est, max_running)
    return max(1, min(cap, est + extra))


def ramp_new_tokens(n: int, base: int, step: int, limit: int) -> list[int]:
    """max_new_tokens of the held run's requests: base + i * step, at most ``limit``."""
    return [max(1, min(limit, base + i * step)) for i in range(n)]


# ---------------------------------------------------------------- result file

def empty_row(context: int, plugin: bool, server: str) -> dict[str, Any]:
    return {"context": context, "plugin": plugin, "server": server, **{k: None for k in ROW_FIELDS[2:]}}


def merge_results(old: Optional[dict[str, Any]], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` over ``old``: rows by (context, plugin) (new replaces old), servers by tag,
    top-level values that ``new`` leaves None taken from ``old``."""
    if not old:
        return new
    out = dict(old)
    for k, v in new.items():
        if k in ("rows", "servers", "check"):
            continue
        if v is not None or k not in out:
            out[k] = v
    keyed = {(r["context"], r["plugin"]): r for r in old.get("rows", [])}
    for r in new.get("rows", []):
        keyed[(r["context"], r["plugin"])] = r
    out["rows"] = sorted(keyed.values(), key=lambda r: (r["context"], r["plugin"]))
    out["servers"] = {**old.get("servers", {}), **new.get("servers", {})}
    old_check, new_check = dict(old.get("check") or {}), dict(new.get("check") or {})
    if any(old_check.get(k) != new_check.get(k) for k in CHECK_KEYS if k in new_check):
        out["check"] = new_check  # other prompts: the old reference and verdicts do not apply
    else:
        out["check"] = {**old_check, **{k: v for k, v in new_check.items() if v is not None}}
    return out


def check_schema(payload: dict[str, Any]) -> list[str]:
    """Problems with a result payload's required fields (empty: fine)."""
    bad = [f"missing {k}" for k in TOP_FIELDS if k not in payload]
    for k in ("defaults_start", "tokens_equal_full_topk"):
        if k in payload and payload[k] is not None and not isinstance(payload[k], bool):
            bad.append(f"{k} is not a bool")
    for i, r in enumerate(payload.get("rows", [])):
        bad += [f"row {i}: missing {k}" for k in ROW_FIELDS if k not in r]
        if not isinstance(r.get("plugin"), bool):
            bad.append(f"row {i}: plugin is not a bool")
        if not isinstance(r.get("context"), int):
            bad.append(f"row {i}: context is not an int")
        for k in ("batch_held", "best_batch"):
            if r.get(k) is not None and not isinstance(r[k], int):
                bad.append(f"row {i}: {k} is not an int")
        for k in ("b1_tok_s", "best_tok_s", "ttft_s", "peak_gpu_gib", "peak_host_gib"):
            if r.get(k) is not None and not isinstance(r[k], (int, float)):
                bad.append(f"row {i}: {k} is not a number")
    return bad


def tokens_verdict(ref: Optional[list], got: Optional[list]) -> dict[str, Any]:
    """Per-prompt comparison of greedy tokens: ``{equal, first_mismatch: [index or None]}``
    (equal None when either side is missing)."""
    if not ref or not got or len(ref) != len(got) or any(x is None for x in list(ref) + list(got)):
        return {"equal": None, "first_mismatch": None}
    firsts = []
    for a, b in zip(ref, got):
        idx = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if idx is None and len(a) != len(b):
            idx = min(len(a), len(b))
        firsts.append(idx)
    return {"equal": all(i is None for i in firsts), "first_mismatch": firsts}


def combine_tokens_equal(graphed: Optional[bool], eager: Optional[bool]) -> Optional[bool]:
    """True when every check that ran passed, False if one failed, None if none ran."""
    ran = [v for v in (graphed, eager) if v is not None]
    return None if not ran else all(ran)


# ---------------------------------------------------------------- machine

def _run_text(cmd: list[str], timeout: float = 10.0) -> Optional[str]:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_index() -> str:
    vis = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return vis or "0"


def gpu_used_gib(gpu: str) -> Optional[float]:
    out = _run_text(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", gpu], 5.0)
    try:
        return float(out.strip().splitlines()[0]) / 1024.0 if out else None
    except (ValueError, IndexError):
        return None


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        kids.setdefault(int(fields[1]), []).append(int(d))
    return kids


def process_tree(root: int) -> list[int]:
    """``root`` and its descendants (from /proc)."""
    kids = _children_map()
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def tree_rss_gib(root: int) -> float:
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for p in process_tree(root):
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            pass
    return total / GIB


def mem_available_gib() -> Optional[float]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return None


def device_info(gpu: str) -> dict[str, Any]:
    """GPU name and memory (nvidia-smi; this process never touches CUDA, so the server has
    the GPU to itself), versions, host."""
    out = _run_text(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits",
                     "-i", gpu])
    info: dict[str, Any] = {"device": "unknown (nvidia-smi failed)"}
    if out:
        parts = [p.strip() for p in out.strip().splitlines()[0].split(",")]
        if len(parts) >= 3:
            info.update(device=parts[0], gpu_mem_gib=round(float(parts[1]) / 1024, 1), driver=parts[2])
    from importlib import metadata
    for pkg in ("sglang", "torch", "triton", "sparsehi"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info[pkg] = None
    mem = None
    try:
        mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2 ** 20
    except (OSError, ValueError, IndexError):
        pass
    info.update(python=platform.python_version(), host_cpus=os.cpu_count(),
                host_mem_gib=None if mem is None else round(mem, 1))
    rev = _run_text(["git", "rev-parse", "--short", "HEAD"], 5.0)
    info["git"] = rev.strip() if rev else None
    # HEAD alone does not name the code that ran (a copied tree may carry changes past it)
    dirty = _run_text(["git", "status", "--porcelain", "--untracked-files=no", "--", "sparsehi", "hicache"], 5.0)
    info["git_dirty"] = None if dirty is None else bool(dirty.strip())
    info["source_sha1"] = source_digest()
    return info


def source_digest(root: Path = Path(__file__).resolve().parent.parent) -> str:
    """SHA-1 over the paths and bytes of the package sources (``sparsehi/``, ``hicache/``),
    which names the code a run used whatever git says about the tree."""
    h = hashlib.sha1()
    for pkg in ("sparsehi", "hicache"):
        for f in sorted((root / pkg).rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


class MemTracker(threading.Thread):
    """Polls the GPU's used memory and the server tree's RSS; keeps the peaks of the server's
    life and of the current phase; kills the server if the host runs out of memory."""

    def __init__(self, gpu: str, poll_s: float, min_avail_gib: float, on_host_oom: Callable[[], None]):
        super().__init__(daemon=True)
        self.gpu, self.poll_s, self.min_avail_gib, self.on_host_oom = gpu, poll_s, min_avail_gib, on_host_oom
        self.pid: Optional[int] = None
        self.life = {"gpu": None, "host": None}
        self.phase = {"gpu": None, "host": None}
        self.host_oom = False
        self._halt = threading.Event()  # (not _stop: threading.Thread has a method of that name)
        self._lock = threading.Lock()

    def reset_phase(self) -> None:
        with self._lock:
            self.phase = {"gpu": None, "host": None}

    def _bump(self, key: str, v: Optional[float]) -> None:
        if v is None:
            return
        with self._lock:
            for d in (self.life, self.phase):
                if d[key] is None or v > d[key]:
                    d[key] = v

    def sample(self) -> None:
        self._bump("gpu", gpu_used_gib(self.gpu))
        if self.pid is not None:
            self._bump("host", tree_rss_gib(self.pid))
            avail = mem_available_gib()
            if avail is not None and avail < self.min_avail_gib and not self.host_oom:
                self.host_oom = True
                self.on_host_oom()

    def run(self) -> None:
        while not self._halt.wait(self.poll_s):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a failed poll must not end the run
                pass

    def stop(self) -> None:
        self._halt.set()

    def peaks(self, which: str = "phase") -> tuple[Optional[float], Optional[float]]:
        d = self.phase if which == "phase" else self.life
        r = lambda v: None if v is None else round(v, 2)  # noqa: E731
        return r(d["gpu"]), r(d["host"])


def _set_pdeathsig() -> None:  # runs in the child before exec: SIGKILL when this script dies
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
    except OSError:
        pass


def free_port() -> int:
    for _ in range(50):
        p = random.randint(20000, 39000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
                return p
            except OSError:
                continue
    raise RuntimeError("no free port")


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # localhost: never through a proxy


def _open(req: Any, timeout: float) -> Any:
    return _OPENER.open(req, timeout=timeout)


class ServerDied(RuntimeError):
    pass


class Server:
    """One SGLang server: started, waited for, talked to over HTTP, always killed."""

    def __init__(self, tag: str, cmd: list[str], env: dict[str, str], log_path: Path, port: int,
                 tracker: MemTracker, request_timeout: float):
        self.tag, self.cmd, self.env, self.log_path, self.port = tag, cmd, env, log_path, port
        self.tracker, self.request_timeout = tracker, request_timeout
        self.proc: Optional[subprocess.Popen] = None
        self.base = f"http://127.0.0.1:{port}"
        self.killed_for: Optional[str] = None

    # -- life
    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True, preexec_fn=_set_pdeathsig)
        self.tracker.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float) -> float:
        t0 = time.perf_counter()
        while True:
            if not self.alive():
                raise ServerDied(f"{self.tag}: server exited (rc={self.proc.returncode}) before it was up")
            try:
                with _open(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"{self.tag}: server not up in {timeout:.0f} s")
            time.sleep(1.0)

    def kill(self, reason: Optional[str] = None) -> None:
        if reason and not self.killed_for:
            self.killed_for = reason
        if self.proc is None:
            return
        tree = process_tree(self.proc.pid) if self.alive() else []
        if self.alive():
            try:
                self.proc.terminate()
                self.proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, OSError):
                pass
        for p in tree:  # what SIGTERM left: SIGKILL, by pid
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        try:  # and whatever is left of the session it was started in (its own process group)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.tracker.pid = None
        try:
            self._log.close()
        except Exception:  # noqa: BLE001
            pass

    # -- log
    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def log_lines(self, start: int = 0, end: Optional[int] = None) -> list[str]:
        with open(self.log_path, "rb") as f:
            f.seek(start)
            data = f.read() if end is None else f.read(max(0, end - start))
        return data.decode("utf-8", "replace").splitlines()

    def read_new(self, pos: int) -> tuple[list[str], int]:
        """The complete log lines from byte ``pos`` on, and where the next read starts."""
        with open(self.log_path, "rb") as f:
            f.seek(pos)
            data = f.read()
        cut = data.rfind(b"\n") + 1
        return data[:cut].decode("utf-8", "replace").splitlines(), pos + cut

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_lines()[-n:])
        except OSError:
            return ""

    # -- HTTP
    def post(self, path: str, body: Optional[dict] = None, timeout: float = 30.0) -> tuple[int, bytes]:
        req = urllib.request.Request(self.base + path, data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with _open(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def get_json(self, path: str, timeout: float = 30.0) -> Any:
        with _open(self.base + path, timeout=timeout) as r:
            return json.loads(r.read())

    def flush_cache(self) -> bool:
        for _ in range(10):
            try:
                code, _ = self.post("/flush_cache", timeout=30)
                if code == 200:
                    return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        return False

    def abort(self, rid: Optional[str] = None) -> None:
        body = {"rid": rid} if rid is not None else {"abort_all": True}
        try:
            self.post("/abort_request", body, timeout=10)
        except (urllib.error.URLError, OSError):
            pass

    def generate(self, input_ids: list[int], max_new: int, rid: Optional[str] = None,
                 timeout: Optional[float] = None, rec: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """One streamed greedy request: ``{t_send, chunks: [(t, tokens)], t_first, t_done,
        output_ids, finish_reason, cached_tokens, error}`` (times: perf_counter), filled in
        ``rec`` as the chunks arrive (another thread may read it meanwhile)."""
        body: dict[str, Any] = {"input_ids": input_ids, "stream": True,
                                "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0,
                                                    "ignore_eos": True}}
        if rid is not None:
            body["rid"] = rid
        rec = {} if rec is None else rec
        rec.update({"t_send": None, "chunks": [], "t_first": None, "t_done": None,
                    "output_ids": None, "finish_reason": None, "cached_tokens": None, "error": None,
                    "max_new": max_new, "rid": rid})
        req = urllib.request.Request(self.base + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        rec["t_send"] = time.perf_counter()
        try:
            with _open(req, timeout=timeout or self.request_timeout) as r:
                for raw in r:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    t = time.perf_counter()
                    out = json.loads(data)
                    if "error" in out:
                        rec["error"] = str(out["error"])[:500]
                        break
                    meta = out.get("meta_info", {})
                    n = meta.get("completion_tokens")
                    if n is None:
                        n = len(out.get("output_ids") or [])
                    rec["chunks"].append((t, int(n)))
                    if rec["t_first"] is None and n >= 1:
                        rec["t_first"] = t
                    ids = out.get("output_ids")
                    if ids is not None:  # cumulative (SGLang's default) or, with
                        # --incremental-streaming-output, this chunk's tokens only
                        rec["output_ids"] = list(ids) if len(ids) == n or rec["output_ids"] is None \
                            else rec["output_ids"] + list(ids)
                    rec["cached_tokens"] = meta.get("cached_tokens", rec["cached_tokens"])
                    fr = meta.get("finish_reason")
                    if fr is not None:
                        rec["finish_reason"] = fr
        except urllib.error.HTTPError as e:
            rec["error"] = f"HTTP {e.code}: {e.read()[:300]!r}"
        except (urllib.error.URLError, OSError, ValueError) as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:500]
        rec["t_done"] = time.perf_counter()
        return rec


# ---------------------------------------------------------------- the run

def prompt(seed: int, tag: str, length: int, vocab: int) -> list[int]:
    """Random token ids in [3, vocab): the same for the same (seed, tag), fresh otherwise."""
    rng = random.Random(f"{seed}/{tag}/{length}")
    return [rng.randrange(3, vocab) for _ in range(length)]


def model_vocab(model_dir: str) -> int:
    try:
        return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError):
        return 32000


def emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj, default=str), flush=True)


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.t0 = time.monotonic()
        self.out_dir = Path(args.out or RESULTS_DIR)
        self.log_dir = Path(args.log_dir) if args.log_dir else self.out_dir
        self.gpu = args.gpu or gpu_index()
        self.vocab = model_vocab(args.model_dir)
        self.existing: Optional[dict] = None
        path = self.out_dir / RESULT_NAME
        if args.merge and path.exists():
            try:
                self.existing = json.loads(path.read_text())
            except ValueError:
                self.existing = None
        self.result: dict[str, Any] = {}
        self.check_prompts = [prompt(args.seed, f"check{i}", args.check_len, self.vocab)
                              for i in range(args.check_prompts)]
        self.server: Optional[Server] = None

    # -- time
    def left(self) -> float:
        if not self.args.time_budget:
            return float("inf")
        return self.args.time_budget - (time.monotonic() - self.t0)

    def bounded(self, t: float) -> float:
        return max(1.0, min(t, self.left()))

    # -- result file
    def init_result(self, servers: list[dict]) -> None:
        a = self.args
        old = (self.existing or {}).get("check") or {}
        same = all(old.get(k) == v for k, v in zip(CHECK_KEYS, (a.check_prompts, a.check_len, a.check_new, a.seed)))
        ref = old.get("reference_tokens") if same else None  # SGLang's tokens for these same prompts
        env = device_info(self.gpu)
        self.result = {
            "device": env["device"],
            "date": _dt.date.today().isoformat(),
            "env": env,
            "what": "SGLang's real server (launch_server, dummy weights) with and without the sparsehi plugin, "
                    "one GPU, same flags; see benchmarks/bench_sglang_server.py",
            "rows": [],
            "defaults_start": None,
            "tokens_equal_full_topk": None,
            "tokens_equal_full_topk_graphed": None,
            "tokens_equal_full_topk_eager": None,
            "check": {"prompts": a.check_prompts, "prompt_len": a.check_len, "new_tokens": a.check_new,
                      "seed": a.seed, "plugin_args": a.check_plugin_args, "reference_tokens": ref},
            "config": {"model_dir": a.model_dir, "contexts": a.contexts, "context_length": a.context_length,
                       "new_tokens": a.new_tokens, "b1_new_tokens": a.b1_new_tokens, "ramp_step": a.ramp_step,
                       "batch_cap": a.batch_cap, "held_extra": a.held_extra, "ttft_reps": a.ttft_reps,
                       "start_token": a.start_token, "min_window_steps": a.min_window_steps,
                       "plugin_args": a.plugin_args, "server_args": a.server_args, "page_size": a.page_size,
                       "mem_fraction_static": a.mem_fraction_static, "baseline": (
                           "plugin loaded, no --sparsehi flags" if a.baseline_plugin_loaded else
                           "SGLANG_PLUGINS=__none__: no plugin loaded"),
                       "argv": sys.argv[1:]},
            "servers": {},
        }

    def write(self) -> Path:
        payload = merge_results(self.existing, self.result)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / RESULT_NAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        os.replace(tmp, path)
        return path

    def put_row(self, row: dict[str, Any]) -> None:
        rows = [r for r in self.result["rows"] if (r["context"], r["plugin"]) != (row["context"], row["plugin"])]
        self.result["rows"] = sorted(rows + [row], key=lambda r: (r["context"], r["plugin"]))
        self.write()

    # -- servers
    def wait_gpu_idle(self, baseline: Optional[float], timeout: float = 90.0) -> None:
        if baseline is None:
            return
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            used = gpu_used_gib(self.gpu)
            if used is None or used <= baseline + 1.0:
                return
            time.sleep(1.0)
        emit({"warning": f"GPU memory still {gpu_used_gib(self.gpu)} GiB used, {baseline:.2f} GiB before"})

    def run(self, servers: list[dict]) -> dict[str, Any]:
        self.init_result(servers)
        self.write()
        baseline = gpu_used_gib(self.gpu)
        self.result["gpu_used_before_gib"] = None if baseline is None else round(baseline, 2)
        for spec in servers:
            if self.left() < self.args.min_server_s:
                emit({"server": spec["tag"], "skipped": "time budget"})
                self.result["servers"][spec["tag"]] = {"skipped": "time budget"}
                self.write()
                continue
            self.wait_gpu_idle(baseline)
            self.run_server(spec)
        self.result["tokens_equal_full_topk"] = combine_tokens_equal(
            self.result["tokens_equal_full_topk_graphed"], self.result["tokens_equal_full_topk_eager"])
        path = self.write()
        final = merge_results(self.existing, self.result)
        problems = check_schema(final)
        emit({"wrote": str(path), "schema_problems": problems})
        return final

    def run_server(self, spec: dict[str, Any]) -> None:
        a = self.args
        tag = spec["tag"]
        port = free_port()
        cmd = server_cmd(a.python, spec["flags"], port)
        env = server_env(spec["plugin"], a.baseline_plugin_loaded)
        log_path = self.log_dir / f"server_{tag}.log"
        rec: dict[str, Any] = {"cmd": shlex.join(cmd), "env_SGLANG_PLUGINS": env["SGLANG_PLUGINS"],
                               "log": str(log_path), "plugin": spec["plugin"], "tasks": spec["tasks"]}
        self.result["servers"][tag] = rec
        emit({"server": tag, "starting": rec["cmd"]})
        srv = None
        tracker = MemTracker(self.gpu, a.poll_s, a.min_host_avail_gib,
                             on_host_oom=lambda: srv and srv.kill("host memory available fell below "
                                                                   f"{a.min_host_avail_gib} GiB"))
        srv = Server(tag, cmd, env, log_path, port, tracker, a.request_timeout)
        self.server = srv
        measured: set[int] = set()
        try:
            srv.start()  # before the tracker's thread: the fork sees one thread
            tracker.start()
            rec["start_s"] = round(srv.wait_ready(self.bounded(a.start_timeout)), 1)
            rec.update(parse_startup(srv.log_lines()))
            rec["server_info"] = self.server_info(srv)
            if rec.get("max_total_num_tokens") is None:  # the log line not found: ask the server
                rec["max_total_num_tokens"] = next((v for k, v in rec["server_info"].items()
                                                    if k.endswith("max_total_num_tokens") and isinstance(v, int)), None)
            emit({"server": tag, "up_s": rec["start_s"], "kv_tokens": rec.get("kv_tokens"),
                  "max_total_num_tokens": rec.get("max_total_num_tokens"),
                  "max_running_requests": rec.get("max_running_requests")})
            w = srv.generate(prompt(a.seed, "warmup", WARMUP_LEN, self.vocab), WARMUP_NEW,
                             timeout=self.bounded(a.request_timeout))
            rec["warmup_ok"] = w["error"] is None and w["output_ids"] is not None and \
                len(w["output_ids"]) == WARMUP_NEW
            rec["warmup_error"] = w["error"]
            if spec["defaults_probe"]:
                self.result["defaults_start"] = bool(self.result["defaults_start"] is not False and rec["warmup_ok"])
                self.result.setdefault("defaults_start_server", tag)
            self.write()
            if "reference" in spec["tasks"]:
                self.check_tokens(srv, reference=True)
            if "check" in spec["tasks"]:
                self.check_tokens(srv, reference=False, eager="eager" in tag)
            if "measure" in spec["tasks"]:
                for ctx in a.contexts:
                    if self.left() < a.min_context_s:
                        emit({"server": tag, "context": ctx, "skipped": "time budget"})
                        continue
                    row = empty_row(ctx, spec["plugin"], tag)
                    try:
                        self.measure_context(srv, spec, ctx, row)
                    except Exception as e:  # noqa: BLE001 - this context's row says so; the next one goes on
                        row["error"] = f"{type(e).__name__}: {e}"[:1000]
                        if srv.killed_for:
                            row["error"] = f"{srv.killed_for} ({row['error']})"
                        row["peak_gpu_gib"], row["peak_host_gib"] = srv.tracker.peaks()
                        emit({"server": tag, "context": ctx, "error": row["error"]})
                        self.put_row(row)
                        measured.add(ctx)
                        if not srv.alive():
                            raise
                        continue
                    measured.add(ctx)
        except Exception as e:  # noqa: BLE001 - the run goes on with the next server
            err = f"{type(e).__name__}: {e}"
            if srv.killed_for:
                err = f"{srv.killed_for} ({err})"
            rec["error"] = err[:1000]
            rec["log_tail"] = srv.log_tail(40)
            emit({"server": tag, "error": rec["error"]})
            if spec["defaults_probe"] and "warmup_ok" not in rec:
                self.result["defaults_start"] = False
                self.result["defaults_start_server"] = tag  # the one that failed
            if "measure" in spec["tasks"]:
                for ctx in a.contexts:
                    if ctx not in measured:
                        row = empty_row(ctx, spec["plugin"], tag)
                        row["error"] = rec["error"]
                        self.put_row(row)
        finally:
            srv.kill()
            tracker.stop()
            g, h = tracker.peaks("life")
            rec.update(peak_gpu_gib=g, peak_host_gib=h, host_oom_guard=tracker.host_oom)
            self.server = None
            self.write()

    def server_info(self, srv: Server) -> dict[str, Any]:
        """A few resolved settings from /server_info (SGLang's defaults as they came out)."""
        want = {"page_size", "mem_fraction_static", "max_running_requests", "max_total_num_tokens",
                "chunked_prefill_size", "max_prefill_tokens", "context_length", "attention_backend",
                "cuda_graph_max_bs", "max_bs", "disable_cuda_graph", "decode_log_interval", "version"}
        try:
            info = srv.get_json("/server_info", timeout=30)
        except Exception as e:  # noqa: BLE001
            return {"error": f"{type(e).__name__}: {e}"[:300]}
        flat: dict[str, Any] = {}

        def walk(x, pre=""):
            if isinstance(x, dict):
                for k, v in x.items():
                    walk(v, f"{pre}{k}.")
            elif isinstance(x, list) and pre.startswith("internal_states"):
                for i, v in enumerate(x[:1]):
                    walk(v, f"{pre}{i}.")
            else:
                key = pre[:-1]
                last = key.rsplit(".", 1)[-1]
                if last in want or "sparsehi" in key:
                    flat[key] = x if isinstance(x, (int, float, str, bool, type(None))) else str(x)[:200]
        walk(info)
        return flat

    # -- measurements
    def measure_context(self, srv: Server, spec: dict[str, Any], ctx: int, row: dict[str, Any]) -> None:
        a = self.args
        tag, plugin = spec["tag"], spec["plugin"]
        row.update(new_tokens=a.new_tokens, b1_new_tokens=a.b1_new_tokens)
        srv.tracker.reset_phase()
        if not srv.flush_cache():
            row["flush_cache_failed"] = True
        start = srv.log_size()
        cached = 0
        t_one = None
        if not a.skip_ttft:
            reps = []
            for i in range(max(1, a.ttft_reps)):
                r = srv.generate(prompt(a.seed, f"ttft{i}", ctx, self.vocab), 1, timeout=self.bounded(a.request_timeout))
                if r["error"] or not r["chunks"]:
                    raise RuntimeError(f"ttft request failed: {r['error']}")
                reps.append(r["t_done"] - r["t_send"])
                cached += r["cached_tokens"] or 0
            t_one = min(reps)
            row.update(ttft_s=round(t_one, 3), ttft_reps_s=[round(x, 3) for x in reps])
            emit({"server": tag, "context": ctx, "plugin": plugin, "ttft_s": row["ttft_s"], "reps": row["ttft_reps_s"]})
        if not a.skip_b1:
            b1_start = srv.log_size()
            r = srv.generate(prompt(a.seed, "b1", ctx, self.vocab), a.b1_new_tokens,
                             timeout=self.bounded(a.request_timeout))
            if r["error"] or not r["chunks"]:
                raise RuntimeError(f"batch-1 request failed: {r['error']}")
            cached += r["cached_tokens"] or 0
            n = r["chunks"][-1][1]
            t_n = r["t_done"] - r["t_send"]
            row["b1_tok_s"] = b1_rate(t_one, t_n, n)
            row["b1_stream_tok_s"] = window_rates([r], 1, a.start_token).get(1)
            row.update(first_step(r["chunks"]))
            time.sleep(0.3)
            b1_log = decode_lines(srv.log_lines(b1_start))
            row["sglang_b1_gen_tok_s"] = steady_gen_tok_s(b1_log, 1)
            emit({"server": tag, "context": ctx, "plugin": plugin, "b1_tok_s": row["b1_tok_s"],
                  "b1_stream_tok_s": row["b1_stream_tok_s"], "sglang_b1_gen_tok_s": row["sglang_b1_gen_tok_s"],
                  "T1_s": None if t_one is None else round(t_one, 3), "TN_s": round(t_n, 3), "N": n})
        row["peak_gpu_gib"], row["peak_host_gib"] = srv.tracker.peaks()
        self.put_row(row)
        if not a.skip_held and self.left() > a.min_context_s / 2:
            srv.flush_cache()
            held = self.held_run(srv, spec, ctx)
            cached += held.pop("cached_tokens_client", 0)
            row.update(held)
            emit({"server": tag, "context": ctx, "plugin": plugin, **{k: row.get(k) for k in (
                "batch_held", "held_sent", "held_saturated", "best_tok_s", "best_batch", "held_tok_s",
                "sglang_gen_tok_s", "tok_s_by_batch")}})
        lines = srv.log_lines(start)
        summ = phase_log_summary(lines)
        row["cached_tokens"] = max(cached, summ["cached_tokens"])
        row["retracted"] = summ["retracted"]
        row["peak_gpu_gib"], row["peak_host_gib"] = srv.tracker.peaks()
        if srv.tracker.host_oom:
            row["error"] = srv.killed_for
        emit({"server": tag, "context": ctx, "plugin": plugin, "peak_gpu_gib": row["peak_gpu_gib"],
              "peak_host_gib": row["peak_host_gib"]})
        self.put_row(row)

    def held_run(self, srv: Server, spec: dict[str, Any], ctx: int) -> dict[str, Any]:
        """Send more requests of ``ctx`` than fit, streamed, each asking for more tokens than
        the run lasts; once SGLang decodes with a queue and its number of running requests
        has not grown for ``--held-settle-s`` (it holds all it can: the plugin's batch grows
        as registered prompts leave the GPU, one prefill at a time), abort those still
        queued, let the held batch decode for ``--held-measure-s``, then abort the rest.
        Held batch from the log, rates from the streams."""
        a = self.args
        rec = self.result["servers"][spec["tag"]]
        n = held_plan(rec.get("max_total_num_tokens"), rec.get("max_running_requests"), ctx, a.held_extra,
                      a.batch_cap)
        news = ramp_new_tokens(n, a.held_new_tokens, a.ramp_step, a.context_length - ctx - 8)
        prompts = [prompt(a.seed, f"held{i}", ctx, self.vocab) for i in range(n)]
        stamp = f"{os.getpid()}-{int(time.time())}"
        rids = [f"bench-{spec['tag']}-{ctx}-{i}-{stamp}" for i in range(n)]
        recs: list[dict[str, Any]] = [{"t_first": None, "chunks": []} for _ in range(n)]
        start = srv.log_size()
        deadline = time.monotonic() + self.bounded(a.request_timeout)

        def worker(i: int) -> None:
            srv.generate(prompts[i], news[i], rid=rids[i], timeout=max(1.0, deadline - time.monotonic()),
                         rec=recs[i])

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
        t_sent, t_mono = time.perf_counter(), time.monotonic()
        for t in threads:
            t.start()
        aborted: Optional[list[int]] = None
        stop_at: Optional[float] = None
        pos, last_queue, queue_seen = start, 0, False
        most, grew = 0, time.monotonic()  # most running requests seen, and when that last grew
        while any(t.is_alive() for t in threads):
            now = time.monotonic()
            if now > deadline or not srv.alive():
                srv.abort()
                break
            lines, pos = srv.read_new(pos)
            for d in decode_lines(lines):
                last_queue = d["queue"]
                queue_seen = queue_seen or last_queue > 0
                if d["running"] > most:
                    most, grew = d["running"], now
            settled = queue_seen and now - grew > a.held_settle_s
            if aborted is None and (settled or (queue_seen and last_queue == 0 and most > 0
                                                and now - grew > a.held_settle_s)):
                waiting = [i for i in range(n) if threads[i].is_alive() and recs[i]["t_first"] is None]
                for i in waiting:
                    srv.abort(rids[i])
                aborted = waiting
                stop_at = now + a.held_measure_s
                emit({"server": spec["tag"], "context": ctx, "held_aborted_queued": len(waiting),
                      "log_queue": last_queue, "running": most, "after_s": round(now - t_mono, 2)})
            if aborted is None and not queue_seen and most > 0 and now - grew > a.held_settle_s:
                stop_at = stop_at or now + a.held_measure_s  # everything was admitted (fewer sent than fit)
                aborted = []
            if stop_at is not None and now > stop_at:
                for i in range(n):
                    if threads[i].is_alive():
                        srv.abort(rids[i])
                stop_at = float("inf")
            time.sleep(0.05)
        for t in threads:
            t.join(timeout=max(1.0, deadline - time.monotonic() + 5.0))
        wall = time.perf_counter() - t_sent
        time.sleep(0.5)
        summ = phase_log_summary(srv.log_lines(start))
        decoded = [r for r in recs if r.get("error") is None and r["t_first"] is not None]
        rates = window_rates(decoded, a.min_window_steps, a.start_token)
        best, best_b = best_rate(rates)
        held = summ["held"]
        return {"batch_held": held, "held_sent": n, "held_aborted": len(aborted or []),
                "held_saturated": None if held is None else bool(summ["queue_seen"]),
                "held_new_tokens": [news[0], news[-1]],
                "held_errors": sum(1 for i, r in enumerate(recs) if r.get("error") and r["t_first"] is None
                                   and i not in (aborted or [])),
                "best_tok_s": best, "best_batch": best_b, "held_tok_s": rates.get(held) if held else None,
                "tok_s_by_batch": {str(k): v for k, v in rates.items()},
                "sglang_gen_tok_s": steady_gen_tok_s(summ["decodes"], held),
                "held_cuda_graph": summ["cuda_graph"], "held_wall_s": round(wall, 1),
                "cached_tokens_client": sum(r.get("cached_tokens") or 0 for r in recs)}

    def check_tokens(self, srv: Server, reference: bool, eager: bool = False) -> None:
        """Greedy tokens of the check prompts, one at a time: SGLang's reference, or the
        plugin's, compared with it."""
        a = self.args
        toks = []
        for i, p in enumerate(self.check_prompts):
            r = srv.generate(p, a.check_new, timeout=self.bounded(a.request_timeout))
            toks.append(r["output_ids"] if r["error"] is None else None)
        check = self.result["check"]
        if reference:
            check["reference_tokens"] = toks
            check["reference_server"] = srv.tag
            emit({"server": srv.tag, "check_reference": [None if t is None else t[:8] for t in toks]})
        else:
            v = tokens_verdict(check.get("reference_tokens"), toks)
            key = "eager" if eager else "graphed"
            check[f"{key}_first_mismatch"] = v["first_mismatch"]
            check[f"{key}_tokens_head"] = [None if t is None else t[:8] for t in toks]
            self.result[f"tokens_equal_full_topk_{key}"] = v["equal"]
            self.result["tokens_equal_full_topk"] = combine_tokens_equal(
                self.result["tokens_equal_full_topk_graphed"], self.result["tokens_equal_full_topk_eager"])
            emit({"server": srv.tag, f"tokens_equal_full_topk_{key}": v["equal"],
                  "first_mismatch": v["first_mismatch"]})
        self.write()


# ---------------------------------------------------------------- CLI

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=os.environ.get("MODEL_DIR", "/tmp/l8b"),
                    help="model config dir for --load-format dummy (default $MODEL_DIR or /tmp/l8b)")
    ap.add_argument("--contexts", default=DEFAULT_CONTEXTS, help="comma list of prompt lengths (tokens)")
    ap.add_argument("--context-length", type=int, default=None,
                    help=f"SGLang's --context-length (default: largest context + {CONTEXT_MARGIN})")
    ap.add_argument("--new-tokens", type=int, default=256, help="max_new_tokens of the held run's first request")
    ap.add_argument("--b1-new-tokens", type=int, default=None, help="N of the batch-1 timing (default --new-tokens)")
    ap.add_argument("--ramp-step", type=int, default=0,
                    help="held run: request i asks --held-new-tokens + i * this (0: all the same)")
    ap.add_argument("--held-new-tokens", type=int, default=8192,
                    help="held run: max_new_tokens of each request (more than the run lasts; capped by the "
                         "context length); the run ends them by abort")
    ap.add_argument("--held-settle-s", type=float, default=25.0,
                    help="held run: the batch is held once SGLang decodes with a queue and its running "
                         "requests have not grown for this long")
    ap.add_argument("--held-measure-s", type=float, default=15.0,
                    help="held run: how long the held batch decodes (queue aborted) before the run ends")
    ap.add_argument("--batch-cap", type=int, default=64, help="most requests a held run sends")
    ap.add_argument("--held-extra", type=int, default=2, help="requests sent beyond what the KV pool can hold")
    ap.add_argument("--min-window-steps", type=int, default=16,
                    help="a rate window counts when every request in it advanced this many tokens")
    ap.add_argument("--start-token", type=int, default=2,
                    help="client-side rates count a request from its arrival of this token on (2: the first "
                         "decode step, where the plugin registers the prompt, is left out)")
    ap.add_argument("--ttft-reps", type=int, default=2, help="max_new_tokens=1 requests per context")
    ap.add_argument("--only", choices=("plugin", "sglang"), default=None, help="start only these servers")
    ap.add_argument("--plugin-args", default=DEFAULT_PLUGIN_ARGS, help="the plugin's flags (measurement server)")
    ap.add_argument("--check-plugin-args", default=DEFAULT_CHECK_PLUGIN_ARGS,
                    help="the plugin's flags for the tokens-equal check (top-k >= check prompt + new tokens)")
    ap.add_argument("--server-args", default="", help="extra flags for every server (e.g. '--max-running-requests 16')")
    ap.add_argument("--page-size", type=int, default=None, help="SGLang --page-size (default: SGLang's)")
    ap.add_argument("--mem-fraction-static", type=float, default=None,
                    help="SGLang --mem-fraction-static (default: SGLang's)")
    ap.add_argument("--baseline-plugin-loaded", action="store_true",
                    help="the SGLang server loads the plugin (without --sparsehi flags) instead of no plugin")
    ap.add_argument("--check-prompts", type=int, default=3)
    ap.add_argument("--check-len", type=int, default=3000, help="check prompt tokens")
    ap.add_argument("--check-new", type=int, default=64, help="greedy tokens per check prompt")
    for what, help_ in (("measure", "the per-context measurements (servers for the checks only)"),
                        ("ttft", "the ttft requests (b1 then has no T(1))"), ("b1", "the batch-1 timing"),
                        ("held", "the held-batch run"), ("check", "the tokens-equal check"),
                        ("eager-check", "the eager tokens-equal check"),
                        ("defaults", "the extra defaults_start server (needed only with --page-size / "
                                     "--mem-fraction-static)")):
        ap.add_argument(f"--skip-{what}", action="store_true", help=f"skip {help_}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=420.0, help="seconds for a server to come up")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds for one request / held run")
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds for the whole run (0: none); no new server or context past it")
    ap.add_argument("--min-server-s", type=float, default=150.0, help="budget left needed to start a server")
    ap.add_argument("--min-context-s", type=float, default=60.0, help="budget left needed to start a context")
    ap.add_argument("--poll-s", type=float, default=0.5, help="memory poll interval")
    ap.add_argument("--min-host-avail-gib", type=float, default=3.0,
                    help="kill the server when the host's MemAvailable falls below this")
    ap.add_argument("--gpu", default=None, help="nvidia-smi -i for the memory polls (default: CUDA_VISIBLE_DEVICES[0] or 0)")
    ap.add_argument("--python", default=sys.executable, help="python that runs sglang.launch_server")
    ap.add_argument("--out", default=None, help="result directory (default benchmarks/results)")
    ap.add_argument("--log-dir", default=None, help="directory of the server logs (default: --out's)")
    ap.add_argument("--merge", action="store_true",
                    help="keep what an existing result file has and this run does not measure")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the server commands, start nothing")
    # the flag-string options take a value that starts with "--": join it as --opt=value
    argv = list(sys.argv[1:] if argv is None else argv)
    joined = []
    it = iter(argv)
    for tok in it:
        if tok in FLAG_STRING_OPTIONS:
            nxt = next(it, None)
            joined.append(tok if nxt is None else f"{tok}={nxt}")
        else:
            joined.append(tok)
    args = ap.parse_args(joined)
    try:
        args.contexts = [int(x) for x in str(args.contexts).split(",") if x.strip()]
    except ValueError:
        ap.error(f"--contexts={args.contexts!r}: a comma list of integers")
    if not args.contexts or min(args.contexts) < 1:
        ap.error("--contexts: at least one positive length")
    if args.context_length is None:
        args.context_length = max(args.contexts) + CONTEXT_MARGIN
    if args.b1_new_tokens is None:
        args.b1_new_tokens = args.new_tokens
    if args.new_tokens < 2 or args.b1_new_tokens < 2:
        ap.error("--new-tokens / --b1-new-tokens: at least 2")
    return args


def dry_run(args: argparse.Namespace, servers: list[dict]) -> list[str]:
    lines = []
    for s in servers:
        lines.append(f"# {s['tag']}: plugin={s['plugin']} tasks={','.join(s['tasks'])} "
                     f"contexts={args.contexts if 'measure' in s['tasks'] else '-'}")
        lines.append(f"SGLANG_PLUGINS={s['env_plugins']} " + shlex.join(server_cmd(args.python, s["flags"], "PORT")))
    for line in lines:
        print(line, flush=True)
    return lines


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    servers = plan_servers(args)
    if args.dry_run:
        return {"dry_run": dry_run(args, servers)}
    bench = Bench(args)

    def on_signal(signum, frame):  # noqa: ARG001
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return bench.run(servers)
    finally:
        if bench.server is not None:
            bench.server.kill("interrupted")
        try:
            bench.write()
        except Exception:  # noqa: BLE001
            pass
        for s, h in old.items():
            signal.signal(s, h)


if __name__ == "__main__":
    main()
