"""SparseSelection: what one decode layer attends to, handed from the decode path to an
attention-backend adapter. Pure data, no policy.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

import torch


class SparseMode(Enum):
    """Granularity of selection: logical ids are pages (``PAGE_WISE``) or tokens
    (``TOKEN_WISE``, ``page_size == 1``)."""

    PAGE_WISE = "page_wise"
    TOKEN_WISE = "token_wise"


@dataclass
class SparseSelection:
    """All entries (sink + Top-k + recent window) one layer of one batch attends to.

    Units are pages for ``SparseMode.PAGE_WISE`` and tokens for ``TOKEN_WISE``
    (``page_size == 1``).

    logical_ids:  ``[B, N] int32`` logical page/token ids, ascending per row, ``-1`` padded
                  at the end of each row.
    physical_ids: ``[B, N] int32`` device-pool page ids (page mode: slot // page_size;
                  token mode: slot) holding each logical id's KV, ``-1`` padded.
    num_valid:    ``[B] int32`` valid entries per row.
    seq_lens:     ``[B] int32`` tokens in each request's context, the token being decoded
                  included. The last page of the context may be partial; it is always
                  selected (recent window), so attention covers
                  ``(num_valid - 1) * page_size + (seq_len - last_page * page_size)`` tokens.
    page_size:    tokens per page (1 in token mode).
    mode:         page or token.
    page_table:   optional ``[B, N] int32``: ``physical_ids`` with 0 padding, and
    attended:     optional ``[B] int32`` tokens attended per row — both filled by the
                  coordinator's one-launch selection table, so adapters build nothing.
    """

    logical_ids: torch.Tensor
    physical_ids: torch.Tensor
    num_valid: torch.Tensor
    seq_lens: torch.Tensor
    page_size: int
    mode: SparseMode
    page_table: Optional[torch.Tensor] = None
    attended: Optional[torch.Tensor] = None

    @property
    def batch_size(self) -> int:
        return self.logical_ids.shape[0]
