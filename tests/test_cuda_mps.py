"""benchmarks/cuda_mps.py: where no MPS daemon can start, the run goes on time-sliced and
says why; the environment is left as it was."""
from __future__ import annotations

import os

from benchmarks.cuda_mps import ENV_KEYS, cuda_mps


def test_disabled_is_time_sliced_and_touches_nothing():
    before = {k: os.environ.get(k) for k in ENV_KEYS}
    with cuda_mps(enabled=False) as mps:
        assert mps.sharing == "time-sliced" and mps.servers() == []
    assert {k: os.environ.get(k) for k in ENV_KEYS} == before


def test_missing_control_binary_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no nvidia-cuda-mps-control
    with cuda_mps() as mps:
        assert mps.sharing == "time-sliced"
        assert "nvidia-cuda-mps-control not on PATH" in mps.why_not


def test_a_failing_daemon_is_named_and_the_environment_restored(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-cuda-mps-control"
    fake.write_text("#!/bin/sh\necho 'cannot start: no GPU' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    for k in ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    with cuda_mps() as mps:
        assert mps.sharing == "time-sliced"
        assert "exited 3" in mps.why_not and "cannot start: no GPU" in mps.why_not
    assert not any(k in os.environ for k in ENV_KEYS)
