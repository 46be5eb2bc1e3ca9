"""benchmarks/main_job.py on CPU (--quick): the main job's report and the target ratios
computed from its own rows."""
from __future__ import annotations

import json

from benchmarks import main_job as mj


def test_ratios_from_rows():
    rows = [{"mode": "dense", "decode_tokens_per_s": 100.0}, {"mode": "sparse-gpu", "decode_tokens_per_s": 50.0},
            {"mode": "sparse-hier", "decode_tokens_per_s": 60.0}]
    assert mj.ratios(rows) == {"sparse_hier_over_sparse_gpu": 1.2, "sparse_hier_over_dense": 0.6}
    assert mj.ratios(rows[:2]) == {"sparse_hier_over_sparse_gpu": None, "sparse_hier_over_dense": None}


def test_quick_run_writes_targets(tmp_path):
    out = mj.main(["--context", "256", "--quick", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "main_job_1k.json").read_text())
    assert written["targets"] == out["targets"]
    tps = {r["mode"]: r["decode_tokens_per_s"] for r in written["run"]["rows"]}
    assert set(tps) == {"dense", "sparse-gpu", "sparse-hier"}
    assert out["targets"]["sparse_hier_over_dense"] == round(tps["sparse-hier"] / tps["dense"], 3)
    assert "tokens" not in written["run"]
