"""Bad-input sweep of the public entry points: configs, CLI flags, the algorithm path,
storage extra-config files and the registry, the tree's insert/match. Each bad input must
give a ValueError (or argparse's exit 2) whose message names the parameter and what it
accepts, and leave the state as it was. (Broken ``retrieve_topk`` results:
tests/test_bad_selection.py; adapters fed inconsistent metadata: tests/test_bad_metadata.py.)"""
from __future__ import annotations

import math
import os

import pytest
import torch

from hicache.config import HiCacheConfig, parse_storage_extra_config
from hicache.storage_setup import check_backend_options
from sparsehi.config import SparseConfig

EXTRA = "--hicache-storage-backend-extra-config"


# ---------------------------------------------------------------------------------- configs
SPARSE_BAD = [
    ("algorithm", "", "a registered algorithm name"), ("algorithm", None, "a registered algorithm name"),
    ("backend", "cudnn", r"one of \('flashattention', 'triton', 'dsa'\)"),
    ("page_size", 3, r"a power of two in \[1, 256\]"), ("page_size", 512, r"a power of two in \[1, 256\]"),
    ("page_size", True, "not a bool"), ("page_size", 16.0, r"a power of two"),
    ("top_k", 0, "an integer > 0"), ("top_k", "64", "an integer > 0"), ("top_k", 24, "a multiple of page_size=16"),
    ("device_buffer_size", 32, "an integer >= top_k=64"), ("device_buffer_size", 72, "a multiple of page_size=16"),
    ("device_buffer_size", 10 ** 9, "LRU diff kernel limit"),
    ("host_to_device_ratio", math.nan, "a finite number > 1"), ("host_to_device_ratio", math.inf, "a finite number > 1"),
    ("host_to_device_ratio", 1, "a finite number > 1"), ("host_to_device_ratio", "2", "not a bool or string"),
    ("min_sparse_prompt_len", -1, "an integer >= 0"), ("sink_tokens", -16, "an integer >= 0"),
    ("recent_tokens", 0, "an integer >= 1"), ("dense_layers", 3, "None or a tuple/list"),
    ("dense_layers", [-1], "layer ids >= 0"), ("dense_layers", [True], "not bools"),
    ("io_backend", "dma", r"one of \('direct', 'kernel'\)"), ("sparse_extra_config", [], "a dict"),
]


@pytest.mark.parametrize("field,value,allowed", SPARSE_BAD, ids=lambda x: repr(x)[:24])
def test_sparse_config_names_the_field_and_what_it_takes(field, value, allowed):
    kw = dict(top_k=64, device_buffer_size=128, page_size=16)
    kw[field] = value
    with pytest.raises(ValueError, match=rf"SparseConfig\.{field}=.* is invalid: .*{allowed}"):
        SparseConfig(**kw)


def test_sparse_config_validate_after_mutation_rejects_and_names_field():
    sc = SparseConfig(top_k=64, device_buffer_size=128, page_size=16)
    sc.top_k = -64
    with pytest.raises(ValueError, match=r"SparseConfig\.top_k=-64 is invalid"):
        sc.validate()


HICACHE_BAD = [
    ("enable_hierarchical_cache", 1, "enable-hierarchical-cache", "a bool"),
    ("hicache_ratio", 0.5, "hicache-ratio", "a number > 1"), ("hicache_ratio", math.nan, "hicache-ratio", "finite"),
    ("hicache_ratio", math.inf, "hicache-ratio", "finite"), ("hicache_ratio", True, "hicache-ratio", "not a bool"),
    ("hicache_size", -1, "hicache-size", "GB >= 0"), ("hicache_size", math.nan, "hicache-size", "finite"),
    ("hicache_size", math.inf, "hicache-size", "finite"), ("hicache_size", True, "hicache-size", "not a bool"),
    ("page_size", 0, "page-size", "an integer >= 1"),
    ("hicache_write_policy", "sometimes", "hicache-write-policy", "one of"),
    ("hicache_io_backend", "dma", "hicache-io-backend", "one of"),
    ("hicache_mem_layout", "diagonal", "hicache-mem-layout", "one of"),
    ("hicache_host_kv_dtype", "int4", "hicache-host-kv-dtype", "one of"),
    ("hicache_storage_backend", "../etc", "hicache-storage-backend", "one of"),
    ("hicache_storage_prefetch_policy", "eager", "hicache-storage-prefetch-policy", "one of"),
]


@pytest.mark.parametrize("field,value,flag,allowed", HICACHE_BAD, ids=lambda x: repr(x)[:24])
def test_hicache_config_names_the_flag_and_what_it_takes(field, value, flag, allowed):
    with pytest.raises(ValueError, match=rf"--{flag}.*{allowed}"):
        HiCacheConfig(**{field: value})


# ------------------------------------------------------------------- extra config files
def _write(tmp_path, name, content):
    p = tmp_path / name
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return "@" + str(p)


EXTRA_FILES = [
    ("bad.json", "{not json", "is invalid: a JSON object"),
    ("list.json", "[1, 2]", "must hold an object .* got list"),
    ("binary.json", b"\xff\xfe\x00", "is invalid: a JSON object"),
    ("deep.json", "[" * 100000 + "]" * 100000, "nested too deeply"),
    ("deep2.json", '{"a": ' * 40 + "1" + "}" * 40, "nested too deeply"),
    ("bad.toml", "a = [", "is invalid"),
    ("deep.toml", "a = " + "[" * 5000 + "]" * 5000, "nested too deeply"),
    ("bad.yaml", "a: [1, 2", "malformed YAML"),
    ("list.yaml", "- 1\n- 2\n", "must hold an object .* got list"),
    ("deep.yaml", "a: " + "[" * 200 + "]" * 200, "nested too deeply"),
    ("cycle.yaml", "a: &x\n  b: *x\n", "refers to itself"),
    ("keys.yaml", "1: 2\n", "keys must be strings, got 1"),
    ("python.yaml", "!!python/object/apply:os.system ['true']\n", "malformed YAML"),
    ("empty.yaml", "", "must hold an object .* got NoneType"),
    ("config.ini", "[a]\nb=1\n", r"unsupported file type '\.ini'"),
]


@pytest.mark.parametrize("name,content,message", EXTRA_FILES, ids=[e[0] for e in EXTRA_FILES])
def test_malformed_extra_config_files(tmp_path, name, content, message):
    raw = _write(tmp_path, name, content)
    with pytest.raises(ValueError, match=rf"{EXTRA}=.*{message}"):
        parse_storage_extra_config(raw)
    with pytest.raises(ValueError, match=EXTRA):
        HiCacheConfig(hicache_storage_backend="file", hicache_mem_layout="page_first_direct",
                      hicache_io_backend="direct", hicache_storage_backend_extra_config=raw)


def test_extra_config_paths_that_are_not_files(tmp_path):
    for raw in ("@" + str(tmp_path / "missing.json"), "@" + str(tmp_path), "@", "@.json"):
        with pytest.raises(ValueError, match=rf"{EXTRA}=.* is invalid"):
            parse_storage_extra_config(raw)
    with pytest.raises(ValueError, match=f"{EXTRA} must be a JSON string"):
        parse_storage_extra_config(b"{}")  # type: ignore[arg-type]


def test_good_extra_config_files_still_parse(tmp_path):
    want = {"file_path": "/x", "prefetch_threshold": 32, "nested": {"a": [1, 2]}}
    for name, text in (("a.json", '{"file_path": "/x", "prefetch_threshold": 32, "nested": {"a": [1, 2]}}'),
                       ("a.toml", 'file_path = "/x"\nprefetch_threshold = 32\n[nested]\na = [1, 2]\n'),
                       ("a.yaml", "file_path: /x\nprefetch_threshold: 32\nnested: {a: [1, 2]}\n")):
        assert parse_storage_extra_config(_write(tmp_path, name, text)) == want
    shared = "a: &s [1, 2]\nb: *s\n"  # an anchor used twice (not a cycle) is fine
    assert parse_storage_extra_config(_write(tmp_path, "s.yaml", shared)) == {"a": [1, 2], "b": [1, 2]}


BACKEND_OPTIONS = [
    ("file", {"file_path": 5}, "file_path must be a directory path"),
    ("file", {"file_path": "/tmp/a\x00b"}, "without NUL"),
    ("file", {"file_max_bytes": "1gb"}, r"file_max_bytes must be an int >= 0"),
    ("file", {"file_max_bytes": -1}, r"file_max_bytes must be an int >= 0"),
    ("mooncake", {}, "master_server_address as 'host:port'"),
    ("mooncake", {"master_server_address": "h:1", "protocol": "udp"}, "protocol must be one of"),
    ("lmcache", {"op_timeout_s": 0}, "op_timeout_s must be a number of seconds > 0"),
    ("lmcache", {"enable_p2p": True}, "enable_p2p=True is not supported by the lmcache L3 backend"),
    ("dynamic", {"backend_name": "x", "module_path": "no_such_module_x", "class_name": "C"}, "module_path='no_such_module_x' cannot be imported"),
    ("dynamic", {"backend_name": "x", "module_path": "os", "class_name": "path"}, "must be a subclass of hicache.storage.base.HiCacheStorage"),
]


@pytest.mark.parametrize("backend,extra,message", BACKEND_OPTIONS, ids=lambda x: repr(x)[:30])
def test_backend_options_are_checked_without_building(tmp_path, monkeypatch, backend, extra, message):
    import json

    for var in ("MOONCAKE_MASTER", "MOONCAKE_PROTOCOL"):
        monkeypatch.delenv(var, raising=False)
    raw = _write(tmp_path, "x.json", json.dumps(extra))
    hc = HiCacheConfig(hicache_storage_backend=backend, hicache_mem_layout="page_first_direct",
                       hicache_io_backend="direct",
                       hicache_storage_backend_extra_config=raw if backend != "dynamic" else raw)
    with pytest.raises(ValueError, match=message):
        check_backend_options(hc)
    assert not os.path.exists("/tmp/a")


def test_registry_rejects_bad_names_and_keeps_its_table():
    from hicache.storage.registry import (create_storage_backend, register_storage_backend, storage_backend_names,
                                          unregister_storage_backend)
    from hicache.storage.base import StorageConfig

    before = storage_backend_names()
    for name in ("", "../x", "a b", "-x", 7):
        with pytest.raises(ValueError, match="storage backend name must be letters, digits"):
            register_storage_backend(name, lambda c: None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be callable"):
        register_storage_backend("okname", "not callable")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is built in and cannot be replaced"):
        register_storage_backend("file", lambda c: None, replace=True)
    with pytest.raises(ValueError, match=r"--hicache-storage-backend='nope' is invalid: one of"):
        create_storage_backend("nope", StorageConfig())
    with pytest.raises(ValueError, match="config must be a hicache.storage.base.StorageConfig"):
        create_storage_backend("file", {"file_path": "/tmp"})  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="is not registered"):
        unregister_storage_backend("never-registered")
    assert storage_backend_names() == before


# ---------------------------------------------------------------------------------- CLI
def _cli(argv, tmp_path, capsys) -> str:
    from sparsehi.cli import main

    base = ["run", "--context", "96", "--decode-tokens", "2", "--num-layers", "1", "--device", "cpu", "--no-progress",
            "--output-dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as e:
        main(base + argv)
    assert e.value.code == 2
    assert not (tmp_path / "out" / "run.json").exists()  # stopped before any work
    return capsys.readouterr().err


L3 = ["--hicache-storage-backend", "file", "--hicache-mem-layout", "page_first_direct", "--hicache-io-backend", "direct"]
CLI_BAD = [
    (["--context", "0"], "--context must be > 0"),
    (["--batch", "x"], "argument --batch"),
    (["--shared-prefix", "nan"], r"--shared-prefix must be in \[0, 1\)"),
    (["--modes", "fast"], "mode 'fast' is unknown: allowed"),
    (["--algorithm", ":"], r"--algorithm :.* an import path is 'package.module:ClassName'"),
    (["--algorithm", "a b:C"], "an import path is 'package.module:ClassName'"),
    (["--algorithm", "os:path"], "must name a BaseSparseAlgorithm subclass"),
    (["--algorithm", "nope"], "is unknown: registered algorithms are"),
    (["--top-k", "17"], "--top-k 17 must be a multiple of --page-size 16"),
    (["--top-k", "96"], "--top-k 96 must be below --context 96"),
    (["--buffer-size", "16", "--top-k", "32"], "--buffer-size=16 is invalid: an integer >= --top-k=32"),
    (["--page-size", "3"], r"--page-size=3 is invalid: a power of two in \[1, 256\]"),
    (["--sink-tokens", "-1"], "--sink-tokens"), (["--recent-tokens", "0"], "--recent-tokens"),
    (["--adapter", "x"], "argument --adapter: invalid choice"),
    (["--host-layout", "x"], "argument --host-layout: invalid choice"),
    (["--device", "tpu"], "--device must be cpu, cuda, cuda:N or auto"),
    (["--dtype", "int8"], "argument --dtype: invalid choice"),
    (["--model-path", "/nonexistent"], "--model-path /nonexistent: expected a local HF-layout checkpoint"),
    (["--hicache-ratio", "nan"], "--hicache-ratio=nan is invalid: a finite number"),
    (["--hicache-write-policy", "x"], "argument --hicache-write-policy"),
    (["--hicache-storage-backend", "../x"], "--hicache-storage-backend='../x' is invalid: one of"),
    (["--hicache-storage-backend-extra-config", "{}"], "needs --hicache-storage-backend to be set"),
    ([*L3, EXTRA, "[" * 5000], "nested too deeply"),
    ([*L3, EXTRA, '{"prefetch_threshold": -1}'], "prefetch_threshold must be an int >= 0"),
    ([*L3, EXTRA, '{"file_path": 5}'], "file_path must be a directory path"),
    ([*L3, EXTRA, '{"file_max_bytes": "x"}'], "file_max_bytes must be an int >= 0"),
    (["--host-layout", "page_first", "--hicache-mem-layout", "page_head"], "name the same setting and disagree"),
    (["--host-kv-dtype", "auto", "--hicache-host-kv-dtype", "fp8_e4m3"], "name the same setting and disagree"),
    (["--cache-salt", ""], "--cache-salt must be a non-empty string"),
]


@pytest.mark.parametrize("argv,message", CLI_BAD, ids=lambda x: " ".join(x)[:40] if isinstance(x, list) else "")
def test_cli_flags_fail_before_any_work_naming_the_flag(argv, message, tmp_path, capsys):
    err = _cli(argv, tmp_path, capsys)
    assert "Traceback" not in err
    import re
    assert re.search(message, err), err


# ------------------------------------------------------------------------------ the tree
def test_tree_rejects_bad_inserts_and_keeps_its_state():
    from l3_kit import PS, build

    tree, dev, host = build()
    toks = list(range(32))
    slots = dev.allocator.alloc(32)
    tree.insert(toks, device_indices=slots)
    tree.writing_check(block=True)  # the write-through backup's lock is released
    snap = (tree.stats(), sorted(x.id for x in tree.nodes()), dev.allocator.available_size(),
            host.available_size())
    cases = [
        (dict(token_ids=toks + [1], device_indices=slots), "insert takes whole pages"),
        (dict(token_ids=toks), "insert needs device_indices and/or host_indices"),
        (dict(token_ids=toks, device_indices=slots[:16]), "has 16 slots but token_ids has 32 tokens"),
        (dict(token_ids=toks, device_indices=slots.float()), "device_indices must be a 1-D int64 tensor"),
        (dict(token_ids=toks, device_indices=slots.flip(0)), "must list whole pages"),
        (dict(token_ids=toks, device_indices=torch.full((32,), -1)), r"must hold slots in \[0, \d+\)"),
        (dict(token_ids=toks, host_indices=torch.arange(10 ** 6, 10 ** 6 + 32)), r"host_indices must hold slots in"),
        (dict(token_ids=[[1, 2]] * 16, device_indices=slots), "token_ids must be a sequence of ints"),
        (dict(token_ids=torch.zeros(2, 16, dtype=torch.int64), device_indices=slots), "token_ids must be 1-D"),
        (dict(token_ids=toks, device_indices=slots, cache_salt=5), "cache_salt must be a str or None"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message):
            tree.insert(**kw)
    with pytest.raises(ValueError, match="token_ids must be a sequence of ints"):
        tree.match_prefix(["a"] * PS)
    with pytest.raises(ValueError, match="evict: num_tokens must be >= 0"):
        tree.evict(-1)
    with pytest.raises(ValueError, match="dec_lock_ref: node .* is not locked"):
        tree.dec_lock_ref(next(iter(tree.nodes())))
    stats = tree.stats()
    for k in ("match_queries", "query_tokens", "miss_tokens"):  # the rejected match counted nothing either
        assert stats[k] == snap[0][k], k
    assert (sorted(x.id for x in tree.nodes()), dev.allocator.available_size(), host.available_size()) == snap[1:]
    tree.check_invariants()
    tree.close()


def test_storage_policy_and_runtime_arguments():
    from hicache.storage_controller import StoragePolicy
    from sparsehi.runtime.runtime_config import RuntimeConfig

    for kw, message in (({"prefetch_policy": "eager"}, "prefetch_policy must be one of"),
                        ({"prefetch_threshold": -1}, "prefetch_threshold must be an int >= 0"),
                        ({"io_batch_pages": 0}, "io_batch_pages must be an int >= 1"),
                        ({"prefetch_timeout_base": math.nan}, "prefetch_timeout_base must be a finite number of seconds")):
        with pytest.raises(ValueError, match=message):
            StoragePolicy(**kw)
    with pytest.raises(ValueError, match="mode"):
        RuntimeConfig(mode="turbo")


@pytest.mark.parametrize("kw,message", [
    (dict(mode="turbo"), "RuntimeConfig.mode='turbo': allowed"),
    (dict(max_num_reqs="2"), r"RuntimeConfig.max_num_reqs='2' is invalid: an int >= 1"),
    (dict(max_num_reqs=True), r"RuntimeConfig.max_num_reqs=True is invalid"),
    (dict(max_context_len=1), r"RuntimeConfig.max_context_len=1 is invalid: an int >= 2"),
    (dict(device_kv_tokens=-16), r"device_kv_tokens=-16 is invalid: None \(sized for the mode\) or an int >= 1"),
    (dict(host_kv_tokens=1.5), r"host_kv_tokens=1.5 is invalid"),
    (dict(sparse={"top_k": 64}), "RuntimeConfig.sparse must be a sparsehi.config.SparseConfig"),
    (dict(dtype=torch.int8), "RuntimeConfig.dtype=torch.int8 is invalid: a floating torch.dtype"),
    (dict(dtype="float32"), "a floating torch.dtype"),
    (dict(device="tpu"), "RuntimeConfig.device='tpu' is invalid: 'cpu', 'cuda' or 'cuda:N'"),
    (dict(host_layout="diagonal"), r"RuntimeConfig.host_layout='diagonal' is invalid: one of \('layer_first'"),
    (dict(adapter="cudnn"), "RuntimeConfig.adapter='cudnn': allowed"),
])
def test_runtime_config_names_the_field(kw, message):
    from sparsehi.runtime.runtime_config import RuntimeConfig

    kw = {"mode": "dense", **kw}
    with pytest.raises(ValueError, match=message):
        RuntimeConfig(**kw)
