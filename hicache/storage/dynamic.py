"""The ``dynamic`` backend: any ``HiCacheStorage`` subclass, named in the extra config.

``--hicache-storage-backend dynamic --hicache-storage-backend-extra-config
'{"backend_name": "mine", "module_path": "pkg.mod", "class_name": "MyStorage", ...}'``
imports ``pkg.mod``, checks that ``MyStorage`` subclasses ``HiCacheStorage`` and builds it
with the ``StorageConfig`` (whose ``extra`` holds the whole extra config, so the class can
read its own keys from it).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache.storage.base import HiCacheStorage, StorageConfig

DYNAMIC_KEYS = ("backend_name", "module_path", "class_name")
"""Extra-config keys the dynamic backend needs (SGLang's names)."""


def missing_dynamic_keys(extra: dict[str, Any]) -> list[str]:
    """The keys of ``DYNAMIC_KEYS`` that ``extra`` lacks or leaves empty."""
    return [k for k in DYNAMIC_KEYS if not isinstance(extra.get(k), str) or not extra[k]]


def load_storage_class(extra: dict[str, Any]) -> "type[HiCacheStorage]":
    """The class ``extra['class_name']`` of module ``extra['module_path']``; ValueError naming
    the key when either is missing, does not import, or is not a ``HiCacheStorage``."""
    from hicache.storage.base import HiCacheStorage

    missing = missing_dynamic_keys(extra)
    if missing:
        raise ValueError("--hicache-storage-backend=dynamic needs --hicache-storage-backend-extra-config with "
                         f"non-empty string keys {DYNAMIC_KEYS} (missing: {missing})")
    module_path, class_name = extra["module_path"], extra["class_name"]
    try:
        module = importlib.import_module(module_path)
    except ImportError as e:
        raise ValueError(f"dynamic storage backend: extra config module_path={module_path!r} cannot be "
                         f"imported ({e})") from e
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"dynamic storage backend: extra config class_name={class_name!r} is not defined in "
                         f"module {module_path!r}")
    if not (isinstance(cls, type) and issubclass(cls, HiCacheStorage)):
        raise ValueError(f"dynamic storage backend: extra config class_name={class_name!r} in {module_path!r} "
                         f"must be a subclass of hicache.storage.base.HiCacheStorage, got {cls!r}")
    return cls


def create_dynamic_backend(config: "StorageConfig") -> "HiCacheStorage":
    """Build the class the extra config names, with ``config``."""
    return load_storage_class(config.extra)(config)
