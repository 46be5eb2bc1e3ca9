"""The LRU diff's result type, argument and value checks, and its plain-torch reference:
the contract the Triton kernel (sparsehi/kernels/lru_diff.py, whose docstring states the
policy, the shapes and the limits) is tested against. Import these from
``sparsehi.kernels.lru_diff``, which re-exports them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from hicache.triton_support import INT32_MAX

MAX_SLOTS = 16384  # the buffer row lives in registers and one shared-memory gather


@dataclass
class LruDiffResult:
    """device_slots/load_ids/load_slots ``[B, K] int32`` (-1 padded), num_loads ``[B] int32``;
    num_valid ``[B] int32`` (optional output: the ids each row selected, ``valid`` clamped to
    ``[0, K]``, 0 for padding rows; written when given, so callers that count hits need no
    copy of ``valid`` of their own)."""

    device_slots: torch.Tensor
    load_ids: torch.Tensor
    load_slots: torch.Tensor
    num_loads: torch.Tensor
    num_valid: Optional[torch.Tensor] = None


# --------------------------------------------------------------------------- validation
def _check_args(topk, valid, resident, last_used, slot_of, rows) -> None:
    """Shape/dtype checks only: no host sync, safe inside CUDA graphs."""
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(msg)

    need(topk.dim() == 2 and topk.dtype == torch.int32, f"topk must be [B, K] int32, got {tuple(topk.shape)} {topk.dtype}")
    b, k = topk.shape
    need(valid.shape == (b,) and valid.dtype == torch.int32, f"valid must be [B={b}] int32, got {tuple(valid.shape)} {valid.dtype}")
    need(resident.dim() == 2 and resident.dtype == torch.int32, f"resident must be [R, S] int32, got {tuple(resident.shape)} {resident.dtype}")
    r, s = resident.shape
    need(k <= s, f"topk width K={k} exceeds buffer slots S={s}: K must be <= S (raise device_buffer_size or lower top_k)")
    need(last_used.shape == (r, s) and last_used.dtype == torch.int32, f"last_used must be [R={r}, S={s}] int32, got {tuple(last_used.shape)} {last_used.dtype}")
    need(slot_of.dim() == 2 and slot_of.shape[0] == r and slot_of.dtype == torch.int32,
         f"slot_of must be [R={r}, M] int32, got {tuple(slot_of.shape)} {slot_of.dtype}")
    need(s <= MAX_SLOTS, f"buffer slots S={s} exceed {MAX_SLOTS} (the kernel holds a buffer row on one SM): "
                         f"lower device_buffer_size or raise page_size")
    need(slot_of.shape[1] >= 1, "slot_of must have M >= 1 columns (logical ids per request)")
    need(last_used.stride(0) == resident.stride(0),
         f"last_used must have resident's row stride {resident.stride(0)}, got {last_used.stride(0)}")
    need(b <= 65535, f"batch B={b} exceeds 65535 rows per launch")
    if rows is None:
        need(r == b, f"without rows, state must have B={b} rows, got {r}")
    else:
        need(rows.shape == (b,), f"rows must be [B={b}] int64, got {tuple(rows.shape)}")
    for name, t in (("resident", resident), ("last_used", last_used), ("slot_of", slot_of)):
        need(t.stride(1) == 1, f"{name} must be contiguous in its last dim")
    for name, t in (("valid", valid), ("resident", resident), ("last_used", last_used), ("slot_of", slot_of)):
        need(t.device == topk.device, f"{name} is on {t.device}, topk on {topk.device}: all on one device")


def _check_out(out: LruDiffResult, b: int, k: int, dev: torch.device) -> None:
    """Result buffers the kernel can write: ``[B, K]`` lists with one row layout, ``num_valid``
    ``[B] int32`` on the launch device."""
    for name in ("load_ids", "load_slots"):
        o = getattr(out, name)
        if o.shape != (b, k) or o.stride() != out.device_slots.stride() or o.stride(1) != 1:
            raise ValueError(f"out.{name} must be [B={b}, K={k}] with device_slots' strides "
                             f"{out.device_slots.stride()} (contiguous rows), got {tuple(o.shape)} {o.stride()}")
    if out.num_valid is not None and (out.num_valid.shape != (b,) or out.num_valid.dtype != torch.int32
                                      or out.num_valid.device != dev):
        raise ValueError(f"out.num_valid must be [B={b}] int32 on {dev}, got {tuple(out.num_valid.shape)} "
                         f"{out.num_valid.dtype} on {out.num_valid.device}")


def check_lru_diff_values(topk: torch.Tensor, valid: torch.Tensor, num_ids: int | torch.Tensor,
                          rows: Optional[torch.Tensor] = None, num_rows: Optional[int] = None) -> None:
    """Value checks (sync with the host): ``valid`` in ``[0, K]``, ids in ``[0, num_ids)``
    (an int, or ``[B]`` per-row limits), ``-1`` padding after ``valid``, no duplicate id in a
    row, distinct ``rows``. Raises ValueError; call before the kernel so state is untouched.
    (Without these checks the kernel serves a repeated id by its first column: module
    docstring.)"""
    b, k = topk.shape
    v = valid.long()
    if bool(((v < 0) | (v > k)).any()):
        raise ValueError(f"valid must lie in [0, K={k}] per row, got {valid.tolist()}")
    cols = torch.arange(k, device=topk.device)[None, :]
    in_range = cols < v[:, None]
    t = topk.long()
    if bool(((t >= 0) != in_range).any()):
        raise ValueError("topk must hold valid[b] ids >= 0 then -1 padding in every row")
    lim = torch.as_tensor(num_ids, device=topk.device).long()
    lim = lim[:, None] if lim.dim() == 1 else lim
    if bool((in_range & (t >= lim)).any()):
        raise ValueError(f"topk holds ids beyond the request's length (allowed: [0, {num_ids if isinstance(num_ids, int) else 'per-row limit'}))")
    srt, _ = torch.sort(torch.where(in_range, t, -1 - cols), dim=1)
    same = srt[:, 1:] == srt[:, :-1]
    if bool(same.any()):
        row = int(same.any(1).int().argmax())
        rep = int(srt[row, 1:][same[row]][0])
        raise ValueError(f"topk holds duplicate ids in a row (row {row} names id {rep} twice): each id "
                         f"at most once per row")
    if rows is not None:
        rl = rows.long()
        rl = rl[rl >= 0]  # -1: padding rows
        if rl.unique().numel() != rl.numel():
            raise ValueError("rows must be distinct (two batch rows cannot share one buffer state)")
        if num_rows is not None and bool((rl >= num_rows).any()):
            raise ValueError(f"rows must lie in [0, {num_rows}) (or be -1: padding)")


MAX_STEP = INT32_MAX - 2  # stamps stay below the kernel's INT_MAX - 1 threshold sentinel


def _step_tensor(step: Union[int, torch.Tensor], device: torch.device) -> torch.Tensor:
    if isinstance(step, torch.Tensor):
        if step.numel() != 1:
            raise ValueError(f"step must be an int or a one-element tensor, got shape {tuple(step.shape)}")
        return step.reshape(1).to(device=device, dtype=torch.int32)
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be an int in [0, {MAX_STEP}], got {step!r}")
    return torch.tensor([step], dtype=torch.int32, device=device)


# --------------------------------------------------------------------------- reference
def lru_diff_reference(topk: torch.Tensor, valid: torch.Tensor, resident: torch.Tensor, last_used: torch.Tensor,
                       slot_of: torch.Tensor, step: Union[int, torch.Tensor], *,
                       rows: Optional[torch.Tensor] = None, out: Optional[LruDiffResult] = None,
                       choice: Any = None) -> LruDiffResult:
    """Plain-torch LRU diff (same contract and results as the kernel). ``out``: result
    buffers written in place and returned. ``choice``: rows that do not use ``topk`` /
    ``valid`` take ``choice.ids`` / ``choice.count`` (a ``sparsehi.row_choice.RowChoice``)."""
    _check_args(topk, valid, resident, last_used, slot_of, rows)
    if choice is not None:
        topk, valid = choice.apply(topk, valid)
    dev = topk.device
    b, k = topk.shape
    s = resident.shape[1]
    st = _step_tensor(step, dev).long()
    ridx = torch.arange(b, device=dev) if rows is None else rows.to(dev).long()
    pad = ridx < 0  # padding rows: select nothing, change no state (as the kernel)
    ridx = ridx.clamp(min=0)
    res, lu, so = resident[ridx].long(), last_used[ridx].long(), slot_of[ridx].long()
    m = so.shape[1]
    cols = torch.arange(k, device=dev)[None, :]
    sel = cols < torch.where(pad, 0, valid.long().clamp(0, k))[:, None]
    # as the kernel: unvalidated bad ids are clamped so they stay inside their own row
    ids = torch.where(sel, topk.long(), 0).clamp(0, m - 1)
    # a repeated id is served by its first column: only first columns can miss
    key = torch.where(sel, ids, m)
    first_col = torch.full((b, m + 1), k, dtype=torch.long, device=dev)
    first_col.scatter_reduce_(1, key, cols.expand(b, k), "amin")
    src = first_col.gather(1, key)
    hint = torch.where(sel, so.gather(1, ids), -1)
    hit = (hint >= 0) & (res.gather(1, hint.clamp(min=0)) == ids)
    slot = torch.where(hit, hint, -1)
    miss = sel & ~hit & (src == cols)
    repeat = sel & ~hit & (src != cols)
    nmiss = miss.sum(1)
    mrank = torch.cumsum(miss.long(), 1) - miss.long()
    hit_mask = torch.zeros(b, s + 1, dtype=torch.bool, device=dev)
    hit_mask.scatter_(1, torch.where(hit, slot, s), True)
    ar = torch.arange(s, device=dev)[None, :]
    key = torch.where(hit_mask[:, :s], 1 << 40, lu + 1) * s + ar  # non-hits by (last_used, slot)
    lru_rank = torch.argsort(torch.argsort(key, dim=1), dim=1)
    victim = lru_rank < nmiss[:, None]
    vlist = torch.sort(torch.where(victim, ar, s + ar), dim=1).values[:, :k]  # victims in slot order first
    device_slots = torch.where(hit, slot, torch.where(miss, vlist.gather(1, torch.where(miss, mrank, 0)), -1))
    device_slots = torch.where(repeat, device_slots.gather(1, src.clamp(max=k - 1)), device_slots)
    load_valid = cols < nmiss[:, None]
    load_slots = torch.where(load_valid, vlist, -1)
    spill = torch.full((b, k + 1), -1, dtype=torch.long, device=dev)
    spill.scatter_(1, torch.where(miss, mrank, k), ids)  # non-misses land in the spill column k
    load_ids = spill[:, :k]
    so_ext = torch.cat([so, torch.full((b, 1), -1, dtype=torch.long, device=dev)], 1)  # spill column m
    so_ext.scatter_(1, torch.where(miss, ids, m), torch.where(miss, device_slots, -1))
    res_ext = torch.cat([res, torch.full((b, 1), -1, dtype=torch.long, device=dev)], 1)
    res_ext.scatter_(1, torch.where(miss, device_slots, s), ids)
    lu_ext = torch.cat([lu, torch.full((b, 1), -1, dtype=torch.long, device=dev)], 1)
    lu_ext.scatter_(1, torch.where(sel, device_slots, s), st.expand(b, k).clone())
    live = ~pad
    if bool(live.all()):
        resident[ridx] = res_ext[:, :s].to(torch.int32)
        last_used[ridx] = lu_ext[:, :s].to(torch.int32)
        slot_of[ridx] = so_ext[:, :m].to(torch.int32)
    else:  # padding rows alias row 0: write back the live rows only
        resident[ridx[live]] = res_ext[live, :s].to(torch.int32)
        last_used[ridx[live]] = lu_ext[live, :s].to(torch.int32)
        slot_of[ridx[live]] = so_ext[live, :m].to(torch.int32)
    num_valid = torch.where(pad, 0, valid.long().clamp(0, k)).to(torch.int32)
    res = LruDiffResult(device_slots.to(torch.int32), load_ids.to(torch.int32), load_slots.to(torch.int32),
                        nmiss.to(torch.int32), num_valid)
    if out is None:
        return res
    out.device_slots.copy_(res.device_slots), out.load_ids.copy_(res.load_ids)
    out.load_slots.copy_(res.load_slots), out.num_loads.copy_(res.num_loads)
    if out.num_valid is not None:
        out.num_valid.copy_(res.num_valid)
    return out
