"""`sparsehi` CLI: help text, argument errors, and small end-to-end runs of `run` and
`bench` that write their JSON / PNG outputs."""
from __future__ import annotations

import json

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
])
def test_bad_options_get_clear_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_run_writes_table_json_and_plot(tmp_path, capsys):
    out = tmp_path / "o"
    rc = main(["run", "--context", "320", "--batch", "2", "--decode-tokens", "6", "--num-layers", "3",
               "--top-k", "64", "--sink-tokens", "16", "--recent-tokens", "16", "--output-dir", str(out),
               "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "torch reference" in text or "plain-torch reference" in text
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
