"""The ``lmcache`` L3 backend: pages stored in and read from an LMCache storage engine.

LMCache (``pip install lmcache``) keeps KV chunks in tiers: its local CPU memory
(``local_cpu``), a local disk directory (``local_disk``) and a remote store (``remote_url``,
e.g. ``lm://host:port`` for LMCache's own server). This backend drives LMCache's
``StorageManager`` (built in ``hicache.storage.lmcache_engine``, shared by the instances of
one process that use the same LMCache settings) with HiCache's pages:

- **Keys.** Page key ``<hash>[_<rank>]`` (``hicache.storage.keys.storage_key``: a SHA-256
  hex digest, rank-suffixed for MHA) becomes LMCache's chunk key
  ``CacheEngineKey(model_name=<namespace>, world_size=tp_size, worker_id=<rank>,
  chunk_hash=int(<hash>, 16), dtype=uint8)``. An MLA page (no suffix) takes worker 0, as
  LMCache's own MLA mode (``remote_enable_mla_worker_id_as0``) does, so ``<hash>`` and
  ``<hash>_0`` name one chunk; one model's pages are all MLA or all MHA, so the two never
  meet. ``<namespace>`` is ``sparsehi/<model name>``, or ``sparsehi/h-<24 hex digits of the
  name's SHA-256>`` for a name over 48 characters or holding ``@`` or ``%`` (the separators
  of LMCache's key string, whose length its remote protocol caps at 150).
- **Objects.** One LMCache memory object per page: ``uint8 [1, 1, 1, 56 + page bytes]`` in
  LMCache's ``KV_2LTD`` format: the page's ``PageDigest`` (length and CRC-32, 24 bytes), a
  32-byte tag (SHA-256 of the chunk key's string), then the page. Every tier keeps and
  returns it whole. The tag matters: LMCache's disk tier reads a file into a buffer of the
  size it recorded without checking how much it read, so a file cut to nothing returns the
  buffer as LMCache's allocator handed it over, which may hold another page's intact object.
  A read whose tag, length or checksum is wrong, or whose page is not the size asked for, is
  a miss counted in ``stats.corrupt``, and the chunk is removed from the local tiers (a
  remote copy cannot be removed: LMCache's server has no delete command; the next write of
  the key replaces it).
- **Writes** copy each page into memory from LMCache's allocator (its local CPU backend)
  and hand it to ``StorageManager.batched_put``, which writes every tier (disk and remote
  asynchronously); the call returns once LMCache has no write of those keys in flight, and a
  key is reported held when LMCache then finds it in a tier. Only keys LMCache does not hold
  are written; two writers of one key in the process write it once.
- **Reads** take each page from the first tier that holds it (``StorageManager.get``, which
  also copies a disk or remote hit into local CPU memory, as LMCache does), into a copy that
  is verified before it reaches the caller's target.
- **Faults.** Every call into LMCache runs under ``op_timeout_s``; an exception or an
  overrun is a miss, counted in ``stats.faults``. So is a page LMCache reports held but
  cannot read (a disk file gone raises in LMCache's disk tier), a write LMCache still has in
  flight after half of ``op_timeout_s`` (its disk tier keeps a write whose file could not be
  written in flight for good, and later writes of that key are faults at once), and every
  exception of the remote connector, which LMCache itself turns into misses silently: the
  remote tier is then bypassed for ``retry_interval_s`` and reconnected
  (``hicache.storage.lmcache_engine.RemoteWatch``).
- **clear** removes this namespace's pages (this rank's for MHA) from the local tiers; remote
  copies stay (no delete command). **close** releases the engine; the last instance using it
  closes it, and its local tiers' pages go with it (LMCache's disk tier indexes its files in
  memory and does not adopt files found at start).
"""
from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch

from .base import HiCacheStorage, StorageConfig
from .bounded_call import BoundedCaller, CallTimeout
from .integrity import HEADER_BYTES, CorruptPage, PageDigest
from .lmcache_config import LMCacheSettings
from .lmcache_engine import REMOTE, SharedEngine, acquire_engine, release_engine

logger = logging.getLogger(__name__)

_KEY_RE = re.compile(r"([0-9a-f]{1,64})(?:_([0-9]{1,6}))?")
NAMESPACE_MAX_NAME = 48
TAG_BYTES = 32
OBJECT_HEADER_BYTES = HEADER_BYTES + TAG_BYTES
_POLL_S = 0.0005


def load_lmcache() -> None:
    """Import LMCache's storage engine; ImportError saying how to install it otherwise."""
    try:
        import lmcache.v1.storage_backend.storage_manager  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "--hicache-storage-backend=lmcache needs the lmcache package. On a CPU machine install it without "
            "its dependencies (its wheel requires CUDA packages and a CUDA torch): pip install --no-deps "
            "'lmcache==0.5.6', then the pure-Python packages its storage engine imports (docs/storage.md, "
            f"'LMCache'). Import failed: {exc}") from exc


def lmcache_namespace(model_name: Optional[str]) -> str:
    """The ``model_name`` field of this model's LMCache chunk keys."""
    name = model_name or "default"
    if len(name) <= NAMESPACE_MAX_NAME and name.isprintable() and not set(name) & {"@", "%"}:
        return "sparsehi/" + name
    return "sparsehi/h-" + hashlib.sha256(name.encode()).hexdigest()[:24]


class LMCacheStorage(HiCacheStorage):
    """L3 pages in LMCache's tiers; settings from ``config.extra`` (``LMCacheSettings``)."""

    def __init__(self, config: StorageConfig, settings: Optional[LMCacheSettings] = None) -> None:
        super().__init__(config)
        self.settings = settings if settings is not None else LMCacheSettings.from_extra(config.extra)
        load_lmcache()
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.memory_management import MemoryFormat

        self._key_cls = CacheEngineKey
        self._fmt = MemoryFormat.KV_2LTD
        self.namespace = lmcache_namespace(config.model_name)
        self._caller = BoundedCaller("lmcache")
        self._logged: set[str] = set()
        self._closed = False
        self._engine: SharedEngine = acquire_engine(self.settings)

    @property
    def engine(self) -> SharedEngine:
        return self._engine

    @property
    def interop_model_path(self) -> Optional[str]:
        """``model_name`` of LMCache's serving-engine connector keys that a sparse-hier run
        shares its KV with (the extra config's ``interop_model_path``), or None."""
        return self.settings.interop_model_path

    # -- keys ------------------------------------------------------------------------------
    def chunk_key(self, key: str) -> Any:
        """LMCache's ``CacheEngineKey`` for page key ``key`` (see the module docstring)."""
        m = _KEY_RE.fullmatch(key) if isinstance(key, str) else None
        if m is None:
            raise ValueError(f"keys must be page keys: lowercase hex hashes of up to 64 digits with an optional "
                             f"'_<rank>' suffix, got {key!r:.100}")
        return self._key_cls(self.namespace, self.config.tp_size, int(m[2] or 0), int(m[1], 16), torch.uint8)

    # -- batch -----------------------------------------------------------------------------
    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """One bool per key: whether some LMCache tier holds it."""
        cks = [self.chunk_key(k) for k in keys]
        if not cks:
            return []
        manager = self._engine.manager
        held, down = self._op_call("exists", len(cks), lambda: [manager.contains(k) is not None for k in cks])
        held = held if held is not None else [False] * len(cks)
        self._outage_misses(down, held.count(False))
        return held

    def batch_set(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[bool]:
        """Write each value (a contiguous CPU tensor, any dtype) unless LMCache holds its key."""
        cks = [self.chunk_key(k) for k in keys]
        if len(values) != len(cks):
            raise ValueError(f"keys and values must have the same length, got {len(cks)} and {len(values)}")
        bufs = [_byte_view(v, "values") for v in values]
        if not cks:
            return []
        if not self.config.writes_pages:
            return self.batch_exists(keys)  # MLA: rank 0 writes the page every rank shares
        first: dict[Any, int] = {}
        for i, k in enumerate(cks):
            first.setdefault(k, i)  # a key twice in one batch is written once
        uniq = list(first.values())
        # the digest is taken here, so a page changed under an abandoned write reads as corrupt
        headers = {i: PageDigest.of(bufs[i]).to_bytes() + key_tag(cks[i]) for i in uniq}
        outcome, down = self._op_call("put", len(uniq), lambda: self._put([cks[i] for i in uniq],
                                                                          [bufs[i] for i in uniq],
                                                                          [headers[i] for i in uniq]))
        held: dict[Any, bool] = {}
        for r, i in enumerate(uniq):
            state = outcome[r] if outcome is not None else "failed"
            held[cks[i]] = state in ("written", "present")
            if state == "written":
                self._count(sets=1, bytes_written=bufs[i].numel())
            elif state == "present":
                self._count(skipped_existing=1)
            elif state == "full":
                self._log_once("full", "lmcache storage: LMCache's local CPU memory has no room for a page "
                               "(max_local_cpu_size); pages not written")
            elif state == "lost":
                self._log_once("lost", "lmcache storage: a written page is held by no tier afterwards (the disk "
                               "tier full, or a remote write failed); it is not reported held")
            elif state == "stuck":
                self._fault("stuck", 1, f"LMCache's write of {cks[i].to_string()} did not finish within "
                            f"op_timeout_s / 2 = {self.settings.op_timeout_s / 2:g} s (a disk write that failed "
                            "stays in flight in LMCache)")
        self._outage_misses(down, sum(not h for h in held.values()))
        return [held[k] for k in cks]

    def batch_get(self, keys: Sequence[str],
                  targets: Optional[Sequence[torch.Tensor]] = None) -> list[Optional[torch.Tensor]]:
        """Verified pages: ``targets[i]`` filled in place (its size is the expected size), or a
        new ``uint8`` tensor; None on a miss, fault or corrupt page."""
        cks = [self.chunk_key(k) for k in keys]
        if targets is not None and len(targets) != len(cks):
            raise ValueError(f"keys and targets must have the same length, got {len(cks)} and {len(targets)}")
        views = None if targets is None else [_byte_view(t, "targets") for t in targets]
        out: list[Optional[torch.Tensor]] = [None] * len(cks)
        if not cks:
            return out
        self._count(gets=len(cks))
        read, down = self._op_call("get", len(cks), lambda: [self._read_isolated(k) for k in cks])
        for i, got in enumerate(read if read is not None else [None] * len(cks)):
            if isinstance(got, str):  # "unreadable": held by a tier that cannot return it
                self._fault("unreadable", 1, f"{cks[i].to_string()} is held but could not be read")
                self._drop_local(cks[i])
                continue
            if isinstance(got, _ReadError):
                self._fault("read", 1, f"reading {cks[i].to_string()} raised {type(got.exc).__name__}: {got.exc}")
                self._drop_local(cks[i])
                continue
            if got is None:
                continue
            try:
                page = open_object(got, cks[i])
                if views is not None and page.numel() != views[i].numel():
                    raise CorruptPage(f"page is {page.numel()} bytes, expected {views[i].numel()}")
            except CorruptPage as exc:
                self._bad_object(cks[i], str(exc))
                continue
            if views is None:
                out[i] = page.clone()
            else:
                views[i].copy_(page)
                out[i] = targets[i]
            self._count(hits=1, bytes_read=page.numel())
        misses = sum(o is None for o in out)
        self._count(misses=misses)
        self._outage_misses(down if read is not None else False, misses)
        return out

    # -- for other users of this engine (hicache.storage.lmcache_interop) -------------------
    def call_engine(self, what: str, n: int, fn: Callable[[], Any]) -> Any:
        """``fn()`` (which calls into LMCache) under ``op_timeout_s`` on this backend's
        threads, after reconnecting the remote tier if due; None on an exception or overrun
        (``n`` faults counted and logged, as a miss)."""
        return self._op_call(what, n, fn)[0]

    def wait_written(self, keys: list[Any]) -> set[Any]:
        """Wait (at most half of ``op_timeout_s``) until no tier has a write of the chunk
        keys ``keys`` in flight; the keys still in flight then."""
        return self._wait_written(keys)

    def log_fault(self, kind: str, n: int, msg: str) -> None:
        """Count ``n`` faults and log ``msg`` (once per ``kind`` as a warning)."""
        self._fault(kind, n, msg)

    # -- lifecycle -------------------------------------------------------------------------
    def clear(self) -> None:
        """Remove this namespace's pages (MHA: this rank's) from LMCache's local tiers; a
        remote store keeps them (LMCache's server has no delete command)."""
        def mine(k: Any) -> bool:
            return k.model_name == self.namespace and (self.config.is_mla or (
                k.world_size == self.config.tp_size and k.worker_id == self.config.tp_rank))

        self._call("clear", 0, lambda: self._remove_local(mine))
        if self._engine.remote.present:
            self._log_once("clear-remote", "lmcache storage: clear removes pages from LMCache's local tiers only; "
                           "its remote server has no delete command, so remote copies stay")

    def close(self) -> None:
        """Release the shared engine (closed with its last user); stored remote pages stay."""
        if self._closed:
            return
        self._closed = True
        self._caller.wait_idle(self.settings.op_timeout_s)
        release_engine(self._engine)

    # -- calls into LMCache (on the bounded caller's threads) ------------------------------
    def _put(self, cks: list[Any], bufs: list[torch.Tensor], headers: list[bytes]) -> list[str]:
        """Write the keys LMCache lacks; per key "written", "present", "full", "lost" or
        "stuck" (a write LMCache still has in flight after half of ``op_timeout_s``)."""
        engine, manager = self._engine, self._engine.manager
        mine, theirs = self._claim(cks)
        try:
            for ev in theirs.values():
                ev.wait(self.settings.op_timeout_s)
            state: dict[Any, str] = {}
            todo: list[int] = []
            for i, k in enumerate(cks):
                if k not in mine:
                    continue  # another thread wrote it: looked up below
                if k not in engine.rewrite and manager.contains(k) is not None:
                    state[k] = "present"
                elif k in engine.stuck and self._in_flight(k):
                    state[k] = "stuck"  # LMCache takes no new write of it: do not wait again
                else:
                    engine.stuck.discard(k)
                    state[k] = "lost"
                    todo.append(i)
            put_keys, objs = self._objects([cks[i] for i in todo], [bufs[i] for i in todo],
                                           [headers[i] for i in todo], state)
            if put_keys:
                manager.batched_put(put_keys, objs)  # takes over the allocation's reference
                pending = self._wait_written(put_keys)
                for k in put_keys:
                    if k in pending:
                        state[k] = "stuck"
                        engine.stuck.add(k)
                    elif manager.contains(k) is not None:
                        state[k] = "written"
                        engine.rewrite.discard(k)
            for k in theirs:
                state[k] = ("present" if manager.contains(k) is not None else
                            "stuck" if k in engine.stuck else "lost")
            return [state[k] for k in cks]
        finally:
            self._release(mine)

    def _objects(self, cks: list[Any], bufs: list[torch.Tensor], headers: list[bytes],
                 state: dict[Any, str]) -> tuple[list[Any], list[Any]]:
        """LMCache memory objects holding the pages (header, then page), from its allocator;
        a key it has no room for is marked "full"."""
        manager = self._engine.manager
        keys, objs = [], []
        try:
            for ck, buf, header in zip(cks, bufs, headers):
                obj = manager.allocate(torch.Size([1, 1, 1, OBJECT_HEADER_BYTES + buf.numel()]), torch.uint8,
                                       fmt=self._fmt, eviction=True, busy_loop=False)
                if obj is None:
                    state[ck] = "full"
                    continue
                objs.append(obj)
                flat = obj.tensor.view(-1)
                flat[:OBJECT_HEADER_BYTES].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
                flat[OBJECT_HEADER_BYTES:].copy_(buf)
                keys.append(ck)
        except BaseException:
            for obj in objs:
                obj.ref_count_down()  # back to LMCache's allocator
            raise
        return keys, objs

    def _claim(self, cks: list[Any]) -> tuple[dict[Any, threading.Event], dict[Any, threading.Event]]:
        """Claim the keys no other thread of this process is writing; the others' events."""
        engine = self._engine
        mine: dict[Any, threading.Event] = {}
        theirs: dict[Any, threading.Event] = {}
        with engine.write_lock:
            for k in cks:
                ev = engine.writing.get(k)
                if ev is None:
                    ev = engine.writing[k] = threading.Event()
                    mine[k] = ev
                else:
                    theirs[k] = ev
        return mine, theirs

    def _release(self, mine: dict[Any, threading.Event]) -> None:
        with self._engine.write_lock:
            for k, ev in mine.items():
                if self._engine.writing.get(k) is ev:
                    del self._engine.writing[k]
                ev.set()

    def _in_flight(self, ck: Any) -> bool:
        return any(b.exists_in_put_tasks(ck) for b in self._engine.manager.storage_backends.values())

    def _wait_written(self, keys: list[Any]) -> set[Any]:
        """Wait until no tier has a write of ``keys`` in flight (disk and remote write
        later), at most half of ``op_timeout_s`` (so the call itself returns in time to say
        so); the keys still in flight then."""
        pending = list(keys)
        deadline = time.monotonic() + self.settings.op_timeout_s / 2
        while pending:
            pending = [k for k in pending if self._in_flight(k)]
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
        return set(pending)

    def _read(self, ck: Any) -> Optional[Any]:
        """The object under ``ck`` (a copy), None when no tier holds it, or "unreadable"
        when a tier holds it but returns nothing, twice (once could be a write landing
        between the read and the look-up)."""
        manager = self._engine.manager
        obj = manager.get(ck)
        if obj is None and manager.contains(ck) is not None:
            obj = manager.get(ck)
            if obj is None:
                return "unreadable" if manager.contains(ck) is not None else None
        if obj is None:
            return None
        try:
            return obj.tensor.reshape(-1).clone()
        finally:
            obj.ref_count_down()

    def _read_isolated(self, ck: Any) -> Any:
        """``_read``, with an exception of LMCache's (a disk file gone: a KeyError in its
        disk tier) returned as a ``_ReadError``, so it costs this key only."""
        try:
            return self._read(ck)
        except Exception as exc:
            return _ReadError(exc)

    def _remove_local(self, select: Callable[[Any], bool]) -> None:
        for name, backend in self._engine.local_tiers():
            if hasattr(backend, "get_keys"):
                keys = backend.get_keys()
            else:  # LocalDiskBackend lists no keys: its index is its `dict`
                with backend.disk_lock:
                    keys = list(backend.dict.keys())
            chosen = [k for k in keys if select(k)]
            if chosen:
                self._engine.manager.batched_remove(chosen, locations=[name])

    def _drop_local(self, ck: Any) -> None:
        """Forget a bad chunk: removed from the local tiers, rewritten on the next write."""
        self._call("remove", 0, lambda: self._remove_local(lambda k: k == ck))
        if self._engine.remote.present:
            self._engine.rewrite.add(ck)

    def _bad_object(self, ck: Any, why: str) -> None:
        self._count(corrupt=1)
        self._fault("corrupt", 1, f"corrupt page object {ck.to_string()}: {why}")
        self._drop_local(ck)

    def _op_call(self, what: str, n: int, fn: Callable[[], Any]) -> tuple[Any, bool]:
        """``_call`` of ``fn`` after reconnecting the remote tier if it is due; also whether
        the remote tier was out of service for the call."""
        remote = self._engine.remote

        def run() -> tuple[Any, bool]:
            remote.maybe_reconnect()
            down = remote.out_of_service
            return fn(), down

        got = self._call(what, n, run)
        return got if got is not None else (None, False)

    def _outage_misses(self, down: bool, n: int) -> None:
        """Misses and unwritten pages while the remote tier is out of service are faults:
        the remote store may hold or take them."""
        if down and n:
            self._fault("remote-unavailable", n, "the remote tier is out of service")

    def _call(self, what: str, n: int, fn: Callable[[], Any]) -> Any:
        """``fn()`` under the deadline; None on an exception or an overrun (``n`` faults
        counted). Remote faults LMCache swallowed during the call are counted too."""
        if self._closed:
            self._fault("closed", n, f"{what} on a closed backend")
            return None
        remote = self._engine.remote
        before = remote.faults
        try:
            return self._caller.call(fn, self.settings.op_timeout_s)
        except CallTimeout as exc:
            self._count(faults=remote.faults - before)
            before = remote.faults
            if remote.present:  # a hung server stalls LMCache's event loop: stop asking it for a while
                remote.take_out(str(exc))
            self._fault(what, n, f"{what}: {exc}")
        except Exception as exc:
            self._fault(what, n, f"{what} raised {type(exc).__name__}: {exc}")
        finally:
            self._count(faults=remote.faults - before)
        return None

    def _fault(self, kind: str, n: int, msg: str) -> None:
        if n:
            self._count(faults=n)
        self._log_once(kind, "lmcache storage: " + msg + " (served as a miss; further faults of this kind are "
                       "logged at debug level)")

    def _log_once(self, kind: str, msg: str) -> None:
        with self._stats_lock:
            first = kind not in self._logged
            self._logged.add(kind)
        logger.log(logging.WARNING if first else logging.DEBUG, msg)


class _ReadError:
    """An exception LMCache raised reading one key."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def key_tag(ck: Any) -> bytes:
    """The 32 bytes an object carries to say whose it is: SHA-256 of the chunk key's string."""
    return hashlib.sha256(ck.to_string().encode()).digest()


def open_object(obj: torch.Tensor, ck: Any) -> torch.Tensor:
    """The page inside object ``obj`` (``uint8 [n]``, a view) stored under ``ck``;
    CorruptPage when the object is short, carries another key's tag, or fails its digest."""
    if obj.numel() < OBJECT_HEADER_BYTES:
        raise CorruptPage(f"object is {obj.numel()} bytes, shorter than its {OBJECT_HEADER_BYTES}-byte header")
    raw = obj.numpy()
    digest = PageDigest.from_bytes(raw[:HEADER_BYTES])
    if raw[HEADER_BYTES:OBJECT_HEADER_BYTES].tobytes() != key_tag(ck):
        raise CorruptPage("the object carries another key's tag")
    page = obj[OBJECT_HEADER_BYTES:]
    digest.verify(page)
    return page


def _byte_view(t: Any, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
        got = type(t).__name__ if not isinstance(t, torch.Tensor) else f"{t.device} tensor"
        raise ValueError(f"{name} must be contiguous CPU tensors, got {got}")
    return t.view(torch.uint8).reshape(-1)
