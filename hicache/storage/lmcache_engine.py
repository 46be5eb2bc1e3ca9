"""One LMCache storage engine per process and LMCache configuration, shared by the
``lmcache`` backend instances that use it.

The engine is LMCache's ``StorageManager`` (``lmcache.v1.storage_backend.storage_manager``):
the storage half of ``LMCacheEngine``, the part that holds the tiers (``LocalCPUBackend``,
``LocalDiskBackend``, ``RemoteBackend``) and moves objects between them. ``LMCacheEngine``'s
other half turns a serving engine's GPU KV cache into those objects through a GPU connector;
HiCache hands over host pages itself, so this module builds the ``StorageManager`` alone,
which needs no GPU.

Instances share an engine because LMCache's local tiers live in it: two instances (two TP
ranks in one process, or an instance opened again after another with the same settings) see
the same pages only through one engine, as LMCache's own ``LMCacheEngineBuilder`` shares
one engine per instance id. The engine is closed when its last instance closes.

Remote faults: LMCache's ``RemoteBackend`` catches a connector's exceptions and serves them
as misses, and never reconnects a connector whose server went away. ``RemoteWatch`` wraps
the connector (as LMCache's ``InstrumentedRemoteConnector`` does) to see each exception,
counts it, takes the remote tier out of service with LMCache's bypass switch
(``StorageManager.set_backend_bypass``), and after ``retry_interval_s`` reconnects through
``RemoteBackend.init_connection``.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable, Optional

from .lmcache_config import LMCacheSettings

logger = logging.getLogger(__name__)

REMOTE = "RemoteBackend"
LOCAL_TIERS = ("LocalCPUBackend", "LocalDiskBackend")


def _config_identity(config: Any) -> str:
    """The settings that make two engines differ (LMCache's random instance id does not)."""
    d = {k: v for k, v in config.to_dict().items() if k != "lmcache_instance_id"}
    return json.dumps(d, sort_keys=True, default=str)


class RemoteWatch:
    """Sees the remote tier's faults and brings it back (see the module docstring)."""

    def __init__(self, manager: Any, retry_interval_s: float) -> None:
        self.manager = manager
        self.backend = manager.storage_backends.get(REMOTE)
        self.retry_interval_s = retry_interval_s
        self.faults = 0
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._logged = False
        if self.backend is None:
            return
        # LMCache waits this long after a failed connect before trying again
        self.backend.min_reconnect_interval = retry_interval_s
        if self.backend.connection is None:
            self.take_out("the first connection failed")
        else:
            self._wrap()

    @property
    def present(self) -> bool:
        return self.backend is not None

    @property
    def out_of_service(self) -> bool:
        """Whether the remote tier is bypassed now (after a fault, until it reconnects)."""
        return self.backend is not None and self.manager.is_backend_bypassed(REMOTE)

    def fault(self, exc: BaseException) -> None:
        """Count one remote fault and take the tier out of service (any thread)."""
        with self._lock:
            self.faults += 1
        self.take_out(f"{type(exc).__name__}: {exc}")

    def take_out(self, why: str) -> None:
        """Bypass the remote tier for ``retry_interval_s`` (LMCache's bypass switch)."""
        with self._lock:
            self._down_until = time.monotonic() + self.retry_interval_s
            first, self._logged = not self._logged, True
        self.manager.set_backend_bypass(REMOTE, True)
        (logger.warning if first else logger.debug)(
            "lmcache storage: remote tier %s out of service for %.3g s (%s); its pages are misses meanwhile",
            getattr(self.backend, "remote_url", "?"), self.retry_interval_s, why)

    def maybe_reconnect(self) -> None:
        """Reconnect a tripped remote tier once its retry interval has passed."""
        if self.backend is None:
            return
        with self._lock:
            if not self.manager.is_backend_bypassed(REMOTE) or time.monotonic() < self._down_until:
                return
            self._down_until = time.monotonic() + self.retry_interval_s  # one reconnect at a time
        self.backend.connection = None  # the old socket is broken; LMCache only rebuilds a missing one
        self.backend.init_connection()
        if self.backend.connection is None:
            self.take_out("reconnect failed")
            return
        self._wrap()
        self.manager.set_backend_bypass(REMOTE, False)
        with self._lock:
            self._logged = False
        logger.info("lmcache storage: remote tier %s reconnected", self.backend.remote_url)

    def _wrap(self) -> None:
        watched: list[Any] = []

        def report(exc: BaseException) -> None:
            # a call still running on a connection replaced since then is not news
            if watched and self.backend.connection is watched[0]:
                self.fault(exc)

        watched.append(_watched_connector(self.backend.connection, report))
        self.backend.connection = watched[0]


def _watched_connector(connection: Any, on_fault: Callable[[BaseException], None]) -> Any:
    """``connection`` (an LMCache ``RemoteConnector``) with every exception of ``exists``,
    ``get`` and ``put`` reported to ``on_fault`` and then raised on, as before."""
    from lmcache.v1.storage_backend.connector import InstrumentedRemoteConnector

    inner = connection.getWrappedConnector() if isinstance(connection, InstrumentedRemoteConnector) else connection

    class WatchedConnector(InstrumentedRemoteConnector):
        async def exists(self, key: Any) -> bool:
            try:
                return await super().exists(key)
            except Exception as exc:
                on_fault(exc)
                raise

        def exists_sync(self, key: Any) -> bool:
            try:
                return super().exists_sync(key)
            except Exception as exc:
                on_fault(exc)
                raise

        async def get(self, key: Any) -> Any:
            try:
                return await super().get(key)
            except Exception as exc:
                on_fault(exc)
                raise

        async def put(self, key: Any, memory_obj: Any) -> None:
            try:
                await super().put(key, memory_obj)
            except Exception as exc:
                on_fault(exc)
                raise

    return WatchedConnector(inner)


class SharedEngine:
    """An LMCache ``StorageManager`` and what the instances using it share: the remote
    watch, and the keys being written now (so two writers of one key write it once)."""

    def __init__(self, identity: str, config: Any, retry_interval_s: float) -> None:
        import torch
        from lmcache.v1.event_manager import EventManager
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.storage_manager import StorageManager

        self.identity = identity
        self.config = config
        # The metadata names this process's engine; the model and rank of each page are in
        # its key. kv_shape only sizes LMCache's chunk budget estimates (one uint8 chunk).
        metadata = LMCacheMetadata(model_name="sparsehi", world_size=1, local_world_size=1, worker_id=0,
                                   local_worker_id=0, kv_dtype=torch.uint8, kv_shape=(1, 1, config.chunk_size, 1, 1),
                                   chunk_size=config.chunk_size)
        self.manager = StorageManager(config, metadata, EventManager())
        self.remote = RemoteWatch(self.manager, retry_interval_s)
        self.users = 0
        self.writing: dict[Any, threading.Event] = {}
        self.write_lock = threading.Lock()
        self.stuck: set[Any] = set()
        """Keys whose write LMCache still had in flight at a call's deadline: LMCache's disk
        tier keeps a write whose file could not be written in flight for good, and takes no
        new write of that key."""
        self.rewrite: set[Any] = set()
        """Keys whose remote copy failed its check: written again though the server holds them."""

    @property
    def tiers(self) -> tuple[str, ...]:
        return tuple(self.manager.storage_backends)

    def local_tiers(self) -> list[tuple[str, Any]]:
        return [(n, b) for n, b in self.manager.storage_backends.items() if n in LOCAL_TIERS]

    def close(self) -> None:
        # LMCache's CPU tier releases its objects on close only when local_cpu is on, yet it
        # also holds the disk and remote hits StorageManager.get copied into it
        cpu = self.manager.storage_backends.get("LocalCPUBackend")
        if cpu is not None:
            self.manager.batched_remove(cpu.get_keys(), locations=["LocalCPUBackend"])
        self.manager.close()


_engines: dict[str, SharedEngine] = {}
_engines_lock = threading.Lock()


def acquire_engine(settings: LMCacheSettings) -> SharedEngine:
    """The engine for ``settings``' LMCache configuration, built on first use."""
    config = settings.engine_config()
    identity = _config_identity(config)
    with _engines_lock:
        engine = _engines.get(identity)
        if engine is None:
            engine = SharedEngine(identity, config, settings.retry_interval_s)
            _engines[identity] = engine
        engine.users += 1
        return engine


def release_engine(engine: SharedEngine) -> None:
    """One user fewer; the last one closes the engine (its local tiers' pages go with it)."""
    with _engines_lock:
        engine.users -= 1
        if engine.users > 0:
            return
        if _engines.get(engine.identity) is engine:
            del _engines[engine.identity]
    engine.close()
