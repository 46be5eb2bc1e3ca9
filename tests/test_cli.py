"""`sparsehi` CLI: help text, argument errors, and small end-to-end runs of `run` and
`bench` that write their JSON / PNG outputs."""
from __future__ import annotations

import json
import os

import pytest
import torch

from sparsehi.cli import build_parser, main


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_help_explains_every_option(capsys):
    parser = build_parser()
    for cmd in ("run", "bench"):
        with pytest.raises(SystemExit) as e:
            parser.parse_args([cmd, "--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        sub = parser._subparsers._group_actions[0].choices[cmd]
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{cmd} {action.option_strings} has no help"
                assert action.option_strings[0] in text
    squeezed = "".join(text.split())  # argparse wraps lines, also at hyphens
    for mode in ("dense", "sparse-gpu", "sparse-hier", "offload-full"):
        assert mode in squeezed


@pytest.mark.parametrize("argv,needle", [
    (["run", "--top-k", "0"], "--top-k must be > 0"),
    (["run", "--context", "abc"], "--context must be an integer"),
    (["run", "--modes", "dense,turbo"], "mode 'turbo' is unknown"),
    (["run", "--page-size", "3"], "--page-size=3 is invalid"),
    (["run", "--top-k", "512", "--buffer-size", "256"], "--buffer-size=256 is invalid"),
    (["run", "--model", "tiny-dsa", "--page-size", "16"], "--page-size must be 1"),
    (["run", "--algorithm", "nope"], "--algorithm"),
    (["run", "--model", "gpt-9"], "invalid choice"),
    (["bench", "--contexts", "1024,x"], "--contexts must be a comma list"),
    (["run", "--shared-prefix", "1.5"], "--shared-prefix must be in [0, 1)"),
    (["run", "--model-path", "/nonexistent/ckpt"], "--model-path /nonexistent/ckpt: expected a local HF-layout"),
    (["run", "--model", "tiny-dsa", "--algorithm", "oracle"], "runs only dsa"),
    (["run", "--model", "tiny-gqa", "--algorithm", "dsa", "--page-size", "1"], "dsa needs an MLA model"),
    (["run", "--algorithm", "quest", "--page-size", "1"], "invalid for quest"),
    (["run", "--top-k", "24", "--page-size", "16"], "--top-k 24 must be a multiple of --page-size 16"),
    (["bench", "--top-k", "24"], "sparsehi bench: error"),
    # a top-k at or above the context is rejected, naming the flags the user gave
    (["run", "--top-k", "4096", "--context", "512"], "--top-k 4096 must be below --context 512"),
    (["run", "--top-k", "512", "--context", "512"], "--top-k 512 must be below --context 512"),
    (["run", "--top-k", "1000000000000"], "--top-k 1000000000000 must be below --context 4096"),
    (["bench", "--contexts", "256,1024", "--top-k", "256"], "--top-k 256 must be below every --contexts value"),
    (["run", "--context", "1000000", "--top-k", "262160"], "--top-k 262160 is above the LRU buffer limit"),
    (["run", "--context", "16"], "--context 16 is too short"),
    (["run", "--lookahead-tokens", "8"], "--lookahead-tokens=8 is invalid: an integer >= 0, a multiple of --page-size=16"),
    (["run", "--top-k", "256", "--buffer-size", "512", "--lookahead-tokens", "512"],
     "--lookahead-tokens=512 is invalid: at most --buffer-size - --top-k = 256"),
    (["run", "--lookahead-tokens", "-16"], "--lookahead-tokens must be >= 0"),
    (["run", "--kv-cache-dtype", "fp8"], "invalid choice: 'fp8'"),
    (["run", "--kv-cache-dtype", "fp8_e4m3"], "--kv-cache-dtype fp8_e4m3 is for MLA models"),
    (["run", "--model", "tiny-dsa-fp8", "--kv-cache-dtype", "fp8_e4m3", "--modes", "offload-full"],
     "--kv-cache-dtype fp8_e4m3 is for MLA models in the modes dense, sparse-gpu and sparse-hier"),
    (["run", "--model", "tiny-dsa-fp8", "--kv-cache-dtype", "fp8_e4m3", "--host-kv-dtype", "fp8_e4m3"],
     "--kv-cache-dtype='fp8_e4m3' is invalid: 'auto' with --host-kv-dtype='fp8_e4m3'"),
])
def test_bad_options_get_clear_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err
    if "--buffer-size" not in argv:  # a flag the user never gave is never blamed
        assert "--buffer-size" not in err.splitlines()[-1]


SMALL_RUN = ["--batch", "1", "--decode-tokens", "2", "--num-layers", "1", "--modes", "sparse-gpu", "--sink-tokens",
             "16", "--recent-tokens", "16", "--no-progress", "--no-forced"]


def test_default_sizes_stay_within_the_context(tmp_path, capsys):
    # default top-k (at least 64) is lowered below a 64-token context; the default buffer
    # (4 x top-k) is capped at prompt + decode tokens, where more slots could never be used
    main(["run", "--context", "64", "--output-dir", str(tmp_path / "a"), *SMALL_RUN])
    sc = json.loads((tmp_path / "a" / "run.json").read_text())["sparse_config"]
    assert sc["top_k"] == 48 and sc["device_buffer_size"] == 80  # 64 + 2 decode tokens, whole pages
    main(["run", "--context", "96", "--top-k", "64", "--output-dir", str(tmp_path / "b"), *SMALL_RUN])
    sc = json.loads((tmp_path / "b" / "run.json").read_text())["sparse_config"]
    assert sc["top_k"] == 64 and sc["device_buffer_size"] == 112
    main(["run", "--context", "96", "--top-k", "64", "--buffer-size", "256", "--output-dir", str(tmp_path / "c"),
          *SMALL_RUN])
    sc = json.loads((tmp_path / "c" / "run.json").read_text())["sparse_config"]
    assert sc["device_buffer_size"] == 256
    # the KV formats are part of what a result measured
    assert (sc["host_kv_dtype"], sc["kv_cache_dtype"], sc["lookahead_tokens"]) == ("auto", "auto", 0)


@pytest.fixture
def no_work(monkeypatch):
    """Fail loudly if a run gets as far as building its model."""
    def refuse(*a, **k):
        raise AssertionError("the run started work before its output directory was checked")

    import sparsehi.runtime.bench as bench_mod
    import sparsehi.runtime.demo as demo_mod

    monkeypatch.setattr(demo_mod, "build_model", refuse)
    monkeypatch.setattr(bench_mod, "build_model", refuse)


@pytest.mark.parametrize("cmd", ["run", "bench"])
@pytest.mark.parametrize("case", ["is_a_file", "parent_is_a_file", "result_name_is_a_directory"])
def test_unusable_output_dir_stops_before_any_work(tmp_path, capsys, no_work, cmd, case):
    blocker = tmp_path / "blocker"
    blocker.write_text("a regular file")
    if case == "is_a_file":
        out, needle = blocker, f"--output-dir {blocker} exists and is not a directory"
    elif case == "parent_is_a_file":
        out, needle = blocker / "sub" / "dir", f"{blocker} is a file, not a directory"
    else:
        out = tmp_path / "out"
        name = "run.json" if cmd == "run" else "bench.json"
        (out / name).mkdir(parents=True)
        needle = f"{out / name} exists and is not a file"
    with pytest.raises(SystemExit) as e:
        main([cmd, "--output-dir", str(out), "--no-progress"] if cmd == "run" else [cmd, "--output-dir", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories; the file cases cover it")
def test_read_only_output_dir_stops_before_any_work(tmp_path, capsys, no_work):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(SystemExit) as e:
            main(["run", "--output-dir", str(ro / "out")])
        assert e.value.code == 2 and "cannot be created" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            main(["bench", "--output-dir", str(ro)])
        assert f"{ro} is not writable" in capsys.readouterr().err
    finally:
        ro.chmod(0o755)


def test_library_runs_check_the_output_dir_first(tmp_path, no_work):
    from sparsehi.runtime.bench import BenchConfig, run_bench
    from sparsehi.runtime.demo import DemoConfig, run_demo

    blocker = tmp_path / "f"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        run_demo(DemoConfig(output_dir=str(blocker)))
    with pytest.raises(ValueError, match="is a file, not a directory"):
        run_bench(BenchConfig(output_dir=str(blocker / "o")))


def test_run_writes_table_json_and_plot(tmp_path, capsys):
    out = tmp_path / "o"
    rc = main(["run", "--context", "320", "--batch", "2", "--decode-tokens", "6", "--num-layers", "3",
               "--top-k", "64", "--sink-tokens", "16", "--recent-tokens", "16", "--output-dir", str(out),
               "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    # the kernel-path note once (it used to be printed again inside the tok/s note), and
    # the CPU throughput caveat in the printed notes
    assert text.count("plain-torch reference") == 1
    assert text.count("tok/s measures the Python overhead") == 1
    payload = json.loads((out / "run.json").read_text())
    rows = {r["mode"]: r for r in payload["rows"]}
    assert set(rows) == {"dense", "sparse-gpu", "sparse-hier", "offload-full"}
    assert rows["sparse-hier"]["agree_sparse_gpu"] == 1.0
    assert rows["offload-full"]["agree_dense_free"] == 1.0
    assert 0.0 <= rows["sparse-hier"]["hit_rate"] <= 1.0
    assert rows["offload-full"]["mib_loaded_per_step"] > rows["sparse-hier"]["mib_loaded_per_step"]
    assert len(payload["per_step"]["sparse-hier"]) == 6
    # request 1 starts with half of request 0's prompt: sparse-hier reuses those pages from host
    assert rows["sparse-hier"]["prefix_reused_tokens"] == 160 // 16 * 16 and rows["dense"]["prefix_reused_tokens"] == 0
    assert (out / "run.png").stat().st_size > 1000
    for mode in rows:
        assert mode in text


def test_run_with_fp8_latent_rows(tmp_path):
    """``--kv-cache-dtype fp8_e4m3`` on an MLA model: bf16 and the dsa adapter by default,
    offload-full left out of the default modes, sparse-hier as sparse-gpu, FP8 row bytes."""
    out = tmp_path / "o"
    rc = main(["run", "--model", "tiny-dsa-fp8", "--kv-cache-dtype", "fp8_e4m3", "--context", "96", "--batch", "1",
               "--decode-tokens", "4", "--num-layers", "2", "--top-k", "32", "--sink-tokens", "8", "--recent-tokens",
               "8", "--device", "cpu", "--output-dir", str(out), "--no-progress", "--no-forced"])
    assert rc == 0
    run = json.loads((out / "run.json").read_text())
    assert run["sparse_config"]["kv_cache_dtype"] == "fp8_e4m3"  # the result names its KV format
    rows = {r["mode"]: r for r in run["rows"]}
    assert set(rows) == {"dense", "sparse-gpu", "sparse-hier"}
    assert rows["sparse-hier"]["agree_sparse_gpu"] == 1.0
    assert rows["sparse-hier"]["hit_rate"] < 1.0
    # the host pool held 100 tokens x 2 layers of 164-byte rows (bf16 would be 288 bytes)
    assert rows["sparse-hier"]["host_kv_mib"] * 2 ** 20 == pytest.approx(100 * 2 * 164)


def _tiny_checkpoint(path) -> None:
    """A 2-layer Llama-layout checkpoint: config.json + model.safetensors."""
    from safetensors.torch import save_file

    from sparsehi.runtime.gqa_model import GQAModel
    from sparsehi.runtime.model_config import ModelConfig

    cfg = ModelConfig(name="ck", family="gqa", vocab_size=96, hidden_size=32, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, intermediate_size=48, seed=3)
    m = GQAModel(cfg)
    m.random_init()
    hf = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48}
    (path / "config.json").write_text(json.dumps(hf))
    state = {(k if k == "lm_head.weight" else f"model.{k}"): v.contiguous() for k, v in m.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))


def test_run_loads_a_local_checkpoint(tmp_path, capsys):
    ck = tmp_path / "ck"
    ck.mkdir()
    _tiny_checkpoint(ck)
    rc = main(["run", "--model-path", str(ck), "--context", "96", "--batch", "1", "--decode-tokens", "3",
               "--modes", "dense,sparse-hier", "--top-k", "32", "--sink-tokens", "16", "--recent-tokens", "16",
               "--output-dir", str(tmp_path / "o"), "--no-progress", "--no-forced"])
    assert rc == 0
    payload = json.loads((tmp_path / "o" / "run.json").read_text())
    assert payload["model"] == "ck"
    assert [r["mode"] for r in payload["rows"]] == ["dense", "sparse-hier"]


def test_bench_sweeps_contexts_batches_and_modes(tmp_path):
    rc = main(["bench", "--contexts", "128,192", "--batches", "1,2", "--decode-tokens", "2", "--num-layers", "2",
               "--modes", "dense,sparse-hier", "--top-k", "32", "--sink-tokens", "16", "--recent-tokens", "16",
               "--output-dir", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert {(r["context"], r["batch"], r["mode"]) for r in rows} == {
        (c, b, m) for c in (128, 192) for b in (1, 2) for m in ("dense", "sparse-hier")}
    assert all(r["tokens_per_s"] > 0 for r in rows)


def _corrupt(ck, case: str) -> str:
    """Break a fresh checkpoint in ``ck`` one way; returns the text the error must hold."""
    cfg_path, st_path = ck / "config.json", ck / "model.safetensors"
    hf = json.loads(cfg_path.read_text())
    if case == "not_json":
        cfg_path.write_text('{"model_type": "llama",')
        return f"{cfg_path}: not valid JSON"
    if case == "json_list":
        cfg_path.write_text("[1, 2]")
        return f"{cfg_path}: expected a JSON object"
    if case == "missing_heads":
        del hf["num_attention_heads"]
        cfg_path.write_text(json.dumps(hf))
        return f"{cfg_path}: missing num_attention_heads"
    if case == "heads_not_a_number":
        hf["num_attention_heads"] = "four"
        cfg_path.write_text(json.dumps(hf))
        return f"{cfg_path}: num_attention_heads='four' is not an integer"
    if case == "kv_heads_do_not_divide":
        hf["num_key_value_heads"] = 3
        cfg_path.write_text(json.dumps(hf))
        return f"{cfg_path}: ModelConfig.num_kv_heads=3 must divide num_heads=4"
    if case == "unsupported_model_type":
        hf["model_type"] = "gpt2"
        cfg_path.write_text(json.dumps(hf))
        return f"{cfg_path}: model_type='gpt2' is not supported"
    if case == "sliding_window":
        hf.update(model_type="mistral", sliding_window=4096)
        cfg_path.write_text(json.dumps(hf))
        return f"{cfg_path}: sliding_window=4096 is not supported"
    if case == "corrupt_safetensors":
        st_path.write_bytes(b"\xff" * 64)
        return f"{st_path}: not a readable safetensors file"
    if case == "truncated_safetensors":
        os.truncate(st_path, st_path.stat().st_size // 2)
        return f"{st_path}: not a readable safetensors file"
    if case == "shape_mismatch":
        hf["intermediate_size"] = 64
        cfg_path.write_text(json.dumps(hf))
        return "has shape"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["not_json", "json_list", "missing_heads", "heads_not_a_number",
                                  "kv_heads_do_not_divide", "unsupported_model_type", "sliding_window",
                                  "corrupt_safetensors", "truncated_safetensors", "shape_mismatch"])
def test_bad_checkpoint_is_one_line_naming_the_file(tmp_path, capsys, case):
    ck = tmp_path / "ck"
    ck.mkdir()
    _tiny_checkpoint(ck)
    needle = _corrupt(ck, case)
    with pytest.raises(SystemExit) as e:  # any other exception would be a traceback
        main(["run", "--model-path", str(ck), "--context", "96", "--top-k", "32", "--output-dir",
              str(tmp_path / "o"), "--no-progress"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sparsehi run: error: --model-path "), err
    assert needle in lines[0] and str(ck) in lines[0]
    assert not (tmp_path / "o" / "run.json").exists()


def test_checkpoint_loading_errors_are_checkpoint_errors(tmp_path):
    # a broken file found while loading (not through the CLI) is still one named problem
    from sparsehi.runtime.weights import CheckpointError, load_hf_model

    _tiny_checkpoint(tmp_path)
    needle = _corrupt(tmp_path, "truncated_safetensors")
    with pytest.raises(CheckpointError, match="not a readable safetensors file") as e:
        load_hf_model(tmp_path)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_qwen2_sliding_window_off_is_accepted():
    from sparsehi.runtime.weights import hf_config_to_model_config

    base = {"vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
            "intermediate_size": 8}
    cfg, bias = hf_config_to_model_config({**base, "model_type": "qwen2", "sliding_window": 32768,
                                           "use_sliding_window": False}, "q")
    assert bias and cfg.num_heads == 2
    cfg, _ = hf_config_to_model_config({**base, "model_type": "mistral", "sliding_window": None}, "m")
    assert cfg.num_layers == 1


@pytest.mark.parametrize("flag,want", [([], True), (["--no-cuda-graph"], False)])
def test_no_cuda_graph_reaches_the_runtime(monkeypatch, tmp_path, flag, want):
    """--no-cuda-graph turns the graph runner off (graphs are the default, used on CUDA)."""
    seen = []
    monkeypatch.setattr("sparsehi.runtime.demo.run_demo", lambda cfg: seen.append(cfg.cuda_graph) or {})
    main(["run", "--context", "512", "--output-dir", str(tmp_path), *flag])
    assert seen == [want]


def test_lookahead_tokens_reach_the_sparse_config(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr("sparsehi.runtime.demo.run_demo", lambda cfg: seen.append(cfg.sparse.lookahead_tokens) or {})
    main(["run", "--context", "512", "--output-dir", str(tmp_path), "--lookahead-tokens", "32"])
    assert seen == [32]
