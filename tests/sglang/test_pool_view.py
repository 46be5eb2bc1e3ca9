"""SGLang's MHA and MLA KV pools adopted as one DeviceKVPool (shared memory), and the
hierarchical coordinator built over SGLang's real pools."""
from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.plugins", reason="SGLang is not installed (run scripts/setup_sglang_env.sh)")

import torch  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool  # noqa: E402

from sgl_kit import sparse_config  # noqa: E402
from sparsehi.sglang_plugin.bridge import SGLangSparseBridge  # noqa: E402
from sparsehi.sglang_plugin.pool_view import adopt_kv_pool, describe_kv_pool  # noqa: E402


def test_mha_pool_shares_memory_and_reserves_a_region():
    sgl = MHATokenToKVPool(64, 4, torch.float32, 2, 8, 2, "cpu", False)
    sgl.k_buffer[1][5] = 7.0  # written before adoption: kept
    pool = adopt_kv_pool(sgl, reserve_tokens=30)
    rows = 64 + 4
    assert pool.num_slots == rows + 32
    assert torch.all(pool.get_key_buffer(1)[5] == 7.0)
    # SGLang's write path and ours see one memory
    loc = torch.tensor([9, 10])
    sgl.set_kv_buffer(None, loc, torch.ones(2, 2, 8), torch.full((2, 2, 8), 2.0), layer_id_override=0)
    assert torch.all(pool.get_value_buffer(0)[loc] == 2.0)
    pool.set_kv(1, torch.tensor([11]), torch.full((1, 2, 8), 3.0), torch.zeros(1, 2, 8))
    assert torch.all(sgl.get_key_buffer(1)[11] == 3.0)
    assert sgl.k_data_ptrs[0].item() == pool.get_key_buffer(0).data_ptr()
    # the allocator hands out reserved pages only
    pages = pool.allocator.alloc_pages(8)
    assert pages is not None and int(pages.min()) >= rows // 4
    assert pool.allocator.alloc_pages(1) is None


def test_mla_pool_adopted():
    sgl = MLATokenToKVPool(32, 4, torch.float32, 16, 8, 2, "cpu", False)
    lay = describe_kv_pool(sgl)
    assert (lay.attention, lay.head_dim, lay.kv_lora_rank) == ("mla", 24, 16)
    pool = adopt_kv_pool(sgl, reserve_tokens=8)
    sgl.kv_buffer[1][6] = 4.0  # SGLang's MLA writers index kv_buffer[layer] (set_kv_buffer needs its TP context)
    assert torch.all(pool.get_key_buffer(1)[6] == 4.0)
    assert pool.get_value_buffer(1).shape[-1] == 16
    assert sgl.data_ptrs[1].item() == pool.get_key_buffer(1).data_ptr()


def test_mla_bridge_offloads_a_prompt():
    """The coordinator over SGLang's MLA pool: a prompt's latent KV reaches the host pool."""
    cfg = sparse_config(algorithm="quest", backend="dsa", min_sparse_prompt_len=8)
    req = ReqToTokenPool(2, 64, "cpu", False)
    sgl = MLATokenToKVPool(128, 4, torch.float32, 16, 8, 2, "cpu", False)
    bridge = SGLangSparseBridge(cfg, req, sgl, max_running_requests=2, validate=True)
    slots = torch.arange(4, 4 + 20)
    kv = torch.randn(20, 1, 24)
    for layer in range(2):
        sgl.kv_buffer[layer][slots] = kv + layer
    req.req_to_token[1, :20] = slots.int()
    from sparsehi.forward_batch import ForwardBatch

    bridge.coord.on_request_begin(1)
    batch = ForwardBatch.prefill(torch.tensor([1]), torch.tensor([20], dtype=torch.int32), slots[None, :])
    bridge.coord.forward_end(batch, free_device_kv=False)
    host = bridge.coord.manager.reqs[1].host_pages
    hs = (torch.tensor(host)[:, None] * 4 + torch.arange(4)).reshape(-1)[:20]
    for layer in range(2):
        torch.testing.assert_close(bridge.host_pool.read_tokens(layer, hs)[0], kv + layer)


def test_dsa_algorithm_is_refused_in_sglang():
    req = ReqToTokenPool(2, 64, "cpu", False)
    sgl = MLATokenToKVPool(128, 4, torch.float32, 16, 8, 2, "cpu", False)
    with pytest.raises(ValueError, match="--sparsehi-algorithm dsa"):
        SGLangSparseBridge(sparse_config(algorithm="dsa", backend="dsa"), req, sgl, max_running_requests=2)


def test_unsupported_pools_are_refused():
    sgl = MHATokenToKVPool(32, 4, torch.float32, 2, 8, 2, "cpu", False, v_head_dim=4)
    with pytest.raises(ValueError, match="same head dim"):
        describe_kv_pool(sgl)
    with pytest.raises(ValueError, match="reserve_tokens"):
        adopt_kv_pool(MHATokenToKVPool(32, 4, torch.float32, 2, 8, 2, "cpu", False), -1)
