"""Settings of the Mooncake L3 backend: from the extra config, else ``MOONCAKE_*`` variables.

The extra config (``--hicache-storage-backend-extra-config``) wins; an absent key falls back
to the environment variable SGLang's Mooncake backend reads, then to a default. Sizes take
bytes as an int or a string with a unit (``"4gb"``, ``"512 MiB"``).
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

logger = logging.getLogger(__name__)

PROTOCOLS = ("tcp", "rdma")
_UNITS = {"": 1, "b": 1, "kb": 1 << 10, "kib": 1 << 10, "mb": 1 << 20, "mib": 1 << 20,
          "gb": 1 << 30, "gib": 1 << 30, "tb": 1 << 40, "tib": 1 << 40}
# extra-config key -> environment variable (the names SGLang's Mooncake backend uses)
_ENV = {
    "master_server_address": "MOONCAKE_MASTER",
    "metadata_server": "MOONCAKE_TE_META_DATA_SERVER",
    "protocol": "MOONCAKE_PROTOCOL",
    "device_name": "MOONCAKE_DEVICE",
    "local_hostname": "MOONCAKE_LOCAL_HOSTNAME",
    "global_segment_size": "MOONCAKE_GLOBAL_SEGMENT_SIZE",
    "local_buffer_size": "MOONCAKE_LOCAL_BUFFER_SIZE",
}
# keys the generic storage layer reads from the same extra config; not ours, never warned about
_SHARED_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold",
                "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "tp_lcm_size", "prefetch_capacity_limit",
                "prefetch_capacity_fraction", "backend_call_timeout_s"}


def parse_size(value: Any, name: str) -> int:
    """Bytes from an int or a string such as ``"4gb"``; ValueError naming ``name`` otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a size in bytes (int, or a string like '4gb'), got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"{name} must be a size in bytes (int, or a string like '4gb' with a unit in "
                             f"{sorted(k for k in _UNITS if k)}), got {value!r}")
        n = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ValueError(f"{name} must be a size in bytes (int, or a string like '4gb'), got {value!r}")
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return n


def _seconds(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class MooncakeSettings:
    """How to reach and use one Mooncake cluster."""

    master_server_address: str
    """``host:port`` of ``mooncake_master``'s RPC service."""
    metadata_server: str
    """Transfer-engine metadata: ``http://host:port/metadata`` (the master's HTTP metadata
    server), an etcd address, or ``P2PHANDSHAKE``."""
    protocol: str = "tcp"
    device_name: str = ""
    """RDMA devices (``"mlx5_0,mlx5_1"``); empty for TCP."""
    local_hostname: str = "localhost"
    """The address other clients reach this one's segment at."""
    global_segment_size: int = 4 << 30
    """Bytes this client contributes to the distributed pool (0: contribute none)."""
    local_buffer_size: int = 16 << 20
    """The client's own transfer buffer (bytes)."""
    op_timeout_s: float = 5.0
    """Longest a store operation may block; an overrun is a miss (fault)."""
    connect_timeout_s: float = 5.0
    """Longest the reachability probe of the master and metadata server before set-up may take."""
    retry_interval_s: float = 1.0
    """After a master fault, operations are misses without calling the store for this long."""

    @classmethod
    def from_extra(cls, extra: Optional[Mapping[str, Any]], env: Optional[Mapping[str, str]] = None
                   ) -> "MooncakeSettings":
        """Validated settings; ValueError naming the bad key and what it accepts."""
        extra = dict(extra or {})
        env = os.environ if env is None else env
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known - _SHARED_KEYS)
        if unknown:
            logger.warning("mooncake storage: ignoring unknown extra config keys %s (known: %s)",
                           unknown, sorted(known))

        def pick(key: str) -> Any:
            if extra.get(key) is not None:
                return extra[key]
            var = _ENV.get(key)
            return env.get(var) if var and env.get(var) else None

        master = pick("master_server_address")
        if not isinstance(master, str) or not re.fullmatch(r"[^\s:]+:\d+", master):
            raise ValueError("mooncake storage needs master_server_address as 'host:port' (extra config key "
                             f"'master_server_address' or ${_ENV['master_server_address']}), got {master!r}")
        metadata = pick("metadata_server")
        if metadata is None:
            # the master's own HTTP metadata server on its default port, as mooncake_master starts it
            metadata = f"http://{master.rsplit(':', 1)[0]}:8080/metadata"
        if not isinstance(metadata, str) or not metadata:
            raise ValueError(f"metadata_server must be a non-empty string (http://host:port/metadata, an etcd "
                             f"address or P2PHANDSHAKE), got {metadata!r}")
        protocol = pick("protocol") or "tcp"
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        kw: dict[str, Any] = dict(master_server_address=master, metadata_server=metadata, protocol=protocol)
        for key in ("device_name", "local_hostname"):
            v = pick(key)
            if v is not None:
                if not isinstance(v, str):
                    raise ValueError(f"{key} must be a string, got {v!r}")
                kw[key] = v
        if protocol == "rdma" and not kw.get("device_name"):
            raise ValueError("protocol 'rdma' needs device_name (e.g. 'mlx5_0'; "
                             f"extra config key 'device_name' or ${_ENV['device_name']})")
        for key in ("global_segment_size", "local_buffer_size"):
            v = pick(key)
            if v is not None:
                kw[key] = parse_size(v, key)
        if kw.get("local_buffer_size", cls.local_buffer_size) < 1 << 20:
            raise ValueError(f"local_buffer_size must be >= 1 MiB, got {kw['local_buffer_size']}")
        for key in ("op_timeout_s", "connect_timeout_s", "retry_interval_s"):
            if extra.get(key) is not None:
                kw[key] = _seconds(extra[key], key)
        return cls(**kw)
