"""The author's one-call entry point: :func:`check_algorithm` runs every check in order and
returns the :class:`~sparsehi.algorithms.testing.report.AlgorithmReport`."""
from __future__ import annotations

from typing import Any, Optional

import torch

from sparsehi.algorithms.base import SparseMode
from sparsehi.algorithms.testing.capture import _check_capture
from sparsehi.algorithms.testing.contract import _fail, _same_selection, check_api
from sparsehi.algorithms.testing.decode_checks import _check_decoded_keys, _check_padding_row_selections, _probe_content
from sparsehi.algorithms.testing.fidelity import attention_mass, mass_recall, plant_needles
from sparsehi.algorithms.testing.harness import _Case
from sparsehi.algorithms.testing.inputs import AttentionInputs
from sparsehi.algorithms.testing.report import AlgorithmReport


_CHECK_MODES = ("require", "report", "off")


def check_algorithm(
    cls: type,
    config_overrides: Optional[dict[str, Any]] = None,
    device: torch.device | str = "cpu",
    *,
    inputs: Optional[AttentionInputs] = None,
    algorithm_kwargs: Optional[dict[str, Any]] = None,
    num_layers: int = 3,
    q_heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    context_len: int = 160,
    decode_steps: int = 2,
    needles_per_row: int = 2,
    min_needle_recall: Optional[float] = 1.0,
    min_mass_recall: Optional[float] = None,
    capture_check: str = "require",
    replay_check: str = "require",
    seed: int = 0,
) -> AlgorithmReport:
    """Run the author checks on ``cls`` and return an :class:`AlgorithmReport`.

    config_overrides: ``SparseConfig`` fields; defaults are small: page-wise ``page_size=4,
                      top_k=32`` tokens (8 pages), token-wise ``page_size=1, top_k=16``;
                      ``sink_tokens = recent_tokens = page_size`` (4 for token mode).
    inputs:           how the algorithm's inputs derive from attention q/k (default: as is).
    min_needle_recall / min_mass_recall: thresholds (None: measure only).
    capture_check:    ``"require"`` (default): a host sync or data-dependent shape in
                      ``retrieve_topk`` / ``update_representations`` (or a CUDA capture that
                      raises) fails the check; ``"report"``: recorded in the report only;
                      ``"off"``: not run (nor is the replay comparison).
    replay_check:     ``"require"`` (default): replayed hooks must equal eager calls;
                      ``"report"``: a difference is recorded in ``report.capture_findings``
                      and printed, not raised.

    Raises AssertionError (message names the check) on the first failure.
    """
    _check_arguments(capture_check, replay_check, decode_steps)
    name = getattr(cls, "__name__", repr(cls))
    check_api(cls)
    report_checks = ["api"]
    config = _small_config(cls, config_overrides)
    dev = torch.device(device)
    inputs = inputs or AttentionInputs()

    sparse_layers = _sparse_layers(name, cls(config, dev, **(algorithm_kwargs or {})), num_layers)
    case = _Case(config, dev, inputs, num_layers=num_layers, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                 context_len=context_len, decode_steps=decode_steps, needles_per_row=needles_per_row,
                 sparse_layers=sparse_layers, seed=seed)
    alg = case.make(cls, name, algorithm_kwargs)
    case.ascending = bool(getattr(alg, "selects_ascending", False))
    report = AlgorithmReport(algorithm=name, mode=alg.mode.value, page_size=case.ps, top_k_units=case.k_units,
                             top_k_tokens=config.top_k)

    case.prefill(alg, case.seq0)
    report_checks.append("prefill")
    cur, fills, last = _decode_steps(name, case, alg, decode_steps, report)
    report_checks += ["shapes/padding", "budget", "candidates", "sparse_mask"]

    _check_determinism(name, case, cls, algorithm_kwargs, alg, cur, last, sparse_layers)
    report.deterministic = True
    report_checks.append("determinism")

    _check_padding_row_writes(name, case, alg, cur, last, sparse_layers, inputs)
    report_checks.append("padding-row writes")
    _check_padding_row_selections(name, case, alg, cur, last)
    report_checks.append("padding-row selections")

    report_checks.append(_check_decoded_keys_where_read(name, case, cls, algorithm_kwargs, alg, cur, last, seed,
                                                        report))
    if capture_check != "off":
        _check_capture(name, case, cls, algorithm_kwargs, cur, report, capture_check, replay_check)
        report_checks.append("capture safety")
    else:
        report.capture.append("not checked (capture_check='off')")

    _check_recall(name, case, alg, sparse_layers, last, cur, fills, report, min_needle_recall, min_mass_recall)
    report_checks.append("recall")
    report.checks = report_checks
    return report


def _check_arguments(capture_check: str, replay_check: str, decode_steps: Any) -> None:
    for pname, v, allowed in (("capture_check", capture_check, _CHECK_MODES),
                              ("replay_check", replay_check, _CHECK_MODES[:2])):
        if v not in allowed:
            raise ValueError(f"{pname}={v!r} is invalid: one of {allowed}")
    if not isinstance(decode_steps, int) or decode_steps < 1:
        raise ValueError(f"decode_steps={decode_steps!r} is invalid: an integer >= 1")


def _small_config(cls: type, config_overrides: Optional[dict[str, Any]]):
    """The checks' SparseConfig: small defaults for ``cls``'s mode, then ``config_overrides``."""
    from sparsehi.config import SparseConfig

    token_wise = cls.mode is SparseMode.TOKEN_WISE
    cfg_kw: dict[str, Any] = dict(
        algorithm=f"{cls.__module__}:{cls.__qualname__}", page_size=1 if token_wise else 4,
        top_k=(16 if token_wise else 32), device_buffer_size=(64 if token_wise else 128), sink_tokens=4,
        recent_tokens=4, min_sparse_prompt_len=0,
    )
    cfg_kw.update(config_overrides or {})
    return SparseConfig(**cfg_kw)


def _sparse_layers(name: str, probe: Any, num_layers: int) -> list[int]:
    """The test layers ``probe`` (an instance of the checked class) makes sparse; none fails."""
    sparse_layers = [layer for layer in range(num_layers) if probe.is_sparse_layer(layer)]
    if not sparse_layers:
        _fail(name, f"no sparse layer among the {num_layers} test layers (dense_layers={probe.dense_layers()})")
    return sparse_layers


def _decode_steps(name: str, case: _Case, alg: Any, decode_steps: int, report: AlgorithmReport
                  ) -> tuple[torch.Tensor, list[float], dict[int, tuple]]:
    """``decode_steps`` plain decode steps, each selection checked. Returns (sequence
    lengths ``[B]`` after the last step, per-call fill shares, each layer's last
    (selection, valid counts, candidate starts, candidate ends))."""
    k_units = case.k_units
    cur = case.seq0.clone()
    fills: list[float] = []
    last: dict[int, tuple] = {}
    for step in range(decode_steps):
        case.call_update(alg, case.update_inputs(cur))
        cur = cur + 1
        x = case.retrieve_inputs(cur)
        got = case.checked(name, f"decode step {step}", case.call_retrieve(alg, x), x)
        for layer, (sel, valid) in got.items():
            report.retrieve_calls += 1
            n_cand = (x["ce"] - x["cs"]).clamp(min=0).clamp(max=k_units)
            live = case.sparse_mask & (n_cand > 0)
            if bool(live.any()):
                fills.append(float((valid[live].float() / n_cand[live].float()).mean()))
            last[layer] = (sel, valid, x["cs"], x["ce"])
    return cur, fills, last


def _check_determinism(name: str, case: _Case, cls: type, algorithm_kwargs: Optional[dict[str, Any]], alg: Any,
                       cur: torch.Tensor, last: dict[int, tuple], sparse_layers: list[int]) -> None:
    """The same call again, and a fresh instance fed the same history, select the same."""
    fresh = case.make(cls, name, algorithm_kwargs)
    case.prefill(fresh, cur)
    x = case.retrieve_inputs(cur)
    again = case.checked(name, "repeated call", case.call_retrieve(alg, x), x)
    other = case.checked(name, "fresh instance", case.call_retrieve(fresh, x), x)
    for layer in sparse_layers:
        s0, v0 = last[layer][:2]
        s1, v1 = again[layer]
        if not (torch.equal(s0, s1) and torch.equal(v0, v1)):
            _fail(name, f"layer {layer}: two identical retrieve_topk calls returned different selections")
        if not _same_selection(other[layer], (s0, v0)):
            _fail(name, f"layer {layer}: prefill of the whole context and prefill + decode steps select differently "
                        "(update_representations disagrees with construct_representations)")


def _check_padding_row_writes(name: str, case: _Case, alg: Any, cur: torch.Tensor, last: dict[int, tuple],
                              sparse_layers: list[int], inputs: AttentionInputs) -> None:
    """Strong needle keys written with req_pool_index -1 at the first position of candidate
    units of row 0 must change no selection."""
    cs0, ce0 = (int(v[0]) for v in case.candidates(cur))
    if ce0 <= cs0:
        return
    b, dev_ = case.b, case.dev
    pad_pos = (cs0 + (torch.arange(b, device=dev_) * (ce0 - cs0)) // b) * case.ps
    pad_req = torch.full((b,), -1, dtype=torch.int64, device=dev_)
    for layer in sparse_layers:
        pad = torch.zeros(b, case.kv_heads, case.head_dim, device=dev_)
        plant_needles(pad, case.q_layers[layer][0], torch.arange(b, device=dev_), strength=20.0)
        alg.update_representations(layer, pad_req, pad_pos, pad, **inputs.decode_kwargs(layer, pad))
    x = case.retrieve_inputs(cur)
    got = case.checked(name, "after padding-row writes", case.call_retrieve(alg, x), x)
    for layer in sparse_layers:
        if not _same_selection(got[layer], last[layer][:2]):
            _fail(name, f"layer {layer}: update_representations with padding rows (req_pool_indices == -1) "
                        "changed a live request's selection: padding rows must write nothing")


def _check_decoded_keys_where_read(name: str, case: _Case, cls: type, algorithm_kwargs: Optional[dict[str, Any]],
                                   alg: Any, cur: torch.Tensor, last: dict[int, tuple], seed: int,
                                   report: AlgorithmReport) -> str:
    """Decoded keys are checked only where the selection depends on key content at all (a
    query-blind algorithm such as a sliding window needs no representations). Returns the
    check's name for the report."""
    report.content_dependent = _probe_content(case, cls, name, algorithm_kwargs, cur, last, seed)
    if report.content_dependent:
        _check_decoded_keys(name, case, alg, cur)
        return "decoded keys"
    return "decoded keys (n/a: selection ignores key content)"


def _recall(case: _Case, sparse_layers: list[int], last: dict[int, tuple], cur: torch.Tensor
            ) -> tuple[int, int, list[float]]:
    """Recall vs the oracle on the planted needles (last plain decode step): (needles
    selected, needles planted, per-row attention-mass recalls)."""
    masses: list[float] = []
    needle_hits = needle_total = 0
    for layer in sparse_layers:
        sel, valid, cs, ce = last[layer]
        for b_i in range(case.b):
            if not bool(case.sparse_mask[b_i]) or int(ce[b_i]) <= int(cs[b_i]):
                continue
            chosen = set(sel[b_i, : int(valid[b_i])].tolist())
            needle_total += len(case.needles[b_i])
            needle_hits += sum(1 for u in case.needles[b_i] if u in chosen)
            m = attention_mass(case.q_layers[layer][b_i], case.keys_logical[layer][b_i], int(cur[b_i]), case.ps)
            masses.append(mass_recall(m, sel[b_i], int(cs[b_i]), int(ce[b_i]), case.k_units))
    return needle_hits, needle_total, masses


def _check_recall(name: str, case: _Case, alg: Any, sparse_layers: list[int], last: dict[int, tuple],
                  cur: torch.Tensor, fills: list[float], report: AlgorithmReport,
                  min_needle_recall: Optional[float], min_mass_recall: Optional[float]) -> None:
    """Fill the report's recall, fill and size numbers; fail a recall below its threshold."""
    needle_hits, needle_total, masses = _recall(case, sparse_layers, last, cur)
    report.needle_recall = needle_hits / needle_total if needle_total else 1.0
    report.mass_recall = sum(masses) / len(masses) if masses else 1.0
    report.mean_fill = sum(fills) / len(fills) if fills else 1.0
    report.representation_bytes = int(alg.representation_bytes())
    if min_needle_recall is not None and report.needle_recall < min_needle_recall:
        _fail(name, f"needle recall {report.needle_recall:.3f} < required {min_needle_recall} "
                    f"({needle_hits}/{needle_total} planted needles selected)")
    if min_mass_recall is not None and report.mass_recall < min_mass_recall:
        _fail(name, f"attention-mass recall {report.mass_recall:.3f} < required {min_mass_recall}")
