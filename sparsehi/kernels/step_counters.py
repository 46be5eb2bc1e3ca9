"""Close a decode step's hit / miss counters in one launch.

A step's swap-ins leave ``counts [C, n_sparse, B] int32`` (``C >= 2``): ids each sparse layer
attended per row (``counts[0]``), how many of them it loaded from host (``counts[1]``), and
``C - 2`` further per-row counts summed as they are (the load-ahead's pages and the misses
it hid). Closing the step folds them, per model layer ``l`` with sparse index
``s = layer_slot[l]`` (-1: not a sparse layer, counted as 0), into

- ``hm [C]`` with ``hm[1] = misses = sum_b counts[1, s, b]``,
  ``hm[0] = hits = sum_b counts[0, s, b] - misses``, ``hm[c] = sum_b counts[c, s, b]``
  for ``c >= 2``;
- ``totals [C, L] int64 += hm``; ``ring[slot] = hm`` with ``slot = step_t % history``;
- ``steps_closed [1] int64 += any(live)``; ``ring_step[slot] = step_t`` if any row is live,
  else -1 (a capture warm-up step, skipped by readers).

As torch ops that is some twenty launches once per step; the kernel is one program (the
tables are small: layers x batch). Graph-safe: no host sync, updates in place.

Entry points: ``close_step_counts`` (dispatch), ``close_step_counts_triton``,
``close_step_counts_reference``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hicache.triton_support import dispatch


def _check(counts, step_t, live, layer_slot, totals, ring, ring_step, steps_closed) -> None:
    if counts.dim() != 3 or counts.shape[0] < 2 or counts.dtype != torch.int32 or not counts.is_contiguous():
        raise ValueError(f"counts must be a contiguous [C >= 2, n_sparse, B] int32 tensor, got {tuple(counts.shape)} "
                         f"{counts.dtype}")
    C, B, L = counts.shape[0], counts.shape[2], layer_slot.shape[0]
    if live.shape != (B,) or live.dtype != torch.bool:
        raise ValueError(f"live must be [B={B}] bool, got {tuple(live.shape)} {live.dtype}")
    if step_t.shape != (1,) or step_t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"step_t must be [1] int32/int64, got {tuple(step_t.shape)} {step_t.dtype}")
    if layer_slot.dim() != 1 or layer_slot.dtype != torch.int32:
        raise ValueError(f"layer_slot must be [L] int32, got {tuple(layer_slot.shape)} {layer_slot.dtype}")
    H = ring_step.shape[0]
    for name, t, shape in (("totals", totals, (C, L)), ("ring", ring, (H, C, L)), ("ring_step", ring_step, (H,)),
                           ("steps_closed", steps_closed, (1,))):
        if tuple(t.shape) != shape or t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {list(shape)} int64 tensor, got {tuple(t.shape)} {t.dtype}")
    devs = {t.device for t in (counts, step_t, live, layer_slot, totals, ring, ring_step, steps_closed)}
    if len(devs) != 1:
        raise ValueError(f"every tensor must be on one device, got {sorted(map(str, devs))}")


def close_step_counts_reference(counts: torch.Tensor, step_t: torch.Tensor, live: torch.Tensor,
                                layer_slot: torch.Tensor, totals: torch.Tensor, ring: torch.Tensor,
                                ring_step: torch.Tensor, steps_closed: torch.Tensor) -> None:
    """Torch reference (see the module docstring)."""
    _check(counts, step_t, live, layer_slot, totals, ring, ring_step, steps_closed)
    C, L, H = counts.shape[0], layer_slot.shape[0], ring_step.shape[0]
    hm = torch.zeros(C, L, dtype=torch.int64, device=totals.device)
    if counts.shape[1]:
        sparse_idx = torch.nonzero(layer_slot >= 0).flatten()  # layers in sparse-index order
        sums = counts.sum(2, dtype=torch.int64)  # [C, n_sparse]
        sums[0] -= sums[1]  # attended - loaded = hits
        order = layer_slot[sparse_idx].long()
        for c in range(C):
            hm[c].index_add_(0, sparse_idx, sums[c][order])
    any_live = live.any().to(torch.int64)
    totals += hm
    steps_closed += any_live
    slot = step_t.to(torch.int64) % H
    ring.index_copy_(0, slot, hm[None])
    step_id = torch.where(any_live > 0, step_t.to(torch.int64), torch.full_like(any_live, -1))
    ring_step.index_copy_(0, slot, step_id)


@triton.jit
def _channel_sums(cnt_ptr, s, ob, c, NS, B, BLOCK_L: tl.constexpr, BLOCK_B: tl.constexpr):
    """``[BLOCK_L] int64`` sums over the batch of channel ``c`` for sparse slots ``s`` (-1: 0)."""
    acc = tl.zeros([BLOCK_L], dtype=tl.int64)
    for b0 in range(0, B, BLOCK_B):
        bb = b0 + ob
        m2 = (s >= 0)[:, None] & (bb < B)[None, :]
        at = c * NS * B + s[:, None] * B + bb[None, :]
        acc += tl.sum(tl.load(cnt_ptr + at, mask=m2, other=0).to(tl.int64), 1)
    return acc


@triton.jit
def _close_step_kernel(cnt_ptr, step_ptr, live_ptr, slot_ptr, tot_ptr, ring_ptr, rstep_ptr, closed_ptr, NS, B, L, H,
                       C: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_B: tl.constexpr):
    step = tl.load(step_ptr).to(tl.int64)
    slot = ((step % H) + H) % H  # floor modulo, as torch's
    ob = tl.arange(0, BLOCK_B)
    acc = tl.zeros([BLOCK_B], dtype=tl.int32)
    for b0 in range(0, B, BLOCK_B):
        lv = tl.load(live_ptr + b0 + ob, mask=b0 + ob < B, other=0)
        acc = tl.maximum(acc, (lv != 0).to(tl.int32))
    any_live = tl.max(acc, 0).to(tl.int64)
    ring_row = ring_ptr + slot * C * L
    for l0 in range(0, L, BLOCK_L):
        lay = l0 + tl.arange(0, BLOCK_L)
        lm = lay < L
        s = tl.load(slot_ptr + lay, mask=lm, other=-1).to(tl.int64)
        nl = _channel_sums(cnt_ptr, s, ob, 1, NS, B, BLOCK_L, BLOCK_B)
        for c in tl.static_range(C):
            acc_c = _channel_sums(cnt_ptr, s, ob, c, NS, B, BLOCK_L, BLOCK_B)
            if c == 0:
                acc_c = acc_c - nl  # attended - loaded = hits
            t = tl.load(tot_ptr + c * L + lay, mask=lm, other=0)
            tl.store(tot_ptr + c * L + lay, t + acc_c, mask=lm)
            tl.store(ring_row + c * L + lay, acc_c, mask=lm)
    tl.store(closed_ptr, tl.load(closed_ptr) + any_live)
    tl.store(rstep_ptr + slot, tl.where(any_live > 0, step, -1))


def close_step_counts_triton(counts: torch.Tensor, step_t: torch.Tensor, live: torch.Tensor,
                             layer_slot: torch.Tensor, totals: torch.Tensor, ring: torch.Tensor,
                             ring_step: torch.Tensor, steps_closed: torch.Tensor) -> None:
    """Triton launcher: one program."""
    _check(counts, step_t, live, layer_slot, totals, ring, ring_step, steps_closed)
    NS, B = counts.shape[1], counts.shape[2]
    L = layer_slot.shape[0]
    # an empty counts table may have no storage: hand the kernel another pointer (never read,
    # as no layer then has a sparse slot)
    cnt = counts if counts.numel() else live
    _close_step_kernel[(1,)](cnt, step_t, live, layer_slot, totals, ring, ring_step, steps_closed, NS, B, L,
                             ring_step.shape[0], C=counts.shape[0], BLOCK_L=min(64, triton.next_power_of_2(max(L, 1))),
                             BLOCK_B=min(128, triton.next_power_of_2(max(B, 1))), num_warps=4)


def close_step_counts(counts: torch.Tensor, step_t: torch.Tensor, live: torch.Tensor, layer_slot: torch.Tensor,
                      totals: torch.Tensor, ring: torch.Tensor, ring_step: torch.Tensor,
                      steps_closed: torch.Tensor) -> None:
    """Fold one step's counters (see the module docstring).

    counts ``[C, n_sparse, B] int32``; step_t ``[1] int32/int64``; live ``[B] bool``;
    layer_slot ``[L] int32`` (sparse index of each layer, -1 for others; each sparse index
    at most once); totals ``[C, L]``, ring ``[H, C, L]``, ring_step ``[H]``, steps_closed
    ``[1]``: int64, updated in place.
    """
    impl = dispatch("close_step_counts", counts, close_step_counts_triton, close_step_counts_reference)
    impl(counts, step_t, live, layer_slot, totals, ring, ring_step, steps_closed)
