"""FP8 host pages with engine-held host KV (``host_addressing='tokens'``, the SGLang
plugin's mode): the manager derives each request's host pages from its token table (at
registration, each decode step, and when the engine rewrites slots), and refuses a prompt
whose tokens do not sit on whole host pages in order."""
from __future__ import annotations

import pytest
import torch

from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.kv_spec import KVCacheSpec
from hicache.transfer import KVTransferEngine
from sparsehi.config import SparseConfig
from sparsehi.kv_manager import SparseKVCacheManager

L, H, D, PS = 2, 2, 4, 4


def _manager(host_kv_dtype: str = "fp8_e4m3") -> SparseKVCacheManager:
    cfg = SparseConfig(algorithm="oracle", page_size=PS, top_k=2 * PS, device_buffer_size=4 * PS, sink_tokens=PS,
                       recent_tokens=PS, min_sparse_prompt_len=8, host_kv_dtype=host_kv_dtype)
    dev = DeviceKVPool(KVCacheSpec("mha", L, H, D, torch.float32, PS), PS * 64, "cpu")
    layout = "page_first" if host_kv_dtype == "fp8_e4m3" else "layer_first"
    host = HostKVPool(dev, hicache_ratio=4.0, pin_memory=False, layout=layout, host_kv_dtype=host_kv_dtype)
    return SparseKVCacheManager(cfg, dev, mode="hierarchical", host_pool=host,
                                transfer=KVTransferEngine(dev, host, io_backend="kernel"), sparse_layers=(0, 1),
                                max_num_reqs=3, max_context_len=64, validate=True, host_addressing="tokens")


def _prompt_slots(host_pages: list[int], n: int) -> torch.Tensor:
    """``[1, n]`` host slots of a prompt laid on ``host_pages`` in order."""
    return (torch.tensor(host_pages)[:, None] * PS + torch.arange(PS)).reshape(1, -1)[:, :n]


def test_host_pages_follow_the_token_table():
    mgr = _manager()
    t = mgr.tables
    mgr.begin_request(1)
    mgr.adopt_prompt([1], [10], torch.full((1, 10), -1), _prompt_slots([7, 3, 12], 10))
    assert t.host_pages[1, :4].tolist() == [7, 3, 12, -1]
    # a decode step: the new token opens page 3 on host page 20; a padding row beside it
    # writes nothing any request reads
    before = t.host_pages.clone()
    t.record_host_tokens(torch.tensor([-1, 1]), torch.tensor([0, 12]), torch.tensor([5, 20 * PS]))
    before[1, 3] = 20
    assert torch.equal(t.host_pages, before)
    # the engine rewrites positions [4, 12) to another copy of the same KV (host pages 30, 31)
    t.host_token_slots[1, 4:12] = _prompt_slots([30, 31], 8)[0].to(torch.int32)
    t.host_pages_from_tokens(1, 4, 12)
    assert t.host_pages[1, :4].tolist() == [7, 30, 31, 20]


def test_misaligned_prompt_is_refused_with_fp8_pages_only():
    mgr = _manager()
    mgr.begin_request(0)
    slots = _prompt_slots([7, 3, 12], 10)
    slots[0, 5] += 1  # position 5 off its page's order
    with pytest.raises(ValueError, match="each page's tokens on one host page in order"):
        mgr.adopt_prompt([0], [10], torch.full((1, 10), -1), slots)
    assert mgr.tables.host_pages[0].eq(-1).all()
    plain = _manager("auto")  # token slots need no page order in the model's dtype
    plain.begin_request(0)
    plain.adopt_prompt([0], [10], torch.full((1, 10), -1), torch.randperm(40)[:10][None])
    assert not plain.tables.pages_from_tokens and plain.tables.host_pages[0].eq(-1).all()
