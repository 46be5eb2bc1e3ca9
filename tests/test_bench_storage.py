"""benchmarks/bench_storage.py end to end at tiny sizes: the prefetch path reads every page
back (the script checks the bytes), one row per backend with the issue's fields, the result
file written; mooncake runs against a real master when its client imports, else the result
says why it was skipped."""
from __future__ import annotations

import json

import pytest

from benchmarks import bench_storage as bs


def test_quick_run_writes_fields(tmp_path):
    out = bs.main(["--quick", "--pages", "6", "--repeats", "2", "--io-batch-pages", "4", "--out", str(tmp_path),
                   "--file-dir", str(tmp_path)])
    on_disk = json.loads((tmp_path / "storage.json").read_text())
    assert on_disk["results"] == out["results"]
    assert on_disk["date"] == "2026-11-25"
    assert on_disk["hardware"]["cpu_cores"] >= 1 and on_disk["hardware"]["cpu_model"]
    rows = out["results"]
    want = [("file", "warm"), ("file", "cold")]
    if bs.mooncake_missing() is None:
        want.append(("mooncake", "memory"))
    else:
        assert "mooncake" in out["skipped"]
    assert [(r["backend"], r["cache"]) for r in rows] == want
    for r in rows:
        assert r["pages"] == 6 and r["faults"] == 0
        assert r["gbps"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"]
        assert r["latency_samples"] == 2 * 2  # two batch_get calls (4 + 2 pages) per repeat
        assert "4 page" in r["latency_unit"]


def test_bad_backend_is_rejected(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bs.main(["--quick", "--backends", "nfs", "--out", str(tmp_path)])
    assert "--backends" in capsys.readouterr().err


def test_percentile():
    assert bs.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert bs.percentile([0.0, 10.0], 0.99) == pytest.approx(9.9)
