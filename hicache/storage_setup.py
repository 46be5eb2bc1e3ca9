"""Build the L3 backend ``--hicache-storage-backend`` names, for a tree to attach.

The backends and their registry (``hicache.storage.registry``) are imported only here and
only when a backend is asked for, so a cache without L3 never loads them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # pragma: no cover
    from hicache.config import HiCacheConfig
    from hicache.storage.base import HiCacheStorage


def check_backend_options(config: "HiCacheConfig") -> None:
    """Check the extra config keys of a built-in backend without building it (no directory
    created, no connection made), so a command line fails before any work: ValueError
    naming the key and what it accepts. Third-party backends check theirs when built."""
    name = config.hicache_storage_backend
    extra = config.storage_extra_config()
    if name == "file":
        from hicache.storage.file_store import FileStorageOptions

        FileStorageOptions.from_extra(extra)
    elif name == "mooncake":
        from hicache.storage.mooncake_config import MooncakeSettings

        MooncakeSettings.from_extra(extra)
    elif name == "lmcache":
        from hicache.storage.lmcache_config import LMCacheSettings, lmcache_importable

        settings = LMCacheSettings.from_extra(extra)
        if lmcache_importable():  # LMCache's own key names and values (reads no file but the YAML)
            settings.engine_config()
    elif name == "dynamic":
        from hicache.storage.dynamic import load_storage_class

        load_storage_class(extra)


def backend_from_config(config: "HiCacheConfig", tp_rank: int = 0, tp_size: int = 1, is_mla: bool = False,
                        model_name: Optional[str] = None) -> Optional["HiCacheStorage"]:
    """The backend ``config.hicache_storage_backend`` names (None when unset), built through
    ``hicache.storage.registry.create_storage_backend`` with this rank's ``StorageConfig``
    and the parsed ``--hicache-storage-backend-extra-config``."""
    name = config.hicache_storage_backend
    if name is None:
        return None
    from hicache.storage.base import StorageConfig

    try:
        from hicache.storage.registry import create_storage_backend
    except ImportError as e:
        raise ImportError(f"--hicache-storage-backend={name} needs hicache.storage.registry, which this "
                          f"installation lacks ({e}); install a sparsehi version that ships the L3 backends") from e
    sc = StorageConfig(tp_rank=tp_rank, tp_size=tp_size, is_mla=is_mla, model_name=model_name,
                       extra=config.storage_extra_config())
    return create_storage_backend(name, sc)
