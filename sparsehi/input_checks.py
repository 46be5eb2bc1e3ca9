"""Argument checks the algorithms and adapters share: shapes and dtypes of the per-row
tensors the coordinator passes (no host sync), value checks that read back to the host
(only where ``host_checks_enabled``), and the row masks derived from them.
"""
from __future__ import annotations

import torch

_INT_DTYPES = (torch.int32, torch.int64)


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


def selection_kwargs(
    kwargs: dict, batch: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Validate the keyword arguments the coordinator passes to ``retrieve_topk``.

    Returns ``(seq_lens, candidate_start, candidate_end)``, each ``[B]`` int32 or int64 as
    given (moved to ``device`` only when elsewhere: the kernels read either dtype, so the
    decode path needs no conversion launch), and ``top_k`` int; raises ValueError naming a
    missing or malformed one.
    """
    ts = []
    for name in ("seq_lens", "candidate_start", "candidate_end"):
        t = kwargs.get(name)
        if not isinstance(t, torch.Tensor) or t.shape != (batch,) or t.dtype not in _INT_DTYPES:
            got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"retrieve_topk needs {name}: a [B={batch}] int32/int64 tensor, got {got}")
        ts.append(t if t.device == torch.device(device) else t.to(device))
    top_k = kwargs.get("top_k")
    if isinstance(top_k, torch.Tensor) and top_k.numel() == 1:
        top_k = int(top_k)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k <= 0:
        raise ValueError(f"retrieve_topk needs top_k: an integer > 0 (selection units), got {top_k!r}")
    return ts[0], ts[1], ts[2], top_k


def as_row_mask(sparse_mask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``sparse_mask [B]`` as the ``bool`` row mask :func:`topk_select` takes, on ``device``
    (no launch when it already is one)."""
    m = sparse_mask if sparse_mask.device == torch.device(device) else sparse_mask.to(device)
    return m if m.dtype == torch.bool else m != 0
