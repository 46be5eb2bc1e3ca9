"""A third-party sparse algorithm in ~30 lines: StreamingLLM-style sink + sliding window.

The coordinator always attends the sink (first pages) and the recent window (last pages);
this algorithm spends its Top-k budget on the ``top_k`` most recent candidates, so
attention sees ``sink + the last (top_k + recent) units``. No representations, no
kernels: a query-blind baseline (the fidelity benchmark's floor).

Use it without registering anything:
    SparseConfig(algorithm="examples.sink_window:SinkWindow", ...)
"""
import torch

from sparsehi.algorithms import BaseSparseAlgorithm, SparseMode


class SinkWindow(BaseSparseAlgorithm):
    mode = SparseMode.PAGE_WISE  # units are pages (tokens when page_size == 1)

    # Nothing to store: the window depends only on the context length.
    def initialize_representation_pool(self, start_layer, end_layer, max_num_reqs, max_context_len, **kwargs):
        pass

    def construct_representations(self, layer_id, req_pool_indices, seq_lens, key_buffer, token_slots, **kwargs):
        pass

    def update_representations(self, layer_id, req_pool_indices, positions, new_keys, **kwargs):
        pass

    def retrieve_topk(self, queries, layer_id, req_pool_indices, sparse_mask, **kwargs):
        start, end, top_k = kwargs["candidate_start"].long(), kwargs["candidate_end"].long(), kwargs["top_k"]
        cols = torch.arange(top_k, device=end.device)[None, :]
        live = sparse_mask.to(end.device) & (req_pool_indices.to(end.device) >= 0)  # masked / padding rows: none
        count = (end - start).clamp(0, top_k) * live.long()
        ids = torch.where(cols < count[:, None], end[:, None] - 1 - cols, torch.full_like(cols, -1))
        return ids.to(torch.int32), count.to(torch.int32)
