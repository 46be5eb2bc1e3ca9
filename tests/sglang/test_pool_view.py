"""SGLang's MHA and MLA KV pools taken over as one DeviceKVPool in the same memory (no
second copy), and the bridge built over SGLang's real pools and allocators."""
from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.plugins", reason="SGLang is not installed (run scripts/setup_sglang_env.sh)")

import torch  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402

from sgl_kit import World, qkv, sparse_config  # noqa: E402
from sparsehi.sglang_plugin.pool_view import adopt_kv_pool, describe_kv_pool  # noqa: E402


def _bytes(pool) -> int:
    bufs = pool.kv_buffer if hasattr(pool, "kv_lora_rank") else [*pool.k_buffer, *pool.v_buffer]
    return sum(t.numel() * t.element_size() for t in bufs)


def test_mha_pool_is_taken_over_in_its_own_bytes():
    sgl = MHATokenToKVPool(64, 4, torch.float32, 2, 8, 2, "cpu", False)
    before = _bytes(sgl)
    old = sgl.k_buffer[0]
    pool, rows = adopt_kv_pool(sgl, sel_page_size=4, reserve_tokens=30)
    assert pool.nbytes() <= before  # SGLang's tensors went first; the pool takes at most their bytes
    assert rows % 4 == 0 and rows + 32 <= 68 and sgl.size == rows - 4
    assert sgl.k_buffer[0].data_ptr() != old.data_ptr()
    # SGLang's write path and ours see one memory
    loc = torch.tensor([9, 10])
    sgl.set_kv_buffer(None, loc, torch.ones(2, 2, 8), torch.full((2, 2, 8), 2.0), layer_id_override=0)
    assert torch.all(pool.get_value_buffer(0)[loc] == 2.0)
    pool.set_kv(1, torch.tensor([11]), torch.full((1, 2, 8), 3.0), torch.zeros(1, 2, 8))
    assert torch.all(sgl.get_key_buffer(1)[11] == 3.0)
    assert sgl.k_data_ptrs[0].item() == pool.get_key_buffer(0).data_ptr()
    assert sgl.k_buffer[0].shape[0] == rows
    # the allocator hands out pages after SGLang's rows only
    pages = pool.allocator.alloc_pages(8)
    assert pages is not None and int(pages.min()) >= rows // 4
    assert pool.allocator.alloc_pages(1) is None


def test_mla_pool_is_taken_over():
    sgl = MLATokenToKVPool(32, 4, torch.float32, 16, 8, 2, "cpu", False)
    lay = describe_kv_pool(sgl)
    assert (lay.attention, lay.head_dim, lay.kv_lora_rank) == ("mla", 24, 16)
    before = _bytes(sgl)
    pool, rows = adopt_kv_pool(sgl, sel_page_size=4, reserve_tokens=8)
    assert pool.nbytes() <= before
    sgl.kv_buffer[1][6] = 4.0  # SGLang's MLA writers index kv_buffer[layer]
    assert torch.all(pool.get_key_buffer(1)[6] == 4.0)
    assert pool.get_value_buffer(1).shape[-1] == 16
    assert sgl.data_ptrs[1].item() == pool.get_key_buffer(1).data_ptr()


def test_a_reserve_that_leaves_sglang_nothing_is_refused_naming_the_options():
    sgl = MHATokenToKVPool(32, 4, torch.float32, 2, 8, 2, "cpu", False)
    with pytest.raises(ValueError, match="--sparsehi-max-sparse-requests"):
        adopt_kv_pool(sgl, sel_page_size=4, reserve_tokens=36)
    with pytest.raises(ValueError, match="reserve_tokens"):
        adopt_kv_pool(MHATokenToKVPool(32, 4, torch.float32, 2, 8, 2, "cpu", False), sel_page_size=4,
                      reserve_tokens=-1)


def test_unsupported_pools_are_refused():
    sgl = MHATokenToKVPool(32, 4, torch.float32, 2, 8, 2, "cpu", False, v_head_dim=4)
    with pytest.raises(ValueError, match="same head dim"):
        describe_kv_pool(sgl)


def test_the_bridge_takes_sglangs_kv_memory_and_allocator():
    """Over SGLang's real pools and allocator: the runner's allocator becomes the
    host-backed one (the scheduler's capacity is the host pool's slots), the GPU bytes stay
    SGLang's, and an MLA prompt's latent rows reach the host pool at their virtual slots."""
    world = World(sparse_config(algorithm="quest", backend="dsa", min_sparse_prompt_len=8), mla=True)
    b = world.bridge
    assert world.runner.token_to_kv_pool_allocator is b.allocator
    assert world.runner.max_total_num_tokens == b.virtual_tokens == b.allocator.size
    assert b.virtual_tokens >= 2 * world.pool_tokens - 1  # --sparsehi-host-to-device-ratio 2
    gen = torch.Generator().manual_seed(3)
    layers = qkv(20, gen, mla=True)
    world.run(world.extend([1], [20]), layers)
    vids = world.req_pool.req_to_token[1, :20].long()
    for i in range(2):
        torch.testing.assert_close(b.host_pool.read_tokens(i, vids)[0], layers[i][1].view(20, 1, -1))


def test_dsa_algorithm_is_refused_in_sglang():
    with pytest.raises(ValueError, match="--sparsehi-algorithm dsa"):
        World(sparse_config(algorithm="dsa", backend="dsa"), mla=True)
