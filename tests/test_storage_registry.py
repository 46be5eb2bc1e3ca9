"""Storage backends by name: built-ins, third-party registration, the dynamic loader, and
what the config accepts; HiCacheConfig.storage_config."""
from __future__ import annotations

import argparse
import json
import sys
import textwrap

import pytest
import torch

import storage_conformance as sc
from hicache.config import HiCacheConfig
from hicache.storage.base import HiCacheStorage, StorageConfig
from hicache.storage.file_store import FileStorage
from hicache.storage.registry import (BUILTIN_BACKENDS, create_storage_backend, register_storage_backend,
                                      storage_backend_names, unregister_storage_backend)

# A backend in its own module, as a third party would ship it: pages sealed in a dict shared
# by all instances of one model name.
_MODULE = textwrap.dedent('''
    import threading
    import torch
    from hicache.storage.base import HiCacheStorage
    from hicache.storage.integrity import CorruptPage, seal, unseal

    class DictStorage(HiCacheStorage):
        spaces = {}
        lock = threading.Lock()

        def __init__(self, config):
            super().__init__(config)
            self.prefix = config.extra.get("prefix", "")
            with self.lock:
                self.objects = self.spaces.setdefault(config.model_name, {})

        def batch_exists(self, keys):
            return [k in self.objects for k in keys]

        def batch_get(self, keys, targets=None):
            out = []
            for i, k in enumerate(keys):
                obj = self.objects.get(k)
                try:
                    page = None if obj is None else torch.frombuffer(bytearray(unseal(obj)), dtype=torch.uint8)
                except CorruptPage as e:
                    self._record_fault("corrupt", e, corrupt=True)
                    page = None
                if page is not None and targets is not None:
                    t = targets[i]
                    if t.numel() * t.element_size() != page.numel():
                        page = None
                    else:
                        t.view(torch.uint8).view(-1).copy_(page)
                        page = t
                out.append(page)
            hits = [p for p in out if p is not None]
            self._count(gets=len(keys), hits=len(hits), misses=len(keys) - len(hits),
                        bytes_read=sum(p.numel() * p.element_size() for p in hits))
            return out

        def batch_set(self, keys, values):
            out = []
            for k, v in zip(keys, values):
                if not self.config.writes_pages:
                    out.append(k in self.objects)
                    continue
                with self.lock:
                    new = k not in self.objects
                    if new:
                        self.objects[k] = seal(v)
                if new:
                    self._count(sets=1, bytes_written=len(self.objects[k]))
                else:
                    self._count(skipped_existing=1)
                out.append(True)
            return out

        def clear(self):
            self.objects.clear()

    class NotStorage:
        def __init__(self, config):
            pass
''')


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    (tmp_path / "l3_plugin_for_tests.py").write_text(_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "l3_plugin_for_tests"
    sys.modules.pop("l3_plugin_for_tests", None)


@pytest.fixture
def registered():
    names = []

    def register(name, factory, **kw):
        register_storage_backend(name, factory, **kw)
        names.append(name)
    yield register
    for n in set(names):
        unregister_storage_backend(n)


def dynamic_extra(module, cls="DictStorage", **kw):
    return {"backend_name": "dict", "module_path": module, "class_name": cls, **kw}


def test_builtin_file_backend(tmp_path):
    s = create_storage_backend("file", StorageConfig(model_name="m", extra={"file_path": str(tmp_path)}))
    assert isinstance(s, FileStorage) and s.directory.startswith(str(tmp_path))


def test_unknown_name_lists_the_allowed_ones():
    with pytest.raises(ValueError) as e:
        create_storage_backend("nvme", StorageConfig())
    assert "--hicache-storage-backend='nvme'" in str(e.value)
    assert all(n in str(e.value) for n in BUILTIN_BACKENDS)
    with pytest.raises(ValueError, match="dynamic"):  # SGLang's names get a pointer to a way in
        create_storage_backend("hf3fs", StorageConfig())


def test_mooncake_without_its_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)  # makes "import mooncake..." fail
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(ImportError) as e:
        create_storage_backend("mooncake", StorageConfig())
    assert "--hicache-storage-backend=mooncake" in str(e.value) and "libibverbs1" in str(e.value)
    assert "mooncake-transfer-engine-non-cuda" in str(e.value)


def test_dynamic_backend_passes_the_conformance_checks(plugin_module):
    def factory(config):
        return create_storage_backend("dynamic", StorageConfig(**{**config.__dict__, "extra": dynamic_extra(plugin_module)}))

    s = factory(sc.fresh_config())
    assert type(s).__name__ == "DictStorage" and type(s).__module__ == plugin_module
    for check in sc.BASIC_CHECKS:
        check(factory)

    def damage(backend, key):
        obj = bytearray(backend.objects[key])
        obj[-1] ^= 1
        backend.objects[key] = bytes(obj)
    sc.check_corrupt_object_is_miss(factory, damage)


def test_dynamic_backend_reads_its_extra_keys(plugin_module):
    s = create_storage_backend("dynamic", StorageConfig(extra=dynamic_extra(plugin_module, prefix="p/")))
    assert s.prefix == "p/"


@pytest.mark.parametrize("extra, names", [
    ({}, ["module_path", "class_name", "backend_name"]),
    ({"backend_name": "x", "module_path": "", "class_name": "C"}, ["module_path"]),
    ({"backend_name": "x", "module_path": "no_such_module_xyz", "class_name": "C"}, ["module_path", "no_such_module_xyz"]),
    ({"backend_name": "x", "module_path": "PLUGIN", "class_name": "Missing"}, ["class_name", "Missing"]),
    ({"backend_name": "x", "module_path": "PLUGIN", "class_name": "NotStorage"}, ["class_name", "HiCacheStorage"]),
    ({"backend_name": "x", "module_path": "PLUGIN", "class_name": "torch"}, ["class_name", "HiCacheStorage"]),
])
def test_dynamic_errors_name_the_key(plugin_module, extra, names):
    extra = {k: plugin_module if v == "PLUGIN" else v for k, v in extra.items()}
    with pytest.raises(ValueError) as e:
        create_storage_backend("dynamic", StorageConfig(extra=extra))
    assert all(n in str(e.value) for n in names), str(e.value)


class Collaborator(FileStorage):
    """A third-party backend (here a file store under another name)."""


def test_third_party_registration(tmp_path, registered):
    register = registered
    register("team-l3", lambda cfg: Collaborator(StorageConfig(**{**cfg.__dict__, "extra": {"file_path": str(tmp_path)}})))
    assert storage_backend_names() == BUILTIN_BACKENDS + ("team-l3",)
    s = create_storage_backend("team-l3", StorageConfig(model_name="m"))
    assert isinstance(s, Collaborator)
    key = sc.page_keys(1)[0]
    assert s.set(key, sc.random_page(0)) and torch.equal(s.get(key), sc.random_page(0))
    # The config and the CLI accept the registered name.
    assert HiCacheConfig(hicache_storage_backend="team-l3").hicache_storage_backend == "team-l3"
    parser = HiCacheConfig.add_cli_args(argparse.ArgumentParser())
    assert parser.parse_args(["--hicache-storage-backend", "team-l3"]).hicache_storage_backend == "team-l3"
    with pytest.raises(ValueError, match="already registered"):
        register("team-l3", Collaborator)
    register("team-l3", Collaborator, replace=True)


def test_registration_rules(registered):
    with pytest.raises(ValueError, match="built in"):
        register_storage_backend("file", FileStorage)
    with pytest.raises(ValueError, match="name"):
        register_storage_backend("../x", FileStorage)
    with pytest.raises(ValueError, match="callable"):
        register_storage_backend("x", "FileStorage")
    with pytest.raises(KeyError, match="not registered"):
        unregister_storage_backend("never-registered")
    registered("returns-junk", lambda cfg: object())
    with pytest.raises(TypeError, match="not a HiCacheStorage"):
        create_storage_backend("returns-junk", StorageConfig())
    with pytest.raises(ValueError, match="StorageConfig"):
        create_storage_backend("file", {"tp_rank": 0})


def test_unregistered_name_is_rejected_by_config_and_cli():
    with pytest.raises(ValueError, match="--hicache-storage-backend"):
        HiCacheConfig(hicache_storage_backend="team-l3")
    with pytest.raises(ValueError, match="dynamic"):
        HiCacheConfig(hicache_storage_backend="nixl")
    parser = HiCacheConfig.add_cli_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--hicache-storage-backend", "aibrix"])


def test_storage_config_from_hicache_config(tmp_path):
    c = HiCacheConfig(hicache_storage_backend="file", hicache_mem_layout="page_first",
                      hicache_storage_backend_extra_config=json.dumps({"file_path": str(tmp_path), "file_max_bytes": 8192}))
    sc_ = c.storage_config(tp_rank=1, tp_size=2, is_mla=True, model_name="org/model")
    assert sc_ == StorageConfig(1, 2, True, "org/model", {"file_path": str(tmp_path), "file_max_bytes": 8192})
    assert not sc_.writes_pages
    s = create_storage_backend(c.hicache_storage_backend, sc_)
    assert isinstance(s, HiCacheStorage) and s.options.file_max_bytes == 8192
    with pytest.raises(ValueError, match="tp_rank"):
        c.storage_config(tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="--hicache-storage-backend"):
        HiCacheConfig().storage_config()
    with pytest.raises(ValueError, match="model_name"):
        StorageConfig(model_name=3)


def test_config_validation_imports_no_backend():
    """hicache.config validates backend names through the registry without importing torch
    or any backend (the CLI's --help stays fast)."""
    import os
    import subprocess

    code = ("import sys, hicache.config; "
            "bad = [m for m in ('torch', 'hicache.storage.base', 'hicache.storage.file_store') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ.copy(), timeout=60)
