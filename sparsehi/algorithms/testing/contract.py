"""The contract checks: API conformance of an algorithm class, and one ``retrieve_topk``
result against the selection rules; each failure an AssertionError naming the rule."""
from __future__ import annotations

import inspect
from typing import Any, Optional

import torch

from sparsehi.algorithms.base import BaseSparseAlgorithm, SparseMode, check_selection

_HOOKS = ("initialize_representation_pool", "construct_representations", "update_representations", "retrieve_topk")


def _fail(name: str, msg: str) -> None:
    raise AssertionError(f"check_algorithm[{name}]: {msg}")


def check_api(cls: type) -> None:
    """API conformance: a concrete ``BaseSparseAlgorithm`` subclass whose hooks accept the
    base class's parameters."""
    name = getattr(cls, "__name__", repr(cls))
    if not (isinstance(cls, type) and issubclass(cls, BaseSparseAlgorithm)):
        _fail(name, f"{cls!r} is not a BaseSparseAlgorithm subclass")
    if inspect.isabstract(cls):
        _fail(name, f"abstract methods not implemented: {sorted(cls.__abstractmethods__)}")
    if not isinstance(getattr(cls, "mode", None), SparseMode):
        _fail(name, f"class attribute mode must be a SparseMode, got {getattr(cls, 'mode', None)!r}")
    for hook in _HOOKS:
        base_params = inspect.signature(getattr(BaseSparseAlgorithm, hook)).parameters
        params = inspect.signature(getattr(cls, hook)).parameters
        takes_var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
        for pname, p in base_params.items():
            if pname == "self" or p.kind is p.VAR_KEYWORD:
                continue
            if pname not in params and not takes_var_kw:
                _fail(name, f"{hook} does not accept parameter {pname!r} (keep BaseSparseAlgorithm's signature)")
        if not takes_var_kw:
            _fail(name, f"{hook} must accept **kwargs (the coordinator passes extra keyword arguments)")


def check_result(name: str, where: str, out: Any, top_k: int, candidate_start: torch.Tensor,
                 candidate_end: torch.Tensor, sparse_mask: torch.Tensor,
                 req_pool_indices: torch.Tensor, ascending: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One ``retrieve_topk`` result against the contract; returns ``(selected, valid)``.

    On top of :func:`~sparsehi.algorithms.base.check_selection`: two torch tensors, padding
    exactly ``-1``, ``valid_lengths`` in ``[0, K]``, nothing for ``sparse_mask`` False rows
    and nothing for padding rows (``req_pool_indices < 0``). AssertionError naming the rule.
    """
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        _fail(name, f"{where}: retrieve_topk must return (selected_indices, valid_lengths), got {type(out).__name__}")
    sel, valid = out
    if not (isinstance(sel, torch.Tensor) and isinstance(valid, torch.Tensor)):
        _fail(name, f"{where}: retrieve_topk must return two torch.Tensor (selected_indices [B, top_k] int32, "
                    f"valid_lengths [B] int32) on the device, got ({type(sel).__name__}, {type(valid).__name__})")
    try:
        check_selection(sel, valid, top_k, candidate_start, candidate_end)
    except ValueError as e:
        _fail(name, f"{where}: selection breaks the contract: {e}")
    if bool((valid.long() > sel.shape[1]).any()) or bool((valid < 0).any()):
        _fail(name, f"{where}: valid_lengths {valid.tolist()} outside [0, {sel.shape[1]}] (budget top_k={top_k})")
    cols = torch.arange(sel.shape[1], device=sel.device)[None, :]
    pad = cols >= valid.long()[:, None]
    bad = pad & (sel != -1)
    if bool(bad.any()):
        _fail(name, f"{where}: selected_indices pads with {sorted(set(sel[bad].tolist()))} after the valid ids: "
                    "the padding value is exactly -1")
    if bool(valid[~sparse_mask.to(valid.device).bool()].ne(0).any()):
        _fail(name, f"{where}: rows with sparse_mask False must return valid_lengths == 0")
    padding = (req_pool_indices < 0).to(valid.device)
    if bool(padding.any()) and bool(valid[padding].ne(0).any() or sel[padding].ne(-1).any()):
        rows = [i for i in range(valid.shape[0]) if bool(padding[i])]
        _fail(name, f"{where}: rows {rows} have req_pool_indices == -1 (padding rows of a CUDA-graph batch) and "
                    f"returned valid_lengths {valid[padding].tolist()}, ids {sel[padding].tolist()}: padding rows "
                    "must get valid_lengths == 0 "
                    "and all -1 ids, whatever their sparse_mask, seq_lens and candidates")
    if ascending:  # the algorithm declares selects_ascending: the coordinator skips its sort
        cols_v = cols < valid.long()[:, None]
        nxt = torch.cat([sel[:, 1:], torch.full_like(sel[:, :1], torch.iinfo(torch.int32).max)], 1)
        if bool((cols_v & (cols + 1 < valid.long()[:, None]) & (sel >= nxt)).any()):
            _fail(name, f"{where}: selects_ascending is True but a row's ids are not in ascending order "
                        "(the coordinator relies on it and skips its sort)")
    return sel, valid


def _same_selection(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                    rows: Optional[slice] = None) -> bool:
    """Equal ``(selected, valid)`` up to the order of the ids in a row."""
    rows = rows or slice(None)
    sa, va = a[0][rows], a[1][rows]
    sb, vb = b[0][rows], b[1][rows]
    return (sa.shape == sb.shape and torch.equal(va.cpu(), vb.cpu())
            and torch.equal(torch.sort(sa, dim=1).values.cpu(), torch.sort(sb, dim=1).values.cpu()))
