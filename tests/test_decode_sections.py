"""benchmarks/decode/sections.py: a narrower bench_decode run stored beside the full one."""
import json

import pytest

from benchmarks.decode.sections import write_section


def test_section_sits_beside_the_full_run_and_lifts_summary_keys(tmp_path):
    path = tmp_path / "decode.json"
    full = {"rows": [{"mode": "dense", "batch": 1}], "summary": {"dense_b1_tok_s": 144.0}, "date": "2026-11-25"}
    path.write_text(json.dumps(full))
    run = {"rows": [{"mode": "sparse-hier-fp8", "batch": 10}], "date": "2026-11-27",
           "summary": {"fp8_best_tok_s_64k": 820.0, "b1_tok_s_1m": None, "other": 1}}
    write_section(path, "fp8_host_kv", run, lift=("fp8_best_tok_s_64k", "b1_tok_s_1m"))
    doc = json.loads(path.read_text())
    assert doc["rows"] == full["rows"] and doc["date"] == "2026-11-25"
    assert doc["fp8_host_kv"] == run
    # a figure the section has no rows for (None) is not lifted
    assert doc["summary"] == {"dense_b1_tok_s": 144.0, "fp8_best_tok_s_64k": 820.0,
                              "lifted_from": {"fp8_best_tok_s_64k": "fp8_host_kv"}}
    run2 = {**run, "summary": {"fp8_best_tok_s_64k": 900.0, "b1_tok_s_1m": 87.0}}
    write_section(path, "fp8_host_kv", run2, lift=("fp8_best_tok_s_64k", "b1_tok_s_1m"))
    doc = json.loads(path.read_text())
    assert doc["fp8_host_kv"]["summary"] == run2["summary"]
    assert doc["summary"]["fp8_best_tok_s_64k"] == 900.0 and doc["rows"] == full["rows"]
    # a later, narrower section leaves the 1M figure of the earlier one standing
    write_section(path, "lookahead", {"summary": {"fp8_best_tok_s_64k": 950.0, "b1_tok_s_1m": None}},
                  lift=("fp8_best_tok_s_64k", "b1_tok_s_1m"))
    top = json.loads(path.read_text())["summary"]
    assert (top["fp8_best_tok_s_64k"], top["b1_tok_s_1m"]) == (950.0, 87.0)
    assert top["lifted_from"] == {"fp8_best_tok_s_64k": "lookahead", "b1_tok_s_1m": "fp8_host_kv"}


@pytest.mark.parametrize("name", ["", "rows", "summary", "bad name"])
def test_section_name_is_checked(tmp_path, name):
    with pytest.raises(ValueError, match="section name"):
        write_section(tmp_path / "decode.json", name, {"rows": []})


def test_summary_describes_64k_and_lifts_fp8_and_million_rows():
    from benchmarks.decode.report import SECTION_SUMMARY_KEYS, summary, summary_context

    assert summary_context([65536, 131072, 1 << 20]) == 65536
    assert summary_context([512, 1024]) == 1024

    def row(mode, ctx, batch, tok_s):
        return {"model": "m", "scenario": "a", "trace_source": "trace85", "mode": mode, "context": ctx,
                "batch": batch, "tokens_per_s": tok_s}

    rows = [row("sparse-hier", 65536, 10, 740.0), row("sparse-hier-fp8", 65536, 1, 170.0),
            row("sparse-hier-fp8", 65536, 10, 830.0), row("sparse-hier-fp8", 131072, 6, 505.0),
            row("sparse-hier-fp8", 1 << 20, 1, 120.0)]
    s = summary(rows, {}, 65536, "m", graphs=True)
    assert s["context"] == 65536 and s["sparse_hier_best_tok_s"] == 740.0
    assert s["fp8_best_tok_s_64k"] == 830.0 and s["b1_tok_s_1m"] == 120.0
    assert (s["fp8_best_mode_64k"], s["b1_mode_1m"]) == ("sparse-hier-fp8", "sparse-hier-fp8")
    assert set(SECTION_SUMMARY_KEYS) <= set(s)
    # FP8 host KV with loading ahead counts too: the fastest FP8 mode gives each figure
    rows += [row("sparse-hier-fp8-ahead", 65536, 10, 930.0), row("sparse-hier-fp8-ahead", 1 << 20, 1, 110.0),
             row("sparse-hier-ahead", 65536, 10, 990.0)]
    s = summary(rows, {}, 65536, "m", graphs=True)
    assert (s["fp8_best_tok_s_64k"], s["fp8_best_mode_64k"]) == (930.0, "sparse-hier-fp8-ahead")
    assert (s["b1_tok_s_1m"], s["b1_mode_1m"]) == (120.0, "sparse-hier-fp8")


def test_prefetch_share_is_the_smaller_of_batch_one_and_best_and_is_judged():
    from benchmarks.decode.report import summary, targets

    def row(mode, batch, tok_s, hidden=None, hit=0.92):
        r = {"model": "m", "scenario": "a", "trace_source": "trace85", "mode": mode, "context": 65536,
             "batch": batch, "tokens_per_s": tok_s, "hit_rate": hit, "split_ms": {"other": 1.0}}
        if hidden is not None:
            r.update(prefetch_hidden_frac=hidden, ahead_precision=0.5)
        return r

    rows = [row("sparse-hier", 1, 200.0), row("sparse-hier", 10, 800.0),
            row("sparse-hier-ahead", 1, 210.0, 0.86, 0.988), row("sparse-hier-ahead", 10, 870.0, 0.81, 0.989),
            row("sparse-hier-fp8-ahead", 1, 215.0, 0.79, 0.98), row("sparse-hier-fp8-ahead", 10, 1020.0, 0.83, 0.99)]
    s = summary(rows, {}, 65536, "m", graphs=True)
    assert s["prefetch_hidden_frac"] == 0.79  # the smallest of the batch-1 and best rows
    assert s["prefetch"]["sparse-hier-ahead"]["best"]["batch"] == 10
    lines = [x for x in targets(rows, {}, 65536, "m") if "loaded ahead" in x]
    assert len(lines) == 2 and lines[0].endswith("MET") and lines[1].endswith("MISSED")
    assert summary(rows[:2], {}, 65536, "m", graphs=True)["prefetch_hidden_frac"] is None


def test_quick_mla_only_run_keeps_a_section_of_mla_rows(tmp_path, monkeypatch, one_thread):
    from benchmarks import bench_decode

    built = []
    real_build = bench_decode.build_model

    def recording_build(*args, **kwargs):
        model = real_build(*args, **kwargs)
        built.append(model.cfg.name)
        return model

    monkeypatch.setattr(bench_decode, "build_model", recording_build)
    (tmp_path / "decode.json").write_text(json.dumps({"summary": {"prefetch_hidden_frac": 0.86}}))
    assert bench_decode.main(["--quick", "--skip-llama", "--modes", "dense,sparse-hier,sparse-hier-ahead",
                              "--lookahead-pages", "16", "--max-batch", "2", "--section", "mla_only",
                              "--out", str(tmp_path)]) == 0
    assert built == ["tiny-dsa"]  # no llama-shape model, for scenario a or b
    with pytest.raises(SystemExit, match="--skip-llama"):
        bench_decode.main(["--quick", "--skip-llama", "--skip-dsv32", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "decode.json").read_text())
    sec = doc["mla_only"]
    # the file's summary (the llama-shape run's) keeps its figure: the MLA rows' is the section's alone
    assert sec["summary"]["prefetch_hidden_frac"] is not None
    assert doc["summary"] == {"prefetch_hidden_frac": 0.86, "lifted_from": {}}
    assert sec["rows"] and {r["model"] for r in sec["rows"]} == {"tiny-dsa"}
    assert sec["model"] == "tiny-dsa" and sec["summary"]["context"] == 512
    assert sec["summary"]["sparse_hier_b1_tok_s"] > 0 and sec["summary"]["dense_b1_tok_s"] > 0
