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
    assert doc["summary"] == {"dense_b1_tok_s": 144.0, "fp8_best_tok_s_64k": 820.0, "b1_tok_s_1m": None}
    run2 = {**run, "summary": {"fp8_best_tok_s_64k": 900.0}}
    write_section(path, "fp8_host_kv", run2, lift=("fp8_best_tok_s_64k",))
    doc = json.loads(path.read_text())
    assert doc["fp8_host_kv"]["summary"] == {"fp8_best_tok_s_64k": 900.0}
    assert doc["summary"]["fp8_best_tok_s_64k"] == 900.0 and doc["rows"] == full["rows"]


@pytest.mark.parametrize("name", ["", "rows", "summary", "bad name"])
def test_section_name_is_checked(tmp_path, name):
    with pytest.raises(ValueError, match="section name"):
        write_section(tmp_path / "decode.json", name, {"rows": []})
