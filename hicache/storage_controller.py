"""StorageController: moves KV pages between the host pool (L2) and an L3 backend on its own
threads, for the HiRadixTree's storage paths (``hicache.radix_storage``).

* A **prefetch thread** first asks the backend which of the operation's pages it holds
  (``batch_exists``; the first hole ends the prefix, and a continuation shorter than the
  threshold beyond what the tree held is not fetched), then reads those pages in batches of
  ``io_batch_pages`` into a staging buffer (``HiCacheStorage.batch_get``) and copies each
  batch into host pages the tree reserved; after each batch it publishes how many *leading*
  pages have arrived (a miss or a fault stops the operation there: a prefix cannot have
  holes). The scheduler only enqueues and later polls: no backend call runs on its thread.
* A **backup thread** writes host pages of backed-up nodes to L3: it asks ``batch_exists``
  first and writes only the pages the backend lacks, in batches of ``io_batch_pages``
  copied into a staging buffer (``batch_set``); ranks that do not write (MLA pages on
  ``tp_rank != 0``) complete their operation without I/O, so every rank's tree retires the
  same operations.

Every backend call runs under ``backend_call_timeout_s`` (``hicache.storage_calls``): a call
past it is abandoned and served as a miss (``l3_call_timeouts``), so no operation waits on a
hung backend for longer. A call is given only keys and a staging buffer of the controller
(``hicache.storage_staging``), never host-pool memory, so a late answer can touch nothing the
tree uses (the module docstring of ``hicache.storage_calls`` says how).

Only the scheduler thread touches the tree, the host allocator and the operations'
reservations; the threads touch only page *contents* and the operation's progress fields
(under ``self._cv``). An operation is ``done`` once its thread will never touch its pages
again: that is the moment its unused reservation may be released. A prefetch whose read
overran its deadline is done at that deadline (the abandoned read holds only its staging
buffer).

Backend faults (an exception out of a backend, a call past its deadline, a page that comes
back missing or corrupt) end the operation early and are counted; the first of each kind is
logged, later ones at debug level. They surface as a shorter prefetched prefix (a cache
miss) or an unwritten page, never as an exception on the scheduler thread.
"""
from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Hashable, Optional

import torch

from hicache.config import PREFETCH_CAPACITY_FRACTION, PREFETCH_DEFAULTS, PREFETCH_POLICIES
from hicache.storage_calls import (DEFAULT_BACKEND_CALL_TIMEOUT_S, MAX_ABANDONED_CALLS, StorageCalls,
                                   StorageCallSkipped, StorageCallTimeout)
from hicache.storage_staging import StagingBuffers

if TYPE_CHECKING:  # pragma: no cover
    from hicache.config import HiCacheConfig
    from hicache.host_pool import HostKVPool
    from hicache.storage.base import HiCacheStorage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoragePolicy:
    """How the tree uses L3 (``--hicache-storage-prefetch-policy`` and the prefetch keys of
    ``--hicache-storage-backend-extra-config``, SGLang's names and defaults).

    ``best_effort``: the scheduler takes whatever pages have arrived when it checks, and
    never waits for more; ``wait_complete``: it waits for the whole fetch (which ends: every
    backend call is bounded by ``backend_call_timeout_s``); ``timeout``: it waits until the
    fetch completes or ``prefetch_timeout_base + prefetch_timeout_per_ki_token * tokens /
    1024`` seconds have passed since it was issued (``tokens``: what the prefetch thread's
    existence check found to fetch; until that check returns, the base alone).
    """

    prefetch_policy: str = "best_effort"
    prefetch_threshold: int = PREFETCH_DEFAULTS["prefetch_threshold"]
    """Tokens a prefix must continue in L3 beyond the tree's L1/L2 hit to be fetched."""
    prefetch_timeout_base: float = PREFETCH_DEFAULTS["prefetch_timeout_base"]
    prefetch_timeout_per_ki_token: float = PREFETCH_DEFAULTS["prefetch_timeout_per_ki_token"]
    io_batch_pages: int = 8
    """Pages per backend read or write call: the granularity at which a prefetch's progress
    shows, and the size of a staging buffer, what one abandoned call holds (see
    ``hicache.storage_staging``)."""
    backend_call_timeout_s: float = DEFAULT_BACKEND_CALL_TIMEOUT_S
    """The longest one backend call of the L3 threads (an existence check, a batch of reads
    or of writes) may take; past it the call is abandoned and served as a miss."""
    write_through: bool = True
    """Write host-backed pages to L3 after their host backup completes."""
    prefetch_capacity_limit: Optional[int] = None
    """Host tokens that prefetches in flight may reserve together; a prefetch that would
    exceed it is not started (``prefetch_rate_limited``). None: SGLang's default,
    ``prefetch_capacity_fraction * host pool slots``."""
    prefetch_capacity_fraction: float = PREFETCH_CAPACITY_FRACTION

    def __post_init__(self) -> None:
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"prefetch_policy must be one of {PREFETCH_POLICIES}, got {self.prefetch_policy!r}")
        for name in ("prefetch_threshold", "io_batch_pages"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "prefetch_threshold" else 1):
                raise ValueError(f"{name} must be an int >= {0 if name == 'prefetch_threshold' else 1}, got {v!r}")
        cap = self.prefetch_capacity_limit
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 0):
            raise ValueError(f"prefetch_capacity_limit must be an int >= 0 (host tokens) or None (the default, "
                             f"prefetch_capacity_fraction of the host pool), got {cap!r}")
        frac = self.prefetch_capacity_fraction
        if not isinstance(frac, (int, float)) or isinstance(frac, bool) or not 0 < frac <= 1:
            raise ValueError(f"prefetch_capacity_fraction must be a number in (0, 1], got {frac!r}")
        for name in ("prefetch_timeout_base", "prefetch_timeout_per_ki_token"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                # NaN would compare False against every elapsed time: the timeout policy
                # would wait forever
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {v!r}")
        v = self.backend_call_timeout_s
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"backend_call_timeout_s must be a finite number of seconds > 0, got {v!r}")

    @classmethod
    def from_config(cls, config: "HiCacheConfig") -> "StoragePolicy":
        """Policy from ``--hicache-storage-prefetch-policy`` and the extra config's
        ``prefetch_threshold`` / ``prefetch_timeout_base`` / ``prefetch_timeout_per_ki_token``,
        ``prefetch_capacity_limit`` / ``prefetch_capacity_fraction`` and
        ``backend_call_timeout_s``."""
        opts = config.prefetch_options()
        try:
            return cls(prefetch_policy=config.hicache_storage_prefetch_policy, **opts)
        except ValueError as e:
            raise ValueError(f"--hicache-storage-backend-extra-config: {e}") from e

    def timeout_for(self, tokens: int) -> float:
        """Seconds the ``timeout`` policy waits for a fetch of ``tokens`` tokens."""
        return self.prefetch_timeout_base + self.prefetch_timeout_per_ki_token * tokens / 1024

    def capacity_tokens(self, host_slots: int) -> int:
        """Host tokens prefetches in flight may reserve together, for a host pool of
        ``host_slots`` token slots."""
        if self.prefetch_capacity_limit is not None:
            return self.prefetch_capacity_limit
        return int(self.prefetch_capacity_fraction * host_slots)


@dataclass(eq=False)
class PrefetchOp:
    """One request's fetch of up to ``len(keys)`` pages into reserved host slots.

    ``host_indices`` int64 [len(keys) * page_size]: the reservation (the tree releases it or
    adopts part of it exactly once). ``tokens``: the tokens those pages would hold,
    continuing ``start_node``'s path; ``hash_keys``: their page hash chain (the tree's
    keys). The thread's existence check sets ``planned_pages`` (the leading pages L3 holds,
    0 when too few continue beyond the ``held_tokens`` the tree had) and ``timeout_s``.
    """

    req_id: Hashable
    keys: list[str]
    host_indices: torch.Tensor
    start_node: Any
    tokens: tuple[int, ...]
    hash_keys: list[str]
    timeout_s: float
    """The ``timeout`` policy's wait: the base until the existence check sizes the fetch."""
    held_tokens: int = 0
    """Tokens of ``tokens`` the tree already held when the prefetch was issued."""
    issued_at: float = field(default_factory=time.monotonic)
    planned_pages: Optional[int] = None
    """Leading pages L3 holds and the thread fetches (None: existence not checked yet)."""
    below_threshold: bool = False
    completed_pages: int = 0
    """Leading pages read and verified (grows only; pages below it are never written again)."""
    done: bool = False
    """The thread will not touch this op's pages again (finished, stopped or cancelled)."""
    cancel: bool = False
    error: Optional[str] = None
    released: bool = False
    """The tree has settled the reservation (its single release path ran)."""

    @property
    def num_pages(self) -> int:
        return len(self.keys)


@dataclass(eq=False)
class BackupOp:
    """Write of host pages to L3. ``nodes``: the tree nodes covered (marked in L3 when it
    succeeds); ``lock_node``: the node whose host lock keeps every page alive in flight."""

    op_id: int
    keys: list[str]
    host_pages: list[int]
    nodes: list[Any]
    lock_node: Any
    ok: bool = False
    done: bool = False
    cancel: bool = False
    written: int = 0
    skipped: int = 0


class StorageController:
    """Background L3 I/O for one tree. Built by ``HiRadixTree.attach_storage_backend``."""

    def __init__(self, storage: "HiCacheStorage", host_pool: "HostKVPool", policy: StoragePolicy) -> None:
        if getattr(host_pool, "layout", None) == "layer_first":
            raise ValueError("an L3 storage backend needs a host pool with a page layout: --hicache-mem-layout "
                             "(or --host-layout) page_first, page_first_direct or page_head, not layer_first")
        storage.register_host_pool(host_pool)
        self.storage = storage
        self.host_pool = host_pool
        self.policy = policy
        self.page_size = host_pool.page_size
        self.page_bytes = getattr(host_pool, "page_nbytes", host_pool.spec.token_bytes * host_pool.page_size)
        cfg = storage.config
        self.tp_rank, self.is_mla, self.writes_pages = cfg.tp_rank, cfg.is_mla, cfg.writes_pages
        self._cv = threading.Condition()
        self._ids = itertools.count(1)
        self._pending = 0  # submitted ops not yet done (both threads)
        self._accepting = True
        self._logged: set[str] = set()
        self.counters = {
            "l3_pages_fetched": 0, "l3_bytes_fetched": 0, "l3_fetch_miss_pages": 0, "l3_fetch_faults": 0,
            "l3_pages_written": 0, "l3_bytes_written": 0, "l3_write_skipped_existing": 0, "l3_write_faults": 0,
            "l3_write_incomplete_ops": 0, "l3_exists_faults": 0, "l3_call_timeouts": 0, "l3_calls_skipped": 0,
        }
        self.calls = StorageCalls(policy.backend_call_timeout_s)
        # One set per thread (reads: prefetch thread; writes: backup thread), see hicache.storage_staging.
        page_record = host_pool.page_tensor(0).view(torch.uint8).numel()
        pinned = bool(getattr(host_pool, "pin_memory", False))
        self._read_stages, self._write_stages = (
            StagingBuffers(MAX_ABANDONED_CALLS + 1, policy.io_batch_pages, page_record, pinned) for _ in range(2))
        self.backup_acks: "queue.Queue[BackupOp]" = queue.Queue()
        self._prefetch_q: "queue.Queue[Optional[PrefetchOp]]" = queue.Queue()
        self._backup_q: "queue.Queue[Optional[BackupOp]]" = queue.Queue()
        self._threads = [
            threading.Thread(target=self._loop, args=(self._prefetch_q, self._run_prefetch),
                             name="hicache-l3-prefetch", daemon=True),
            threading.Thread(target=self._loop, args=(self._backup_q, self._run_backup),
                             name="hicache-l3-backup", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ keys, existence
    def storage_keys(self, hash_keys: list[str]) -> list[str]:
        """Object names of pages with tree keys ``hash_keys`` (rank-suffixed for MHA)."""
        from hicache.storage.keys import storage_key

        return [storage_key(h, self.tp_rank, self.is_mla) for h in hash_keys]

    def leading_hits(self, keys: list[str]) -> int:
        """Leading keys the backend holds (one ``batch_exists``; the first hole ends the
        prefix). A raising backend counts as holding none. Runs on the prefetch thread."""
        if not keys:
            return 0
        try:
            found = self._call("batch_exists", lambda: list(self.storage.batch_exists(keys)))
        except Exception as e:  # the contract says misses, not exceptions: degrade anyway
            self._fault("l3_exists_faults", f"batch_exists: {_describe(e)}")
            return 0
        if len(found) != len(keys):
            self._fault("l3_exists_faults", f"batch_exists returned {len(found)} results for {len(keys)} keys")
            return 0
        n = 0
        while n < len(keys) and bool(found[n]):
            n += 1
        return n

    # ------------------------------------------------------------------ submission
    def next_op_id(self) -> int:
        return next(self._ids)

    def submit_prefetch(self, op: PrefetchOp) -> None:
        self._submit(self._prefetch_q, op)

    def submit_backup(self, op: BackupOp) -> None:
        self._submit(self._backup_q, op)

    def _submit(self, q: "queue.Queue", op: Any) -> None:
        with self._cv:
            if not self._accepting:
                raise RuntimeError("storage controller is detaching: no new operations")
            self._pending += 1
        q.put(op)

    def can_terminate(self, op: PrefetchOp) -> bool:
        """Whether the policy lets the scheduler settle ``op`` now."""
        policy = self.policy.prefetch_policy
        if policy == "best_effort":
            return True
        with self._cv:
            if op.done:
                return True
        return policy == "timeout" and time.monotonic() - op.issued_at >= op.timeout_s

    def wait_op(self, op: Any, timeout: Optional[float]) -> bool:
        """Block until ``op`` is done (True) or ``timeout`` seconds pass (False)."""
        with self._cv:
            return self._cv.wait_for(lambda: op.done, timeout=timeout)

    def cancel(self, op: Any) -> None:
        """Ask the thread to stop ``op`` at its next batch boundary."""
        with self._cv:
            op.cancel = True

    def stop(self, op: PrefetchOp) -> tuple[int, bool]:
        """Cancel ``op`` and read its progress atomically: (leading pages arrived, whether
        its I/O has finished). Pages below the first value are final."""
        with self._cv:
            op.cancel = True
            return op.completed_pages, op.done

    def backup_acks_ready(self) -> int:
        return self.backup_acks.qsize()

    def pop_backup_ack(self) -> BackupOp:
        return self.backup_acks.get_nowait()

    # ------------------------------------------------------------------ threads
    def _loop(self, q: "queue.Queue", run) -> None:
        while True:
            op = q.get()
            if op is None:
                return
            try:
                run(op)
            finally:
                if isinstance(op, BackupOp):  # queued before done: an idle controller has every ack queued
                    self.backup_acks.put(op)
                with self._cv:
                    op.done = True
                    self._pending -= 1
                    self._cv.notify_all()

    def _call(self, what: str, fn: Callable[[], Any], on_return: Optional[Callable[[], None]] = None) -> Any:
        """``fn()`` under the deadline (``StorageCalls.run``); an overrun or a skipped call is
        counted here and raised."""
        try:
            return self.calls.run(what, fn, on_return)
        except StorageCallTimeout:
            with self._cv:
                self.counters["l3_call_timeouts"] += 1
            raise
        except StorageCallSkipped:
            with self._cv:
                self.counters["l3_calls_skipped"] += 1
            raise

    def _fault(self, counter: str, message: str) -> None:
        with self._cv:
            self.counters[counter] += 1
            first = counter not in self._logged
            self._logged.add(counter)
        (logger.warning if first else logger.debug)("hicache L3: %s (served as a cache miss; counted in %s)",
                                                    message, counter)

    def _plan_prefetch(self, op: PrefetchOp) -> int:
        """The existence check of ``op`` (on this thread, never the scheduler's): how many
        leading pages to fetch. Publishes ``planned_pages`` and the sized timeout."""
        with self._cv:
            if op.cancel:
                return 0
        hits = self.leading_hits(op.keys)
        below = hits * self.page_size - op.held_tokens < self.policy.prefetch_threshold or hits == 0
        planned = 0 if below else hits
        with self._cv:
            op.planned_pages = planned
            op.below_threshold = below
            op.timeout_s = self.policy.timeout_for(planned * self.page_size)
        return planned

    def _run_prefetch(self, op: PrefetchOp) -> None:
        ps = self.page_size
        planned = self._plan_prefetch(op)
        pages = [int(p) for p in (op.host_indices[::ps] // ps).tolist()]
        step = self.policy.io_batch_pages
        i = 0
        while i < planned:
            j = min(planned, i + step)
            good = self._read_batch(op, i, j, pages[i:j])
            if good is None:
                return
            with self._cv:
                op.completed_pages = i + good
                self.counters["l3_pages_fetched"] += good
                self.counters["l3_bytes_fetched"] += good * self.page_bytes
            if good < j - i:
                op.error = f"page {i + good} of {planned} missing or corrupt"
                self._fault("l3_fetch_miss_pages", f"prefetch of request {op.req_id!r}: {op.error}")
                return
            i = j

    def _read_batch(self, op: PrefetchOp, i: int, j: int, host_pages: list[int]) -> Optional[int]:
        """Read pages ``[i, j)`` of ``op`` into a staging buffer under the deadline, then copy
        the leading pages that arrived intact into ``host_pages``; returns how many. None
        when ``op`` was cancelled, or after a fault (counted): an abandoned read keeps its
        staging buffer, and nothing it delivers is ever copied."""
        with self._cv:
            if op.cancel:
                return None
        keys = op.keys[i:j]
        lease = None
        try:
            lease = self._read_stages.lease()
            targets = [lease.page(r) for r in range(j - i)]
            got = self._call("batch_get", lambda: list(self.storage.batch_get(keys, targets)), lease.give_to_call())
            if len(got) != j - i:
                raise RuntimeError(f"batch_get returned {len(got)} results for {j - i} keys")
            good = 0
            while good < j - i and _filled_in_place(got[good], targets[good]):
                good += 1
            for r in range(good):
                self.host_pool.page_tensor(host_pages[r]).view(torch.uint8).view(-1).copy_(targets[r])
            return good
        except Exception as e:
            op.error = _describe(e)
            self._fault("l3_fetch_faults", f"batch_get: {op.error}")
            return None
        finally:
            if lease is not None:
                lease.release()

    def _run_backup(self, op: BackupOp) -> None:
        if not self.writes_pages:  # MLA pages: rank 0 writes them for every rank
            op.ok = True
            return
        with self._cv:
            if op.cancel:
                return
        try:
            have = self._call("batch_exists", lambda: list(self.storage.batch_exists(op.keys)))
            if len(have) != len(op.keys):
                raise RuntimeError(f"batch_exists returned {len(have)} results for {len(op.keys)} keys")
            todo = [i for i, h in enumerate(have) if not h]
            op.skipped = len(op.keys) - len(todo)
            with self._cv:
                self.counters["l3_write_skipped_existing"] += op.skipped
            step = self.policy.io_batch_pages
            for c in range(0, len(todo), step):
                part = todo[c:c + step]
                stored = self._write_batch([op.keys[i] for i in part], [op.host_pages[i] for i in part])
                op.written += stored
                with self._cv:
                    self.counters["l3_pages_written"] += stored
                    self.counters["l3_bytes_written"] += stored * self.page_bytes
        except Exception as e:
            self._fault("l3_write_faults", f"writing {len(op.keys)} page(s): {_describe(e)}")
            return
        op.ok = op.written == len(todo)
        if not op.ok:
            self._fault("l3_write_incomplete_ops", f"{len(todo) - op.written} of {len(todo)} page(s) not stored")

    def _write_batch(self, keys: list[str], host_pages: list[int]) -> int:
        """Store ``host_pages`` under ``keys`` from a staging copy (``batch_set``) under the
        deadline; returns pages stored. The copy is made while the tree's host lock keeps the
        pages valid; an abandoned call keeps its staging buffer until it returns."""
        pool = self.host_pool
        lease = self._write_stages.lease()
        try:
            values = [lease.page(r) for r in range(len(keys))]
            for v, p in zip(values, host_pages):
                v.copy_(pool.page_tensor(int(p)).view(torch.uint8).view(-1))
            res = self._call("batch_set", lambda: list(self.storage.batch_set(keys, values)), lease.give_to_call())
        finally:
            lease.release()
        if len(res) != len(keys):
            raise RuntimeError(f"batch_set returned {len(res)} results for {len(keys)} keys")
        return sum(1 for r in res if r)

    # ------------------------------------------------------------------ lifecycle
    def wait_idle(self, timeout: Optional[float]) -> bool:
        """Block until every submitted operation is done (True) or ``timeout`` passes."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending == 0, timeout=timeout)

    def in_flight(self) -> int:
        with self._cv:
            return self._pending

    def stop_accepting(self) -> None:
        with self._cv:
            self._accepting = False

    def shutdown(self, join_timeout: float = 5.0) -> None:
        """Stop both threads after the operations queued before this call. A thread stuck in
        a backend call is left behind (daemon): nothing the tree owns waits for it."""
        self.stop_accepting()
        self._prefetch_q.put(None)
        self._backup_q.put(None)
        for t in self._threads:
            t.join(timeout=join_timeout)

    def stats(self) -> dict[str, int]:
        with self._cv:
            out = dict(self.counters)
            out["l3_ops_in_flight"] = self._pending
        out["l3_calls_abandoned"] = self.calls.abandoned
        out["l3_stages_retired"] = self._read_stages.retired + self._write_stages.retired
        return out


def _filled_in_place(got: Any, target: torch.Tensor) -> bool:
    """Whether a ``batch_get`` result is ``target`` filled in place (the contract). Anything
    else (None, a tensor of its own) is a miss: the staging row holds no page then."""
    return (isinstance(got, torch.Tensor) and got.data_ptr() == target.data_ptr()
            and got.numel() * got.element_size() == target.numel())


def _describe(e: BaseException) -> str:
    """A fault for the log: a deadline's own message, else the exception's repr."""
    return str(e) if isinstance(e, (StorageCallTimeout, StorageCallSkipped)) else f"raised {e!r}"
