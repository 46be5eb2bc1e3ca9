"""A real ``mooncake_master`` (with its HTTP metadata server) on 127.0.0.1, for tests.

``MooncakeMaster`` picks free ports, starts the master the ``mooncake`` package ships, waits
until its RPC and metadata ports accept connections, and stops it. ``kill`` / ``start``
again on the same ports are the fault test's "master killed mid-run, then restarted".
``missing_reason()`` says why the tests cannot run here (no client package, or no binary).
``MooncakeSegmentHolder`` runs Mooncake's standalone store client, whose memory holds objects
that outlive the processes that put them.
"""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Optional

from server_process import ServerProcess, free_port  # noqa: F401  (free_port: for the tests)


def _package_binary(name: str) -> Optional[str]:
    """The executable ``name`` inside the installed ``mooncake`` package (the wheel ships its
    binaries there), else one on PATH."""
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        for d in spec.submodule_search_locations:
            p = Path(d, name)
            if p.is_file():
                return str(p)
    return shutil.which(name)


def master_binary() -> Optional[str]:
    """The ``mooncake_master`` executable."""
    return _package_binary("mooncake_master")


def store_client_binary() -> Optional[str]:
    """``mooncake_client``: Mooncake's standalone store client (its "real client")."""
    return _package_binary("mooncake_client")


def missing_reason() -> Optional[str]:
    """None when the Mooncake client imports and the master binary exists; else why not."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return (f"Mooncake client not importable ({exc}); install the 'mooncake' extra "
                "(mooncake-transfer-engine-non-cuda) and libibverbs1, or run scripts/setup.sh")
    if master_binary() is None:
        return "mooncake_master binary not found (in the mooncake package or on PATH)"
    return None


class MooncakeMaster(ServerProcess):
    """One master process; ports stay fixed across ``kill`` / ``start``."""

    def __init__(self, lease_ttl_ms: int = 500, extra_flags: tuple[str, ...] = ()) -> None:
        binary = master_binary()
        if binary is None:
            raise RuntimeError("mooncake_master binary not found")
        self.binary = binary
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.lease_ttl_ms = lease_ttl_ms
        self.extra_flags = tuple(extra_flags)
        super().__init__("mooncake_master_")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def extra_config(self, **overrides) -> dict:
        """The storage backend's extra config for this master (small segment for tests)."""
        cfg = {"master_server_address": self.address, "metadata_server": self.metadata_server,
               "protocol": "tcp", "local_hostname": "127.0.0.1", "global_segment_size": "64mb",
               "local_buffer_size": "16mb"}
        cfg.update(overrides)
        return cfg

    def start(self, timeout: float = 20.0) -> "MooncakeMaster":
        if self.proc is not None and self.proc.poll() is None:
            return self
        cmd = [self.binary, f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
               "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
               f"--http_metadata_server_port={self.http_port}",
               "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
               # short leases, so a full pool can evict and removed objects go at once
               f"--default_kv_lease_ttl={self.lease_ttl_ms}", *self.extra_flags]
        self._spawn(cmd)
        self._wait_listening((self.rpc_port, self.http_port), timeout, "mooncake_master")
        return self


class MooncakeSegmentHolder(ServerProcess):
    """Mooncake's standalone store client (``mooncake_client``) mounting ``segment_size`` of
    its memory into ``master``'s pool until stopped. A client that contributes no memory
    (``global_segment_size`` 0) puts its objects there, so they outlive it; memory a client
    contributes itself is unmounted, with its objects, when that client exits."""

    def __init__(self, master: MooncakeMaster, segment_size: str = "64MB") -> None:
        binary = store_client_binary()
        if binary is None:
            raise RuntimeError("mooncake_client binary not found")
        self.port = free_port()
        self.cmd = [binary, f"--master_server_address={master.address}",
                    f"--metadata_server={master.metadata_server}", "--protocol=tcp", "--host=127.0.0.1",
                    f"--port={self.port}", f"--global_segment_size={segment_size}"]
        super().__init__("mooncake_client_")

    def start(self, timeout: float = 20.0) -> "MooncakeSegmentHolder":
        self._spawn(self.cmd)
        # it serves its port only after the segment is mounted
        self._wait_listening((self.port,), timeout, "mooncake_client")
        return self
