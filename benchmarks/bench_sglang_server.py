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
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sglang_server.run import Bench  # noqa: E402
from benchmarks.sglang_server.server_plan import (CONTEXT_MARGIN, DEFAULT_CHECK_PLUGIN_ARGS,  # noqa: E402
                                                  DEFAULT_CONTEXTS, DEFAULT_PLUGIN_ARGS, FLAG_STRING_OPTIONS,
                                                  plan_servers, server_cmd)


# ---------------------------------------------------------------- CLI

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=os.environ.get("MODEL_DIR", "/tmp/l8b"),
                    help="model config dir for --load-format dummy (default $MODEL_DIR or /tmp/l8b)")
    ap.add_argument("--contexts", default=DEFAULT_CONTEXTS, help="comma list of prompt lengths (tokens)")
    ap.add_argument("--context-length", type=int, default=None,
                    help=f"SGLang's --context-length (default: largest context + {CONTEXT_MARGIN})")
    _add_measurement_args(ap)
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
    _add_run_args(ap)
    # the flag-string options take a value that starts with "--": join it as --opt=value
    args = ap.parse_args(_join_flag_strings(sys.argv[1:] if argv is None else argv))
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


def _add_measurement_args(ap: argparse.ArgumentParser) -> None:
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


def _add_run_args(ap: argparse.ArgumentParser) -> None:
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


def _join_flag_strings(argv: list[str]) -> list[str]:
    """``argv`` with each flag-string option joined to its value (``--opt=value``)."""
    joined = []
    it = iter(argv)
    for tok in it:
        if tok in FLAG_STRING_OPTIONS:
            nxt = next(it, None)
            joined.append(tok if nxt is None else f"{tok}={nxt}")
        else:
            joined.append(tok)
    return joined


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