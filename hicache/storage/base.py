"""HiCacheStorage: the L3 tier's interface (below the pinned host pool).

Objects are whole KV pages: one page of every layer, as the host pool's page layouts hold it
contiguously (``HostKVPool.page_tensor``). Keys come from ``hicache.storage.keys`` (a hash
chain over token ids, rank-suffixed for MHA).

Three forms of every operation:

- single: ``get`` / ``set`` / ``exists`` on one key;
- batch: ``batch_get`` / ``batch_set`` / ``batch_exists``, one result per key;
- page (zero-copy where the backend can): ``get_pages`` / ``set_pages`` read into / write
  from host-pool pages in place, after ``register_host_pool``.

Rules every backend keeps (the tests hold each backend to them):

- ``batch_exists`` returns one bool per key, never a count of leading hits: a hole in the
  middle of a prefix stays visible.
- ``set_pages`` / ``batch_set`` write only keys the backend does not already hold
  (content-addressed keys: an existing key has the same bytes) and report them as True.
- Every stored page carries its length and a checksum (``hicache.storage.integrity``); a
  read that comes back short, long or with a wrong checksum is a miss (False / None), and
  the target page is not trusted by the caller.
- A backend fault (exception, timeout, lost connection) is a miss, never an exception out
  of the public methods; the backend counts it in ``stats``.
- ``clear`` deletes what this backend instance's namespace holds; ``close`` releases
  connections and never deletes remote data.
"""
from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

logger = logging.getLogger("hicache.storage")


@dataclass(frozen=True)
class StorageConfig:
    """What a backend is told when it is built (SGLang's ``HiCacheStorageConfig``)."""

    tp_rank: int = 0
    tp_size: int = 1
    is_mla: bool = False
    """MLA pages are the same on every rank: one rank (``tp_rank == 0``) writes them."""
    model_name: Optional[str] = None
    """Namespaces keys when set, so two models never share an object."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The parsed ``--hicache-storage-backend-extra-config``."""

    def __post_init__(self) -> None:
        for name in ("tp_rank", "tp_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"StorageConfig.{name} must be an int, got {v!r}")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"StorageConfig needs tp_size >= 1 and 0 <= tp_rank < tp_size, "
                             f"got tp_rank={self.tp_rank}, tp_size={self.tp_size}")
        if self.model_name is not None and not isinstance(self.model_name, str):
            raise ValueError(f"StorageConfig.model_name must be a str or None, got {type(self.model_name).__name__}")
        if not isinstance(self.extra, dict):
            raise ValueError(f"StorageConfig.extra must be a dict, got {type(self.extra).__name__}")

    @property
    def writes_pages(self) -> bool:
        """Whether this rank writes: every rank for MHA, rank 0 only for MLA."""
        return not self.is_mla or self.tp_rank == 0


@dataclass
class StorageStats:
    """Counters a backend keeps (monotonic; ``misses`` include fault misses)."""

    gets: int = 0
    hits: int = 0
    misses: int = 0
    sets: int = 0
    skipped_existing: int = 0
    faults: int = 0
    """Exceptions, timeouts, short or corrupt pages, each served as a miss."""
    corrupt: int = 0
    bytes_read: int = 0
    bytes_written: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class HiCacheStorage(ABC):
    """One L3 backend instance. Thread-safe for concurrent calls from the controller's
    prefetch and write-back threads."""

    def __init__(self, config: StorageConfig) -> None:
        self.config = config
        self.stats = StorageStats()
        self.host_pool = None  # set by register_host_pool
        self._stats_lock = threading.Lock()
        self._fault_kinds_logged: set[str] = set()

    # -- counters (for implementations) ----------------------------------------------------
    def _count(self, **deltas: int) -> None:
        """Add ``deltas`` to the ``stats`` fields of the same names (thread-safe)."""
        with self._stats_lock:
            for name, d in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + d)

    def _record_fault(self, kind: str, detail: object, corrupt: bool = False) -> None:
        """Count one fault served as a miss (``stats.faults``, and ``stats.corrupt`` for a page
        that failed its length / checksum check). The first fault of each ``kind`` is logged
        as a warning, later ones at debug level: a broken disk or a lost master must not
        flood the log once per page."""
        with self._stats_lock:
            self.stats.faults += 1
            if corrupt:
                self.stats.corrupt += 1
            first = kind not in self._fault_kinds_logged
            self._fault_kinds_logged.add(kind)
        log = logger.warning if first else logger.debug
        log("%s: %s fault served as a cache miss%s: %s", type(self).__name__, kind,
            " (further ones of this kind are logged at debug level)" if first else "", detail)

    # -- host pool -------------------------------------------------------------------------
    def register_host_pool(self, host_pool: Any) -> None:
        """Remember the pinned ``HostKVPool`` whose pages ``get_pages`` / ``set_pages`` move
        (backends that register memory with a transfer engine do it here). The pool must
        use a page layout (not ``layer_first``): one page is one contiguous object."""
        if getattr(host_pool, "layout", None) == "layer_first":
            raise ValueError("register_host_pool needs a host pool with layout in ('page_first', "
                             "'page_first_direct', 'page_head'), got 'layer_first'")
        self.host_pool = host_pool

    # -- single ----------------------------------------------------------------------------
    def get(self, key: str, target: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """The page stored under ``key`` (a ``uint8`` CPU tensor, or ``target`` filled in
        place when given; ``target`` is a contiguous CPU tensor of the page's size), or None
        on a miss."""
        return self.batch_get([key], None if target is None else [target])[0]

    def set(self, key: str, value: torch.Tensor) -> bool:
        """Store ``value`` (a contiguous CPU tensor) under ``key`` unless present; True when
        the key is held afterwards."""
        return self.batch_set([key], [value])[0]

    def exists(self, key: str) -> bool:
        return self.batch_exists([key])[0]

    # -- batch -----------------------------------------------------------------------------
    @abstractmethod
    def batch_get(self, keys: Sequence[str],
                  targets: Optional[Sequence[torch.Tensor]] = None) -> list[Optional[torch.Tensor]]:
        """One result per key: the verified page, or None (miss, fault, corrupt)."""

    @abstractmethod
    def batch_set(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[bool]:
        """One result per key: True when held afterwards (written now, or already there)."""

    @abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """One bool per key (never a leading count)."""

    # -- pages (host pool in place) --------------------------------------------------------
    def get_pages(self, keys: Sequence[str], host_pages: Sequence[int]) -> list[bool]:
        """Read ``keys[i]`` into host-pool page ``host_pages[i]`` in place; one bool per key
        (False: miss or fault, and that page's contents are undefined). Default: through
        ``batch_get`` with the page tensors as targets; zero-copy backends override."""
        pool = self._pool()
        _check_pairs(keys, host_pages, pool.num_pages)
        targets = [pool.page_tensor(int(p)).view(torch.uint8).view(-1) for p in host_pages]
        return [r is not None for r in self.batch_get(keys, targets)]

    def set_pages(self, keys: Sequence[str], host_pages: Sequence[int]) -> list[bool]:
        """Write host-pool page ``host_pages[i]`` under ``keys[i]`` unless held; one bool per
        key (True: held afterwards). Default: through ``batch_set``."""
        pool = self._pool()
        _check_pairs(keys, host_pages, pool.num_pages)
        values = [pool.page_tensor(int(p)).view(torch.uint8).view(-1) for p in host_pages]
        return self.batch_set(keys, values)

    # -- lifecycle -------------------------------------------------------------------------
    @abstractmethod
    def clear(self) -> None:
        """Delete every object this instance's namespace holds."""

    def close(self) -> None:
        """Release connections and threads; never deletes stored data."""

    def _pool(self) -> Any:
        if self.host_pool is None:
            raise RuntimeError(f"{type(self).__name__}: call register_host_pool before get_pages/set_pages")
        return self.host_pool


def _check_pairs(keys: Sequence[str], host_pages: Sequence[int], num_pages: int) -> None:
    if len(keys) != len(host_pages):
        raise ValueError(f"keys and host_pages must have the same length, got {len(keys)} and {len(host_pages)}")
    for p in host_pages:
        if not 0 <= int(p) < num_pages:
            raise ValueError(f"host_pages entries must be in [0, {num_pages}), got {int(p)}")
