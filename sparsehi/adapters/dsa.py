"""DSAAdapter: a SparseSelection as token indices into the MLA latent buffer.

DeepSeek sparse attention (DSA) decodes over ``[B, K]`` token slots of the MLA buffer
``kv[num_slots, 1, kv_lora_rank + rope_dim]``, ``-1`` padded. A token-wise selection maps
one to one; a page-wise one is expanded to its pages' token slots (tokens past the
sequence end become ``-1``), so any algorithm can drive an MLA model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sparsehi.adapters.base import BackendAdapter
from sparsehi.adapters.flash_attention import _bad, check_sparse_selection
from sparsehi.adapters.triton_backend import expand_to_token_slots
from sparsehi.kernels.sparse_mla_decode import (
    sparse_mla_decode,
    sparse_mla_decode_reference,
    sparse_mla_decode_triton,
)
from sparsehi.selection import SparseSelection

IMPLS = ("auto", "triton", "reference")


@dataclass
class DSAMetadata:
    """indices: ``[B, K] int32`` MLA buffer slots per row, ``-1`` padded."""

    indices: torch.Tensor


class DSAAdapter(BackendAdapter):
    """Sparse selection → sparse MLA decode over token indices.

    kv_lora_rank: latent width (DeepSeek: 512); the rest of the buffer's last dim is rope.
    impl: ``auto`` (Triton on CUDA, torch reference on CPU), ``triton`` or ``reference``.
    """

    name = "dsa"

    def __init__(self, kv_lora_rank: int = 512, impl: str = "auto", validate: bool = False) -> None:
        if not isinstance(kv_lora_rank, int) or kv_lora_rank <= 0:
            _bad("kv_lora_rank", "an int > 0", kv_lora_rank)
        if impl not in IMPLS:
            _bad("impl", f"one of {IMPLS}", impl)
        self.kv_lora_rank = kv_lora_rank
        self.impl = impl
        self.validate = bool(validate)

    def build_metadata(self, selection: SparseSelection) -> DSAMetadata:
        check_sparse_selection(selection)
        self.check_values(selection)
        if selection.page_size == 1 and selection.attended is not None:
            # token-wise and built by the selection table: valid slots first, -1 after
            return DSAMetadata(indices=selection.physical_ids)
        slots, valid, _ = expand_to_token_slots(selection)
        indices = torch.where(valid, slots, torch.full((), -1, dtype=slots.dtype, device=slots.device))
        return DSAMetadata(indices=indices.to(torch.int32))

    def forward_decode(self, q: torch.Tensor, layer_cache: Any, metadata: DSAMetadata, *,
                       sm_scale: float) -> torch.Tensor:
        """q ``[B, H, kv_lora_rank + rope_dim]`` absorbed query; layer_cache ``(kv_buffer,)``
        ``[num_slots, 1, kv_lora_rank + rope_dim]``. Returns ``[B, H, kv_lora_rank]``."""
        if not isinstance(metadata, DSAMetadata):
            _bad("metadata", "a DSAMetadata from build_metadata", type(metadata))
        if isinstance(layer_cache, torch.Tensor):
            layer_cache = (layer_cache,)
        if not isinstance(layer_cache, (tuple, list)) or len(layer_cache) != 1:
            n = len(layer_cache) if isinstance(layer_cache, (tuple, list)) else type(layer_cache)
            _bad("layer_cache", "(kv_buffer,) of an MLA layer (MHA caches go to 'flashattention' or 'triton')", n)
        if self._value_checks():
            from sparsehi.adapters.checks import check_pool_range

            check_pool_range("metadata.indices", metadata.indices, layer_cache[0].shape[0], "slot")
        fn = {"auto": sparse_mla_decode, "triton": sparse_mla_decode_triton,
              "reference": sparse_mla_decode_reference}[self.impl]
        return fn(q, layer_cache[0], metadata.indices, kv_lora_rank=self.kv_lora_rank, sm_scale=sm_scale)
