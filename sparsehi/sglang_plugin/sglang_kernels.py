"""SGLang's own Triton decode kernel reading the metadata our Triton adapter rewrote.

``TritonAdapter.build_metadata`` turns a selection into SGLang's Triton-backend contract
(``kv_indptr [B+1]`` / ``kv_indices`` token slots); :func:`sglang_triton_decode` hands
that to ``sglang.kernels.ops.attention.decode_attention.decode_attention_fwd``, the
kernel SGLang's ``TritonAttnBackend.forward_decode`` runs over its dense metadata. Imports
SGLang lazily (only when called).
"""
from __future__ import annotations

import torch

from sparsehi.adapters.triton_backend import TritonMetadata

NUM_KV_SPLITS = 8
"""Split-K factor of the decode kernel (static: the partial-result buffers' shape)."""


def sglang_triton_decode(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, meta: TritonMetadata,
                         sm_scale: float) -> torch.Tensor:
    """Decode attention of ``q [B, Hq, D]`` over ``k_buffer`` / ``v_buffer``
    ``[slots, Hkv, D|Dv]`` at the token slots ``meta`` lists per row; returns ``[B, Hq, Dv]``.
    No host sync: the split count is a constant and the buffers are shaped by the batch."""
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    if not isinstance(meta, TritonMetadata):
        raise ValueError(f"meta must be a TritonMetadata from TritonAdapter.build_metadata, got {type(meta).__name__}")
    b, hq, _ = q.shape
    dv = v_buffer.shape[-1]
    o = q.new_empty((b, hq, dv))
    logits = torch.empty((b, hq, NUM_KV_SPLITS, dv), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, hq, NUM_KV_SPLITS), dtype=torch.float32, device=q.device)
    splits = torch.full((b,), NUM_KV_SPLITS, dtype=torch.int32, device=q.device)
    decode_attention_fwd(q, k_buffer, v_buffer, o, meta.kv_indptr, meta.kv_indices, logits, lse, splits,
                         NUM_KV_SPLITS, sm_scale, 1.0, 1.0)
    return o
