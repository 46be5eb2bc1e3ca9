"""Settings of the ``lmcache`` L3 backend, read from the storage extra config.

The extra config carries two kinds of keys:

- LMCache's own engine settings, under LMCache's names (``local_cpu``,
  ``max_local_cpu_size``, ``local_disk``, ``max_local_disk_size``, ``remote_url``,
  ``remote_serde``, ``cache_policy``, ...). They override, in this order, LMCache's defaults,
  the YAML file named by ``lmcache_config_file`` (else by the environment variable
  ``LMCACHE_CONFIG_FILE``) and LMCache's ``LMCACHE_<NAME>`` environment variables — LMCache's
  own loader (``load_engine_config_with_overrides``) does the reading.
- This backend's own: ``lmcache_config_file`` (path of an LMCache YAML file),
  ``op_timeout_s`` (deadline of one call into LMCache, default 5 s), ``retry_interval_s``
  (how long a remote tier that faulted is left alone before reconnecting, default 2 s) and
  ``interop_model_path`` (set: a sparse-hier run shares its KV with LMCache's own
  serving-engine connectors, whose keys name the model by this string, SGLang's
  ``--model-path``; see ``hicache.storage.lmcache_interop``).

This module imports no LMCache code until ``engine_config`` is called, so options can be
checked where LMCache is not installed (its key names are then checked when it is built).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

OWN_KEYS = ("lmcache_config_file", "op_timeout_s", "retry_interval_s", "interop_model_path")
INTEROP_PATH_MAX = 100
"""Longest ``interop_model_path``: LMCache's remote protocol caps a key string at 150 characters."""
KEYS_READ_ELSEWHERE = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold", "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token", "tp_lcm_size", "prefetch_capacity_limit", "prefetch_capacity_fraction",
    "backend_call_timeout_s"})
"""Extra-config keys the generic storage layer and the prefetch path read; not LMCache settings."""

UNSUPPORTED_FEATURES = {
    "enable_pd": "disaggregated prefill moves KV between serving engines, not to an L3 store",
    "enable_p2p": "peer-to-peer sharing needs LMCache's controller and a serving engine",
    "enable_controller": "the controller tracks a serving engine's workers",
    "use_layerwise": "layer-wise storage needs LMCache's GPU connector",
    "enable_blending": "blending recomputes KV on the GPU",
    "gds_path": "GPUDirect Storage needs a CUDA GPU",
    "maru_path": "the Maru backend needs its own packages and GPU memory",
    "enable_async_loading": "asynchronous loading is driven by a serving engine's scheduler",
}
"""LMCache settings this backend refuses (set to a true value), with the reason."""


@dataclass(frozen=True)
class LMCacheSettings:
    """What ``--hicache-storage-backend-extra-config`` says to the ``lmcache`` backend."""

    config_file: Optional[str] = None
    op_timeout_s: float = 5.0
    retry_interval_s: float = 2.0
    overrides: dict[str, Any] = field(default_factory=dict)
    """LMCache engine settings by LMCache's names."""
    interop_model_path: Optional[str] = None
    """``model_name`` of the chunk keys of LMCache's serving-engine connectors that a
    sparse-hier run imports from and exports to (None: no interop)."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any], env: Optional[Mapping[str, str]] = None) -> "LMCacheSettings":
        """Parse and check the extra config (ValueError naming the key). ``env`` (default
        ``os.environ``) supplies ``LMCACHE_CONFIG_FILE`` when the extra config names no file."""
        if not isinstance(extra, Mapping):
            raise ValueError(f"the lmcache storage extra config must be a mapping, got {type(extra).__name__}")
        env = os.environ if env is None else env
        config_file = extra.get("lmcache_config_file", env.get("LMCACHE_CONFIG_FILE"))
        if config_file is not None:
            if not isinstance(config_file, str) or not config_file or "\0" in config_file:
                raise ValueError(f"lmcache_config_file must be a file path, got {config_file!r}")
            if not os.path.isfile(config_file):
                raise ValueError(f"lmcache_config_file={config_file!r} is not a readable file")
        op_timeout_s = _positive(extra, "op_timeout_s", cls.op_timeout_s)
        retry_interval_s = _positive(extra, "retry_interval_s", cls.retry_interval_s)
        interop_model_path = _interop_model_path(extra.get("interop_model_path"))
        overrides = {k: v for k, v in extra.items() if k not in OWN_KEYS and k not in KEYS_READ_ELSEWHERE}
        for key in overrides:
            if not isinstance(key, str):
                raise ValueError(f"lmcache storage extra config keys must be strings, got {key!r}")
        for key, why in UNSUPPORTED_FEATURES.items():
            if overrides.get(key):
                raise ValueError(f"{key}={overrides[key]!r} is not supported by the lmcache L3 backend: {why}")
        return cls(config_file, op_timeout_s, retry_interval_s, overrides, interop_model_path)

    def engine_config(self) -> Any:
        """The ``LMCacheEngineConfig`` LMCache's loader builds from the file, the
        ``LMCACHE_*`` environment and ``overrides``; ValueError for a key LMCache does not
        know, a value it cannot convert, or a setting this backend cannot serve."""
        from lmcache.v1.config import LMCacheEngineConfig, load_engine_config_with_overrides

        known = LMCacheEngineConfig._config_definitions
        unknown = sorted(k for k in self.overrides if k not in known)
        if unknown:
            raise ValueError(f"lmcache storage extra config: {unknown} are not LMCache engine settings nor this "
                             f"backend's own {OWN_KEYS} (LMCache's settings: lmcache.v1.config._CONFIG_DEFINITIONS)")
        config = load_engine_config_with_overrides(self.config_file, dict(self.overrides))
        for key, value in self.overrides.items():
            # LMCache's loader turns a value its converter rejects into None with a warning
            if value is not None and getattr(config, key) is None:
                raise ValueError(f"lmcache setting {key}={value!r} cannot be converted to {known[key]['type']}")
        for key, why in UNSUPPORTED_FEATURES.items():
            if getattr(config, key, None):
                raise ValueError(f"LMCache setting {key}={getattr(config, key)!r} (from {self._source(key)}) is not "
                                 f"supported by the lmcache L3 backend: {why}")
        size = config.max_local_cpu_size
        if not isinstance(size, (int, float)) or not size > 0:
            raise ValueError(f"max_local_cpu_size must be > 0 GB (LMCache's local CPU backend allocates every "
                             f"page this backend moves, whatever the tiers), got {size!r}")
        if config.local_disk and not config.max_local_disk_size > 0:
            raise ValueError(f"local_disk={config.local_disk!r} needs max_local_disk_size > 0 (GB), got "
                             f"{config.max_local_disk_size!r}")
        return config

    def _source(self, key: str) -> str:
        if key in self.overrides:
            return "the extra config"
        return f"{self.config_file} or LMCACHE_{key.upper()}" if self.config_file else f"LMCACHE_{key.upper()}"


def lmcache_importable() -> bool:
    """Whether LMCache's config module imports here."""
    try:
        import lmcache.v1.config  # noqa: F401
    except ImportError:
        return False
    return True


def _positive(extra: Mapping[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{key} must be a number of seconds > 0, got {value!r}")
    return float(value)


def _interop_model_path(value: Any) -> Optional[str]:
    if value is None:
        return None
    if (not isinstance(value, str) or not value or len(value) > INTEROP_PATH_MAX or not value.isprintable()
            or set(value) & {"@", "%"}):
        raise ValueError(f"interop_model_path must be the model path SGLang serves with LMCache (its --model-path, "
                         f"the model_name of LMCache's keys): a printable str of 1..{INTEROP_PATH_MAX} characters "
                         f"without '@' or '%' (LMCache's key separators), got {value!r:.120}")
    return value
