"""`sparsehi run` with SGLang's --hicache-* flags: the storage backend is built through the
registry, the sparse-hier tree writes finished prompts to it, and a second run (fresh host
memory) prefetches them from L3 and generates the same tokens."""
from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from hicache.config import HiCacheConfig
from hicache.storage_setup import backend_from_config
from memory_storage import MemoryStorage
from sparsehi.cli import main


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def registry(monkeypatch):
    """Every backend name builds a MemoryStorage over one shared dict (one "disk" that
    outlives each run): the registry's factory, patched in, or installed as the module when
    this installation has no registry."""
    objects: dict[str, bytes] = {}
    built = []

    def create_storage_backend(name, config):
        s = MemoryStorage(config, objects=objects)
        built.append((name, config, s))
        return s

    try:
        import hicache.storage.registry as reg
        monkeypatch.setattr(reg, "create_storage_backend", create_storage_backend)
    except ImportError:
        mod = types.ModuleType("hicache.storage.registry")
        mod.create_storage_backend = create_storage_backend
        monkeypatch.setitem(sys.modules, "hicache.storage.registry", mod)
    return objects, built


RUN = ["run", "--context", "96", "--batch", "1", "--decode-tokens", "4", "--num-layers", "2", "--modes", "sparse-hier",
       "--top-k", "32", "--sink-tokens", "16", "--recent-tokens", "16", "--page-size", "16", "--device", "cpu",
       "--no-forced", "--no-progress", "--hicache-mem-layout", "page_first_direct", "--hicache-io-backend", "direct",
       "--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", "wait_complete",
       "--hicache-storage-backend-extra-config", '{"prefetch_threshold": 32}']


def _row(out_dir):
    data = json.loads((out_dir / "run.json").read_text())
    return data, next(r for r in data["rows"] if r["mode"] == "sparse-hier")


def test_second_run_hits_l3_and_generates_the_same_tokens(tmp_path, registry, capsys, one_thread):
    objects, built = registry
    assert main([*RUN, "--output-dir", str(tmp_path / "a")]) == 0
    first, r1 = _row(tmp_path / "a")
    assert r1["l3_hit_tokens"] == 0 and r1["l3_pages_written"] > 0 and objects
    assert main([*RUN, "--output-dir", str(tmp_path / "b")]) == 0
    second, r2 = _row(tmp_path / "b")
    assert r2["l3_hit_tokens"] == 96  # the whole prompt (6 pages) came back from L3 ...
    assert r2["l3_bytes_fetched"] > 0 and r2["prefix_reused_tokens"] == 80  # ... its last page is prefilled
    assert r2["l3_pages_written"] == 0 or r2["l3_write_skipped_existing"] > 0
    assert r2["prefetch_reserved_pages"] == 0
    assert second["tokens"] == first["tokens"]
    name, cfg, _ = built[0]
    assert name == "file" and cfg.extra == {"prefetch_threshold": 32} and cfg.model_name
    out = capsys.readouterr().out
    assert "prefetched 96 prompt tokens" in out


def test_hicache_flags_are_checked_before_any_work(tmp_path, capsys):
    base = ["run", "--context", "96", "--output-dir", str(tmp_path)]
    cases = [
        (["--hicache-storage-backend", "file"], "stores whole pages of the host pool"),
        (["--host-layout", "page_first", "--hicache-mem-layout", "page_head"], "name the same setting"),
        (["--hicache-storage-prefetch-policy", "eager"], "invalid choice"),
        (["--hicache-storage-backend-extra-config", "{}"], "needs --hicache-storage-backend"),
        (["--hicache-storage-backend", "file", "--hicache-mem-layout", "page_first_direct", "--io-backend", "direct",
          "--hicache-storage-backend-extra-config", '{"prefetch_threshold": -1}'], "prefetch_threshold"),
    ]
    for extra, needle in cases:
        with pytest.raises(SystemExit) as e:
            main(base + extra)
        assert e.value.code == 2
        assert needle in capsys.readouterr().err, extra


def test_missing_registry_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "hicache.storage.registry", None)
    cfg = HiCacheConfig(hicache_storage_backend="file", hicache_mem_layout="page_first")
    with pytest.raises(ImportError, match="--hicache-storage-backend=file needs hicache.storage.registry"):
        backend_from_config(cfg)
    assert backend_from_config(HiCacheConfig()) is None
