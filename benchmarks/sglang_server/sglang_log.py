"""What bench_sglang_server reads in SGLang's server log: Decode / Prefill batch lines,
the start-up lines (KV pool, scheduler limits, weights, CUDA graphs, plugins)."""
from __future__ import annotations

import re
import statistics
from typing import Any, Iterable, Optional

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
