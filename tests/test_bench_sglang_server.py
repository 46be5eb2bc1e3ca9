"""benchmarks/bench_sglang_server.py on CPU: parsing SGLang 0.5.23's log lines (built with the
format strings of its source), the held batch and the client-side rates, the result file's
schema and merging, the server plan and commands (--dry-run); and one run end to end against
tests/fake_sglang_server.py (a stand-in for launch_server: no SGLang, no model, no GPU)."""
from __future__ import annotations

import json
import os
import shlex
import time
from pathlib import Path

import pytest

from benchmarks import bench_sglang_server as bench
from benchmarks.sglang_server import client_rates, machine, result_file, server_plan, sglang_log

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- SGLang's log formats

def decode_line(running, used, usage, graph, gen, queue, iter_msg="", prefix="", ms=""):
    """sglang/srt/managers/scheduler_components/metrics_reporter.py report_decode_stats
    (pool_stats_observer.get_decode_usage_msg_parts for a plain pool), behind
    utils/common.py configure_logger's "[%(asctime)s{ms}{prefix}] %(message)s"."""
    token_usage_msg = ", ".join([f"#token: {used}, token usage: {usage:.2f}"]) + ", "
    msg = f"Decode batch{iter_msg}, #running-req: {running}, {token_usage_msg}"
    msg += (f"{'cuda graph'}: {graph}, "
            f"gen throughput (token/s): {gen:.2f}, "
            f"#queue-req: {queue}")
    return f"[2026-11-26 10:00:00{ms}{prefix}] {msg}"


def prefill_line(new_seq, new_token, cached, usage, running, queue, pending=0, graph=False, thr=1234.5):
    token_usage_msg = ", ".join([f"token usage: {usage:.2f}"]) + ", "
    msg = (f"Prefill batch, #new-seq: {new_seq}, #new-token: {new_token}, #cached-token: {cached}, "
           f"{token_usage_msg}#running-req: {running}, #queue-req: {queue}, #pending-token: {pending}, ")
    msg += f"cuda graph: {graph}, "
    msg += f"input throughput (token/s): {thr:.2f}"
    return f"[2026-11-26 10:00:00] {msg}"


def startup_lines():
    """Startup lines as SGLang 0.5.23 formats them (scheduler.py, mem_cache/memory_pool.py,
    model_runner.py, cuda_graph_setup.py, kv_pool_runtime.py, plugins/__init__.py, http_server.py)."""
    ts = "[2026-11-26 10:00:00]"
    ts0 = "[2026-11-26 10:00:00]"
    return [
        f"{ts} " + "Loaded plugin %s from group %s" % ("sparsehi", "sglang.srt.plugins"),
        f"{ts} " + "sparsehi on: SparseConfig(algorithm='quest', top_k=2048)",
        f"{ts0} " + (f"Load weight end. elapsed={3.21:.2f} s, type={'LlamaForCausalLM'}, "
                     f"{''}avail mem={62.5:.2f} GB, mem usage={14.96:.2f} GB."),
        f"{ts0} " + (f"{'KV Cache'} {'is allocated'}. dtype: {'torch.bfloat16'}, "
                     f"#tokens: {404000}, K size: {24.66:.2f} GB, V size: {24.66:.2f} GB"),
        f"{ts0} " + (f"Capture {'target decode'} {'CUDA graph'} end. bs={[1, 2, 4, 8]}, elapsed={12.3:.2f} s, "
                     f"mem usage={0.71:.2f} GB, avail mem={5.1:.2f} GB."),
        f"{ts0} " + ("Post-capture KV sizing: KV cache allocated. dtype: %s, #tokens: %d, "
                     "KV size: %.2f GB, avail mem=%.2f GB" % ("torch.bfloat16", 410000, 50.05, 4.2)),
        f"{ts0} " + (f"max_total_num_tokens={410000}, chunked_prefill_size={8192}, max_prefill_tokens={16384}, "
                     f"max_running_requests={2048}, context_len={69632}, available_gpu_mem={4.2:.2f} GB"),
        f"{ts} The server is fired up and ready to roll!",
    ]


def test_decode_line_fields():
    d = sglang_log.parse_decode_line(decode_line(12, 393216, 0.97, True, 512.345, 2))
    assert d == {"running": 12, "queue": 2, "gen_tok_s": 512.35, "tokens": 393216, "token_usage": 0.97,
                 "cuda_graph": True, "ts": "2026-11-26 10:00:00"}


@pytest.mark.parametrize("kw", [dict(iter_msg=" [4711]"), dict(prefix=" TP0"), dict(ms=".123", prefix=" DP0 TP0")])
def test_decode_line_variants(kw):
    d = sglang_log.parse_decode_line(decode_line(3, 100, 0.01, False, 77.0, 0, **kw))
    assert (d["running"], d["queue"], d["gen_tok_s"], d["cuda_graph"]) == (3, 0, 77.0, False)


def test_decode_line_with_spec_and_mfu_parts():
    # speculative decoding adds "accept len ..." before the graph label; MFU adds text after #queue-req
    line = ("[2026-11-26 10:00:00] Decode batch, #running-req: 5, #token: 9000, token usage: 0.10, "
            "accept len: 1.50, accept rate: 0.25, cuda graph: True, gen throughput (token/s): 300.00, "
            "#queue-req: 0, est. decode TFLOPS/s (per GPU): 1.00")
    d = sglang_log.parse_decode_line(line)
    assert (d["running"], d["gen_tok_s"], d["queue"], d["tokens"]) == (5, 300.0, 0, 9000)


def test_other_lines_are_not_decode_lines():
    for line in [prefill_line(1, 8192, 0, 0.05, 0, 13), *startup_lines(), "", "Decode batch"]:
        assert sglang_log.parse_decode_line(line) is None


def test_prefill_line():
    p = sglang_log.parse_prefill_line(prefill_line(1, 8192, 64, 0.05, 3, 13, pending=24576))
    assert p == {"new_seq": 1, "new_token": 8192, "cached": 64, "running": 3, "queue": 13}


def test_startup_parse():
    info = sglang_log.parse_startup(startup_lines())
    assert info["max_total_num_tokens"] == 410000 and info["max_running_requests"] == 2048
    assert info["chunked_prefill_size"] == 8192 and info["context_len"] == 69632
    assert info["available_gpu_mem_gb"] == 4.2
    # the post-capture line comes after the pre-capture one and wins
    assert info["kv_tokens"] == 410000 and info["kv_gib"] == 50.05 and info["kv_post_capture"]
    assert info["weights_gib"] == 14.96
    assert info["graph_captures"] == [{"what": "target decode CUDA graph", "bs": "[1, 2, 4, 8]", "s": 12.3,
                                       "mem_gib": 0.71, "avail_gib": 5.1}]
    assert info["plugins_loaded"] == ["sparsehi"] and info["ready"]
    assert info["sparsehi_line_count"] == 2
    pre = sglang_log.parse_startup(startup_lines()[:4])
    assert pre["kv_tokens"] == 404000 and pre["kv_gib"] == 49.32
    skipped = sglang_log.parse_startup(["[t] " + "Skipping plugin %s (not in SGLANG_PLUGINS)" % "sparsehi"])
    assert skipped["plugins_skipped"] == ["sparsehi"] and skipped["plugins_loaded"] == []


def test_held_batch_and_steady_throughput():
    lines = [prefill_line(1, 8192, 0, 0.1, 0, 13)]
    lines += [decode_line(1, 40000, 0.1, True, 90.0, 0)]  # an earlier batch-1 phase
    lines += [decode_line(12, 400000, 0.97, True, g, 2) for g in (150.0, 500.0, 510.0, 505.0)]
    lines += [decode_line(9, 300000, 0.7, True, 450.0, 0), decode_line(2, 70000, 0.2, True, 160.0, 0)]
    decs = sglang_log.decode_lines(lines)
    assert sglang_log.held_batch(decs) == 12
    assert sglang_log.steady_gen_tok_s(decs, 12) == 505.0  # first line at 12 (prefill inside) left out
    assert sglang_log.steady_gen_tok_s(decs, 9) == 450.0  # a single line counts
    assert sglang_log.steady_gen_tok_s(decs, 7) is None and sglang_log.steady_gen_tok_s(decs, None) is None
    assert sglang_log.held_batch([]) is None
    summ = sglang_log.phase_log_summary(lines + ["[t] KV cache pool is full. Retract requests. #retracted_reqs: 2, "
                                            "#new_tokens_gained: 100"])
    assert summ["held"] == 12 and summ["queue_seen"] and summ["retracted"] == 2 and summ["cuda_graph"] == [True]


# ---------------------------------------------------------------- client-side rates

def _stream(first, step, n, start_decode):
    """A request whose first token arrives at ``first`` and whose others arrive every ``step``
    from ``start_decode`` on, ``n`` tokens in all."""
    return {"chunks": [(first, 1)] + [(start_decode + k * step, 1 + k) for k in range(1, n)]}


def test_window_rates_ramp_down():
    # three requests prefilled at 0, 1, 2 s (decode starved meanwhile), then decoding together
    # from 2 s at 10 ms a step; they ask 100, 140, 180 tokens: the batch steps down 3 -> 2 -> 1
    step = 0.01
    streams = [_stream(f, step, n, 2.0) for f, n in ((0.0, 100), (1.0, 140), (2.0, 180))]
    rates = client_rates.window_rates(streams, min_steps=16)
    assert set(rates) == {1, 2, 3}
    for c, r in rates.items():
        assert r == pytest.approx(c / step, rel=0.04)
    assert client_rates.best_rate(rates) == (rates[3], 3)


def test_window_rates_leave_out_prefill_windows():
    step = 0.01
    a = _stream(0.0, step, 300, 0.0)
    # b's first token at 1.0 s: a decoded alone before it; then both; nothing short counts
    b = _stream(1.0, step, 60, 1.0)
    # a stall (someone prefilling for 1 s) in c's and a's shared window halves that rate
    rates = client_rates.window_rates([a, b], min_steps=16)
    assert rates[1] == pytest.approx(100, rel=0.05) and rates[2] == pytest.approx(200, rel=0.05)
    assert client_rates.window_rates([a, b], min_steps=1000) == {}
    assert client_rates.window_rates([{"chunks": [(0.0, 1)]}, {"chunks": []}]) == {}


def test_window_rates_leave_out_the_first_decode_step():
    # two requests; the first decode step (token 2) takes 1 s (the plugin registering the
    # prompts), then 10 ms a step: from token 2 on the rate is the steady one
    step = 0.01
    streams = [{"chunks": [(0.0, 1)] + [(1.0 + k * step, 2 + k) for k in range(n)]} for n in (100, 140)]
    steady = client_rates.window_rates(streams, min_steps=16)
    assert steady[2] == pytest.approx(200, rel=0.03) and steady[1] == pytest.approx(100, rel=0.03)
    with_first = client_rates.window_rates(streams, min_steps=16, start_token=1)
    assert with_first[2] < 0.6 * steady[2]


def test_best_rate_and_b1():
    assert client_rates.best_rate({}) == (None, None)
    assert client_rates.best_rate({1: 50.0, 4: 180.0, 8: 170.0}) == (180.0, 4)
    assert client_rates.best_rate({2: 100.0, 4: 100.0}) == (100.0, 4)
    assert client_rates.b1_rate(2.0, 4.55, 256) == round(255 / 2.55, 1)
    assert client_rates.b1_rate(None, 4.0, 256) is None and client_rates.b1_rate(2.0, 1.0, 256) is None
    assert client_rates.b1_rate(2.0, 3.0, 1) is None


def test_held_plan_and_ramp():
    assert client_rates.held_plan(410000, 2048, 32768, 2, 64) == 12 + 2
    assert client_rates.held_plan(410000, 2048, 65536, 2, 64) == 6 + 2
    assert client_rates.held_plan(410000, 4, 32768, 2, 64) == 4 + 2  # max_running_requests binds
    assert client_rates.held_plan(410000, 2048, 32768, 2, 8) == 8  # the cap binds
    assert client_rates.held_plan(None, None, 32768, 2, 16) == 16
    assert client_rates.held_plan(1000, None, 32768, 0, 16) == 1
    assert client_rates.ramp_new_tokens(4, 256, 32, 1000) == [256, 288, 320, 352]
    assert client_rates.ramp_new_tokens(3, 256, 32, 300) == [256, 288, 300]
    assert client_rates.ramp_new_tokens(2, 256, 0, 1000) == [256, 256]


# ---------------------------------------------------------------- result file

def _payload(rows):
    return {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-27", "rows": rows, "defaults_start": True,
            "tokens_equal_full_topk": None}


def test_schema():
    row = result_file.empty_row(32768, True, "plugin")
    assert set(result_file.ROW_FIELDS) <= set(row)
    assert result_file.check_schema(_payload([row])) == []
    row.update(batch_held=12, b1_tok_s=101.5, best_tok_s=900.0, best_batch=12, ttft_s=2.1, peak_gpu_gib=70.1,
               peak_host_gib=20.0)
    assert result_file.check_schema(_payload([row])) == []
    bad = dict(row, batch_held=12.5, plugin="yes")
    del bad["ttft_s"]
    problems = result_file.check_schema({**_payload([bad]), "defaults_start": "yes"})
    assert "row 0: missing ttft_s" in problems and "row 0: plugin is not a bool" in problems
    assert "row 0: batch_held is not an int" in problems and "defaults_start is not a bool" in problems
    assert "missing device" in result_file.check_schema({"rows": []})


def test_merge_results():
    old = {**_payload([dict(result_file.empty_row(32768, False, "sglang"), batch_held=12),
                       dict(result_file.empty_row(65536, False, "sglang"), batch_held=6)]),
           "servers": {"sglang": {"start_s": 80}}, "check": {"reference_tokens": [[1, 2]], "seed": 0},
           "tokens_equal_full_topk": None, "extra_old": 1}
    new = {**_payload([dict(result_file.empty_row(32768, True, "plugin"), batch_held=20),
                       dict(result_file.empty_row(65536, False, "sglang"), batch_held=7)]),
           "defaults_start": None, "tokens_equal_full_topk": True,
           "servers": {"plugin": {"start_s": 90}}, "check": {"reference_tokens": None, "graphed_first_mismatch": [None]}}
    m = result_file.merge_results(old, new)
    assert [(r["context"], r["plugin"], r["batch_held"]) for r in m["rows"]] == [
        (32768, False, 12), (32768, True, 20), (65536, False, 7)]
    assert m["defaults_start"] is True and m["tokens_equal_full_topk"] is True and m["extra_old"] == 1
    assert set(m["servers"]) == {"sglang", "plugin"}
    assert m["check"]["reference_tokens"] == [[1, 2]] and m["check"]["graphed_first_mismatch"] == [None]
    assert result_file.merge_results(None, new) is new
    # other check prompts: the old reference does not carry over
    other = dict(new, check={"prompt_len": 2000, "reference_tokens": None})
    assert result_file.merge_results({**old, "check": {"prompt_len": 3000, "reference_tokens": [[1]]}},
                               other)["check"] == {"prompt_len": 2000, "reference_tokens": None}


def test_tokens_verdict():
    ref = [[1, 2, 3], [4, 5, 6]]
    assert result_file.tokens_verdict(ref, [[1, 2, 3], [4, 5, 6]]) == {"equal": True, "first_mismatch": [None, None]}
    assert result_file.tokens_verdict(ref, [[1, 2, 3], [4, 9, 6]]) == {"equal": False, "first_mismatch": [None, 1]}
    assert result_file.tokens_verdict(ref, [[1, 2], [4, 5, 6]])["first_mismatch"] == [2, None]
    assert result_file.tokens_verdict(None, ref)["equal"] is None
    assert result_file.tokens_verdict(ref, [[1, 2, 3], None])["equal"] is None
    assert result_file.combine_tokens_equal(True, None) is True
    assert result_file.combine_tokens_equal(True, False) is False
    assert result_file.combine_tokens_equal(None, None) is None


# ---------------------------------------------------------------- plan and commands

def _flags_after(cmd, flag):
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def test_dry_run_commands(capsys):
    out = bench.main(["--dry-run", "--model-dir", "/tmp/l8b"])["dry_run"]
    printed = capsys.readouterr().out.splitlines()
    assert printed == out
    cmds = {}
    for head, line in zip(out[::2], out[1::2]):
        tag = head.split(":")[0].lstrip("# ")
        env, *cmd = shlex.split(line)
        cmds[tag] = (env, cmd)
    assert list(cmds) == ["sglang", "plugin", "check_graphed", "check_eager"]
    env, base = cmds["sglang"]
    assert env == "SGLANG_PLUGINS=__none__"
    assert base[1:3] == ["-m", "sglang.launch_server"]
    assert _flags_after(base, "--model-path") == "/tmp/l8b" and _flags_after(base, "--load-format") == "dummy"
    assert _flags_after(base, "--attention-backend") == "triton"
    assert _flags_after(base, "--context-length") == str(65536 + server_plan.CONTEXT_MARGIN)
    assert "--page-size" not in base and "--mem-fraction-static" not in base  # SGLang's defaults
    assert not any(f.startswith("--sparsehi") for f in base)
    env, plug = cmds["plugin"]
    assert env == "SGLANG_PLUGINS=sparsehi"
    common = base[:base.index("--host")]
    assert plug[:len(common)] == common  # same flags, the plugin's after them
    assert plug[len(common):plug.index("--host")] == shlex.split(server_plan.DEFAULT_PLUGIN_ARGS)
    _, chk = cmds["check_graphed"]
    assert chk[len(common):chk.index("--host")] == shlex.split(server_plan.DEFAULT_CHECK_PLUGIN_ARGS)
    _, eager = cmds["check_eager"]
    assert eager[len(common):eager.index("--host")] == shlex.split(server_plan.DEFAULT_CHECK_PLUGIN_ARGS) + list(
        server_plan.EAGER_FLAGS)
    assert "check_graphed: plugin=True tasks=warmup,check" in out[4]


def test_plan_options():
    def plan(*argv):
        return server_plan.plan_servers(bench.parse_args(["--model-dir", "/m", *argv]))

    p = plan("--only", "sglang", "--contexts", "4096")
    assert [(s["tag"], s["tasks"]) for s in p] == [("sglang", ["warmup", "reference", "measure"])]
    assert _flags_after(p[0]["flags"], "--context-length") == str(4096 + server_plan.CONTEXT_MARGIN)
    p = plan("--only", "sglang", "--skip-check")
    assert p[0]["tasks"] == ["warmup", "measure"]
    p = plan("--only", "plugin", "--skip-check")
    assert [s["tag"] for s in p] == ["plugin"]
    p = plan("--only", "plugin", "--skip-measure", "--skip-eager-check")
    assert [s["tag"] for s in p] == ["check_graphed"]
    assert not p[0]["defaults_probe"]  # the check servers do not tell defaults_start
    assert [s["defaults_probe"] for s in plan()] == [False, True, False, False]
    # flags given: a separate server for defaults_start, without them
    p = plan("--page-size", "64", "--mem-fraction-static", "0.8", "--server-args", "--max-running-requests 16")
    assert [s["tag"] for s in p][-1] == "plugin_defaults"
    assert [s["defaults_probe"] for s in p] == [False, False, False, False, True]
    d = p[-1]["flags"]
    assert not server_plan.has_defaults_flags(d) and _flags_after(d, "--max-running-requests") == "16"
    assert _flags_after(p[0]["flags"], "--page-size") == "64"
    assert all(_flags_after(s["flags"], "--mem-fraction-static") == "0.8" for s in p[:-1])
    p = plan("--server-args", "--page-size=32", "--skip-check")
    assert [s["tag"] for s in p] == ["sglang", "plugin", "plugin_defaults"]
    assert "--page-size=32" not in p[-1]["flags"]
    p = plan("--plugin-args", "--sparsehi-algorithm quest --sparsehi-top-k 1024", "--skip-check", "--only", "plugin")
    assert p[0]["flags"][-4:] == ["--sparsehi-algorithm", "quest", "--sparsehi-top-k", "1024"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--contexts", "32k"])


def test_server_env():
    assert server_plan.server_env(True, base={})["SGLANG_PLUGINS"] == "sparsehi"
    assert server_plan.server_env(False, base={})["SGLANG_PLUGINS"] == server_plan.NO_PLUGIN
    assert server_plan.server_env(False, True, base={})["SGLANG_PLUGINS"] == "sparsehi"


def test_flags_parse_in_sglang():
    """The commands' flags are SGLang 0.5.23's (and the plugin's) where SGLang is installed
    (.venv-sglang); skipped elsewhere."""
    pytest.importorskip("sglang.srt.server_args")
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    for s in server_plan.plan_servers(bench.parse_args(["--model-dir", "/tmp/l8b"])):
        if not Path("/tmp/l8b/config.json").exists():
            pytest.skip("no /tmp/l8b/config.json")
        prepare_server_args(server_plan.server_cmd("python", s["flags"], 30000)[3:])


# ---------------------------------------------------------------- end to end, against a stand-in

@pytest.fixture
def fake_sglang(tmp_path):
    pkg = tmp_path / "fake" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text("from tests.fake_sglang_server import main\nmain()\n")
    return tmp_path / "fake"


def test_end_to_end_against_fake_server(tmp_path, fake_sglang, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(fake_sglang), str(ROOT)]))
    monkeypatch.setenv("FAKE_SGLANG_TOKENS", "6000")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    out = tmp_path / "res"
    argv = ["--model-dir", str(model), "--contexts", "1000,2000", "--new-tokens", "100", "--ramp-step", "20",
            "--held-new-tokens", "100", "--held-settle-s", "0.3", "--held-measure-s", "0.3",
            "--min-window-steps", "8", "--check-len", "300", "--check-new", "16", "--out", str(out),
            "--poll-s", "0.1", "--min-host-avail-gib", "0", "--log-dir", str(tmp_path / "logs")]
    t0 = time.time()
    res = bench.main(argv)
    assert time.time() - t0 < 120
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert result_file.check_schema(res) == []
    saved = json.loads((out / result_file.RESULT_NAME).read_text())
    assert saved["rows"] == res["rows"]
    assert sorted(p.name for p in (tmp_path / "logs").glob("server_*.log")) == [
        f"server_{s['tag']}.log" for s in sorted(server_plan.plan_servers(bench.parse_args(argv)), key=lambda s: s["tag"])]
    assert [(r["context"], r["plugin"]) for r in res["rows"]] == [(1000, False), (1000, True), (2000, False),
                                                                 (2000, True)]
    for r in res["rows"]:
        # fake pool 6000 tokens, admits while the tokens in use + prompt + max_new fit:
        # 1000-token prompts (max_new 100, 120, ...) -> 5, 2000 -> 2 (the rest queued, then aborted)
        assert r["batch_held"] == {1000: 5, 2000: 2}[r["context"]], r
        assert r["held_sent"] == {1000: 8, 2000: 5}[r["context"]]
        assert r["held_saturated"] is True and r["held_aborted"] == r["held_sent"] - r["batch_held"]
        assert r["held_errors"] == 0 and r["cached_tokens"] == 0
        assert r["best_batch"] in (int(k) for k in r["tok_s_by_batch"])
        assert r["best_tok_s"] == max(r["tok_s_by_batch"].values())
        assert str(r["batch_held"]) in r["tok_s_by_batch"] and r["held_tok_s"] is not None
        # the fake decodes a step in ~4 ms: ~250 tok/s per running request
        assert 100 < r["b1_tok_s"] < 260 and 100 < r["b1_stream_tok_s"] < 260
        assert r["ttft_s"] > 0 and len(r["ttft_reps_s"]) == 2
        assert r["sglang_gen_tok_s"] is not None and r["sglang_b1_gen_tok_s"] is not None
        assert r["peak_host_gib"] and r["peak_host_gib"] > 0
        assert "error" not in r
    assert res["defaults_start"] is True and res["defaults_start_server"] == "plugin"
    assert res["tokens_equal_full_topk"] is True
    assert res["tokens_equal_full_topk_graphed"] is True and res["tokens_equal_full_topk_eager"] is True
    assert set(res["servers"]) == {"sglang", "plugin", "check_graphed", "check_eager"}
    for tag, s in res["servers"].items():
        assert (tmp_path / "logs" / f"server_{tag}.log").exists()
        assert s["max_total_num_tokens"] == 6000 and s["warmup_ok"] is True
        assert s["env_SGLANG_PLUGINS"] == ("sparsehi" if s["plugin"] else "__none__")
        assert s["plugins_loaded"] == (["sparsehi"] if s["plugin"] else [])
    assert res["servers"]["plugin"]["sparsehi_line_count"] >= 1
    assert any("batch_held" in x for x in lines) and any("ttft_s" in x for x in lines)
    # every server it started is gone
    assert not [p for p in machine.process_tree(os.getpid())[1:] if _is_fake_server(p)]

    # a later --merge run that fails to start its plugin server keeps the earlier rows
    monkeypatch.setenv("FAKE_SGLANG_FAIL_IF", "--sparsehi-algorithm")
    res2 = bench.main(argv + ["--only", "plugin", "--merge", "--skip-check", "--contexts", "1000"])
    rows = {(r["context"], r["plugin"]): r for r in res2["rows"]}
    assert rows[(1000, True)]["error"] and rows[(1000, True)]["batch_held"] is None
    assert rows[(1000, False)]["batch_held"] == 5 and rows[(2000, True)]["batch_held"] == 2
    assert res2["defaults_start"] is False
    assert res2["tokens_equal_full_topk"] is True  # from the first run
    assert "refused by the fake server" in res2["servers"]["plugin"]["log_tail"]

    # a context whose requests fail gets an error row; the server goes on with the next one
    monkeypatch.delenv("FAKE_SGLANG_FAIL_IF")
    monkeypatch.setenv("FAKE_SGLANG_REJECT_LEN", "1000")
    res3 = bench.main(argv + ["--only", "sglang", "--merge", "--skip-check"])
    rows = {(r["context"], r["plugin"]): r for r in res3["rows"]}
    assert "HTTP 400" in rows[(1000, False)]["error"] and rows[(1000, False)]["batch_held"] is None
    assert rows[(2000, False)]["batch_held"] == 2 and "error" not in rows[(2000, False)]
    assert "error" not in res3["servers"]["sglang"]


def _is_fake_server(pid):
    try:
        return b"sglang.launch_server" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def test_first_step_against_the_steady_step():
    from benchmarks.sglang_server.client_rates import first_step

    chunks = [(0.0, 1), (0.05, 2), (0.06, 3), (0.07, 4), (0.08, 5)]  # first step 50 ms, then 10 ms
    got = first_step(chunks)
    assert got["first_step_ms"] == 50.0 and got["steady_step_ms"] == 10.0 and got["first_step_ratio"] == 5.0
    assert first_step([(0.0, 1), (0.1, 3), (0.2, 5)])["first_step_ratio"] is None  # several tokens a chunk
