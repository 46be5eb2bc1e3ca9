"""benchmarks/bench_host_step.py end to end on CPU (--quick): rows per mode and batch, the
page-opening steps counted apart, the result file written."""
from __future__ import annotations

import json

from benchmarks import bench_host_step as bh


def test_quick_run_writes_rows(tmp_path):
    out = bh.main(["--quick", "--out", str(tmp_path), "--modes", "sparse-hier,dense", "--batches", "1,2",
                   "--boundaries", "1"])
    rows = out["rows"]
    assert [(r["schedule"], r["mode"], r["batch"]) for r in rows] == [
        (s, m, b) for s in ("overlap", "wait") for m in ("sparse-hier", "dense") for b in (1, 2)]
    for r in rows:
        assert r["device_gap_ms"] is None  # CPU: no CUDA events
        assert r["host_ms_opening_steps"]["n"] == 1  # one page boundary crossed
        assert r["host_ms"]["n"] == r["steps"] == 17
        assert r["worst_step"]["ms"] == r["host_ms"]["max"]
        probe = r["cpu_probe"]
        assert probe["p50_us"] > 0 and probe["max_over_median"] >= 1.0
        assert r["worst_step"]["probe_over_median"] > 0
    assert json.loads((tmp_path / "host_step.json").read_text())["rows"] == rows


def test_bad_modes_are_rejected(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit):
        bh.main(["--quick", "--out", str(tmp_path), "--modes", "sparse"])
    assert "--modes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bh.main(["--quick", "--out", str(tmp_path), "--schedules", "eager"])
    assert "--schedules" in capsys.readouterr().err
