"""Masked top-k over per-id scores, shared by the built-in algorithms.

This is ``torch.topk`` on scores whose non-candidate ids are set to ``-inf``: the scoring
kernels (Quest, DSA) are the bandwidth-heavy part; a selection over a few thousand ids
per row is cheap in torch and stays CUDA-graph friendly (fixed shapes, no host sync).
"""
from __future__ import annotations

from typing import Optional

import torch


def _capturing() -> bool:
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


class IdentityMemo:
    """One cached value keyed by the identity (and in-place version) of some tensors plus a
    few plain values: decode steps pass the same per-step tensors (req_pool_indices,
    seq_lens, candidate ranges) to every layer, so what is derived from them alone is
    computed by the first layer and reused by the others. A tensor modified in place
    bumps its version and misses the cache; the cached tensors are kept alive with the
    value, so an ``id`` cannot be reused while it is cached.

    CUDA graphs: nothing is cached while a graph is being captured (each call records its
    own build, so a replay recomputes from the replay's inputs: a static input buffer keeps
    its identity and version across replays), and a value built before the capture (its
    warm-up) is never handed to it."""

    def __init__(self) -> None:
        self._tensors: tuple = ()
        self._versions: tuple = ()
        self._extra: tuple = ()
        self._value = None

    def get(self, tensors: tuple, extra: tuple, build):
        if _capturing():
            return build()
        if (len(tensors) == len(self._tensors) and extra == self._extra
                and all(a is b for a, b in zip(tensors, self._tensors))
                and tuple(t._version for t in tensors) == self._versions):
            return self._value
        value = build()
        self._tensors, self._versions, self._extra = tuple(tensors), tuple(t._version for t in tensors), extra
        self._value = value
        return value


_ARANGE: dict = {}


def _arange(n: int, device: torch.device) -> torch.Tensor:
    key = (n, device)
    t = _ARANGE.get(key)
    if t is None:
        t = _ARANGE[key] = torch.arange(n, device=device)
    return t


def candidate_mask(
    num_ids: int,
    candidate_start: torch.Tensor,
    candidate_end: torch.Tensor,
    sparse_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``[B, num_ids] bool``: id ``i`` of row ``b`` is selectable.

    candidate_start / candidate_end: ``[B]`` int, the half-open id range ``[start, end)``.
    sparse_mask: ``[B] bool`` or None; rows with False select nothing.
    """
    ids = _arange(num_ids, candidate_start.device)[None, :]
    mask = (ids >= candidate_start.long()[:, None]) & (ids < candidate_end.long()[:, None])
    if sparse_mask is not None:
        mask &= sparse_mask.to(device=mask.device, dtype=torch.bool)[:, None]
    return mask


def masked_topk(
    scores: torch.Tensor,
    top_k: int,
    candidate_start: torch.Tensor,
    candidate_end: torch.Tensor,
    sparse_mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``top_k`` ids per row among the candidates.

    scores:          ``[B, N]`` float, score of id ``i`` (ids ``>= N`` do not exist; ``-inf``
                     or NaN: not selectable).
    top_k:           int > 0, ids returned per row at most.
    candidate_start: ``[B]`` int, candidate_end: ``[B]`` int (clipped to ``[0, N]``).
    sparse_mask:     ``[B] bool`` or None; False rows return nothing.

    Returns ``(selected [B, top_k] int32`` ids by descending score, ``-1`` padded,
    ``valid [B] int32)``. Ties break towards the lower id (deterministic).
    """
    if not isinstance(top_k, int) or top_k <= 0:
        raise ValueError(f"top_k={top_k!r} is invalid: an integer > 0 (selection units)")
    if scores.dim() != 2:
        raise ValueError(f"scores must be [B, N], got shape {tuple(scores.shape)}")
    bsz, n = scores.shape
    dev = scores.device
    masks = (candidate_start, candidate_end) + (() if sparse_mask is None else (sparse_mask,))
    cand = _MASK_MEMO.get(masks, (n, dev), lambda: candidate_mask(
        n, candidate_start.to(dev).long().clamp(0, n), candidate_end.to(dev).long().clamp(0, n), sparse_mask))
    # A score of -inf (or NaN) means "not selectable" (e.g. a position the index does not
    # cover yet): such ids are neither selected nor counted in valid.
    s = torch.nan_to_num(scores.float(), nan=float("-inf"), posinf=torch.finfo(torch.float32).max, neginf=float("-inf"))
    s = torch.where(cand, s, float("-inf"))
    valid = (s > float("-inf")).sum(dim=1, dtype=torch.int32).clamp_(max=top_k)
    k_eff = min(top_k, n)
    if k_eff > 0:
        # stable sort gives lower-id-first among ties on every device
        _, order = torch.sort(s, dim=1, descending=True, stable=True)
        idx = order[:, :k_eff]
    else:
        idx = torch.empty(bsz, 0, dtype=torch.long, device=dev)
    cols = _arange(k_eff, dev)[None, :]
    sel = torch.where(cols < valid[:, None], idx, -1).to(torch.int32)
    if k_eff < top_k:
        out = torch.full((bsz, top_k), -1, dtype=torch.int32, device=dev)
        out[:, :k_eff] = sel
        sel = out
    return sel, valid


_MASK_MEMO = IdentityMemo()
_KWARGS_MEMO = IdentityMemo()


def selection_kwargs(
    kwargs: dict, batch: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Validate the keyword arguments the coordinator passes to ``retrieve_topk``.

    Returns ``(seq_lens [B] int64, candidate_start [B] int64, candidate_end [B] int64,
    top_k int)`` on ``device``; raises ValueError naming a missing or malformed one.
    """
    ts = []
    for name in ("seq_lens", "candidate_start", "candidate_end"):
        t = kwargs.get(name)
        if not isinstance(t, torch.Tensor) or t.shape != (batch,):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"retrieve_topk needs {name}: a [B={batch}] int tensor, got {got}")
        ts.append(t)
    # the same per-step tensors come with every layer: convert once
    out = _KWARGS_MEMO.get(tuple(ts), (device,), lambda: [t.to(device=device, dtype=torch.long) for t in ts])
    top_k = kwargs.get("top_k")
    if isinstance(top_k, torch.Tensor) and top_k.numel() == 1:
        top_k = int(top_k)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k <= 0:
        raise ValueError(f"retrieve_topk needs top_k: an integer > 0 (selection units), got {top_k!r}")
    return out[0], out[1], out[2], top_k


# ----------------------------------------------------------------------------- input guards
def host_checks_enabled(validate: bool) -> bool:
    """Run the value checks that read tensors back to the host?

    ``validate`` (``sparse_extra_config["validate"]``, default True) asks for them, but
    never while a CUDA graph is being captured: a host read-back would break the capture,
    and a captured graph replays with values the checks never saw anyway. Shape and dtype
    checks (metadata only) always run.
    """
    if not validate:
        return False
    # CUDA not initialised -> nothing can be capturing (and the query itself would fail
    # on a CPU-only torch)
    return not (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())


_INT_DTYPES = (torch.int32, torch.int64)


def check_int_vector(name: str, t: object, batch: int) -> torch.Tensor:
    """``t`` as a ``[batch]`` int32/int64 tensor, else ValueError naming ``name``."""
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != batch:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a [B={batch}] int32/int64 tensor, got shape {got}")
    if t.dtype not in _INT_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    return t


def check_float_tensor(name: str, t: object, shape: tuple[int, ...], desc: str) -> torch.Tensor:
    """``t`` as a floating tensor of exactly ``shape``, else ValueError naming ``name``
    (``desc`` spells the shape, e.g. ``"[B, Hkv, D]"``)."""
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be {desc}={tuple(shape)}, got {got}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor, got {t.dtype}")
    return t


def check_batch_rows(req_pool_indices: object, sparse_mask: object = None) -> int:
    """Validate ``req_pool_indices [B]`` (and ``sparse_mask [B]`` when given); returns B."""
    if not isinstance(req_pool_indices, torch.Tensor) or req_pool_indices.dim() != 1:
        got = tuple(req_pool_indices.shape) if isinstance(req_pool_indices, torch.Tensor) else type(req_pool_indices).__name__
        raise ValueError(f"req_pool_indices must be a [B] int32/int64 tensor, got shape {got}")
    b = req_pool_indices.shape[0]
    check_int_vector("req_pool_indices", req_pool_indices, b)
    if sparse_mask is not None:
        if not isinstance(sparse_mask, torch.Tensor) or tuple(sparse_mask.shape) != (b,):
            got = tuple(sparse_mask.shape) if isinstance(sparse_mask, torch.Tensor) else type(sparse_mask).__name__
            raise ValueError(f"sparse_mask must be a [B={b}] bool tensor, got shape {got}")
    return b


def live_rows(req_pool_indices: torch.Tensor, max_num_reqs: int) -> torch.Tensor:
    """``[B] bool``: rows naming a real request slot. Negative ids are padding rows (e.g. of
    a CUDA-graph batch); ids ``>= max_num_reqs`` (rejected by the checks when they run)
    are treated as padding too, so an unchecked call never writes out of its pool."""
    return (req_pool_indices >= 0) & (req_pool_indices < max_num_reqs)


def raise_if_any(flags: list[tuple[torch.Tensor, str]]) -> None:
    """One host read-back for several checks: raise ValueError with the message of the
    first ``(bool tensor, message)`` whose tensor has a True element."""
    if not flags:
        return
    hits = torch.stack([f.any() for f, _ in flags]).tolist()
    for hit, (_, msg) in zip(hits, flags):
        if hit:
            raise ValueError(msg)
