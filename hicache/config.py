"""HiCacheConfig: SGLang's hierarchical-cache options (same names, same defaults).

The flags mirror SGLang's ``server_args.py`` (``--enable-hierarchical-cache``,
``--hicache-ratio``, ``--hicache-size``, ``--page-size``, ``--hicache-write-policy``,
``--hicache-io-backend``, ``--hicache-mem-layout`` and the L3 storage / prefetch options)
so a launch command written for SGLang configures this stack the same way. Where SGLang
silently rewrites an unsupported combination, this config rejects it and names the flags.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import tomllib
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Optional

from hicache.host_kv_dtype import HOST_KV_DTYPES, namespace_suffix
from hicache.storage.dynamic import DYNAMIC_KEYS, missing_dynamic_keys
from hicache.storage.registry import BUILTIN_BACKENDS, check_storage_backend_name, storage_backend_names

if TYPE_CHECKING:
    from hicache.storage.base import StorageConfig

# The single definition of the io backend and host layout names: this module imports
# nothing heavy (no torch), so hicache.transfer, hicache.host_pool and sparsehi.config all
# import them from here (and re-export them under their old names).
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
IO_BACKENDS = ("direct", "kernel")
HOST_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MEM_LAYOUTS = HOST_LAYOUTS  # SGLang's name (--hicache-mem-layout)
STORAGE_BACKENDS = BUILTIN_BACKENDS  # plus names registered with hicache.storage.registry
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
# L3 backends that hand host pages to storage zero-copy need one page contiguous across layers.
_ZERO_COPY_STORAGE = ("mooncake",)
# Which io backend can move which host layout (page_first_direct is copied per page and
# layer group with plain copies; the other layouts are gathered row-wise by the kernel or,
# for layer_first, by direct indexed copies).
_LAYOUT_IO = {
    "layer_first": ("direct", "kernel"),
    "page_first": ("kernel",),
    "page_first_direct": ("direct",),
    "page_head": ("kernel",),
}


def check_layout_io(layout: str, io_backend: str, layout_name: str = "layout", io_name: str = "io_backend") -> None:
    """The one rule for which io backend a host layout takes (SGLang's): ``page_first`` and
    ``page_head`` need ``kernel``, ``page_first_direct`` needs ``direct``, ``layer_first``
    takes either. Raises ValueError naming the two settings as the caller spells them
    (``--hicache-mem-layout`` / ``--host-layout`` / ``host_pool.layout``)."""
    allowed = _LAYOUT_IO.get(layout)
    if allowed is None:
        raise ValueError(f"{layout_name}={layout!r} is invalid: one of {HOST_LAYOUTS}")
    if io_backend not in allowed:
        raise ValueError(f"{layout_name}={layout} cannot be used with {io_name}={io_backend}: that layout needs "
                         f"{io_name} in {allowed}")


# Extra-config keys the prefetch path reads, with SGLang's defaults.
PREFETCH_CAPACITY_FRACTION = 0.5
"""Share of the host pool that prefetches in flight may reserve together (SGLang's
``prefetch_capacity_limit = int(0.5 * mem_pool_host.size)``; its older
``0.8 * (host - device)`` is 0 when the host pool is barely larger than the device pool,
which leaves L3 written but never read)."""

PREFETCH_DEFAULTS: dict[str, Any] = {
    "prefetch_threshold": 256,
    "prefetch_timeout_base": 1.0,
    "prefetch_timeout_per_ki_token": 0.25,
}


def write_through_threshold(write_policy: str) -> int:
    """Hit count at which a device node is backed up to host: 1 for ``write_through`` (at
    once), 2 for ``write_through_selective`` (second access); ``write_back`` backs up on
    eviction only (the tree does not count hits then)."""
    if write_policy not in WRITE_POLICIES:
        raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
    return 1 if write_policy == "write_through" else 2


def _finite_number(x: Any) -> bool:
    """An int or float that is not a bool, NaN or infinite."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class HiCacheConfig:
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    """Host pool size / device pool size; must be > 1 unless ``hicache_size`` is set."""
    hicache_size: int = 0
    """Host pool size in GB (1e9 bytes) per rank; overrides ``hicache_ratio`` when > 0."""
    page_size: int = 1
    hicache_write_policy: str = "write_through"
    hicache_io_backend: str = "kernel"
    hicache_mem_layout: str = "layer_first"
    hicache_host_kv_dtype: str = "auto"
    """KV in the host pool and L3 pages: ``auto`` (the model's dtype) or ``fp8_e4m3`` (E4M3
    page records with per-page, per-head scales, ``hicache.kv_page_format``; needs
    ``hicache_mem_layout="page_first"`` and ``hicache_io_backend="kernel"``)."""
    hicache_storage_backend: Optional[str] = None
    hicache_storage_prefetch_policy: str = "best_effort"
    hicache_storage_backend_extra_config: Optional[str] = None
    """JSON string, or ``@path`` to a ``.json``, ``.toml`` or ``.yaml`` / ``.yml`` file."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def write_through_threshold(self) -> int:
        """Hit count at which a device node is backed up to host (write_back: never by hits)."""
        return write_through_threshold(self.hicache_write_policy)

    def validate(self) -> None:
        def bad(flag: str, value: Any, allowed: str) -> None:
            raise ValueError(f"--{flag}={value!r} is invalid: {allowed}")

        if not isinstance(self.enable_hierarchical_cache, bool):
            bad("enable-hierarchical-cache", self.enable_hierarchical_cache, "a bool")
        if not isinstance(self.page_size, int) or isinstance(self.page_size, bool) or self.page_size < 1:
            bad("page-size", self.page_size, "an integer >= 1")
        if not _finite_number(self.hicache_size) or self.hicache_size < 0:
            bad("hicache-size", self.hicache_size, "a finite number of GB >= 0 (0: use --hicache-ratio; not a bool)")
        if not _finite_number(self.hicache_ratio) or self.hicache_ratio <= 0:
            bad("hicache-ratio", self.hicache_ratio, "a finite number > 0 (not a bool)")
        if self.hicache_size == 0 and not self.hicache_ratio > 1:
            bad("hicache-ratio", self.hicache_ratio,
                "a number > 1 (the host pool must be larger than the device pool) unless --hicache-size is set")
        if self.hicache_write_policy not in WRITE_POLICIES:
            bad("hicache-write-policy", self.hicache_write_policy, f"one of {WRITE_POLICIES}")
        if self.hicache_io_backend not in IO_BACKENDS:
            bad("hicache-io-backend", self.hicache_io_backend, f"one of {IO_BACKENDS}")
        if self.hicache_mem_layout not in MEM_LAYOUTS:
            bad("hicache-mem-layout", self.hicache_mem_layout, f"one of {MEM_LAYOUTS}")
        if self.hicache_host_kv_dtype not in HOST_KV_DTYPES:
            bad("hicache-host-kv-dtype", self.hicache_host_kv_dtype, f"one of {HOST_KV_DTYPES}")
        if self.hicache_host_kv_dtype == "fp8_e4m3" and (self.hicache_mem_layout, self.hicache_io_backend) != (
                "page_first", "kernel"):
            bad("hicache-host-kv-dtype", self.hicache_host_kv_dtype,
                "fp8_e4m3 pages are whole page records the kernel io backend reads and writes: use "
                "--hicache-mem-layout page_first and --hicache-io-backend kernel (got "
                f"{self.hicache_mem_layout} and {self.hicache_io_backend}), or auto")
        if self.hicache_storage_backend is not None:
            check_storage_backend_name(self.hicache_storage_backend)
        if self.hicache_storage_prefetch_policy not in PREFETCH_POLICIES:
            bad("hicache-storage-prefetch-policy", self.hicache_storage_prefetch_policy, f"one of {PREFETCH_POLICIES}")
        check_layout_io(self.hicache_mem_layout, self.hicache_io_backend, "--hicache-mem-layout", "--hicache-io-backend")
        if self.hicache_storage_backend in _ZERO_COPY_STORAGE and self.hicache_mem_layout == "layer_first":
            raise ValueError(
                f"--hicache-storage-backend={self.hicache_storage_backend} needs a page-contiguous host "
                "layout for zero-copy: use --hicache-mem-layout page_first (with --hicache-io-backend kernel) "
                "or page_first_direct (with --hicache-io-backend direct), not layer_first"
            )
        extra = self.storage_extra_config()  # parse errors surface at construction
        if self.hicache_storage_backend == "dynamic":
            missing = missing_dynamic_keys(extra)
            if missing:
                raise ValueError(
                    "--hicache-storage-backend=dynamic needs --hicache-storage-backend-extra-config "
                    f"with string keys {', '.join(DYNAMIC_KEYS)} (missing: {missing})"
                )
        if self.hicache_storage_backend is None and self.hicache_storage_backend_extra_config is not None:
            raise ValueError("--hicache-storage-backend-extra-config needs --hicache-storage-backend to be set")

    def storage_extra_config(self) -> dict[str, Any]:
        """The parsed ``hicache_storage_backend_extra_config`` ({} when unset)."""
        return parse_storage_extra_config(self.hicache_storage_backend_extra_config)

    def storage_config(self, tp_rank: int = 0, tp_size: int = 1, is_mla: bool = False,
                       model_name: Optional[str] = None) -> "StorageConfig":
        """What ``hicache.storage.registry.create_storage_backend(self.hicache_storage_backend, ...)``
        is given: this rank's place in the TP group, whether pages are MLA (shared by all ranks),
        the model name that namespaces the keys (with the host page format's suffix, so FP8
        pages and pages in the model's dtype never share a namespace), and the parsed extra
        config."""
        from hicache.storage.base import StorageConfig

        if self.hicache_storage_backend is None:
            raise ValueError("storage_config needs --hicache-storage-backend to be set")
        if model_name is not None:
            model_name += namespace_suffix(self.hicache_host_kv_dtype)
        return StorageConfig(tp_rank=tp_rank, tp_size=tp_size, is_mla=is_mla, model_name=model_name,
                             extra=self.storage_extra_config())

    def prefetch_options(self) -> dict[str, Any]:
        """prefetch_threshold (tokens), prefetch_timeout_base (s), prefetch_timeout_per_ki_token (s),
        and, when given, prefetch_capacity_limit (host tokens) / prefetch_capacity_fraction and
        backend_call_timeout_s (s)."""
        extra = self.storage_extra_config()
        out = {k: extra.get(k, v) for k, v in PREFETCH_DEFAULTS.items()}
        for k in ("prefetch_capacity_limit", "prefetch_capacity_fraction", "backend_call_timeout_s"):
            if k in extra:
                out[k] = extra[k]
        return out

    # -- argparse ---------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add the ``--hicache-*`` flags (and ``--page-size`` unless the parser has it)."""
        d = HiCacheConfig.__dataclass_fields__
        g = parser.add_argument_group("hierarchical cache (SGLang HiCache options)")
        g.add_argument("--enable-hierarchical-cache", action="store_true", help="keep KV in host memory below the GPU")
        g.add_argument("--hicache-ratio", type=float, default=d["hicache_ratio"].default,
                       help="host pool size / device pool size (> 1)")
        g.add_argument("--hicache-size", type=int, default=d["hicache_size"].default,
                       help="host pool size in GB per rank; overrides --hicache-ratio")
        if "--page-size" not in parser._option_string_actions:
            g.add_argument("--page-size", type=int, default=d["page_size"].default, help="tokens per KV page")
        g.add_argument("--hicache-write-policy", choices=WRITE_POLICIES, default=d["hicache_write_policy"].default)
        g.add_argument("--hicache-io-backend", choices=IO_BACKENDS, default=d["hicache_io_backend"].default)
        g.add_argument("--hicache-mem-layout", choices=MEM_LAYOUTS, default=d["hicache_mem_layout"].default)
        g.add_argument("--hicache-host-kv-dtype", choices=HOST_KV_DTYPES, default=d["hicache_host_kv_dtype"].default,
                       help="KV in the host pool and L3: auto (the model's dtype) or fp8_e4m3 (needs "
                            "--hicache-mem-layout page_first, --hicache-io-backend kernel)")
        g.add_argument("--hicache-storage-backend", type=_storage_backend_arg, default=None,
                       metavar="{" + ",".join(storage_backend_names()) + "}",
                       help="L3 storage backend (names registered with hicache.storage.registry count too)")
        g.add_argument("--hicache-storage-prefetch-policy", choices=PREFETCH_POLICIES,
                       default=d["hicache_storage_prefetch_policy"].default)
        g.add_argument("--hicache-storage-backend-extra-config", type=str, default=None,
                       help="JSON object string, or @file.json / @file.toml / @file.yaml")
        return parser

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "HiCacheConfig":
        """Build (and validate) a config from parsed CLI args; missing attributes keep defaults."""
        kw = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**kw)


_EXTRA_FLAG = "--hicache-storage-backend-extra-config"


def _load_extra_file(path: str) -> Any:
    ext = os.path.splitext(path)[1].lower()
    if ext == ".toml":
        with open(path, "rb") as f:
            return tomllib.load(f)
    if ext == ".json":
        with open(path) as f:
            return json.load(f)
    if ext in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as e:
            raise ValueError("reading a YAML file needs PyYAML (pip install pyyaml); or use .json / .toml") from e
        with open(path) as f:
            try:
                return yaml.safe_load(f)
            except yaml.YAMLError as e:  # not a ValueError
                raise ValueError(f"malformed YAML: {e}") from e
    raise ValueError(f"unsupported file type {ext!r}: use .json, .toml, .yaml or .yml")


def parse_storage_extra_config(raw: Optional[str]) -> dict[str, Any]:
    """``--hicache-storage-backend-extra-config``: a JSON object string, or ``@path`` to a
    ``.json`` / ``.toml`` / ``.yaml`` / ``.yml`` file holding one; {} when None or empty.
    ValueError naming the flag for anything else (unreadable or malformed file, not an object)."""
    if raw is None or raw == "":
        return {}
    if not isinstance(raw, str):
        raise ValueError(f"{_EXTRA_FLAG} must be a JSON string or '@file' (.json/.toml/.yaml), got "
                         f"{type(raw).__name__}")
    try:
        data = _load_extra_file(raw[1:]) if raw.startswith("@") else json.loads(raw)
    except (OSError, ValueError) as e:  # json / toml decode errors are ValueErrors
        raise ValueError(f"{_EXTRA_FLAG}={raw!r} is invalid: a JSON object or '@file.json' / '@file.toml' / "
                         f"'@file.yaml' ({e})") from e
    except RecursionError as e:  # the parsers recurse per nesting level
        raise ValueError(f"{_EXTRA_FLAG}={raw!r:.200} is invalid: nested too deeply (at most "
                         f"{_MAX_EXTRA_DEPTH} levels)") from e
    if not isinstance(data, dict):
        raise ValueError(f"{_EXTRA_FLAG}={raw!r} is invalid: must hold an object (key/value mapping), got "
                         f"{type(data).__name__}")
    _check_plain_data(data, raw)
    return data


_MAX_EXTRA_DEPTH = 32


def _check_plain_data(data: Any, raw: str) -> None:
    """Reject what the backends could not use safely: non-string keys (YAML allows any),
    nesting beyond ``_MAX_EXTRA_DEPTH`` and self-referencing YAML anchors (a cycle would
    hang or overflow whoever walks the config later)."""
    stack: list[tuple[Any, int, frozenset[int]]] = [(data, 0, frozenset())]
    while stack:
        x, depth, above = stack.pop()
        if not isinstance(x, (dict, list)):
            continue
        if id(x) in above:
            raise ValueError(f"{_EXTRA_FLAG}={raw!r:.200} is invalid: it refers to itself (a YAML anchor "
                             "used inside its own value)")
        if depth >= _MAX_EXTRA_DEPTH:
            raise ValueError(f"{_EXTRA_FLAG}={raw!r:.200} is invalid: nested too deeply (at most "
                             f"{_MAX_EXTRA_DEPTH} levels)")
        if isinstance(x, dict):
            bad = [k for k in x if not isinstance(k, str)]
            if bad:
                raise ValueError(f"{_EXTRA_FLAG}={raw!r:.200} is invalid: keys must be strings, got {bad[0]!r}")
            items = x.values()
        else:
            items = x
        inner = above | {id(x)}
        stack.extend((v, depth + 1, inner) for v in items)


def _storage_backend_arg(name: str) -> str:
    try:
        check_storage_backend_name(name, "--hicache-storage-backend")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return name
