"""Tenant isolation by cache salt: a salt starts the tree key and the L3 hash chain, so
requests with different salts never share a page on any tier (device, host, L3), requests
with the same salt do, and requests without one behave as before."""
from __future__ import annotations

import pytest
import torch

from hicache.storage.keys import page_hash_chain, salt_root, storage_key
from l3_kit import PS, build, empty_tiers, expected, no_leaks, read_host, settle
from memory_storage import MemoryStorage

TOKS = list(range(500, 532))  # 8 pages


def put(tree, dev, tokens, salt=None, kv_offset=0.0):
    """Prefill ``tokens`` on the device under ``salt`` and insert them; the KV carries
    ``kv_offset`` so one tenant's pages can be told from another's."""
    slots = dev.allocator.alloc(len(tokens))
    kv = expected(tokens) + kv_offset
    for layer in range(kv.shape[0]):
        dev.set_kv(layer, slots, kv[layer, 0], kv[layer, 1])
    res = tree.insert(tokens, device_indices=slots, cache_salt=salt)
    dev.allocator.free(res.device_unused)
    return res


def store(tree, dev, tokens, salt=None, kv_offset=0.0):
    res = put(tree, dev, tokens, salt, kv_offset)
    tree.writing_check(block=True)
    tree.flush_storage()
    return res


def prefetch(tree, rid, tokens, salt=None):
    m = tree.match_prefix(tokens, cache_salt=salt)
    return tree.prefetch_from_storage(rid, m.last_backed_node, tokens[m.backed_length:]), m


def salted_keys(tokens, salt):
    return [storage_key(h, 0) for h in page_hash_chain(tokens, PS, salt_root(salt))]


def test_different_salts_share_nothing_on_device_or_host():
    tree, dev, host = build()
    put(tree, dev, TOKS, salt="tenant-a")
    tree.writing_check(block=True)  # write-through: now on device and host
    for salt in ("tenant-b", None):
        m = tree.match_prefix(TOKS, cache_salt=salt)
        assert m.total_hit_length == 0 and m.backed_length == 0
        assert m.last_backed_node.is_root and m.last_device_node.is_root
    m = tree.match_prefix(TOKS, cache_salt="tenant-a")
    assert m.device_hit_length == 32 and m.backed_length == 32
    # the other tenant's insert of the same tokens adopts none of tenant a's pages
    res = put(tree, dev, TOKS, salt="tenant-b", kv_offset=1000.0)
    assert res.prefix_len == 0 and res.device_unused.numel() == 0
    mb = tree.match_prefix(TOKS, cache_salt="tenant-b")
    ma = tree.match_prefix(TOKS, cache_salt="tenant-a")
    assert set(mb.device_indices.tolist()).isdisjoint(ma.device_indices.tolist())
    tree.writing_check(block=True)
    mb = tree.match_prefix(TOKS, cache_salt="tenant-b")
    ma = tree.match_prefix(TOKS, cache_salt="tenant-a")
    assert set(mb.backed_host_indices.tolist()).isdisjoint(ma.backed_host_indices.tolist())
    assert torch.equal(read_host(host, ma.backed_host_indices), expected(TOKS))
    assert torch.equal(read_host(host, mb.backed_host_indices), expected(TOKS) + 1000.0)
    tree.check_invariants()
    tree.close()


def test_same_salt_hits_and_no_salt_is_unchanged():
    tree, dev, _ = build()
    put(tree, dev, TOKS, salt="t")
    assert tree.match_prefix(TOKS + [1, 2], cache_salt="t").device_hit_length == 32
    assert tree.match_prefix(TOKS, cache_salt="").device_hit_length == 0  # "" is no salt
    put(tree, dev, TOKS)
    assert tree.match_prefix(TOKS).device_hit_length == 32
    assert tree.match_prefix(TOKS, cache_salt=None).device_hit_length == 32
    # unsalted hash keys are the plain chain of before
    node = tree.match_prefix(TOKS).last_device_node
    assert tree.page_hashes(node)[-1] == page_hash_chain(TOKS, PS)[-1]
    node = tree.match_prefix(TOKS, cache_salt="t").last_device_node
    assert tree.page_hashes(node) == page_hash_chain(TOKS, PS, salt_root("t"))
    tree.check_invariants()
    tree.close()


def test_salt_must_be_a_string():
    tree, dev, _ = build()
    free = dev.allocator.available_size()
    for bad in (1, b"a", ["a"]):
        with pytest.raises(ValueError, match="cache_salt must be a str or None"):
            tree.match_prefix(TOKS, cache_salt=bad)
        with pytest.raises(ValueError, match="cache_salt"):
            tree.insert(TOKS, device_indices=torch.arange(PS, PS + 32), cache_salt=bad)
    assert not list(tree.nodes()) and not tree.salt_roots and dev.allocator.available_size() == free
    tree.close()


def test_empty_salt_roots_are_dropped_and_revived():
    tree, dev, _ = build()
    put(tree, dev, TOKS, salt="x")
    tree.writing_check(block=True)
    m = tree.match_prefix(TOKS, cache_salt="x")
    kept_root = m.last_device_node.parent
    assert kept_root.is_root and tree.salt_roots["x"] is kept_root
    empty_tiers(tree)
    assert "x" not in tree.salt_roots  # nothing held for the salt: no node kept for it
    tree.check_invariants()
    # a caller still holding the old root (e.g. a match result) inserts into the live tree
    tree._insert_host_from(kept_root, tuple(TOKS[:PS]), torch.arange(PS, 2 * PS), page_hash_chain(TOKS[:PS], PS, salt_root("x")))
    assert tree.salt_roots["x"] is kept_root
    assert tree.match_prefix(TOKS, cache_salt="x").host_hit_length == PS
    assert tree.match_prefix(TOKS).total_hit_length == 0
    tree.check_invariants()
    tree.close()


def test_l3_keys_are_salted_and_prefetch_never_crosses_tenants():
    s = MemoryStorage()
    tree, dev, host = build(s)
    store(tree, dev, TOKS, salt="a")
    keys_a = set(s.objects)
    assert keys_a == set(salted_keys(TOKS, "a"))
    assert keys_a.isdisjoint(salted_keys(TOKS, "b")) and keys_a.isdisjoint(salted_keys(TOKS, None))
    store(tree, dev, TOKS)  # unsalted: its own objects
    keys_none = set(s.objects) - keys_a
    assert keys_none == set(salted_keys(TOKS, None))
    empty_tiers(tree)

    # tenant b: nothing to prefetch, nothing fetched
    fetched = s.pages_read
    n, m = prefetch(tree, "rb", TOKS, salt="b")
    assert m.total_hit_length == 0
    settle(tree, "rb")  # the prefetch thread finds none of tenant b's keys
    assert s.pages_read == fetched and tree.match_prefix(TOKS, cache_salt="b").total_hit_length == 0
    # tenant a: its own pages come back, with its KV
    n, _ = prefetch(tree, "ra", TOKS, salt="a")
    assert n == 32
    settle(tree, "ra")
    m = tree.match_prefix(TOKS, cache_salt="a")
    assert m.backed_length == 32 and torch.equal(read_host(host, m.backed_host_indices), expected(TOKS))
    assert tree.match_prefix(TOKS, cache_salt="b").total_hit_length == 0
    assert tree.match_prefix(TOKS).total_hit_length == 0
    # unsalted requests find the unsalted objects only
    n, _ = prefetch(tree, "rn", TOKS)
    assert n == 32
    settle(tree, "rn")
    assert tree.match_prefix(TOKS).backed_length == 32
    no_leaks(tree)
    tree.close()


def test_salted_prefetch_continues_a_salted_host_hit():
    s = MemoryStorage()
    tree, dev, host = build(s)
    store(tree, dev, TOKS, salt="a")
    empty_tiers(tree)
    store(tree, dev, TOKS[:8], salt="a")  # a partial host hit under the salt
    n, m = prefetch(tree, "r", TOKS, salt="a")
    assert m.backed_length == 8 and n == 24
    settle(tree, "r")
    m = tree.match_prefix(TOKS, cache_salt="a")
    assert m.total_hit_length == 32 and torch.equal(read_host(host, m.backed_host_indices), expected(TOKS))
    no_leaks(tree)
    tree.close()


# ---------------------------------------------------------------------------------- runtime
def test_runtime_requests_isolated_by_salt(one_thread):
    from sparsehi.config import SparseConfig
    from sparsehi.runtime.runtime_config import RuntimeConfig
    from sparsehi.runtime.runner import ModelRunner
    from sparsehi.runtime.weights import build_model

    model = build_model("tiny-gqa", device="cpu", dtype=torch.float32, num_layers=2)
    sc = SparseConfig(algorithm="quest", top_k=32, device_buffer_size=64, page_size=16, min_sparse_prompt_len=0,
                      sink_tokens=16, recent_tokens=16, io_backend="direct")
    rt = RuntimeConfig(mode="sparse-hier", sparse=sc, device="cpu", dtype=torch.float32, max_num_reqs=2,
                       max_context_len=160, adapter="none", host_layout="page_first_direct", prefix_cache=True,
                       cuda_graph=False)
    runner = ModelRunner(model, rt)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.cfg.vocab_size, (96,), generator=g).tolist()
    first = runner.generate([prompt], 2, cache_salts=["a"])
    assert first.prefix_hits == [0]
    other = runner.generate([prompt], 2, cache_salts=["b"])
    plain = runner.generate([prompt], 2)
    assert other.prefix_hits == [0] and plain.prefix_hits == [0]
    again = runner.generate([prompt, prompt], 2, cache_salts=["a", None])
    assert again.prefix_hits == [80, 80]  # both tenants hit their own copy (last page prefilled)
    assert again.tokens[0] == first.tokens[0] == other.tokens[0] == plain.tokens[0]
    with pytest.raises(ValueError, match=r"cache_salts must be a list of 1 entries"):
        runner.generate([prompt], 1, cache_salts=["a", "b"])
    with pytest.raises(ValueError, match=r"cache_salts\[0\] must be a str or None"):
        runner.generate([prompt], 1, cache_salts=[7])
    runner.mode.tree.check_invariants()
    runner.mode.close()


def _cli_run(tmp_path, name, salt, store_dir):
    import json

    from sparsehi.cli import main

    argv = ["run", "--context", "96", "--batch", "1", "--decode-tokens", "2", "--num-layers", "2", "--modes",
            "sparse-hier", "--top-k", "32", "--sink-tokens", "16", "--recent-tokens", "16", "--page-size", "16",
            "--device", "cpu", "--no-forced", "--no-progress", "--hicache-mem-layout", "page_first_direct",
            "--hicache-io-backend", "direct", "--hicache-storage-backend", "file",
            "--hicache-storage-prefetch-policy", "wait_complete", "--hicache-storage-backend-extra-config",
            json.dumps({"prefetch_threshold": 32, "file_path": str(store_dir)}), "--output-dir", str(tmp_path / name)]
    if salt is not None:
        argv += ["--cache-salt", salt]
    assert main(argv) == 0
    data = json.loads((tmp_path / name / "run.json").read_text())
    return data, next(r for r in data["rows"] if r["mode"] == "sparse-hier")


def test_cli_cache_salt_isolates_runs_sharing_a_file_store(tmp_path, one_thread, capsys):
    store_dir = tmp_path / "l3"
    first, r1 = _cli_run(tmp_path, "a1", "tenant-a", store_dir)
    assert r1["l3_pages_written"] > 0
    _, r2 = _cli_run(tmp_path, "b", "tenant-b", store_dir)
    assert r2["l3_hit_tokens"] == 0  # same prompt, other tenant: no hit
    _, r3 = _cli_run(tmp_path, "none", None, store_dir)
    assert r3["l3_hit_tokens"] == 0
    again, r4 = _cli_run(tmp_path, "a2", "tenant-a", store_dir)
    assert r4["l3_hit_tokens"] == 96 and again["tokens"] == first["tokens"]
    from sparsehi.cli import main

    with pytest.raises(SystemExit) as e:
        main(["run", "--cache-salt", "", "--output-dir", str(tmp_path / "x")])
    assert e.value.code == 2 and "--cache-salt must be a non-empty string" in capsys.readouterr().err


def test_bench_cache_salt_reaches_every_request_and_no_tier_is_shared(tmp_path, one_thread, monkeypatch, capsys):
    """``sparsehi bench --cache-salt`` salts every request of every point. The sweep builds
    no prefix tree and no L3 (each point prefills in full), so no request can reach KV
    another wrote, salted or not: if the bench ever gains a shared tier, this test fails
    and the isolation test of ``sparsehi run`` above must be repeated for it."""
    from sparsehi.cli import main
    from sparsehi.runtime.runner import ModelRunner

    seen = []
    real_new_requests, real_generate = ModelRunner.new_requests, ModelRunner.generate

    def new_requests(self, prompts, cache_salts=None):
        reqs = real_new_requests(self, prompts, cache_salts)
        seen.append((self.rt.mode, [r.cache_salt for r in reqs], getattr(self.mode, "tree", None)))
        return reqs

    def generate(self, *args, **kwargs):
        res = real_generate(self, *args, **kwargs)
        seen[-1] += (res.prefix_hits,)
        return res

    monkeypatch.setattr(ModelRunner, "new_requests", new_requests)
    monkeypatch.setattr(ModelRunner, "generate", generate)
    argv = ["bench", "--contexts", "96", "--batches", "2", "--decode-tokens", "2", "--num-layers", "2",
            "--modes", "sparse-gpu,sparse-hier", "--top-k", "32", "--sink-tokens", "16", "--recent-tokens", "16",
            "--device", "cpu"]
    assert main([*argv, "--cache-salt", "tenant-a", "--output-dir", str(tmp_path / "a")]) == 0
    assert seen == [(m, ["tenant-a", "tenant-a"], None, [0, 0]) for m in ("sparse-gpu", "sparse-hier")]
    seen.clear()
    assert main([*argv, "--output-dir", str(tmp_path / "none")]) == 0
    assert seen == [(m, [None, None], None, [0, 0]) for m in ("sparse-gpu", "sparse-hier")]
    with pytest.raises(SystemExit) as e:
        main(["bench", "--cache-salt", "", "--output-dir", str(tmp_path / "x")])
    assert e.value.code == 2 and "--cache-salt must be a non-empty string" in capsys.readouterr().err
