"""Checks on the decode behaviour: padding rows select nothing and leave live rows alone,
whether the selection depends on key content, and decoded keys reaching the selection."""
from __future__ import annotations

from typing import Any, Optional

import torch

from sparsehi.algorithms.base import BaseSparseAlgorithm, SparseMode
from sparsehi.algorithms.testing.contract import _fail, _same_selection
from sparsehi.algorithms.testing.harness import PADDING_ROWS, _Case


def _check_padding_row_selections(name: str, case: _Case, alg: BaseSparseAlgorithm, cur: torch.Tensor,
                                  last: dict[int, tuple]) -> None:
    """Padding rows (``req_pool_indices == -1``, sparse_mask True, a long row's candidates)
    appended to the batch select nothing, and the live rows select as without them."""
    x = case.retrieve_inputs(cur, pad=PADDING_ROWS)
    got = case.checked(name, "batch with padding rows", case.call_retrieve(alg, x), x)
    for layer, sv in got.items():
        if not _same_selection(sv, last[layer][:2], slice(0, case.b)):
            _fail(name, f"layer {layer}: appending padding rows (req_pool_indices == -1) changed the live rows' "
                        "selections: rows are independent")


def _probe_content(case: _Case, cls: type, name: str, algorithm_kwargs: Optional[dict[str, Any]], cur: torch.Tensor,
                   last: dict[int, tuple], seed: int) -> bool:
    """Does the selection depend on key content? A fresh instance prefilled with other
    keys (random, no needles) at the same lengths, same queries: any selection differs."""
    gen = torch.Generator().manual_seed(seed + 7919)
    other = [torch.randn(k.shape, generator=gen).to(case.dev) for k in case.keys_logical]
    alt = case.make(cls, name, algorithm_kwargs)
    case.prefill(alt, cur, keys=other)
    x = case.retrieve_inputs(cur)
    got = case.checked(name, "prefilled with other keys", case.call_retrieve(alt, x), x)
    return any(not _same_selection(got[layer], last[layer][:2]) for layer in case.sparse_layers)


def _check_decoded_keys(name: str, case: _Case, alg: BaseSparseAlgorithm, cur: torch.Tensor) -> int:
    """Decode the probe steps; then each live row's probe units (decoded tokens whose keys
    are aligned with the query, ranked first by the exact-score oracle on the true keys)
    must be selected. Returns the number of (layer, row) pairs checked."""
    from sparsehi.algorithms.oracle import exact_token_scores, page_max_scores

    for t in range(case.probe_steps):
        case.call_update(alg, case.update_inputs(cur + t))
    end = cur + case.probe_steps
    x = case.retrieve_inputs(end)
    got = case.checked(name, "after the decoded-key probe", case.call_retrieve(alg, x), x)
    unit = "page" if alg.mode is SparseMode.PAGE_WISE and case.ps > 1 else "token"
    checked = 0
    for layer, (sel, valid) in got.items():
        for i in range(case.b):
            cs, ce, n = int(x["cs"][i]), int(x["ce"][i]), int(end[i])
            probes = case.probe_units[i]
            if not bool(case.sparse_mask[i]) or not all(cs <= u < ce for u in probes):
                continue
            q = case.q_layers[layer][i]
            scores = exact_token_scores(q[None], case.keys_logical[layer][i][None, :n])
            per_unit = page_max_scores(scores, torch.tensor([n], device=case.dev), case.ps)[0, cs:ce]
            top = set((torch.topk(per_unit, len(probes)).indices + cs).tolist())
            if top != set(probes):  # the planted keys do not dominate: nothing to claim here
                continue
            checked += 1
            chosen = set(sel[i, : int(valid[i])].tolist())
            missing = [u for u in probes if u not in chosen]
            if missing:
                _fail(name, f"layer {layer}, batch row {i} (request slot {int(case.req[i])}): decoded tokens at "
                            f"positions {case.probe_positions[i]} have keys aligned with the query (the exact-score oracle ranks "
                            f"their {unit}s {probes} first), but retrieve_topk missed {unit}(s) {missing} "
                            f"(selected {sorted(chosen)}): update_representations must fold each decoded key into "
                            f"{unit} positions // page_size of request slot req_pool_indices[b]; an update that does "
                            f"nothing, or writes another {unit} or request slot, fails here")
    return checked
