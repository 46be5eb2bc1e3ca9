"""Value checks of what an adapter is fed (debug mode: they read tensors back to the host,
so they run only when an adapter is built with ``validate=True`` and no CUDA graph is
being captured). Without them the kernels still mask every index outside the pool, so
inconsistent metadata gives a wrong answer for its own row but never an out-of-bounds
access; with them it is a ValueError naming the field and what it must hold."""
from __future__ import annotations

import torch

from sparsehi.selection import SparseSelection


def _fail(name: str, allowed: str, row: int, got: object) -> None:
    raise ValueError(f"{name} must be {allowed}; row {row} has {got}")


def _first_bad_row(mask: torch.Tensor) -> int:
    return int(mask.reshape(mask.shape[0], -1).any(1).int().argmax())


def check_selection_values(selection: SparseSelection) -> None:
    """``num_valid`` in ``[0, N]``; per row ``num_valid`` logical ids, strictly ascending and
    >= 0, then -1 padding; their physical ids >= 0; ``seq_lens`` inside the last selected
    page (the recent window always holds the token being decoded). Shapes and dtypes are
    :func:`sparsehi.adapters.flash_attention.check_sparse_selection`'s."""
    lid = selection.logical_ids.long()
    pid = selection.physical_ids.long()
    b, n = lid.shape
    nv = selection.num_valid.long()
    bad = (nv < 0) | (nv > n)
    if bool(bad.any()):
        r = _first_bad_row(bad)
        _fail("selection.num_valid", f"in [0, N={n}]", r, int(nv[r]))
    cols = torch.arange(n, device=lid.device)[None, :]
    valid = cols < nv[:, None]
    bad = valid & ((lid < 0) | (pid < 0))
    if bool(bad.any()):
        r = _first_bad_row(bad)
        _fail("selection.logical_ids / physical_ids", "ids >= 0 in the first num_valid columns", r,
              (lid[r].tolist(), pid[r].tolist()))
    bad = ~valid & ((lid != -1) | (pid != -1))
    if bool(bad.any()):
        r = _first_bad_row(bad)
        _fail("selection.logical_ids / physical_ids", "-1 after the first num_valid columns", r,
              (lid[r].tolist(), pid[r].tolist()))
    if n > 1:
        bad = valid[:, 1:] & (lid[:, 1:] <= lid[:, :-1])
        if bool(bad.any()):
            r = _first_bad_row(bad)
            _fail("selection.logical_ids", "strictly ascending in each row", r, lid[r].tolist())
    ps = selection.page_size
    seq = selection.seq_lens.long()
    last = lid.gather(1, (nv - 1).clamp(min=0)[:, None]).squeeze(1)
    bad = (nv > 0) & ((seq <= last * ps) | (seq > (last + 1) * ps))
    bad |= (nv == 0) & (seq < 0)
    if bool(bad.any()):
        r = _first_bad_row(bad)
        _fail("selection.seq_lens", f"inside the last selected {'page' if ps > 1 else 'token'} "
              f"(last_id * {ps} < seq_len <= (last_id + 1) * {ps})", r, int(seq[r]))


def check_pool_range(name: str, ids: torch.Tensor, limit: int, unit: str) -> None:
    """Every entry of ``ids`` (-1: padding) below ``limit`` (the pool's ``unit`` count)."""
    bad = (ids.long() >= limit) | (ids.long() < -1)
    if bool(bad.any()):
        r = _first_bad_row(bad)
        _fail(name, f"-1 or a {unit} in [0, {limit}) of the layer's cache", r, ids[r].tolist())
