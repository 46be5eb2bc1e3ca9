"""Storage backends by name: what ``--hicache-storage-backend`` can build.

Built in: ``file`` (``FileStorage``, the embedded default), ``mooncake``
(``MooncakeStorage``, needs the ``mooncake`` package), ``lmcache`` (``LMCacheStorage``, needs
the ``lmcache`` package) and ``dynamic`` (a class named in the extra config). Third parties add names with ``register_storage_backend``; the config's flag
validation accepts every name registered here.

This module imports no backend (and no torch) until one is built, so ``hicache.config`` can
validate names cheaply.
"""
from __future__ import annotations

import re
import threading
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from hicache.storage.base import HiCacheStorage, StorageConfig

StorageFactory = Callable[["StorageConfig"], "HiCacheStorage"]

BUILTIN_BACKENDS = ("file", "mooncake", "lmcache", "dynamic")
SGLANG_ONLY_BACKENDS = ("hf3fs", "nixl", "aibrix")
"""Names SGLang accepts that this stack does not implement (each can come in as ``dynamic``)."""
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")

_lock = threading.Lock()
_third_party: dict[str, StorageFactory] = {}


def _make_file(config: "StorageConfig") -> "HiCacheStorage":
    from hicache.storage.file_store import FileStorage

    return FileStorage(config)


def _make_mooncake(config: "StorageConfig") -> "HiCacheStorage":
    try:
        import mooncake.store  # noqa: F401  (the engine MooncakeStorage drives)
    except ImportError as e:
        raise ImportError(
            "--hicache-storage-backend=mooncake needs the mooncake package: pip install "
            "'sparsehi[mooncake]' (mooncake-transfer-engine-non-cuda); its import also needs the system "
            f"library libibverbs (Debian/Ubuntu: apt-get install libibverbs1). Import failed: {e}"
        ) from e
    from hicache.storage.mooncake_store import MooncakeStorage

    return MooncakeStorage(config)


def _make_lmcache(config: "StorageConfig") -> "HiCacheStorage":
    from hicache.storage.lmcache_store import LMCacheStorage, load_lmcache

    load_lmcache()  # ImportError saying how to install it
    return LMCacheStorage(config)


def _make_dynamic(config: "StorageConfig") -> "HiCacheStorage":
    from hicache.storage.dynamic import create_dynamic_backend

    return create_dynamic_backend(config)


_BUILTIN: dict[str, StorageFactory] = {"file": _make_file, "mooncake": _make_mooncake, "lmcache": _make_lmcache,
                                        "dynamic": _make_dynamic}


def storage_backend_names() -> tuple[str, ...]:
    """Every name ``create_storage_backend`` accepts now: built-ins, then registered ones."""
    with _lock:
        return BUILTIN_BACKENDS + tuple(_third_party)


def register_storage_backend(name: str, factory: StorageFactory, replace: bool = False) -> None:
    """Make ``--hicache-storage-backend <name>`` build ``factory(config)``. Built-in names
    cannot be replaced; a registered name only with ``replace=True``."""
    if not isinstance(name, str) or _NAME_RE.fullmatch(name) is None:
        raise ValueError(f"storage backend name must be letters, digits, '_', '.' or '-' (not starting with "
                         f"a symbol), got {name!r}")
    if not callable(factory):
        raise ValueError(f"storage backend factory for {name!r} must be callable (StorageConfig -> "
                         f"HiCacheStorage), got {factory!r}")
    if name in BUILTIN_BACKENDS:
        raise ValueError(f"storage backend name {name!r} is built in and cannot be replaced")
    with _lock:
        if name in _third_party and not replace:
            raise ValueError(f"storage backend {name!r} is already registered (pass replace=True to replace it)")
        _third_party[name] = factory


def unregister_storage_backend(name: str) -> None:
    """Remove a registered (not built-in) name; KeyError if it is not registered."""
    with _lock:
        if name not in _third_party:
            raise KeyError(f"storage backend {name!r} is not registered (registered: {tuple(_third_party)})")
        del _third_party[name]


def check_storage_backend_name(name: str, flag: str = "--hicache-storage-backend") -> None:
    """ValueError naming ``flag`` and the allowed names unless ``name`` can be built."""
    allowed = storage_backend_names()
    if name in allowed:
        return
    hint = ""
    if name in SGLANG_ONLY_BACKENDS:
        hint = (f" ({name!r} is an SGLang backend this stack does not ship: load an implementation with "
                "'dynamic', or register it with hicache.storage.registry.register_storage_backend)")
    raise ValueError(f"{flag}={name!r} is invalid: one of {allowed}{hint}")


def create_storage_backend(name: str, config: "StorageConfig") -> "HiCacheStorage":
    """Build backend ``name`` for ``config``."""
    from hicache.storage.base import HiCacheStorage, StorageConfig

    check_storage_backend_name(name)
    if not isinstance(config, StorageConfig):
        raise ValueError(f"config must be a hicache.storage.base.StorageConfig, got {type(config).__name__}")
    with _lock:
        factory = _BUILTIN.get(name) or _third_party[name]
    backend = factory(config)
    if not isinstance(backend, HiCacheStorage):
        raise TypeError(f"storage backend {name!r}: its factory returned {type(backend).__name__}, "
                        "not a HiCacheStorage")
    return backend
