"""The HiRadixTree's L3 paths (mixed into :class:`hicache.radix_tree.HiRadixTree`), after
SGLang's ``HiRadixCache``: ``prefetch_from_storage`` / ``check_prefetch_progress``,
``write_backup_storage`` and ``attach_storage_backend`` / ``detach_storage_backend``. The
I/O runs on :class:`hicache.storage_controller.StorageController`'s threads; everything
here runs on the scheduler thread.

Prefetch::

    m = tree.match_prefix(tokens)
    tree.prefetch_from_storage(rid, m.last_backed_node, tokens[m.backed_length:])
    ...                                    # later scheduler steps
    if tree.check_prefetch_progress(rid):  # per policy; pages that arrived are now host nodes
        m = tree.match_prefix(tokens)      # longer host hit

Reservations: a prefetch reserves host slots for every whole page of the tokens it is
given (as SGLang does: the existence check runs later, on the prefetch thread, so the
scheduler never waits on the backend; the thread fetches only the leading pages L3 holds).
Prefetches in flight reserve at most ``prefetch_capacity_limit`` host tokens together
(``prefetch_tokens_occupied``); one that would exceed it is not started and counted in
``prefetch_rate_limited``: the request computes its prefix. The reservation is settled exactly once, in ``_settle_prefetch``:
the pages that arrived (the TP ranks' minimum) are inserted into the tree as host nodes
(adopted; duplicates of pages the tree already holds are released), the rest is released
at once or, when the I/O thread may still be writing into it, as soon as that call
returns (an *orphan*, released by ``check_storage_events``). A backend call is never given
host pages (reads land in the controller's staging buffers, ``hicache.storage_staging``),
so a read that overran its deadline holds none: the prefetch's I/O ends at that deadline
and its whole unused reservation is released. ``stats()`` reports
``prefetch_reserved_pages`` (issued - adopted - released); ``storage_leaks()`` compares it
with what live operations hold.

Writes: once a node's host copy is complete (its backup acknowledged, or a caller that
wrote host pages itself calls ``write_backup_storage``), its pages go to L3 in the
background; the node's path stays host-locked until the write is acknowledged, so the
pages being read cannot be evicted and reused.

Tensor parallelism: every rank calls these methods in the same order; the ranks agree
(``all_reduce(MIN)``) on whether a reservation succeeded, on whether a prefetch may be settled
and on how many pages it contributes, on how many write acks to retire and on their
outcome, and on how many orphans to release, so every rank's tree stays identical.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Hashable, Optional, Sequence

import torch

from hicache import tp_sync
from hicache.radix_node import _EMPTY, TreeNode, _as_tokens
from hicache.storage.keys import page_hash_chain
from hicache.storage_controller import BackupOp, PrefetchOp, StorageController, StoragePolicy

if TYPE_CHECKING:  # pragma: no cover
    from hicache.storage.base import HiCacheStorage

_STORAGE_COUNTERS = (
    "prefetch_ops", "prefetch_issued_pages", "prefetch_adopted_pages", "prefetch_released_pages",
    "prefetch_below_threshold", "prefetch_alloc_failures", "prefetch_truncated", "prefetch_rate_limited",
    "l3_hit_tokens",
    "storage_backup_ops", "storage_backup_failed_ops", "storage_orphans_released",
)


class StorageTier:
    """L3 state and operations of a HiRadixTree."""

    def _reset_storage(self) -> None:
        self.storage_ctl: Optional[StorageController] = getattr(self, "storage_ctl", None)
        self.ongoing_prefetch: dict[Hashable, PrefetchOp] = {}
        self.ongoing_backup: dict[int, BackupOp] = {}
        # Operations settled by the tree whose I/O had not returned yet: (op, host slots to
        # free or None, node to host-unlock or None), released in FIFO order once done.
        self._orphans: list[tuple[Any, Optional[torch.Tensor], Optional[TreeNode]]] = []
        self.storage_stats = dict.fromkeys(_STORAGE_COUNTERS, 0)
        # Host tokens reserved by prefetches not yet settled (SGLang's prefetch_tokens_occupied).
        self.prefetch_tokens_occupied = 0
        ctl = self.storage_ctl
        self.prefetch_capacity_limit = 0 if ctl is None else ctl.policy.capacity_tokens(
            self.controller.host_pool.num_slots)

    # ------------------------------------------------------------------ attach / detach
    @property
    def storage_backend(self) -> Optional["HiCacheStorage"]:
        return None if self.storage_ctl is None else self.storage_ctl.storage

    def attach_storage_backend(self, backend: "HiCacheStorage", policy: Optional[StoragePolicy] = None) -> None:
        """Use ``backend`` as this tree's L3 from now on (a running cache may attach one).
        The host pool needs a page layout. Every TP rank attaches its own instance."""
        from hicache.storage.base import HiCacheStorage

        if not isinstance(backend, HiCacheStorage):
            raise ValueError(f"backend must be a HiCacheStorage, got {type(backend).__name__}")
        if self.storage_ctl is not None:
            raise ValueError("a storage backend is already attached: detach_storage_backend() first")
        policy = policy or StoragePolicy()
        c = self.controller
        self.storage_ctl = StorageController(backend, c.host_pool, policy)
        self.prefetch_capacity_limit = policy.capacity_tokens(c.host_pool.num_slots)

    def detach_storage_backend(self, force: bool = False, timeout: Optional[float] = 60.0,
                               force_grace_s: float = 0.5) -> Optional["HiCacheStorage"]:
        """Stop using L3 and return the backend (None when none was attached). Never deletes
        stored data: the backend is neither cleared nor closed (the caller owns it).

        ``force=False`` drains: waits (up to ``timeout`` s, then TimeoutError with nothing
        changed) for in-flight fetches and writes, retires the writes, and settles each
        prefetch with what it fetched. ``force=True`` abandons them: prefetches are settled
        with nothing, their reservations and the writes' host locks released as soon as the
        backend calls in progress return (``force_grace_s`` s are waited for that here; a
        call that hangs longer leaves an orphan that ``check_storage_events`` releases)."""
        ctl = self.storage_ctl
        if ctl is None:
            return None
        if not force:
            if not tp_sync.all_ranks_true(ctl.wait_idle(timeout), self.controller.tp_group):
                raise TimeoutError(f"detach_storage_backend: L3 operations still in flight after {timeout} s "
                                   f"({ctl.in_flight()} here); retry, or pass force=True")
            ctl.stop_accepting()
            while self.ongoing_backup:
                self._retire_backups(ctl)
            for op in list(self.ongoing_prefetch.values()):
                self._settle_prefetch(op)
        else:
            ctl.stop_accepting()
            for op in list(self.ongoing_backup.values()):
                ctl.cancel(op)
            for op in list(self.ongoing_prefetch.values()):
                ctl.cancel(op)
            ctl.wait_idle(force_grace_s)
            for op in list(self.ongoing_prefetch.values()):
                self._settle_prefetch(op, take_pages=0)
            self._retire_backups(ctl)  # writes that returned (TP: those every rank has)
            for op in list(self.ongoing_backup.values()):  # still in a backend call: orphans
                del self.ongoing_backup[op.op_id]
                self._clear_backup_marks(op, ok=False)
                self._orphans.append((op, None, op.lock_node))
        self.storage_ctl = None
        ctl.shutdown(join_timeout=0.1 if force else 5.0)
        self._release_orphans()
        return ctl.storage

    # ------------------------------------------------------------------ prefetch
    def _held_below(self, node: TreeNode, key: tuple[int, ...]) -> int:
        """Tokens of ``key`` the tree already holds (any tier) continuing ``node``'s path."""
        pos = 0
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None or child in self._stale:
                break
            m = self._match_len(child.key, key, pos)
            pos += m
            if m < len(child.key):
                break
            node = child
        return pos

    def prefetch_from_storage(self, req_id: Hashable, last_host_node: TreeNode,
                              new_input_tokens: Sequence[int] | torch.Tensor) -> int:
        """Start fetching, in the background, the pages with which ``new_input_tokens``
        (the tokens following ``last_host_node``'s path, e.g. ``tokens[m.backed_length:]``
        with ``m.last_backed_node``) continue in L3 (the keys chain onto that path, whose
        root carries the request's cache salt), when they reach beyond what the tree
        holds by at least ``prefetch_threshold`` tokens. ``last_host_node`` must be backed up
        (or the root) and stays host-locked until the prefetch is settled.

        Makes no backend call: host slots are reserved for all whole pages of
        ``new_input_tokens`` and the prefetch thread checks which of them L3 holds before it
        fetches. Returns the tokens reserved, an upper bound of what arrives (0: no
        prefetch: below the threshold, over ``prefetch_capacity_limit``, or no host
        memory). Settle with ``check_prefetch_progress(req_id)``."""
        ctl = self.storage_ctl
        if ctl is None:
            return 0
        if req_id in self.ongoing_prefetch:
            raise ValueError(f"prefetch_from_storage: request {req_id!r} already has a prefetch in flight")
        if not last_host_node.is_root and not last_host_node.backed_up:
            raise ValueError(f"prefetch_from_storage: last_host_node {last_host_node.id} has no host copy; pass "
                             "the match's last_backed_node and the tokens after backed_length")
        ps = self.page_size
        key = _as_tokens(new_input_tokens)
        key = key[: len(key) - len(key) % ps]
        if not key:
            return 0
        last_host_node = self._live_root(last_host_node, register=False)
        held = self._held_below(last_host_node, key)
        if len(key) - held < ctl.policy.prefetch_threshold:  # L3 cannot add enough: no reservation
            self.storage_stats["prefetch_below_threshold"] += 1
            return 0
        n = len(key)
        if self.prefetch_tokens_occupied + n > self.prefetch_capacity_limit:
            # every rank has the same counter (same calls, agreed settles): no collective
            self.storage_stats["prefetch_rate_limited"] += 1
            return 0
        hashes = page_hash_chain(key, ps, self._hash_prior(last_host_node))
        self.inc_host_lock(last_host_node)  # its host copy must outlive the fetch (and evict_host below)
        c = self.controller
        host = self._alloc_agreed(c.alloc_host, c.free_host, self.evict_host, n)
        if host is None:
            self.dec_host_lock(last_host_node)
            self.storage_stats["prefetch_alloc_failures"] += 1
            return 0
        op = PrefetchOp(req_id=req_id, keys=ctl.storage_keys(hashes), host_indices=host, start_node=last_host_node,
                        tokens=key, hash_keys=hashes, timeout_s=ctl.policy.prefetch_timeout_base, held_tokens=held)
        self.ongoing_prefetch[req_id] = op
        self.prefetch_tokens_occupied += n
        self.storage_stats["prefetch_ops"] += 1
        self.storage_stats["prefetch_issued_pages"] += n // ps
        ctl.submit_prefetch(op)
        return n

    def check_prefetch_progress(self, req_id: Hashable) -> bool:
        """True when request ``req_id`` has no prefetch in flight any more: none was issued,
        or the policy lets it be settled now and it was (its arrived pages are host nodes of
        the tree, the rest of its reservation released). False: ask again later."""
        op = self.ongoing_prefetch.get(req_id)
        if op is None:
            return True
        ctl = self.storage_ctl
        if not tp_sync.all_ranks_true(ctl.can_terminate(op), self.controller.tp_group):
            return False
        self._settle_prefetch(op)
        return True

    def wait_prefetch(self, req_id: Hashable, timeout: Optional[float]) -> bool:
        """Block up to ``timeout`` s until the I/O of ``req_id``'s prefetch has finished
        (True; also when there is none). Does not settle it: ``check_prefetch_progress``."""
        op = self.ongoing_prefetch.get(req_id)
        if op is None or self.storage_ctl is None:
            return True
        return self.storage_ctl.wait_op(op, timeout)

    def terminate_prefetch(self, req_id: Hashable) -> int:
        """Settle ``req_id``'s prefetch now whatever the policy (e.g. the request was
        aborted): the pages that arrived are kept in the tree. Returns tokens kept."""
        op = self.ongoing_prefetch.get(req_id)
        if op is None:
            return 0
        return self._settle_prefetch(op)

    def _settle_prefetch(self, op: PrefetchOp, take_pages: Optional[int] = None) -> int:
        """The single release path of a prefetch reservation: insert the agreed arrived
        pages (at most ``take_pages``) as host nodes, release the rest. Returns tokens
        inserted."""
        assert not op.released, "prefetch reservation settled twice"
        ctl = self.storage_ctl
        ps = self.page_size
        local, io_done = ctl.stop(op)  # the thread stops at its next batch boundary
        if take_pages is not None:
            local = min(local, take_pages)
        # Orphan or release at once: agreed too, so every rank's orphan list is the same and
        # their releases can be agreed in order.
        pages, io_done = tp_sync.agree_min_many([local, int(io_done)], self.controller.tp_group)
        n = pages * ps
        st = self.storage_stats
        if op.below_threshold:  # this rank's view (a statistic, not a decision)
            st["prefetch_below_threshold"] += 1
        elif pages < (op.planned_pages if op.planned_pages is not None else op.num_pages):
            st["prefetch_truncated"] += 1
        if n:
            last, unused = self._insert_host_from(op.start_node, op.tokens[:n], op.host_indices[:n], op.hash_keys)
            if unused.numel():
                self.controller.free_host(unused)
                st["prefetch_released_pages"] += unused.numel() // ps
            st["prefetch_adopted_pages"] += pages - unused.numel() // ps
            st["l3_hit_tokens"] += n
        tail = op.host_indices[n:]
        op.released = True
        self.prefetch_tokens_occupied -= op.num_pages * ps
        del self.ongoing_prefetch[op.req_id]
        self.dec_host_lock(op.start_node)
        if tail.numel():
            if io_done:
                self._free_reserved(tail)
            else:
                self._orphans.append((op, tail, None))
        return n

    def _free_reserved(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self.controller.free_host(slots)
            self.storage_stats["prefetch_released_pages"] += slots.numel() // self.page_size

    def _insert_host_from(self, start: TreeNode, key: tuple[int, ...], host: torch.Tensor,
                          hash_keys: list[str]) -> tuple[TreeNode, torch.Tensor]:
        """Add ``key`` (whole pages continuing ``start``'s backed-up path) with host slots
        ``host`` (int64 [len(key)], KV read from L3). Nodes the tree has keep their host
        copies (the duplicate slots are returned to free); a node with only a device copy
        adopts the host slots. Returns (last node, unused host slots)."""
        ps = self.page_size
        start = self._live_root(start)  # a salt root may have been dropped (and re-made) meanwhile
        node, pos, unused = start, 0, []
        for child, pos, m in self._walk_splitting(start, key):
            seg = host[pos:pos + m]
            if child.backed_up:
                unused.append(seg)
            else:
                self._set_host(child, seg.clone())
                child.in_storage = True
            node = child
            pos += m
        if pos < len(key):
            new = self._new_leaf(node, key, pos)
            new.hash_keys = list(hash_keys[pos // ps: len(key) // ps])
            new.in_storage = True
            self._set_host(new, host[pos:].clone())
            self._refresh(new)
            self.stats_.inserted_tokens += len(key) - pos
            node = new
        return node, (torch.cat(unused) if unused else _EMPTY)

    # ------------------------------------------------------------------ write to L3
    def write_backup_storage(self, node: TreeNode) -> int:
        """Write the host pages of ``node``'s path that L3 may lack (nodes whose host copy is
        complete, not yet written, not being written) in the background; the path stays
        host-locked until the write is acknowledged. For callers that fill host pages
        themselves (host-only ``insert``); backups the tree makes go to L3 on their own.
        Returns pages submitted."""
        if self.storage_ctl is None or node.is_root:
            return 0
        chain = []
        for x in reversed(self._path(node)):
            if not x.backed_up or x.write_ack is not None:
                break  # host KV not (yet) valid below here
            chain.append(x)
        return self._submit_storage_backup([x for x in chain if not x.in_storage and x.storage_op is None])

    def _on_host_backup_done(self, nodes: list[TreeNode]) -> None:
        """Hook of ``writing_check``: ``nodes`` (deepest first) now hold complete host
        copies."""
        ctl = self.storage_ctl
        if ctl is None or not ctl.policy.write_through:
            return
        todo = [x for x in reversed(nodes) if x.backed_up and not x.in_storage and x.storage_op is None]
        self._submit_storage_backup(todo)

    def _submit_storage_backup(self, nodes: list[TreeNode]) -> int:
        """One background write of ``nodes`` (nodes of one root path)."""
        if not nodes:
            return 0
        nodes = sorted(nodes, key=lambda x: len(self._path(x)))  # root first: the last one locks them all
        ctl = self.storage_ctl
        ps = self.page_size
        keys: list[str] = []
        pages: list[int] = []
        for x in nodes:
            keys += ctl.storage_keys(self.page_hashes(x))
            pages += [int(p) for p in (x.host_indices[::ps] // ps).tolist()]
        op = BackupOp(op_id=ctl.next_op_id(), keys=keys, host_pages=pages, nodes=list(nodes), lock_node=nodes[-1])
        self.inc_host_lock(op.lock_node)
        for x in nodes:
            x.storage_op = op.op_id
        self.ongoing_backup[op.op_id] = op
        self.storage_stats["storage_backup_ops"] += 1
        ctl.submit_backup(op)
        return len(keys)

    def _clear_backup_marks(self, op: BackupOp, ok: bool) -> None:
        for x in op.nodes:
            x.storage_op = None
            if ok:
                x.in_storage = True
        if not ok:
            self.storage_stats["storage_backup_failed_ops"] += 1

    def _retire_backups(self, ctl: StorageController) -> int:
        results = self._agreed_results(ctl.backup_acks_ready(), ctl.pop_backup_ack)
        for op, ok in results:
            if op.op_id not in self.ongoing_backup:  # pragma: no cover - force-detached earlier
                continue
            del self.ongoing_backup[op.op_id]
            self._clear_backup_marks(op, bool(ok))
            self.dec_host_lock(op.lock_node)
        return len(results)

    # ------------------------------------------------------------------ per step
    def check_storage_events(self) -> None:
        """Per scheduler step: retire acknowledged L3 writes (release their host locks) and
        release orphaned reservations whose backend call has returned."""
        if self.storage_ctl is not None:
            self._retire_backups(self.storage_ctl)
        self._release_orphans()

    def _release_orphans(self) -> None:
        if not self._orphans:  # the same list on every rank (settling agrees on it): no collective
            return
        k = 0
        while k < len(self._orphans) and self._orphans[k][0].done:
            k += 1
        k = tp_sync.agree_min(k, self.controller.tp_group)
        for op, tail, lock_node in self._orphans[:k]:
            if tail is not None:
                self._free_reserved(tail)
            if lock_node is not None:
                self.dec_host_lock(lock_node)
            self.storage_stats["storage_orphans_released"] += 1
        del self._orphans[:k]

    def flush_storage(self, timeout: Optional[float] = 60.0) -> None:
        """Block until every L3 write and fetch in flight has finished, then retire the
        writes (prefetches stay for ``check_prefetch_progress``)."""
        ctl = self.storage_ctl
        if ctl is None:
            return
        if not tp_sync.all_ranks_true(ctl.wait_idle(timeout), self.controller.tp_group):
            raise TimeoutError(f"flush_storage: L3 operations still in flight after {timeout} s")
        while self.ongoing_backup:
            self._retire_backups(ctl)
        self._release_orphans()

    # ------------------------------------------------------------------ accounting
    def storage_stats_dict(self) -> dict[str, int]:
        st = dict(self.storage_stats)
        st["prefetch_reserved_pages"] = (st["prefetch_issued_pages"] - st["prefetch_adopted_pages"]
                                         - st["prefetch_released_pages"])
        st["ongoing_prefetches"] = len(self.ongoing_prefetch)
        st["prefetch_tokens_occupied"] = self.prefetch_tokens_occupied
        st["prefetch_capacity_limit"] = self.prefetch_capacity_limit
        st["ongoing_storage_backups"] = len(self.ongoing_backup)
        st["storage_orphans"] = len(self._orphans)
        if self.storage_ctl is not None:
            st.update(self.storage_ctl.stats())
        return st

    def storage_leaks(self) -> int:
        """Reserved prefetch pages no live operation accounts for (0 unless a release path
        was skipped): ``prefetch_reserved_pages`` minus the pages of prefetches in flight
        and of orphaned tails."""
        ps = self.page_size
        live = sum(op.num_pages for op in self.ongoing_prefetch.values())
        live += sum(t.numel() // ps for _, t, _ in self._orphans if t is not None)
        return self.storage_stats_dict()["prefetch_reserved_pages"] - live
