"""One run of bench_sglang_server: each planned server started in turn, its warm-up, the
per-context measurements (ttft, batch-1 rate, the held batch), the tokens-equal check,
the result file rewritten after each."""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import random
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.sglang_server.client_rates import (b1_rate, best_rate, first_step, held_plan, ramp_new_tokens,
                                                   window_rates)
from benchmarks.sglang_server.machine import MemTracker, device_info, gpu_index, gpu_used_gib
from benchmarks.sglang_server.result_file import (CHECK_KEYS, RESULT_NAME, RESULTS_DIR, check_schema,
                                                  combine_tokens_equal, empty_row, merge_results, tokens_verdict)
from benchmarks.sglang_server.server import Server, free_port
from benchmarks.sglang_server.server_plan import server_cmd, server_env
from benchmarks.sglang_server.sglang_log import decode_lines, parse_startup, phase_log_summary, steady_gen_tok_s

WARMUP_LEN, WARMUP_NEW = 4096, 16  # >= the plugin's default min_sparse_prompt_len: a sparse request


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
            self.start_server(srv, tracker, rec)
            self.warmup(srv, spec, rec)
            if "reference" in spec["tasks"]:
                self.check_tokens(srv, reference=True)
            if "check" in spec["tasks"]:
                self.check_tokens(srv, reference=False, eager="eager" in tag)
            if "measure" in spec["tasks"]:
                self.measure_contexts(srv, spec, measured)
        except Exception as e:  # noqa: BLE001 - the run goes on with the next server
            self.server_failed(srv, spec, rec, e, measured)
        finally:
            srv.kill()
            tracker.stop()
            g, h = tracker.peaks("life")
            rec.update(peak_gpu_gib=g, peak_host_gib=h, host_oom_guard=tracker.host_oom)
            self.server = None
            self.write()

    def start_server(self, srv: Server, tracker: MemTracker, rec: dict[str, Any]) -> None:
        """Start ``srv`` and wait until it serves; ``rec`` takes what its log and
        /server_info say about its start."""
        a = self.args
        srv.start()  # before the tracker's thread: the fork sees one thread
        tracker.start()
        rec["start_s"] = round(srv.wait_ready(self.bounded(a.start_timeout)), 1)
        rec.update(parse_startup(srv.log_lines()))
        rec["server_info"] = self.server_info(srv)
        if rec.get("max_total_num_tokens") is None:  # the log line not found: ask the server
            rec["max_total_num_tokens"] = next((v for k, v in rec["server_info"].items()
                                                if k.endswith("max_total_num_tokens") and isinstance(v, int)), None)
        emit({"server": srv.tag, "up_s": rec["start_s"], "kv_tokens": rec.get("kv_tokens"),
              "max_total_num_tokens": rec.get("max_total_num_tokens"),
              "max_running_requests": rec.get("max_running_requests")})

    def warmup(self, srv: Server, spec: dict[str, Any], rec: dict[str, Any]) -> None:
        """One sparse-length request; on the defaults probe server it decides defaults_start."""
        a = self.args
        w = srv.generate(prompt(a.seed, "warmup", WARMUP_LEN, self.vocab), WARMUP_NEW,
                         timeout=self.bounded(a.request_timeout))
        rec["warmup_ok"] = w["error"] is None and w["output_ids"] is not None and \
            len(w["output_ids"]) == WARMUP_NEW
        rec["warmup_error"] = w["error"]
        if spec["defaults_probe"]:
            self.result["defaults_start"] = bool(self.result["defaults_start"] is not False and rec["warmup_ok"])
            self.result.setdefault("defaults_start_server", spec["tag"])
        self.write()

    def measure_contexts(self, srv: Server, spec: dict[str, Any], measured: set[int]) -> None:
        """Every context's row on ``srv``; a context that fails gets an error row and the next
        one goes on (unless the server died). ``measured`` collects the contexts done."""
        a = self.args
        tag = spec["tag"]
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

    def server_failed(self, srv: Server, spec: dict[str, Any], rec: dict[str, Any], e: Exception,
                      measured: set[int]) -> None:
        """The server's part failed with ``e``: its record says why, and so does every
        context row it did not write."""
        tag = spec["tag"]
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
            for ctx in self.args.contexts:
                if ctx not in measured:
                    row = empty_row(ctx, spec["plugin"], tag)
                    row["error"] = rec["error"]
                    self.put_row(row)

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
