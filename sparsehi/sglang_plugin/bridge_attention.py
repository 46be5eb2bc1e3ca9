"""The bridge's attention in a decode forward with rows of ours: the coordinator's sparse
layer path, SGLang's own attention kept for its rows."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from sparsehi.forward_batch import ForwardBatch as SparseBatch
from sparsehi.sglang_plugin.bridge_state import DecodeState


class DecodeAttention:
    """``RadixAttention.forward`` for the bridge (a base of ``SGLangSparseBridge``, whose
    set-up makes what these methods read: ``coord``, ``kv_kind``, ``attend_with``,
    ``kv_pool``, ``device_pool`` and ``req_to_token_pool``)."""

    def attention(self, state: DecodeState, layer: Any, q: torch.Tensor, k: Optional[torch.Tensor],
                  v: Optional[torch.Tensor], fb: Any, save_kv_cache: bool, original: Callable[[], torch.Tensor],
                  q_rope: Optional[torch.Tensor] = None, k_rope: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One ``RadixAttention.forward`` of a decode forward with rows of ours: k/v written
        to SGLang's slot (its GPU page) and to the coordinator's buffer, attention over the
        selection; rows that are not ours keep SGLang's output. MLA's split form (``q_rope``
        / ``k_rope``) is joined into the latent row. Returns ``[B, Hq * Dv]``."""
        layer_id = int(layer.layer_id)
        if k is None or (self.kv_kind == "mha" and v is None):
            raise ValueError(f"layer {layer_id}: sparsehi decode needs the new token's k and v (MLA: the latent k)")
        if state.batch is None:  # the first layer: the coordinator's device part of the step
            state.batch = SparseBatch.decode(state.slots, state.seq, prepared=True, has_dense_rows=False)
            self.coord.forward_begin(state.batch)
            rtt = self.req_to_token_pool.req_to_token
            pos = (state.seq.long() - 1).clamp(min=0)
            self.coord.record_host_tokens(state.slots, pos, rtt[state.sgl_rows, pos])
        b = state.batch.batch_size
        hq, dv = int(layer.tp_q_head_num), int(layer.v_head_dim)
        d = int(layer.qk_head_dim)
        if q_rope is not None:
            if self.kv_kind != "mla":
                raise ValueError(f"layer {layer_id}: q_rope / k_rope are MLA's split form; this cache is MHA")
            q = torch.cat([q.reshape(b, hq, -1), q_rope.reshape(b, hq, -1)], dim=-1)
            k = torch.cat([k.reshape(b, -1), k_rope.reshape(b, -1)], dim=-1)
            if q.shape[-1] != d:
                raise ValueError(f"layer {layer_id}: q + q_rope give {q.shape[-1]} dims per head, the layer's "
                                 f"qk_head_dim is {d}")
        q3 = q.reshape(b, hq, d)
        if self.kv_kind == "mla":
            k3, v3 = k.reshape(b, 1, d), None
        else:
            hkv = int(layer.tp_k_head_num)
            k3, v3 = k.reshape(b, hkv, d), v.reshape(b, hkv, dv)
        dense = None
        if state.recorded or not state.all_ours:
            dense = original()  # SGLang's attention for its rows; writes every row's KV to its slots
        elif save_kv_cache:
            self._write_sglang_slot(layer, layer_id, fb.out_cache_loc, k3, v3)
        plan = self.coord.attention_begin(layer_id, state.batch, q=q3)
        plan.write_kv(k3, v3)
        if self.attend_with == "sglang_triton" and plan.is_sparse:
            from sparsehi.sglang_plugin.sglang_kernels import sglang_triton_decode

            o = sglang_triton_decode(q3, plan.layer_cache[0], plan.layer_cache[1], plan.metadata, float(layer.scaling))
        else:
            o = plan.attend(q3, float(layer.scaling))
        self.coord.attention_end(layer_id, state.batch, k=k3, v=v3)
        if dense is not None:
            o = torch.where(state.ours[:, None, None], o, dense.reshape(b, hq, dv).to(o.dtype))
        return o.reshape(b, hq * dv)

    def _write_sglang_slot(self, layer: Any, layer_id: int, loc: torch.Tensor, k: torch.Tensor,
                           v: Optional[torch.Tensor]) -> None:
        """The new token into SGLang's own slot (what its backend would have written; the
        write-through copies it to host from there)."""
        if self.kv_kind == "mha":
            self.kv_pool.set_kv_buffer(layer, loc, k, v)
        else:
            buf = self.device_pool.get_key_buffer(layer_id)
            buf.index_copy_(0, loc.long(), k.to(buf.dtype))

