"""benchmarks/bench_sglang_plugin.py end to end on CPU (--quick): the three runs per batch,
their ratios, the result file."""
from __future__ import annotations

import json

from benchmarks import bench_sglang_plugin as bench


def test_quick_run_writes_the_three_runs(tmp_path):
    out = bench.main(["--quick", "--out", str(tmp_path)])
    assert [r["batch"] for r in out["results"]] == [1, 2]
    for row in out["results"]:
        runs = {r["run"]: r for r in row["runs"]}
        assert list(runs) == list(bench.RUNS)
        assert all(r["ms_per_step"] > 0 and r["batch"] == row["batch"] for r in runs.values())
        assert "hit_rate" not in runs["dense"]  # sparsehi off: no coordinator
        for kind in ("sparse_graph", "sparse_eager"):
            assert 0.0 <= runs[kind]["hit_rate"] <= 1.0
        assert row["sparse_graph_speedup_vs_dense"] == round(
            runs["dense"]["ms_per_step"] / runs["sparse_graph"]["ms_per_step"], 3)
    assert json.loads((tmp_path / "sglang_plugin.json").read_text())["results"] == out["results"]
