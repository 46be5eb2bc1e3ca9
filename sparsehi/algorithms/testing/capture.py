"""Capture safety: the decode hooks captured and replayed (emulated everywhere, a real CUDA
graph on CUDA) must run and equal eager calls."""
from __future__ import annotations

from typing import Any, Optional

import torch

from sparsehi.algorithms.testing.contract import _fail, _same_selection
from sparsehi.algorithms.testing.harness import PADDING_ROWS, _Case
from sparsehi.algorithms.testing.report import AlgorithmReport

_CAPTURE_RULE = ("retrieve_topk / update_representations run inside CUDA graphs: no host sync, no data-dependent "
                 "shapes, nothing derived from the inputs cached across calls (docs/algorithms.md, 'Capture safety')")


def _check_capture(name: str, case: _Case, cls: type, algorithm_kwargs: Optional[dict[str, Any]], cur: torch.Tensor,
                   report: AlgorithmReport, capture_check: str, replay_check: str) -> None:
    """Capture, then replay: the probe decode steps through a captured update_representations
    (warmed up and captured on padding rows), then retrieve_topk captured at the start and
    replayed at the end; both must equal eager calls on a twin instance. Emulated on every
    device; a real CUDA graph as well on CUDA."""
    from sparsehi.algorithms.graph_safety import CaptureUnsafe, CudaGraphReplay, EmulatedReplay, raised_finding

    eager = case.make(cls, name, algorithm_kwargs)
    case.prefill(eager, cur)
    for t in range(case.probe_steps):
        case.call_update(eager, case.update_inputs(cur + t, pad=PADDING_ROWS))
    end = cur + case.probe_steps
    x_end = case.retrieve_inputs(end, pad=PADDING_ROWS)
    want = case.checked(name, "eager twin", case.call_retrieve(eager, x_end), x_end)

    kinds: list[type] = [EmulatedReplay] + ([CudaGraphReplay] if case.dev.type == "cuda" else [])
    for kind in kinds:
        label = kind.kind
        g = case.make(cls, name, algorithm_kwargs)
        case.prefill(g, cur)
        upd_in = case.update_inputs(cur, pad=PADDING_ROWS, padding_only=True)
        ret_in = case.retrieve_inputs(cur, pad=PADDING_ROWS)
        upd = kind("update_representations", lambda g=g, s=upd_in: case.call_update(g, s), upd_in)
        ret = kind("retrieve_topk", lambda g=g, s=ret_in: case.call_retrieve(g, s), ret_in)
        running = upd
        try:
            upd.capture()
            running = ret
            ret.capture()
            running = upd
            for t in range(case.probe_steps):
                upd.load(case.update_inputs(cur + t, pad=PADDING_ROWS))
                upd.replay()
            running = ret
            ret.load({k: x_end[k] for k in ret_in})
            outs = [(s.clone(), v.clone()) if isinstance(s, torch.Tensor) else (s, v) for s, v in ret.replay()]
        except Exception as e:  # noqa: BLE001 - whatever a hook raises under capture is the finding
            finding = e.finding if isinstance(e, CaptureUnsafe) else raised_finding(running.hook, e)
            if capture_check == "require":
                _fail(name, f"capture safety ({label}): {finding} — {_CAPTURE_RULE}")
            report.capture.append(f"{label}: FAILED")
            report.capture_findings.append(f"{label}: {finding}")
            continue
        problems = []
        try:
            eager_g = case.checked(name, f"{label} instance, eager", case.call_retrieve(g, x_end), x_end)
        except AssertionError as e:  # its representations came from the replayed updates
            eager_g = None
            problems.append(f"update_representations replayed ({label}), then an eager retrieve_topk: {e}")
        try:
            replayed = case.checked(name, f"{label} replay", outs, ret_in)
        except AssertionError as e:
            replayed = None
            problems.append(f"retrieve_topk replayed ({label}) with new inputs in its static buffers: {e}")
        for layer in case.sparse_layers:
            if eager_g is not None and not _same_selection(eager_g[layer], want[layer]):
                problems.append(f"layer {layer}: update_representations replayed ({label}) leaves other "
                                "representations than eager calls with the same inputs (selections differ)")
            if eager_g is not None and replayed is not None and not _same_selection(replayed[layer], eager_g[layer]):
                problems.append(f"layer {layer}: retrieve_topk replayed ({label}) with new inputs in its static "
                                "buffers selects other ids than an eager call with the same inputs")
        if problems:
            if replay_check == "require":
                _fail(name, f"capture safety ({label}): {problems[0]} — something derived from the inputs is "
                            f"computed once and reused (e.g. a cache keyed on tensor identity); {_CAPTURE_RULE}")
            report.capture.append(f"{label}: replay differs from eager")
            report.capture_findings.extend(f"{label}: {p}" for p in problems)
            continue
        report.capture.append(f"{label}: passed ({case.probe_steps} update replays, retrieve replay == eager)")
    if case.dev.type != "cuda":
        report.capture.append(f"cuda graph: skipped (device {case.dev.type}; run the kit with device='cuda')")
