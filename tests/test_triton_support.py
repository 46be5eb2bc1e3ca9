"""Which implementation a kernel entry point runs (``hicache.triton_support.dispatch``) and
the launch arithmetic kept there."""
from __future__ import annotations

import logging

import pytest
import torch

from hicache import triton_support
from hicache.triton_support import cdiv, dispatch, sm_count


def _triton(x):
    return "triton"


def _reference(x):
    return "reference"


@pytest.mark.parametrize("env, triton_ok, want", [
    ({"TRITON_INTERPRET": "1", "SPARSEHI_FORCE_TRITON": "1"}, True, "triton"),
    ({"TRITON_INTERPRET": "1", "SPARSEHI_FORCE_TRITON": "1"}, False, "reference"),  # the kernel's own limits
    ({"TRITON_INTERPRET": "1", "SPARSEHI_FORCE_TRITON": "0"}, True, "reference"),  # CPU default
    ({"TRITON_INTERPRET": "0", "SPARSEHI_FORCE_TRITON": "1"}, True, "reference"),  # no interpreter, no CPU Triton
    ({"TRITON_INTERPRET": "1", "SPARSEHI_FORCE_TRITON": "1", "SPARSEHI_FORCE_REFERENCE": "1"}, True, "reference"),
])
def test_dispatch_on_cpu_follows_the_interpreter_and_the_overrides(monkeypatch, env, triton_ok, want):
    for name in ("TRITON_INTERPRET", "SPARSEHI_FORCE_TRITON", "SPARSEHI_FORCE_REFERENCE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    impl = dispatch("probe_kernel", torch.zeros(1), _triton, _reference, triton_ok=triton_ok)
    assert impl(None) == want


def test_dispatch_logs_each_path_once_by_name(monkeypatch, caplog):
    monkeypatch.setattr(triton_support, "_announced", set())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("SPARSEHI_FORCE_REFERENCE", raising=False)
    caplog.set_level(logging.INFO, logger="hicache.triton_support")
    for force in ("0", "0", "1", "1"):
        monkeypatch.setenv("SPARSEHI_FORCE_TRITON", force)
        dispatch("logged_kernel", torch.zeros(1), _triton, _reference)
    lines = [r.getMessage() for r in caplog.records if "logged_kernel" in r.getMessage()]
    assert lines == ["sparsehi kernel logged_kernel runs on reference", "sparsehi kernel logged_kernel runs on triton"]


def test_cdiv_and_sm_count_off_cuda():
    assert [cdiv(a, 4) for a in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    assert sm_count(torch.device("cpu")) == 0
    assert sm_count(torch.device("cpu"), off_cuda=4) == 4
