"""sparsehi next to SGLang's own features: the radix cache (prefix reuse) stays on and
reuses prefixes whose KV is only in the plugin's host pool; settings the plugin cannot
follow (SGLang's own host tier among them) are refused naming the flag."""
from __future__ import annotations

import argparse

import pytest

pytest.importorskip("sglang.srt.plugins", reason="SGLang is not installed (run scripts/setup_sglang_env.sh)")

import torch  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from sgl_kit import L, ReferenceHier, World, qkv, sparse_config  # noqa: E402
from sparsehi.sglang_plugin import ATTR  # noqa: E402

HICACHE = ["--enable-hierarchical-cache", "--hicache-ratio", "3", "--hicache-write-policy", "write_back",
           "--hicache-io-backend", "kernel", "--hicache-mem-layout", "page_first"]


def _parse(argv: list[str]):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(["--model-path", "dummy", *argv]))


def test_radix_prefix_reuse_composes_with_sparse_hier():
    """Request A registers at its first decode step and its prompt leaves the GPU (host
    only). Request B then reuses A's first 48 slots (a radix-cache hit, as SGLang's
    scheduler hands it: shared slots in req_to_token, extend_prefix_lens=48): its extend
    forward reads them from the GPU again (brought back from host before it), exactly as
    SGLang alone computes it, and both requests decode as the runtime's sparse-hier
    decode of their whole sequences."""
    cfg = sparse_config()
    world, ref, plain = World(cfg), ReferenceHier(cfg), World(None)
    gen = torch.Generator().manual_seed(10)
    a = qkv(64, gen)
    world.run(world.extend([1], [64]), a)
    plain.run(plain.extend([1], [64]), a, hooked=False)
    ref.prefill(1, [k for _, k, _ in a], [v for _, _, v in a])
    step = qkv(1, gen)
    torch.testing.assert_close(world.run(world.decode([1], [65]), step)[1], ref.decode([1], step)[1])
    plain.run(plain.decode([1], [65]), step, hooked=False)
    res = world.bridge.residency
    shared = world.req_pool.req_to_token[1, :48].long()
    assert (res.v2p[shared] == 0).all()  # A's prompt is in host memory only
    b_new = qkv(20, gen)
    got = world.run(world.extend([2], [68], prefix=[48], share={2: 1}), b_new)
    want = plain.run(plain.extend([2], [68], prefix=[48], share={2: 1}), b_new, hooked=False)
    for i in range(L):
        torch.testing.assert_close(got[i], want[i], rtol=1e-5, atol=1e-5)  # the prefix read is SGLang's own
    assert torch.equal(world.req_pool.req_to_token[2, :48], world.req_pool.req_to_token[1, :48])
    assert (res.v2p[shared] > 0).all()  # back on the GPU for B's prefill
    ref.prefill(2, [torch.cat([a[i][1][:48], b_new[i][1]]) for i in range(L)],
                [torch.cat([a[i][2][:48], b_new[i][2]]) for i in range(L)])
    lens = {1: 65, 2: 68}
    for _ in range(4):
        for r in lens:
            lens[r] += 1
        layers = qkv(2, gen)
        got = world.run(world.decode([1, 2], [lens[1], lens[2]]), layers)
        want = ref.decode([1, 2], layers)
        for i in range(L):
            torch.testing.assert_close(got[i], want[i], rtol=1e-5, atol=1e-5)
    assert (res.v2p[shared] == 0).all()  # B registered too: the shared prefix left the GPU again
    # the shared prefix's host copy was never written by the decode of either request
    host = world.bridge.host_pool
    for i in (0, L - 1):
        k_host = host.read_tokens(i, shared)[0]
        torch.testing.assert_close(k_host, a[i][1][:48].view(48, -1, world.kv_pool.head_dim))


def test_radix_cache_stays_on():
    sa = _parse(["--sparsehi-algorithm", "quest"])
    assert getattr(sa, ATTR) is not None and not sa.disable_radix_cache


def test_sglangs_own_host_tiers_are_refused_naming_the_flag():
    """With the plugin every token's KV already lives in its host pool; SGLang's HiCache
    (which moves KV by the same slot ids) is refused with a message naming the flag, and
    keeps its meaning without the plugin."""
    plain = _parse(HICACHE)
    assert plain.enable_hierarchical_cache and plain.hicache_ratio == 3
    with pytest.raises(ValueError, match="--enable-hierarchical-cache cannot be used with --sparsehi-algorithm"):
        _parse([*HICACHE, "--sparsehi-algorithm", "quest"])
    with pytest.raises(ValueError, match="--disaggregation-mode='decode'"):
        _parse(["--sparsehi-algorithm", "quest", "--disaggregation-mode", "decode"])


def test_cuda_graphs_stay_sglangs_choice_with_a_capture_safe_algorithm():
    plain = _parse([])
    sa = _parse(["--sparsehi-algorithm", "quest"])
    assert sa.cuda_graph_backend_decode == plain.cuda_graph_backend_decode  # the layer path is recorded
    assert sa.cuda_graph_backend_prefill == plain.cuda_graph_backend_prefill  # extend forwards are SGLang's own
    ours = _parse(["--sparsehi-algorithm", "quest", "--cuda-graph-backend-decode", "full"])
    assert ours.cuda_graph_backend_decode == "full"
    cfg = _parse(["--sparsehi-algorithm", "quest", "--cuda-graph-config", '{"decode": {"backend": "full"}}'])
    assert cfg.cuda_graph_config is not None


SGLANG_QUEST = "sglang.srt.mem_cache.sparsity.algorithms.quest_algorithm:QuestAlgorithm"


def test_decode_cuda_graphs_are_turned_off_or_refused_for_an_algorithm_that_syncs():
    sa = _parse(["--sparsehi-algorithm", SGLANG_QUEST])
    assert sa.cuda_graph_backend_decode == "disabled"
    plain = _parse([])
    assert sa.cuda_graph_backend_prefill == plain.cuda_graph_backend_prefill
    with pytest.raises(ValueError, match="--cuda-graph-backend-decode='breakable'.*not CUDA-graph capture safe"):
        _parse(["--sparsehi-algorithm", SGLANG_QUEST, "--cuda-graph-backend-decode", "breakable"])
    ours = _parse(["--sparsehi-algorithm", SGLANG_QUEST, "--cuda-graph-backend-prefill", "breakable"])
    assert ours.cuda_graph_backend_prefill == "breakable" and ours.cuda_graph_backend_decode == "disabled"
    with pytest.raises(ValueError, match="--cuda-graph-config"):
        _parse(["--sparsehi-algorithm", SGLANG_QUEST, "--cuda-graph-config", '{"decode": {"backend": "full"}}'])


def test_speculative_decoding_is_refused():
    with pytest.raises(ValueError, match="--speculative-algorithm"):
        _parse(["--sparsehi-algorithm", "quest", "--speculative-algorithm", "EAGLE"])


def test_two_batch_overlap_and_dp_attention_are_refused():
    with pytest.raises(ValueError, match="--enable-two-batch-overlap"):
        _parse(["--sparsehi-algorithm", "quest", "--enable-two-batch-overlap"])
    with pytest.raises(ValueError, match="--attn-dp-size=2"):
        _parse(["--sparsehi-algorithm", "quest", "--attn-dp-size", "2", "--tp-size", "2"])
    with pytest.raises(ValueError, match="--enable-dp-attention"):
        _parse(["--sparsehi-algorithm", "quest", "--enable-dp-attention", "--dp-size", "2", "--tp-size", "2"])
    _parse(["--enable-two-batch-overlap"])  # without sparsehi: SGLang's business


def test_quantised_kv_cache_is_refused():
    with pytest.raises(ValueError, match=r"--kv-cache-dtype='fp8_e4m3' cannot be used with --sparsehi-algorithm.*"
                                         r"allowed: auto"):
        _parse(["--sparsehi-algorithm", "quest", "--kv-cache-dtype", "fp8_e4m3"])
    _parse(["--sparsehi-algorithm", "quest", "--kv-cache-dtype", "auto"])
    _parse(["--kv-cache-dtype", "fp8_e4m3"])  # without sparsehi: SGLang's business


def test_mixed_chunk_is_refused():
    with pytest.raises(ValueError, match="--enable-mixed-chunk"):
        _parse(["--sparsehi-algorithm", "quest", "--enable-mixed-chunk"])
