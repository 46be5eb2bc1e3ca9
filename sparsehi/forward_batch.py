"""ForwardBatch: what the runtime tells the sparse coordinator about one forward pass.

Pure data. The runtime builds one per forward (prefill or decode) and hands the same
object to every coordinator hook of that forward; ``forward_begin`` fills
``out_cache_loc`` for decode batches.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from sparsehi.decode.state import DecodeState

FORWARD_MODES = ("prefill", "decode")


@dataclass
class ForwardBatch:
    """One forward pass of a batch of requests.

    mode:             ``"prefill"`` | ``"decode"``.
    req_pool_indices: ``[B] int64`` request slots (rows of every per-request table).
    seq_lens:         ``[B] int32`` tokens in context after this forward, new tokens included.
    prefix_lens:      ``[B] int32`` prefill: tokens already cached/reused (their KV is in the
                      device pool at ``token_slots`` and, with the HiRadixTree, on host).
                      Decode: ``seq_lens - 1``.
    token_slots:      prefill only, ``[B, max_len] int64``: device-pool slot of every token
                      position ``[0, seq_len)`` of each row (prefix included; ``-1`` beyond
                      ``seq_len``). Position ``p * page_size`` must start a device page.
    out_cache_loc:    int64 device slots where the model writes this forward's new KV:
                      prefill ``[sum(seq_lens - prefix_lens)]`` (given by the runtime),
                      decode ``[B]`` (set by ``SparseCoordinator.forward_begin``; per layer the
                      plan's ``out_cache_loc`` is authoritative, dense layers of the
                      hierarchical mode write elsewhere).
    positions:        int64 token positions of the new tokens (prefill ``[sum extend]``,
                      decode ``[B]`` = ``seq_lens - 1``); filled when left None.
    seq_lens_cpu:     host copy of ``seq_lens`` (list of int); filled when left None (one
                      sync per forward, never per layer), except for a prepared decode batch.
    prefix_lens_cpu:  host copy of ``prefix_lens`` (same rule).
    prepared:         decode only: the host part of the step
                      (``SparseCoordinator.prepare_decode``) already ran for this batch, as
                      CUDA-graph runners do outside the graph. Nothing then reads the
                      tensors back to the host (no host copies, no value checks), and rows
                      with ``req_pool_indices == -1`` are padding (they do nothing).
    has_dense_rows:   prepared decode only: what ``prepare_decode`` returned (a row of the
                      batch is decoded densely).
    decode_state:     decode only: the step's state, set by ``SparseCoordinator.forward_begin``
                      and read by every hook of the step (pass the same batch object to all).
    """

    mode: str
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: Optional[torch.Tensor] = None
    token_slots: Optional[torch.Tensor] = None
    out_cache_loc: Optional[torch.Tensor] = None
    positions: Optional[torch.Tensor] = None
    seq_lens_cpu: Optional[list[int]] = None
    prefix_lens_cpu: Optional[list[int]] = None
    prepared: bool = False
    has_dense_rows: bool = False
    decode_state: Optional["DecodeState"] = None
    req_pool_indices_cpu: Optional[list[int]] = None
    """Host copy of ``req_pool_indices``; the coordinator fills it when a prefill hook
    first needs it (one read per forward)."""
    extra: dict = field(default_factory=dict)
    """Free-form per-forward data for algorithms or the runtime (the coordinator ignores it)."""

    def __post_init__(self) -> None:
        if self.mode not in FORWARD_MODES:
            raise ValueError(f"ForwardBatch.mode={self.mode!r} is invalid: one of {FORWARD_MODES}")
        if self.req_pool_indices.dim() != 1:
            raise ValueError(f"ForwardBatch.req_pool_indices must be [B] int64, got shape {tuple(self.req_pool_indices.shape)}")
        b = self.req_pool_indices.shape[0]
        self.req_pool_indices = self.req_pool_indices.long()
        if self.seq_lens.shape != (b,):
            raise ValueError(f"ForwardBatch.seq_lens must be [B={b}] int32, got shape {tuple(self.seq_lens.shape)}")
        self.seq_lens = self.seq_lens.to(torch.int32)
        if self.prepared:
            if self.mode != "decode":
                raise ValueError("ForwardBatch.prepared is for decode batches (prefill is never graph-captured)")
            self.prefix_lens = self.seq_lens - 1 if self.prefix_lens is None else self.prefix_lens.to(torch.int32)
            if self.positions is None:
                self.positions = (self.seq_lens - 1).long()
            return
        if self.seq_lens_cpu is None:
            self.seq_lens_cpu = [int(x) for x in self.seq_lens.tolist()]
        if len(self.seq_lens_cpu) != b:
            raise ValueError(f"ForwardBatch.seq_lens_cpu must hold B={b} ints, got {len(self.seq_lens_cpu)}")
        if self.prefix_lens is None:
            if self.mode == "decode":
                self.prefix_lens = self.seq_lens - 1
            else:
                self.prefix_lens = torch.zeros_like(self.seq_lens)
        self.prefix_lens = self.prefix_lens.to(torch.int32)
        if self.prefix_lens.shape != (b,):
            raise ValueError(f"ForwardBatch.prefix_lens must be [B={b}] int32, got shape {tuple(self.prefix_lens.shape)}")
        if self.prefix_lens_cpu is None:
            self.prefix_lens_cpu = [int(x) for x in self.prefix_lens.tolist()]
        if any(s < 1 for s in self.seq_lens_cpu):
            raise ValueError("ForwardBatch.seq_lens must be >= 1 in every row")
        if any(p < 0 or p >= s for p, s in zip(self.prefix_lens_cpu, self.seq_lens_cpu)):
            raise ValueError("ForwardBatch.prefix_lens must lie in [0, seq_len) in every row (each row adds >= 1 token)")
        if self.mode == "decode" and any(s - p != 1 for p, s in zip(self.prefix_lens_cpu, self.seq_lens_cpu)):
            raise ValueError("decode ForwardBatch adds exactly one token per row: prefix_lens must be seq_lens - 1")
        if self.mode == "prefill" and self.token_slots is None:
            raise ValueError("prefill ForwardBatch needs token_slots [B, max_len] int64 (device slot of every position)")
        if self.token_slots is not None:
            if self.token_slots.dim() != 2 or self.token_slots.shape[0] != b:
                raise ValueError(f"ForwardBatch.token_slots must be [B={b}, max_len] int64, got shape {tuple(self.token_slots.shape)}")
            if self.token_slots.shape[1] < max(self.seq_lens_cpu):
                raise ValueError(f"ForwardBatch.token_slots has {self.token_slots.shape[1]} positions < max seq_len {max(self.seq_lens_cpu)}")
            self.token_slots = self.token_slots.long()
        if self.positions is None:
            dev = self.seq_lens.device
            if self.mode == "decode":
                self.positions = (self.seq_lens - 1).long()
            else:
                self.positions = torch.cat(
                    [torch.arange(p, s, device=dev, dtype=torch.int64) for p, s in zip(self.prefix_lens_cpu, self.seq_lens_cpu)]
                )

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.mode == "decode"

    @classmethod
    def prefill(cls, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, token_slots: torch.Tensor,
                prefix_lens: Optional[torch.Tensor] = None, out_cache_loc: Optional[torch.Tensor] = None,
                **kw) -> "ForwardBatch":
        return cls("prefill", req_pool_indices, seq_lens, prefix_lens=prefix_lens, token_slots=token_slots,
                   out_cache_loc=out_cache_loc, **kw)

    @classmethod
    def decode(cls, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, **kw) -> "ForwardBatch":
        return cls("decode", req_pool_indices, seq_lens, **kw)
