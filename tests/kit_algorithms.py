"""Reference algorithms for the author test kit's own tests (tests/test_author_kit*.py):
small, correct, query-blind; the tests derive deliberately broken variants from them."""
import torch

from sparsehi.algorithms import BaseSparseAlgorithm, SparseMode


class Window(BaseSparseAlgorithm):
    """Selects the first ``top_k`` candidates; no representations. Contract-correct: ``-1``
    padding, nothing for masked or padding rows, no host sync."""

    mode = SparseMode.PAGE_WISE

    def initialize_representation_pool(self, start_layer, end_layer, max_num_reqs, max_context_len, **kw): pass
    def construct_representations(self, layer_id, req_pool_indices, seq_lens, key_buffer, token_slots, **kw): pass
    def update_representations(self, layer_id, req_pool_indices, positions, new_keys, **kw): pass

    def _ids(self, start, end, top_k, mask):
        cols = torch.arange(top_k, device=end.device)[None, :]
        count = (end.long() - start.long()).clamp(0, top_k) * mask.long()
        return torch.where(cols < count[:, None], start.long()[:, None] + cols, -1), count

    def retrieve_topk(self, queries, layer_id, req_pool_indices, sparse_mask, **kw):
        live = sparse_mask & (req_pool_indices >= 0)  # padding rows select nothing
        ids, count = self._ids(kw["candidate_start"], kw["candidate_end"], kw["top_k"], live)
        return ids.int(), count.int()
