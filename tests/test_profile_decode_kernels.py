"""benchmarks/profile_decode_kernels.py: kernels grouped by name per step; the CPU path runs."""
import json
import types

import torch

from benchmarks import profile_decode_kernels as pdk


def _ev(name, us, cuda=True):
    dt = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    return types.SimpleNamespace(name=name, device_type=dt, device_time_total=us)


def test_kernel_times_groups_by_name_per_step():
    prof = types.SimpleNamespace(events=lambda: [_ev("quest_score", 30.0), _ev("topk", 10.0), _ev("quest_score", 50.0),
                                                 _ev("aten::mm", 999.0, cuda=False)])
    rows = pdk.kernel_times(prof, steps=2)
    assert [r["name"] for r in rows] == ["quest_score", "topk"]
    assert rows[0]["us_per_step"] == 40.0 and rows[0]["calls_per_step"] == 1.0
    assert rows[1]["us_per_step"] == 5.0


def test_quick_run_writes_the_result(tmp_path):
    out = tmp_path / "prof.json"
    assert pdk.main(["--quick", "--steps", "2", "--warmup", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["mode"] == "sparse-hier-fp8" and res["profiled_steps"] == 2 and res["step_wall_ms_profiled"] > 0
    # the quick GQA model's two layers are both dense under Quest: no rho changes its steps
    assert res["rho"] == pdk.RHO_WITHOUT_SELECTION and res["rho_source"].startswith("fixed")


def test_quick_run_of_several_mla_points_writes_each(tmp_path):
    out = tmp_path / "prof.json"
    assert pdk.main(["--quick", "--model", "dsv32-shape", "--mode", "dense,sparse-hier", "--batch", "1,2",
                     "--steps", "1", "--warmup", "1", "--out", str(out)]) == 0
    pts = json.loads(out.read_text())["points"]
    assert [(p["mode"], p["batch"]) for p in pts] == [("dense", 1), ("dense", 2), ("sparse-hier", 1),
                                                      ("sparse-hier", 2)]
    assert all(p["model"] == "tiny-dsa" and p["step_wall_ms_profiled"] > 0 for p in pts)


def test_bad_arguments_name_the_option(capsys):
    import pytest

    for argv, name in ((["--batch", "1,x"], "--batch"), (["--batch", "0"], "--batch"), (["--mode", "nope"], "--mode"),
                       (["--model", "llama"], "--model"), (["--rho", "high"], "--rho"), (["--rho", "1.5"], "--rho")):
        with pytest.raises(SystemExit):
            pdk.main(["--quick", *argv])
        assert name in capsys.readouterr().err


def test_trace_rho_is_calibrated_unless_given(tmp_path, monkeypatch):
    # the default calibrates the trace as bench_decode does; a given rho is used as it is; where
    # two whole requests do not fit, each point calibrates on its own representations
    out = tmp_path / "prof.json"
    argv = ["--quick", "--model", "dsv32-shape", "--mode", "dense,sparse-hier", "--steps", "1", "--warmup", "1",
            "--out", str(out)]
    assert pdk.main(argv) == 0
    pts = json.loads(out.read_text())["points"]
    assert pts[0]["rho"] == pts[1]["rho"] and 0.0 < pts[0]["rho"] < 1.0 and pts[0]["rho"] != pdk.RHO_WITHOUT_SELECTION
    assert all(p["rho_source"].startswith("calibrated on two requests") for p in pts)
    assert pdk.main([*argv, "--rho", "0.5"]) == 0
    assert [p["rho"] for p in json.loads(out.read_text())["points"]] == [0.5, 0.5]
    monkeypatch.setattr(pdk, "calibration_fits", lambda *args: False)
    assert pdk.main(argv) == 0
    dense, sparse = json.loads(out.read_text())["points"]
    assert dense["rho"] == pdk.RHO_WITHOUT_SELECTION and dense["rho_source"].startswith("fixed")
    assert sparse["rho_source"].startswith("calibrated on this point") and 0.0 < sparse["rho"] < 1.0
