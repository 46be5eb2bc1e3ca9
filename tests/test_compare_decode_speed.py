"""scripts/compare_decode_speed.py: rows matched across runs, medians compared, batch 1 and
the best batch of each mode checked against the tolerance."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "compare_decode_speed.py"
_spec = importlib.util.spec_from_file_location("compare_decode_speed", _PATH)
cds = importlib.util.module_from_spec(_spec)
sys.modules["compare_decode_speed"] = cds
_spec.loader.exec_module(cds)


def _row(mode: str, batch: int, tok_s: float, source: str = "trace85") -> dict:
    return {"mode": mode, "scenario": "a", "context": 65536, "batch": batch, "tokens_per_s": tok_s,
            "trace_source": source}


def test_medians_and_checks():
    # the model-query row at B=10 shares (mode, context, batch) with the trace row: kept apart
    old = [[_row("sparse-hier", 1, 100.0), _row("sparse-hier", 10, 700.0), _row("dense", 1, 50.0),
            _row("sparse-hier", 10, 290.0, "model")],
           [_row("sparse-hier", 1, 102.0), _row("sparse-hier", 10, 740.0), _row("dense", 1, 52.0),
            _row("sparse-hier", 10, 280.0, "model")]]
    new = [[_row("sparse-hier", 1, 101.0), _row("sparse-hier", 10, 650.0), _row("dense", 1, 51.0),
            _row("sparse-hier", 2, 300.0)],  # in one run only: left out
           [_row("sparse-hier", 1, 99.0), _row("sparse-hier", 10, 660.0), _row("dense", 1, 51.0),
            _row("sparse-hier", 10, 284.0, "model")]]
    new[0].append(_row("sparse-hier", 10, 286.0, "model"))
    res = cds.compare(old, new)
    assert set(res["rows"]) == {"sparse-hier a trace85 65536 1", "sparse-hier a trace85 65536 10",
                                "dense a trace85 65536 1", "sparse-hier a model 65536 10"}
    assert res["rows"]["sparse-hier a trace85 65536 10"]["new_over_old"] == pytest.approx(655.0 / 720.0, abs=1e-4)
    assert res["rows"]["sparse-hier a model 65536 10"]["new_over_old"] == pytest.approx(285.0 / 285.0, abs=1e-4)
    checks = res["checks"]
    assert checks["sparse-hier a trace85 65536 batch 1 (B=1)"]["within"]
    assert not checks["sparse-hier a trace85 65536 best batch (B=10)"]["within"]  # 0.91
    assert checks["dense a trace85 65536 best batch (B=1)"]["within"]
    assert res["all_within"] is False


def test_trees_must_hold_the_benchmark(tmp_path):
    with pytest.raises(SystemExit):
        cds.main(["--old", str(tmp_path)])
