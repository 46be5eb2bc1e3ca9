"""The project files one decode step of a sparse-hier layer runs, traced, are the files
docs/architecture.md lists for it ("One decode step of a sparse-hier layer, file by file"),
in the order it lists them: the attention function of a sparse layer (the per-layer path)
and the runner's step outside the model (the per-step part).

A file counts as touched when a Python function defined in it runs (under the Triton
interpreter a kernel's body is Python too), or a method a dataclass generated for one of
its classes (``__init__``). The model itself (``gqa_model.py`` and what it calls outside
the attention function) is not part of either list. Both ``validate`` settings are traced:
``False`` (benchmarks, CUDA graphs) must give the listed files without the validate-only
group, ``True`` with it. The traced parts run the Triton kernels; the untraced rest (the
prefill, a first step, the model and its other layers) runs the torch references, which
keeps the test fast."""
from __future__ import annotations

import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import torch

from hicache.triton_support import interpreter_enabled
from sparsehi.config import SparseConfig
from sparsehi.runtime.model_config import get_model_config
from sparsehi.runtime.runner import ModelRunner
from sparsehi.runtime.runtime_config import RuntimeConfig
from sparsehi.runtime.weights import build_model

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
SECTION = "## One decode step of a sparse-hier layer, file by file"
TRACED_LAYER = 2
"""The sparse layer whose attention function is traced (layers 0 and 1 are Quest's dense
layers)."""

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason="traces the Triton path on CPU (TRITON_INTERPRET=1)")


class _FileTrace:
    """Project files (paths relative to the repository, under ``sparsehi/`` and
    ``hicache/``) in the order their first function ran, per named part."""

    def __init__(self) -> None:
        self.parts: dict[str, list[str]] = {}
        self._rel: dict[str, Optional[str]] = {}

    def _project_path(self, filename: str) -> Optional[str]:
        if filename not in self._rel:
            rel = None
            path = Path(os.path.realpath(filename))
            if path.is_relative_to(ROOT):
                r = path.relative_to(ROOT).as_posix()
                rel = r if r.startswith(("sparsehi/", "hicache/")) else None
            self._rel[filename] = rel
        return self._rel[filename]

    def profiler(self, part: str) -> Callable:
        files = self.parts.setdefault(part, [])

        def on_event(frame, event: str, arg: Any) -> None:
            if event != "call":
                return
            code = frame.f_code
            filename = code.co_filename
            if filename.startswith("<") and code.co_argcount:
                # a dataclass's generated method: the file of the class it belongs to
                owner = type(frame.f_locals.get(code.co_varnames[0]))
                filename = getattr(sys.modules.get(owner.__module__), "__file__", None) or filename
            rel = self._project_path(filename)
            if rel is not None and rel not in files:
                files.append(rel)

        return on_event


@contextmanager
def _running(profiler: Optional[Callable], triton: bool) -> Iterator[None]:
    """Inside: ``profiler`` traces calls (None: nothing is traced), and the kernels run their
    Triton launchers (``triton``) or their torch references."""
    outer, env = sys.getprofile(), os.environ.get("SPARSEHI_FORCE_TRITON")
    os.environ["SPARSEHI_FORCE_TRITON"] = "1" if triton else "0"
    sys.setprofile(profiler)
    try:
        yield
    finally:
        sys.setprofile(outer)
        if env is None:
            del os.environ["SPARSEHI_FORCE_TRITON"]
        else:
            os.environ["SPARSEHI_FORCE_TRITON"] = env


class _UntracedModel:
    """The runner's model, untraced and on the torch references (fast on CPU), except
    inside the traced layer's attention function."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with _running(None, triton=False):
            return self._model(*args, **kwargs)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with _running(None, triton=False):
            return self._model.logits(hidden)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _trace_decode_step(validate: bool) -> dict[str, list[str]]:
    """Files of one sparse-hier decode step (Quest, the FlashAttention adapter, io backend
    ``kernel``, Triton kernels): ``layer`` while layer TRACED_LAYER's attention function
    runs, ``step`` in ``ModelRunner.decode_step`` outside the model."""
    model = build_model(config=get_model_config("tiny-gqa", num_layers=TRACED_LAYER + 1))
    sc = SparseConfig(algorithm="quest", page_size=16, top_k=64, device_buffer_size=128, sink_tokens=16,
                      recent_tokens=16, min_sparse_prompt_len=0, io_backend="kernel")
    rt = RuntimeConfig(mode="sparse-hier", sparse=sc, max_num_reqs=1, max_context_len=400, adapter="auto",
                       validate=validate)
    runner = ModelRunner(model, rt)
    assert runner.mode.algorithm.is_sparse_layer(TRACED_LAYER)
    req = runner.new_requests([list(range(300))])[0]
    # the prefill and a first step (its one-time work stays out of the trace) on the torch
    # references, which run fast on CPU; the traced parts run the Triton kernels
    with _running(None, triton=False):
        runner.prefill(req)
        runner.decode_step([req])

    trace = _FileTrace()
    layer_profiler = trace.profiler("layer")
    decode_device = runner.mode.decode_device

    def traced_decode_device(rows, seq_lens, graph_key):
        attn, close = decode_device(rows, seq_lens, graph_key)

        def traced_attn(layer: int, *args: Any) -> torch.Tensor:
            if layer != TRACED_LAYER:
                return attn(layer, *args)
            with _running(layer_profiler, triton=True):
                return attn(layer, *args)

        return traced_attn, close

    runner.mode.decode_device = traced_decode_device
    runner.model = _UntracedModel(model)
    with _running(trace.profiler("step"), triton=True):
        runner.decode_step([req])
    return trace.parts


@pytest.fixture(scope="module")
def traced() -> dict[bool, dict[str, list[str]]]:
    return {v: _trace_decode_step(v) for v in (False, True)}


def _documented() -> dict[str, list[str]]:
    """The file column of every table row of the section, by its ``###`` / ``####``
    headings (``"### a / #### b"``)."""
    text = DOC.read_text()
    assert SECTION in text, f"{DOC.name} has no section {SECTION!r}"
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    out: dict[str, list[str]] = {}
    h3 = h4 = ""
    for line in body.splitlines():
        if line.startswith("### "):
            h3, h4 = line[4:].strip(), ""
        elif line.startswith("#### "):
            h4 = line[5:].strip()
        elif line.startswith("|") and not set(line) <= set("|-: "):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0] == "#":
                continue  # the header row
            paths = re.findall(r"`([^`]+)`", cells[1])
            assert len(paths) == 1, f"row names no single file: {line}"
            out.setdefault(f"{h3} / {h4}" if h4 else h3, []).append(paths[0])
    return out


def _parts(prefix: str, documented: dict[str, list[str]]) -> dict[str, list[str]]:
    parts = {k: v for k, v in documented.items() if k.startswith(prefix)}
    assert parts, f"{DOC.name}: no table under a heading starting {prefix!r}"
    return parts


def _in_trace_order(listed: list[str], traced: list[str]) -> bool:
    return [f for f in traced if f in listed] == listed


def test_the_documented_files_exist():
    for files in _documented().values():
        for f in files:
            assert (ROOT / f).is_file(), f"{DOC.name} lists {f}, which does not exist"


def test_the_layer_path_is_the_documented_one(traced):
    groups = _parts("Per layer", _documented())
    always = {k: v for k, v in groups.items() if "validate=True" not in k}
    checks = [f for k, v in groups.items() if "validate=True" in k for f in v]
    listed = [f for v in always.values() for f in v]
    got = traced[False]["layer"]
    assert sorted(listed) == sorted(got), (f"validate=False: traced but not listed {sorted(set(got) - set(listed))}; "
                                           f"listed but not traced {sorted(set(listed) - set(got))}")
    for heading, files in always.items():
        assert _in_trace_order(files, got), f"{heading}: {files} is not the call order {got}"
    got_checked = traced[True]["layer"]
    assert sorted(listed + checks) == sorted(got_checked), (
        f"validate=True: traced but not listed {sorted(set(got_checked) - set(listed) - set(checks))}; "
        f"listed but not traced {sorted(set(listed) | set(checks) - set(got_checked))}")
    assert _in_trace_order(checks, got_checked)


def test_the_step_part_is_the_documented_one(traced):
    listed = [f for v in _parts("Per step", _documented()).values() for f in v]
    for validate in (False, True):
        got = traced[validate]["step"]
        assert sorted(listed) == sorted(got), (f"validate={validate}: traced but not listed "
                                               f"{sorted(set(got) - set(listed))}; listed but not traced "
                                               f"{sorted(set(listed) - set(got))}")
    assert listed == traced[False]["step"], "the step's files are not listed in call order"


def test_the_stated_counts_are_the_listed_ones():
    """Each heading's "(N files)" and the section's bold totals match the tables."""
    text = DOC.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    documented = _documented()
    for heading, files in documented.items():
        m = re.search(r"\((\d+) files?\)", heading.rsplit(" / ", 1)[-1])
        assert m, f"heading {heading!r} states no '(N files)'"
        assert int(m.group(1)) == len(files), heading
    layer = [f for k, v in documented.items() if k.startswith("Per layer") and "validate=True" not in k for f in v]
    checks = [f for k, v in documented.items() if k.startswith("Per layer") and "validate=True" in k for f in v]
    step = [f for k, v in documented.items() if k.startswith("Per step") for f in v]
    assert f"**{len(layer)} project files**" in text
    assert f"**{len(layer) + len(checks)}** with `validate=True`" in text
    assert f"**{len(set(layer) | set(checks) | set(step))} files**" in text
