"""HiCacheConfig: SGLang flag names and defaults, argparse round trip, rejected combinations."""
from __future__ import annotations

import argparse
import json

import pytest

from hicache.config import HiCacheConfig


def parse(argv, parser=None):
    parser = parser or argparse.ArgumentParser()
    HiCacheConfig.add_cli_args(parser)
    return HiCacheConfig.from_args(parser.parse_args(argv))


def test_defaults_follow_sglang():
    c = HiCacheConfig()
    assert (c.enable_hierarchical_cache, c.hicache_ratio, c.hicache_size, c.page_size) == (False, 2.0, 0, 1)
    assert (c.hicache_write_policy, c.hicache_io_backend, c.hicache_mem_layout) == ("write_through", "kernel", "layer_first")
    assert c.hicache_storage_backend is None and c.hicache_storage_prefetch_policy == "best_effort"
    assert c.hicache_storage_backend_extra_config is None
    assert parse([]) == c


def test_write_through_thresholds():
    assert HiCacheConfig(hicache_write_policy="write_through").write_through_threshold == 1
    assert HiCacheConfig(hicache_write_policy="write_through_selective").write_through_threshold == 2


def test_cli_round_trip():
    c = parse(["--enable-hierarchical-cache", "--hicache-ratio", "3", "--page-size", "64",
               "--hicache-write-policy", "write_back", "--hicache-io-backend", "direct",
               "--hicache-mem-layout", "page_first_direct", "--hicache-storage-backend", "file",
               "--hicache-storage-prefetch-policy", "timeout",
               "--hicache-storage-backend-extra-config", json.dumps({"prefetch_threshold": 512})])
    assert c.enable_hierarchical_cache and c.hicache_ratio == 3.0 and c.page_size == 64
    assert c.hicache_write_policy == "write_back" and c.hicache_mem_layout == "page_first_direct"
    assert c.prefetch_options() == {"prefetch_threshold": 512, "prefetch_timeout_base": 1.0,
                                    "prefetch_timeout_per_ki_token": 0.25}


def test_existing_page_size_flag_is_reused():
    p = argparse.ArgumentParser()
    p.add_argument("--page-size", type=int, default=16)
    assert parse(["--hicache-ratio", "2.5"], p).page_size == 16


def test_cli_rejects_unknown_choice():
    with pytest.raises(SystemExit):
        parse(["--hicache-write-policy", "lazy"])


@pytest.mark.parametrize("kw,flags", [
    (dict(hicache_mem_layout="page_first_direct", hicache_io_backend="kernel"),
     ["--hicache-mem-layout=page_first_direct", "--hicache-io-backend=kernel"]),
    (dict(hicache_mem_layout="page_first", hicache_io_backend="direct"),
     ["--hicache-mem-layout=page_first", "--hicache-io-backend=direct"]),
    (dict(hicache_storage_backend="mooncake"), ["--hicache-storage-backend=mooncake", "layer_first"]),
    (dict(hicache_storage_backend="dynamic"), ["--hicache-storage-backend=dynamic", "backend_name"]),
    (dict(hicache_ratio=1.0), ["--hicache-ratio"]),
    (dict(hicache_write_policy="lazy"), ["--hicache-write-policy"]),
    (dict(hicache_io_backend="dma"), ["--hicache-io-backend"]),
    (dict(hicache_mem_layout="head_first"), ["--hicache-mem-layout"]),
    (dict(page_size=0), ["--page-size"]),
    (dict(hicache_size=-1), ["--hicache-size"]),
    (dict(hicache_storage_backend="file", hicache_storage_backend_extra_config="{not json"),
     ["--hicache-storage-backend-extra-config"]),
    (dict(hicache_storage_backend_extra_config="{}"), ["--hicache-storage-backend"]),
    (dict(hicache_storage_backend="file", hicache_storage_prefetch_policy="never"),
     ["--hicache-storage-prefetch-policy"]),
])
def test_invalid_combinations_name_the_flags(kw, flags):
    with pytest.raises(ValueError) as e:
        HiCacheConfig(**kw)
    for f in flags:
        assert f in str(e.value)


def test_valid_special_combinations():
    HiCacheConfig(hicache_ratio=1.0, hicache_size=30)  # size overrides ratio
    HiCacheConfig(hicache_storage_backend="mooncake", hicache_mem_layout="page_first")
    HiCacheConfig(hicache_storage_backend="dynamic", hicache_storage_backend_extra_config=json.dumps(
        {"backend_name": "x", "module_path": "m", "class_name": "C"}))


def test_extra_config_from_files(tmp_path):
    t = tmp_path / "c.toml"
    t.write_text('prefetch_threshold = 1024\nprefetch_timeout_base = 0.5\n')
    c = HiCacheConfig(hicache_storage_backend="file", hicache_storage_backend_extra_config=f"@{t}")
    assert c.prefetch_options()["prefetch_threshold"] == 1024 and c.prefetch_options()["prefetch_timeout_base"] == 0.5
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"prefetch_timeout_per_ki_token": 0.1}))
    c = HiCacheConfig(hicache_storage_backend="file", hicache_storage_backend_extra_config=f"@{j}")
    assert c.prefetch_options()["prefetch_timeout_per_ki_token"] == 0.1
    with pytest.raises(ValueError, match="extra-config"):
        HiCacheConfig(hicache_storage_backend="file", hicache_storage_backend_extra_config=f"@{tmp_path}/missing.json")
    with pytest.raises(ValueError, match="extra-config"):
        HiCacheConfig(hicache_storage_backend="file", hicache_storage_backend_extra_config="[1, 2]")


def test_layout_and_io_backend_names_are_defined_once():
    import hicache.config as hc
    import hicache.host_pool as hp
    import hicache.transfer as ht
    import sparsehi.config as sc

    assert ht.IO_BACKENDS is hc.IO_BACKENDS and sc.IO_BACKENDS is hc.IO_BACKENDS
    assert hp.HOST_LAYOUTS is hc.HOST_LAYOUTS and hc.MEM_LAYOUTS is hc.HOST_LAYOUTS


def test_tree_takes_write_through_threshold_from_config():
    import inspect

    from hicache.config import write_through_threshold
    from hicache.radix_tree import HiRadixTree

    for policy in ("write_through", "write_through_selective", "write_back"):
        assert HiCacheConfig(hicache_write_policy=policy).write_through_threshold == write_through_threshold(policy)
    assert write_through_threshold("write_through") == 1 and write_through_threshold("write_through_selective") == 2
    with pytest.raises(ValueError, match="write_policy"):
        write_through_threshold("lazy")
    assert "write_back" not in inspect.signature(HiRadixTree.write_backup).parameters


def _extra(raw):
    return HiCacheConfig(hicache_storage_backend="file", hicache_storage_backend_extra_config=raw)


def test_extra_config_from_yaml(tmp_path, monkeypatch):
    y = tmp_path / "c.yaml"
    y.write_text("prefetch_threshold: 2048\nfile_path: /srv/l3\n")
    try:
        import yaml  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="PyYAML"):
            _extra(f"@{y}")
    else:
        assert _extra(f"@{y}").storage_extra_config() == {"prefetch_threshold": 2048, "file_path": "/srv/l3"}
    monkeypatch.setitem(__import__("sys").modules, "yaml", None)  # as on a machine without PyYAML
    for name in ("c.yaml", "c.yml"):
        (tmp_path / name).write_text("a: 1\n")
        with pytest.raises(ValueError, match="--hicache-storage-backend-extra-config.*PyYAML"):
            _extra(f"@{tmp_path / name}")


@pytest.mark.parametrize("name, text", [
    ("bad.toml", "prefetch_threshold = \n"),
    ("bad.json", "{\"a\": 1,}"),
    ("list.json", "[1, 2]"),
    ("scalar.toml", ""),  # an empty TOML file is an empty table: fine, checked below
    ("c.ini", "[x]\na=1\n"),
])
def test_malformed_extra_config_files_name_the_flag(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    if name == "scalar.toml":
        assert _extra(f"@{p}").storage_extra_config() == {}
        return
    with pytest.raises(ValueError, match="--hicache-storage-backend-extra-config") as e:
        _extra(f"@{p}")
    assert name in str(e.value)


def test_malformed_yaml_names_the_flag(tmp_path):
    yaml = pytest.importorskip("yaml")
    p = tmp_path / "bad.yaml"
    p.write_text("a: [1, 2\n")
    with pytest.raises(ValueError, match="--hicache-storage-backend-extra-config"):
        _extra(f"@{p}")
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="object"):
        _extra(f"@{p}")
    assert yaml is not None


def test_storage_backend_names_come_from_the_registry():
    from hicache.config import STORAGE_BACKENDS
    from hicache.storage.registry import BUILTIN_BACKENDS

    assert STORAGE_BACKENDS is BUILTIN_BACKENDS == ("file", "mooncake", "lmcache", "dynamic")
    with pytest.raises(ValueError, match="--hicache-storage-backend='hf3fs'"):
        HiCacheConfig(hicache_storage_backend="hf3fs", hicache_mem_layout="page_first")


def test_host_kv_dtype_fp8_needs_page_first_and_kernel_and_names_the_flag():
    HiCacheConfig(hicache_host_kv_dtype="fp8_e4m3", hicache_mem_layout="page_first", hicache_io_backend="kernel")
    with pytest.raises(ValueError, match="hicache-host-kv-dtype"):
        HiCacheConfig(hicache_host_kv_dtype="fp8_e4m3")  # layer_first
    with pytest.raises(ValueError, match="hicache-host-kv-dtype.*one of"):
        HiCacheConfig(hicache_host_kv_dtype="int8")


def test_fp8_pages_get_their_own_l3_namespace():
    base = dict(hicache_mem_layout="page_first", hicache_io_backend="kernel", hicache_storage_backend="file")
    bf16 = HiCacheConfig(**base).storage_config(model_name="m")
    fp8 = HiCacheConfig(hicache_host_kv_dtype="fp8_e4m3", **base).storage_config(model_name="m")
    assert bf16.model_name == "m" and fp8.model_name != "m" and fp8.model_name.startswith("m")


def test_controller_refuses_a_host_pool_of_another_kv_dtype():
    import torch

    from hicache.controller import HiCacheController
    from hicache.device_pool import DeviceKVPool
    from hicache.host_pool import HostKVPool
    from hicache.kv_spec import KVCacheSpec

    spec = KVCacheSpec(attention="mha", num_layers=1, kv_heads=2, head_dim=8, dtype=torch.bfloat16, page_size=4)
    dev = DeviceKVPool(spec, 16, "cpu")
    host = HostKVPool(dev, hicache_ratio=2.0, layout="page_first", host_kv_dtype="fp8_e4m3")
    cfg = HiCacheConfig(hicache_mem_layout="page_first", page_size=4)
    with pytest.raises(ValueError, match="hicache-host-kv-dtype=auto"):
        HiCacheController.from_config(cfg, dev, host)
    ok = HiCacheController.from_config(HiCacheConfig(hicache_mem_layout="page_first", page_size=4,
                                                     hicache_host_kv_dtype="fp8_e4m3"), dev, host)
    ok.close()
