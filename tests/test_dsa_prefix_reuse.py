"""DSA (MLA) requests reuse cached prefixes: the lightning indexer's keys are kept per token
in the host pool next to the KV (an extra per-token buffer of the page records, so L3 pages
carry them too) and restored at prefill. A request whose prefix is cached in host memory, or
only in L3 (a fresh runner over the same file backend), generates exactly the tokens of a
cold run, and the stats show the hit."""
from __future__ import annotations

import pytest
import torch

from hicache.storage.base import StorageConfig
from hicache.storage.file_store import FileStorage
from hicache.storage_controller import StoragePolicy
from sparsehi.config import SparseConfig
from sparsehi.runtime.model_config import get_model_config
from sparsehi.runtime.runtime_config import RuntimeConfig
from sparsehi.runtime.runner import ModelRunner
from sparsehi.runtime.sparse_mode import STATE_BUFFER
from sparsehi.runtime.weights import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 24
_MODEL: dict = {}


def model():
    if not _MODEL:
        _MODEL["m"] = build_model(config=get_model_config("tiny-dsa", num_layers=2))
    return _MODEL["m"]


def prompts(seed_a=3, seed_b=4, n=200, shared=150):
    g = torch.Generator().manual_seed(seed_a)
    first = torch.randint(0, 512, (n,), generator=g).tolist()
    g = torch.Generator().manual_seed(seed_b)
    return first, first[:shared] + torch.randint(0, 512, (n - shared,), generator=g).tolist()


def rt(**kw) -> RuntimeConfig:
    m = model()
    sc = SparseConfig(algorithm="dsa", page_size=1, top_k=48, device_buffer_size=96, sink_tokens=8, recent_tokens=8,
                      min_sparse_prompt_len=0, io_backend="direct",
                      sparse_extra_config={"index_head_dim": m.cfg.index_head_dim})
    return RuntimeConfig(mode="sparse-hier", sparse=sc, max_num_reqs=1, max_context_len=200 + STEPS + 1,
                         host_layout="page_first_direct", **kw)


def generate(runner: ModelRunner, prompt: list[int], steps: int = STEPS):
    """(tokens, prefix hit, the index keys the algorithm holds for the prompt right after
    its prefill: one ``uint8 [n, bytes]`` per sparse layer)."""
    mode = runner.mode
    (req,) = runner.new_requests([prompt])
    runner.prefill(req)
    algo = mode.algorithm
    state = [algo.export_token_state(layer, req.req_pool_idx, 0, len(prompt)).cpu()
             for layer in range(mode.cfg.num_layers) if algo.is_sparse_layer(layer)]
    for _ in range(steps):
        runner.decode_step([req])
    mode.end_request(req)
    return req.output, req.prefix_hit, state


def test_index_keys_round_trip_through_the_host_pool():
    """After a request, the host pool's state buffer holds the exact stored index keys of
    every cached token (prompt from prefill, decoded tokens from decode)."""
    first, _ = prompts()
    r = ModelRunner(model(), rt())
    algo = r.mode.algorithm
    res = r.generate([first], 4)
    tree = r.mode.tree
    m = tree.match_prefix(first + res.tokens[0][:3])
    assert m.backed_length == 200 + 3  # prompt and decoded tokens are in the tree
    host = r.mode.host
    st = host.read_extra(STATE_BUFFER, m.backed_host_indices)
    assert st.shape == (203, 2, algo.token_state_bytes())
    assert st.any()  # not the zero fill
    # a second request over the same tokens restores exactly these bytes
    r2 = r.generate([first + res.tokens[0][:3]], 1)
    assert r2.prefix_hits == [202]


def test_host_hit_generates_what_a_cold_run_does():
    first, second = prompts()
    warm = ModelRunner(model(), rt())
    warm.generate([first], 4)
    tree = warm.mode.tree
    before = tree.stats_.host_hit_tokens
    tokens, hit, state = generate(warm, second)
    assert hit == 150
    assert tree.stats_.host_hit_tokens - before == 150
    cold_tokens, cold_hit, cold_state = generate(ModelRunner(model(), rt(prefix_cache=False)), second)
    assert cold_hit == 0
    assert all(torch.equal(a, b) for a, b in zip(state, cold_state))  # the restored keys are the cold run's
    assert tokens == cold_tokens
    tree.check_invariants()


def test_l3_hit_after_a_fresh_runner_generates_what_a_cold_run_does(tmp_path):
    first, second = prompts()
    policy = StoragePolicy(prefetch_policy="wait_complete", prefetch_threshold=16)

    def store():
        return FileStorage(StorageConfig(is_mla=True, model_name="tiny-dsa-test", extra={"file_path": str(tmp_path)}))

    s1 = store()
    a = ModelRunner(model(), rt(storage=s1, storage_policy=policy))
    a.generate([first], 4)
    assert a.mode.l3_stats()["l3_pages_written"] >= 200
    a.mode.close()
    s1.close()

    s2 = store()
    b = ModelRunner(model(), rt(storage=s2, storage_policy=policy))  # empty host pool: only L3 has the prefix
    tokens, hit, state = generate(b, second)
    st = b.mode.l3_stats()
    assert st["l3_hit_tokens"] == 150 and st["l3_bytes_fetched"] > 0 and st["prefetch_reserved_pages"] == 0
    assert hit == 150
    b.mode.close()
    s2.close()
    cold_tokens, _, cold_state = generate(ModelRunner(model(), rt(prefix_cache=False)), second)
    assert all(torch.equal(a, b) for a, b in zip(state, cold_state))
    assert tokens == cold_tokens


def test_a_host_pool_without_the_state_buffer_falls_back_to_recomputing():
    """A reused host pool (benchmarks) that lacks the buffer: no prefix reuse for DSA, and
    still the cold run's tokens."""
    from hicache.host_pool import HostKVPool

    first, second = prompts()
    base = ModelRunner(model(), rt(prefix_cache=False)).mode
    pool = HostKVPool(base.pool, hicache_ratio=2.0 * base.host.num_slots / base.pool.num_slots,
                      layout="page_first_direct", pin_memory=False)
    r = ModelRunner(model(), rt(host_pool=pool))
    assert not r.mode.reuse_prefix
    r.generate([first], 2)
    res = r.generate([second], STEPS)
    assert res.prefix_hits == [0]
    cold = ModelRunner(model(), rt(prefix_cache=False)).generate([second], STEPS)
    assert res.tokens == cold.tokens


def test_sparsehi_run_twice_on_a_dsa_model_hits_l3(tmp_path, capsys):
    """The main job on the MLA/DSA model with the file backend: the second run finds the
    first run's prompt in L3, prefetches it with its index keys, and generates the same tokens."""
    import json

    from sparsehi.cli import main

    argv = ["run", "--model", "tiny-dsa", "--num-layers", "2", "--context", "96", "--batch", "1",
            "--decode-tokens", "6", "--modes", "sparse-hier", "--page-size", "1", "--top-k", "32",
            "--sink-tokens", "8", "--recent-tokens", "8", "--device", "cpu", "--no-forced", "--no-progress",
            "--host-layout", "page_first_direct", "--io-backend", "direct", "--hicache-storage-backend", "file",
            "--hicache-storage-prefetch-policy", "wait_complete", "--hicache-storage-backend-extra-config",
            json.dumps({"file_path": str(tmp_path / "l3"), "prefetch_threshold": 16})]
    rows = []
    for name in ("a", "b"):
        assert main([*argv, "--output-dir", str(tmp_path / name)]) == 0
        data = json.loads((tmp_path / name / "run.json").read_text())
        rows.append((data, next(r for r in data["rows"] if r["mode"] == "sparse-hier")))
    (first, r1), (second, r2) = rows
    assert r1["l3_hit_tokens"] == 0 and r1["l3_pages_written"] > 0
    assert r2["l3_hit_tokens"] == 96 and r2["l3_bytes_fetched"] > 0
    assert r2["prefix_reused_tokens"] == 95  # the last prompt token is prefilled
    assert second["tokens"] == first["tokens"]


@pytest.mark.parametrize("index_dtype", ["bf16", "fp8"])
def test_export_import_restores_the_exact_selection(index_dtype):
    """The algorithm-level contract: a slot's exported index state imported into another
    slot (as a prefix, below newly constructed keys) selects exactly the same tokens."""
    from sparsehi.algorithms.dsa import fp8_dtype
    from sparsehi.algorithms.registry import create_algorithm

    if index_dtype == "fp8" and fp8_dtype() is None:
        pytest.skip("torch without float8_e4m3fn")
    Di, n, pre = 16, 40, 25
    sc = SparseConfig(algorithm="dsa", page_size=1, top_k=8, device_buffer_size=16, sink_tokens=0, recent_tokens=1,
                      min_sparse_prompt_len=0, sparse_extra_config={"index_head_dim": Di, "index_dtype": index_dtype})
    algo = create_algorithm(sc, "cpu")
    algo.initialize_representation_pool(0, 1, 2, 64, kv_heads=1, head_dim=8, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, n, Di, generator=g)
    seq = torch.tensor([n], dtype=torch.int32)
    algo.construct_representations(0, torch.tensor([0]), seq, None, None, index_keys=keys)
    state = algo.export_token_state(0, 0, 0, pre)
    assert state.dtype == torch.uint8 and state.shape == (pre, algo.token_state_bytes())
    tail = torch.cat([torch.zeros(1, pre, Di), keys[:, pre:]], dim=1)  # what a prefix-reusing prefill stores
    algo.construct_representations(0, torch.tensor([1]), seq, None, None, index_keys=tail)
    algo.import_token_state(0, 1, 0, state)
    assert torch.equal(algo.export_token_state(0, 1, 0, n), algo.export_token_state(0, 0, 0, n))
    q, w = torch.randn(2, 4, Di, generator=g), torch.rand(2, 4, generator=g)
    q[1], w[1] = q[0], w[0]
    sel, valid = algo.retrieve_topk(q, 0, torch.tensor([0, 1]), torch.tensor([True, True]), seq_lens=seq.repeat(2),
                                    candidate_start=torch.zeros(2, dtype=torch.int32),
                                    candidate_end=seq.repeat(2), top_k=8, weights=w)
    assert torch.equal(sel[0], sel[1]) and valid.tolist() == [8, 8]
    with pytest.raises(ValueError, match="state must be uint8"):
        algo.import_token_state(0, 1, 0, state.float())


def test_hicache_size_counts_the_index_state():
    """--hicache-size (RuntimeConfig.host_kv_gb) is divided by the host bytes of a token,
    index state included: a size that holds only the KV of the running requests is refused."""
    from sparsehi.runtime.runtime_mode import host_token_bytes

    m = model()
    need = 1 * (200 + STEPS + 1)
    kv_only = need * host_token_bytes(m.cfg, torch.float32) / 1e9
    with pytest.raises(ValueError, match="--hicache-size"):
        ModelRunner(m, rt(host_kv_gb=kv_only * 1.0001))
    r = ModelRunner(m, rt(host_kv_gb=kv_only * 1.5))
    assert r.mode.host_token_bytes() > host_token_bytes(m.cfg, torch.float32)
