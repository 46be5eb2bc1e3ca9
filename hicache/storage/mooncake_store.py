"""The ``mooncake`` L3 backend: pages in Mooncake's distributed store (``MooncakeDistributedStore``).

One object per page: the page's bytes followed by its ``PageDigest`` (length + CRC-32, 24
bytes). Page and digest travel as one object, written in one call from two buffers
(``batch_put_from_multi_buffers``), so they are stored, evicted and removed together and one
existence check covers both.

- Writes (``set_pages``) are zero-copy from the host pool (registered with the store in
  ``register_host_pool``); only keys the store lacks are written.
- Reads land in a staging buffer owned by the call, are verified, then copied into the
  host page. Reading straight into the host page would be one copy less, but a read that
  overruns its deadline is abandoned, not cancelled: it could write into a page the cache
  has since given to another prefix. A late write into the staging buffer harms nobody.
- Every store call runs under a deadline (``op_timeout_s``). A fault — an exception, a
  negative return code, an overrun, a master the client reports unreachable — is a miss,
  counted in ``stats.faults`` and logged once per kind. After a master fault the store is
  left alone for ``retry_interval_s`` (operations are immediate misses), so a dead master
  costs one deadline, not one per call. Mooncake's client pings its master every second
  and reconnects to a restarted one by itself (re-mounting its segment); the store then
  serves again, empty — a restarted master has lost its objects.
- Two client calls hold Python's GIL, so no deadline can bound them: ``setup`` (which blocks
  ~90 s without a master) and ``close`` (which blocks several seconds trying to unmount from
  a dead master). Set-up is preceded by a TCP probe of the master and the metadata server, so
  a missing master fails at once; ``close`` of a client whose master is unreachable is put
  off — the client is kept, not torn down — rather than freezing the process.

Keys: ``sparsehi/<model name>/`` + ``storage_key(page key, tp_rank, is_mla)``.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, Callable, Optional, Sequence
from urllib.parse import urlsplit

import numpy as np
import torch

from .base import HiCacheStorage, StorageConfig, _check_pairs
from .bounded_call import BoundedCaller, CallTimeout
from .integrity import HEADER_BYTES as DIGEST_BYTES
from .integrity import CorruptPage, PageDigest
from .keys import storage_key
from .mooncake_config import MooncakeSettings

logger = logging.getLogger(__name__)

# return codes of the Mooncake client (mooncake-store/include/types.h)
NO_AVAILABLE_HANDLE = -200  # the pool has no room for the object
INVALID_PARAMS = -600  # e.g. a read target smaller than the object
REPLICA_IS_NOT_READY = -703  # another client's put of the object has not finished
OBJECT_NOT_FOUND = -704
# not held (yet): a plain miss, no fault
ABSENT = (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY)
OBJECT_ALREADY_EXISTS = -705
MASTER_FAULTS = (-900, -901)  # RPC_FAIL, RPC_TIMEOUT
HC_HEALTHY = 0  # health_check(): 1 not initialised / closed, 2 master unreachable

_REGEX_SPECIAL = set("\\^$.|?*+()[]{}")
STAGE_BYTES = 256 << 20  # staging memory one read call may hold
_UNCLOSED: list[Any] = []  # clients whose close was put off (see MooncakeStorage._retire)


def _load_store_class() -> type:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ImportError(
            "the 'mooncake' storage backend needs Mooncake's client: pip install 'sparsehi[mooncake]' "
            "(PyPI mooncake-transfer-engine-non-cuda; importing it needs libibverbs1, e.g. "
            f"apt-get install libibverbs1): {exc}") from exc
    return MooncakeDistributedStore


def _regex_literal(text: str) -> str:
    """``text`` as a literal inside an ECMAScript regex (what the store's remove_by_regex takes)."""
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)


class _MasterUnreachable(RuntimeError):
    pass


class _Client:
    """One connected ``MooncakeDistributedStore`` and the calls now using it (it must not be
    closed while one runs: a call on a closed client crashes the process)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.users = 0


class MooncakeStorage(HiCacheStorage):
    """L3 pages in a Mooncake cluster; settings from ``config.extra`` (see
    ``MooncakeSettings``). Raises ConnectionError when the first connection fails."""

    def __init__(self, config: StorageConfig, settings: Optional[MooncakeSettings] = None) -> None:
        super().__init__(config)
        self.settings = settings if settings is not None else MooncakeSettings.from_extra(config.extra)
        self._store_cls = _load_store_class()
        self.prefix = f"sparsehi/{config.model_name or 'default'}/"
        self._caller = BoundedCaller("mooncake")
        self._lock = threading.Condition()
        self._stats_lock = threading.Lock()
        self._closed = False
        self._down_until = 0.0
        self._logged: set[str] = set()
        self._pool_region: Optional[tuple[int, int]] = None
        self._client: Optional[_Client] = self._connect()

    # -- keys ------------------------------------------------------------------------------
    def object_key(self, key: str) -> str:
        """The store's name for page ``key`` (namespaced, rank-suffixed for MHA)."""
        return self.prefix + storage_key(key, self.config.tp_rank, self.config.is_mla)

    # -- host pool -------------------------------------------------------------------------
    def register_host_pool(self, host_pool: Any) -> None:
        """Register the pool's memory with the store (RDMA needs it; TCP works without)."""
        super().register_host_pool(host_pool)
        data = getattr(host_pool, "raw", None)
        if data is None:
            data = host_pool.kv_data
        region = (data.data_ptr(), data.numel() * data.element_size())
        old, self._pool_region = self._pool_region, region
        ok = self._call_on_current("register", lambda st: self._swap_registration(st, old, region))
        if not ok and self.settings.protocol != "tcp":
            raise RuntimeError(f"mooncake storage: register_buffer failed for the host pool "
                               f"({region[1]} bytes); protocol {self.settings.protocol!r} needs it")

    def _swap_registration(self, store: Any, old: Optional[tuple[int, int]], new: tuple[int, int]) -> bool:
        if old == new:
            return True
        if old is not None:
            store.unregister_buffer(old[0])
        return store.register_buffer(new[0], new[1]) == 0

    # -- batch -----------------------------------------------------------------------------
    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """One bool per key (page and digest are one object: both or neither)."""
        full = [self.object_key(k) for k in _check_keys(keys)]
        if not full:
            return []
        held = self._exists(full)
        return [bool(h) for h in held] if held is not None else [False] * len(full)

    def batch_set(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[bool]:
        """Store each value (a contiguous CPU tensor, any dtype) unless its key is held; the
        values are copied into a staging buffer first."""
        keys = _check_keys(keys)
        if len(values) != len(keys):
            raise ValueError(f"keys and values must have the same length, got {len(keys)} and {len(values)}")
        bufs = [_byte_view(v, "values") for v in values]
        if not self.config.writes_pages:
            return self.batch_exists(keys)  # MLA: rank 0 writes the page every rank shares
        return self._put(keys, bufs, zero_copy=False)

    def batch_get(self, keys: Sequence[str],
                  targets: Optional[Sequence[torch.Tensor]] = None) -> list[Optional[torch.Tensor]]:
        """Verified pages: ``targets[i]`` filled in place (its size is the expected size), or
        a new ``uint8`` tensor sized as stored; None on a miss, fault or corrupt page."""
        keys = _check_keys(keys)
        if targets is not None and len(targets) != len(keys):
            raise ValueError(f"keys and targets must have the same length, got {len(keys)} and {len(targets)}")
        out: list[Optional[torch.Tensor]] = [None] * len(keys)
        if targets is None:
            def keep(i: int, payload: np.ndarray) -> None:
                out[i] = torch.from_numpy(payload.copy())

            self._get(keys, None, keep)
            return out
        views = [_byte_view(t, "targets") for t in targets]

        def fill(i: int, payload: np.ndarray) -> None:
            views[i].copy_(torch.from_numpy(payload))
            out[i] = targets[i]

        self._get(keys, [v.numel() for v in views], fill)
        return out

    # -- pages -----------------------------------------------------------------------------
    def set_pages(self, keys: Sequence[str], host_pages: Sequence[int]) -> list[bool]:
        """Write host pages zero-copy (page + its digest as one object), new keys only."""
        pool = self._pool()
        keys = _check_keys(keys)
        _check_pairs(keys, host_pages, pool.num_pages)
        if not self.config.writes_pages:
            return self.batch_exists(keys)  # held or not: rank 0 writes MLA pages
        pages = [pool.page_tensor(int(p)).view(torch.uint8).view(-1) for p in host_pages]
        return self._put(keys, pages, zero_copy=True)

    def get_pages(self, keys: Sequence[str], host_pages: Sequence[int]) -> list[bool]:
        """Read, verify, then copy into host pages; a page whose result is False is untouched."""
        pool = self._pool()
        keys = _check_keys(keys)
        _check_pairs(keys, host_pages, pool.num_pages)
        pages = [pool.page_tensor(int(p)).view(torch.uint8).view(-1) for p in host_pages]
        def fill(i: int, payload: np.ndarray) -> None:
            pages[i].copy_(torch.from_numpy(payload))

        return self._get(keys, [p.numel() for p in pages], fill)

    # -- lifecycle -------------------------------------------------------------------------
    def clear(self) -> None:
        """Remove this namespace's objects (MHA: this rank's only), leases or not."""
        pattern = "^" + _regex_literal(self.prefix)
        if not self.config.is_mla:
            pattern += f".*_{int(self.config.tp_rank)}$"
        rc = self._call("clear", 0, lambda st: st.remove_by_regex(pattern, True))
        if rc is not None and rc < 0:
            self._fault("clear", 0, f"remove_by_regex returned {rc}")

    def close(self) -> None:
        """Release the client (waits up to ``op_timeout_s`` for running calls); stored pages
        stay in the cluster."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            self._retire(client)

    @property
    def available(self) -> bool:
        """Whether operations go to the store now (False while faults keep it at a distance)."""
        with self._lock:
            return (not self._closed and self._client is not None and time.monotonic() >= self._down_until
                    and not self._caller.stuck)

    # -- the store calls -------------------------------------------------------------------
    def _exists(self, full: list[str]) -> Optional[list[bool]]:
        codes = self._call("exists", len(full), lambda st: st.batch_is_exist(full))
        if codes is None:
            return None
        out = []
        for code in codes:
            if code not in (0, 1):
                self._fault("exists", 1, f"batch_is_exist returned {code}", code)
            out.append(code == 1)
        return out

    def _put(self, keys: list[str], bufs: list[torch.Tensor], zero_copy: bool) -> list[bool]:
        full = [self.object_key(k) for k in keys]
        first: dict[str, int] = {}
        for i, k in enumerate(full):
            first.setdefault(k, i)  # a key twice in one batch is written once
        uniq = list(first.values())
        held = self._exists([full[i] for i in uniq])
        if held is None:
            return [False] * len(keys)
        done: dict[str, bool] = {}
        todo = []
        for i, h in zip(uniq, held):
            if h:
                done[full[i]] = True
            else:
                todo.append(i)
        self._count(skipped_existing=len(uniq) - len(todo))
        if todo:
            digests = np.empty((len(todo), DIGEST_BYTES), np.uint8)
            for r, i in enumerate(todo):
                digests[r] = np.frombuffer(PageDigest.of(bufs[i]).to_bytes(), np.uint8)
            tkeys = [full[i] for i in todo]
            sizes = [bufs[i].numel() for i in todo]
            if zero_copy:
                # the host pages go as they are; a page changed under an abandoned write no
                # longer matches its digest and reads back as a miss
                ptrs = [[bufs[i].data_ptr(), digests.ctypes.data + r * DIGEST_BYTES] for r, i in enumerate(todo)]
                codes = self._call("put", len(todo), lambda st: self._registered(
                    st, [digests], lambda: st.batch_put_from_multi_buffers(
                        tkeys, ptrs, [[n, DIGEST_BYTES] for n in sizes])))
            else:
                offs = np.cumsum([0] + [n + DIGEST_BYTES for n in sizes])
                stage = np.empty(int(offs[-1]), np.uint8)
                for r, i in enumerate(todo):
                    o, n = int(offs[r]), sizes[r]
                    stage[o:o + n] = bufs[i].numpy()
                    stage[o + n:o + n + DIGEST_BYTES] = digests[r]
                base = stage.ctypes.data
                ptrs = [base + int(o) for o in offs[:-1]]
                codes = self._call("put", len(todo), lambda st: self._registered(
                    st, [stage], lambda: st.batch_put_from(tkeys, ptrs, [n + DIGEST_BYTES for n in sizes])))
            for r, i in enumerate(todo):
                code = None if codes is None else codes[r]
                ok = code in (0, OBJECT_ALREADY_EXISTS)
                if ok:
                    self._count(sets=1, bytes_written=sizes[r])
                elif code == NO_AVAILABLE_HANDLE:
                    self._log_once("full", "mooncake storage: the pool is full; pages not written (the master "
                                   "evicts above its high watermark once leases expire)")
                elif code is not None:
                    self._fault("put", 1, f"put returned {code}", code)
                done[full[i]] = ok
        return [done[k] for k in full]

    def _get(self, keys: list[str], payload_sizes: Optional[list[int]],
             sink: Callable[[int, np.ndarray], None]) -> list[bool]:
        """Fetch and verify; ``sink(i, payload)`` gets each verified payload (a view into a
        staging buffer, valid during the call). Known sizes are fetched in chunks of at most
        STAGE_BYTES, so staging memory stays bounded whatever the batch."""
        n = len(keys)
        if n == 0:
            return []
        full = [self.object_key(k) for k in keys]
        self._count(gets=n)
        ok = [False] * n
        if payload_sizes is None:
            self._get_chunk(full, list(range(n)), None, sink, ok)
        else:
            chunk: list[int] = []
            held = 0
            for i, p in enumerate(payload_sizes):
                if chunk and held + p > STAGE_BYTES:
                    self._get_chunk(full, chunk, payload_sizes, sink, ok)
                    chunk, held = [], 0
                chunk.append(i)
                held += p
            self._get_chunk(full, chunk, payload_sizes, sink, ok)
        self._count(misses=n - sum(ok))
        return ok

    def _get_chunk(self, full: list[str], idx: list[int], payload_sizes: Optional[list[int]],
                   sink: Callable[[int, np.ndarray], None], ok: list[bool]) -> None:
        keys = [full[i] for i in idx]

        def fetch(st: Any) -> tuple[list[int], np.ndarray, list[tuple[int, int, int]]]:
            if payload_sizes is None:  # unknown sizes: ask the store (one lookup per key)
                sizes = [int(st.get_size(k)) for k in keys]
            else:
                sizes = [payload_sizes[i] + DIGEST_BYTES for i in idx]
            want = [j for j, size in enumerate(sizes) if size > DIGEST_BYTES]
            offs = np.cumsum([0] + [sizes[j] for j in want]).tolist()
            stage = np.empty(int(offs[-1]), np.uint8)
            codes: list[int] = []
            if want:
                base = stage.ctypes.data
                codes = self._registered(st, [stage], lambda: st.batch_get_into(
                    [keys[j] for j in want], [base + o for o in offs[:-1]], [sizes[j] for j in want]))
            return sizes, stage, list(zip(want, offs, codes))

        res = self._call("get", len(idx), fetch)
        if res is None:
            return
        sizes, stage, placed = res
        for j, size in enumerate(sizes):
            if 0 <= size <= DIGEST_BYTES:  # too small to be a page object
                self._bad_object(keys[j], f"object is {size} bytes")
            elif size < 0 and size not in ABSENT:
                self._fault("get", 1, f"get_size returned {size}", size)
        for j, off, code in placed:
            size = sizes[j]
            if code == size:
                obj = stage[off:off + size]
                try:
                    PageDigest.from_bytes(obj[size - DIGEST_BYTES:]).verify(obj[:size - DIGEST_BYTES])
                except CorruptPage as exc:
                    self._bad_object(keys[j], str(exc))
                    continue
                sink(idx[j], obj[:size - DIGEST_BYTES])
                ok[idx[j]] = True
                self._count(hits=1, bytes_read=size - DIGEST_BYTES)
            elif code in ABSENT:
                pass
            elif code >= 0 or code == INVALID_PARAMS:
                # stored under this key with another length: short, or longer than expected
                got = f"{code} bytes" if code >= 0 else "longer"
                self._bad_object(keys[j], f"object is {got}, expected {size}")
            else:
                self._fault("get", 1, f"batch_get_into returned {code}", code)

    def _bad_object(self, key: str, why: str) -> None:
        """A corrupt or wrong-length object: a miss, counted; removed so a good copy can be
        written again (content-addressed keys would otherwise skip it forever)."""
        self._count(corrupt=1)
        self._fault("corrupt", 1, f"corrupt page object {key}: {why}")
        self._call("remove", 0, lambda st: st.remove(key, True))

    def _registered(self, store: Any, arrays: list[np.ndarray], fn: Callable[[], Any]) -> Any:
        """Run ``fn`` with ``arrays`` registered for the transfer (RDMA); TCP needs no
        registration. Runs on the call's thread, so an abandoned call unregisters late."""
        if self.settings.protocol == "tcp":
            return fn()
        done = []
        try:
            for a in arrays:
                rc = store.register_buffer(a.ctypes.data, a.nbytes)
                if rc != 0:
                    raise RuntimeError(f"register_buffer returned {rc}")
                done.append(a)
            return fn()
        finally:
            for a in done:
                store.unregister_buffer(a.ctypes.data)

    def _call(self, what: str, n: int, fn: Callable[[Any], Any]) -> Any:
        """``fn(store)`` under the deadline; None on any fault (``n`` faults counted)."""
        client = self._checkout()
        if client is None:
            self._fault("unavailable", n, "store unavailable (master unreachable, a call still hung, or closed)")
            return None
        store = client.store

        def work() -> Any:
            try:
                if not _healthy(store):
                    raise _MasterUnreachable("the client reports its master unreachable")
                return fn(store)
            finally:
                with self._lock:
                    client.users -= 1
                    self._lock.notify_all()

        try:
            result = self._caller.call(work, self.settings.op_timeout_s)
        except (CallTimeout, _MasterUnreachable) as exc:
            self._fault(what, n, f"{what}: {exc}", MASTER_FAULTS[0])
            return None
        except Exception as exc:
            self._fault(what, n, f"{what} raised {type(exc).__name__}: {exc}")
            return None
        if isinstance(result, list) and any(c in MASTER_FAULTS for c in result if isinstance(c, int)):
            self._trip()
        elif isinstance(result, int) and result in MASTER_FAULTS:
            self._trip()
        return result

    def _call_on_current(self, what: str, fn: Callable[[Any], Any]) -> bool:
        return bool(self._call(what, 0, fn))

    # -- availability ------------------------------------------------------------------------
    def _checkout(self) -> Optional[_Client]:
        with self._lock:
            client = self._client
            if self._closed or client is None or time.monotonic() < self._down_until or self._caller.stuck:
                return None
            client.users += 1
            return client

    def _trip(self) -> None:
        """A master fault: leave the store alone for retry_interval_s (misses meanwhile)."""
        with self._lock:
            self._down_until = time.monotonic() + self.settings.retry_interval_s

    def _connect(self) -> _Client:
        """A set-up client; ConnectionError when the master or metadata server is unreachable."""
        s = self.settings
        for what, host, port in _endpoints(s):
            try:
                socket.create_connection((host, port), timeout=s.connect_timeout_s).close()
            except OSError as exc:
                raise ConnectionError(
                    f"mooncake storage: cannot reach the {what} at {host}:{port} ({exc}); is mooncake_master "
                    f"running (master_server_address={s.master_server_address!r}, "
                    f"metadata_server={s.metadata_server!r})?") from exc
        store = self._store_cls()
        rc = store.setup(s.local_hostname, s.metadata_server, s.global_segment_size, s.local_buffer_size,
                         s.protocol, s.device_name, s.master_server_address)
        if rc != 0:
            raise ConnectionError(f"mooncake storage: set-up with master {s.master_server_address} "
                                  f"(metadata server {s.metadata_server}) returned {rc}")
        return _Client(store)

    def _retire(self, client: _Client) -> None:
        """Close a client once no call uses it. One still used after op_timeout_s, or whose
        master is unreachable, is kept open instead (closing under a running call crashes the
        process; closing without a master blocks it for seconds)."""
        deadline = time.monotonic() + self.settings.op_timeout_s
        with self._lock:
            while client.users and time.monotonic() < deadline:
                self._lock.wait(max(0.0, deadline - time.monotonic()))
            busy = client.users > 0
        store = client.store
        if busy or self._caller.stuck or not _healthy(store):
            _UNCLOSED.append(store)  # a reference, so no destructor tears it down here either
            self._log_once("leak", "mooncake storage: close put off (a call still runs or the master is "
                           "unreachable); the client stays open until the process exits")
            return
        if self._pool_region is not None:
            store.unregister_buffer(self._pool_region[0])
        store.close()

    # -- accounting ----------------------------------------------------------------------------
    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    def _fault(self, kind: str, n: int, msg: str, code: Optional[int] = None) -> None:
        if n:
            self._count(faults=n)
        if code in MASTER_FAULTS:
            self._trip()
        self._log_once(kind, "mooncake storage: " + msg.removeprefix("mooncake storage: ") +
                       " (served as a miss; further faults of this kind are logged at debug level)")

    def _log_once(self, kind: str, msg: str) -> None:
        with self._stats_lock:
            first = kind not in self._logged
            self._logged.add(kind)
        logger.log(logging.WARNING if first else logging.DEBUG, msg)


def _healthy(store: Any) -> bool:
    """The client's own view of its master link (clients without health_check: assume up)."""
    check = getattr(store, "health_check", None)
    return check is None or check() == HC_HEALTHY


def _endpoints(s: MooncakeSettings) -> list[tuple[str, str, int]]:
    """(what, host, port) to probe before set-up: the master, and an HTTP metadata server."""
    host, port = s.master_server_address.rsplit(":", 1)
    out = [("master", host, int(port))]
    if s.metadata_server.startswith(("http://", "https://")):
        u = urlsplit(s.metadata_server)
        if u.hostname:
            out.append(("metadata server", u.hostname, u.port or (443 if u.scheme == "https" else 80)))
    return out


def _check_keys(keys: Sequence[str]) -> list[str]:
    keys = list(keys)
    for k in keys:
        if not isinstance(k, str) or not k:
            raise ValueError(f"keys must be non-empty strings, got {k!r}")
    return keys


def _byte_view(t: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous CPU tensors, got "
                         f"{type(t).__name__ if not isinstance(t, torch.Tensor) else f'{t.device} tensor'}")
    return t.view(torch.uint8).view(-1) if t.dtype != torch.uint8 else t.view(-1)
