"""The HiRadixTree's tier moves: device -> host backups under the write policies, device
and host eviction, and host -> device load-back, each acknowledged by the controller
(mixed into :class:`hicache.radix_tree.HiRadixTree`, whose state it works on)."""
from __future__ import annotations

import heapq
from typing import Any, Callable, Optional

import torch

from hicache import tp_sync
from hicache.radix_node import TreeNode


class TierMoves:
    """Backups, evictions and loads of :class:`~hicache.radix_tree.HiRadixTree` (see its
    module docstring for the invariants these keep)."""


    # ------------------------------------------------------------------ write policies
    def _inc_hit_count(self, node: TreeNode) -> None:
        if self.write_policy == "write_back":
            return
        node.hit_count += 1
        if not node.backed_up and node.on_device and node.hit_count >= self.write_through_threshold:
            self.write_backup(node)

    def _alloc_agreed(self, alloc, free, evict, n: int) -> Optional[torch.Tensor]:
        """Allocate ``n`` slots on every TP rank or on none: ranks agree (MIN) on success
        before and after making room, so all ranks' trees take the same decisions."""
        group = self.controller.tp_group
        idx = alloc(n)
        if tp_sync.all_ranks_true(idx is not None, group):
            return idx
        if idx is not None:
            free(idx)
        evict(n)
        idx = alloc(n)
        if tp_sync.all_ranks_true(idx is not None, group):
            return idx
        if idx is not None:
            free(idx)
        return None

    def write_backup(self, node: TreeNode) -> int:
        """Back ``node``'s device KV up to host. Returns tokens queued (0: parent not backed
        up yet — continuity — or no host room). The node's path stays locked until the
        write is acknowledged by ``writing_check``."""
        if node.backed_up or not node.on_device:
            return 0
        if not node.parent.is_root and not node.parent.backed_up:
            return 0
        c = self.controller
        n = len(node.device_indices)
        host = self._alloc_agreed(c.alloc_host, c.free_host, self.evict_host, n)
        if host is None:
            self.stats_.write_alloc_failures += 1
            return 0
        ack = next(self._ack_ids)
        c.write(node.device_indices, host, ack)
        self._set_host(node, host)
        node.write_ack = ack
        self.ongoing_write[ack] = [node]
        self.inc_lock_ref(node)
        self.stats_.backup_tokens += n
        return n

    def _agreed_results(self, ready_here: int, pop: Callable[[], Any]) -> list[tuple[Any, int]]:
        """Pop the transfer results every TP rank has (MIN of ``ready_here`` over the ranks)
        and pair each with its outcome agreed over the ranks: a copy that failed on any rank
        counts as failed on all (dropping a good copy is safe; keeping a bad one is not), so
        the trees stay identical."""
        group = self.controller.tp_group
        batches = [pop() for _ in range(tp_sync.agree_min(ready_here, group))]
        return list(zip(batches, tp_sync.agree_min_many([int(b.ok) for b in batches], group)))

    def writing_check(self, block: bool = False) -> int:
        """Issue queued writes and retire acknowledged ones (unlock, mark complete). TP ranks
        agree (MIN) on how many acks to retire. block=True waits for every write in flight.
        Returns the number of writes retired."""
        c = self.controller
        c.start_writing()
        if block:
            c.wait_writes()
        results = self._agreed_results(c.write_acks_ready(), c.pop_write_result)
        for batch, ok in results:
            for ack in batch.ack_ids:
                if not ok:
                    self._fail_write(ack)
                    continue
                nodes = self.ongoing_write.pop(ack)
                for nd in nodes:
                    nd.write_ack = None
                self.dec_lock_ref(nodes[0])
                self._on_host_backup_done(nodes)
        return len(results)

    def _subtree_postorder(self, top: TreeNode) -> list[TreeNode]:
        """``top`` and its descendants, children before parents."""
        out, stack = [], [top]
        while stack:
            x = stack.pop()
            out.append(x)
            stack.extend(x.children.values())
        out.reverse()
        return out

    def _fail_write(self, ack: int) -> None:
        """The backup ``ack`` failed: its host slots hold no valid KV. Free them and leave
        the nodes device-only (``hit_count`` is kept, so the next hit writes again). Host
        copies below them (adopted by ``insert`` or written while this write was in
        flight) would break continuity: they are dropped too, host-only ones with their
        node. If any of those host pages is still in use (host-locked, being loaded or
        being written), the write is re-issued to the same slots instead."""
        nodes = self.ongoing_write.pop(ack)
        pieces = set(nodes)
        self.fault_stats["write_failures"] += 1
        top = next(x for x in nodes if x.parent not in pieces)
        affected = [x for x in self._subtree_postorder(top) if x.backed_up]
        busy = any(x.host_lock_ref > 0 or (x not in pieces and (x.loading or x.write_ack is not None))
                   for x in affected)
        if busy:
            new = next(self._ack_ids)
            self.controller.write(torch.cat([x.device_indices for x in nodes]),
                                  torch.cat([x.host_indices for x in nodes]), new)
            for x in nodes:
                x.write_ack = new
            self.ongoing_write[new] = nodes
            self.fault_stats["write_retries"] += 1
            return
        for x in affected:
            self.fault_stats["failed_write_host_tokens_freed"] += len(x.host_indices)
            self.controller.free_host(x.host_indices)
            self._set_host(x, None)
            if x in pieces:
                x.write_ack = None
            elif not x.on_device:
                self._remove_leaf(x)  # its (host-only) children went first
        self.dec_lock_ref(nodes[0])

    # ------------------------------------------------------------------ device eviction
    def evict_node(self, node: TreeNode) -> int:
        """Evict one device leaf now (demote if backed up, else delete). Locked, loading,
        not-on-device or non-leaf nodes -> ValueError, tree unchanged. write_back policy: a
        node without a host copy is backed up first (blocking)."""
        if node.is_root or not node.on_device:
            raise ValueError(f"evict_node: node {node.id} holds no device KV")
        if node.lock_ref > 0 or node.loading:
            raise ValueError(f"evict_node: node {node.id} is locked (lock_ref={node.lock_ref}) or loading")
        if node not in self.device_leaves:
            raise ValueError(f"evict_node: node {node.id} has children on the device; evict them first")
        if not node.backed_up and self.write_policy == "write_back":
            self._write_back_chain(node)
            self.writing_check(block=True)
        if node.write_ack is not None:  # pragma: no cover - in-flight writes hold a lock
            raise ValueError(f"evict_node: node {node.id} has a write in flight")
        return self._evict_device(node)

    def _evict_device(self, node: TreeNode) -> int:
        n = len(node.device_indices)
        self.controller.free_device(node.device_indices)
        self._set_device(node, None)
        self.stats_.device_evicted_tokens += n
        if node.backed_up:
            self.stats_.device_demoted_tokens += n
        else:
            assert not node.children, "an unbacked node cannot have host-only children (continuity)"
            self.stats_.device_deleted_tokens += n
            self._remove_leaf(node)
        return n

    def _write_back_chain(self, node: TreeNode) -> int:
        """write_back: back up ``node`` and its unbacked ancestors (root first) so continuity
        holds; the ancestors stay on the device."""
        chain = []
        n = node
        while not n.is_root and not n.backed_up:
            chain.append(n)
            n = n.parent
        total = 0
        for x in reversed(chain):
            got = self.write_backup(x)
            if got == 0:
                break
            total += got
        return total

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens if unlocked nodes allow, least recently
        used leaves first. Backed-up nodes are demoted (host copy kept), others deleted;
        write_back first backs them up and waits for those writes. Returns tokens freed."""
        if num_tokens < 0:
            raise ValueError(f"evict: num_tokens must be >= 0, got {num_tokens}")
        freed = 0
        while freed < num_tokens:
            heap = [x for x in self.device_leaves if x.lock_ref == 0 and not x.loading]
            heapq.heapify(heap)
            pending: list[TreeNode] = []
            pending_tokens = 0
            progress = False
            while freed + pending_tokens < num_tokens and heap:
                x = heapq.heappop(heap)
                if x.lock_ref > 0 or x.loading or not x.on_device:
                    continue
                parent = x.parent
                if not x.backed_up and self.write_policy == "write_back":
                    if self._write_back_chain(x) and x.backed_up:
                        pending.append(x)
                        pending_tokens += len(x.device_indices)
                        continue
                freed += self._evict_device(x)
                progress = True
                if self._is_device_leaf(parent) and parent.lock_ref == 0 and not parent.loading:
                    heapq.heappush(heap, parent)
            if pending:
                self.writing_check(block=True)
                for x in pending:
                    if x.on_device and x.lock_ref == 0 and not x.loading:
                        freed += self._evict_device(x)
                        progress = True
            if not progress:
                break
        return freed

    # ------------------------------------------------------------------ host eviction
    def _host_evictable(self, node: TreeNode) -> bool:
        return node in self.host_leaves and node.lock_ref == 0 and node.host_lock_ref == 0 and not node.loading

    def evict_host_node(self, node: TreeNode) -> int:
        """Drop one host leaf (a node not on the device, without children). Locked or
        host-locked nodes -> ValueError, tree unchanged."""
        if node not in self.host_leaves:
            raise ValueError(f"evict_host_node: node {node.id} is not a host leaf (on device, has children, or no host copy)")
        if not self._host_evictable(node):
            raise ValueError(f"evict_host_node: node {node.id} is locked (lock_ref={node.lock_ref}, "
                             f"host_lock_ref={node.host_lock_ref})")
        return self._evict_host(node)

    def _evict_host(self, node: TreeNode) -> int:
        n = len(node.host_indices)
        self.controller.free_host(node.host_indices)
        self._set_host(node, None)
        self._remove_leaf(node)
        self.stats_.host_evicted_tokens += n
        return n

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens from nodes that are not on the device
        and not (host-)locked, least recently used first. Returns tokens freed."""
        if num_tokens < 0:
            raise ValueError(f"evict_host: num_tokens must be >= 0, got {num_tokens}")
        heap = [x for x in self.host_leaves if self._host_evictable(x)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            x = heapq.heappop(heap)
            if not self._host_evictable(x):
                continue
            parent = x.parent
            freed += self._evict_host(x)
            if self._host_evictable(parent):
                heapq.heappush(heap, parent)
        return freed

    # ------------------------------------------------------------------ load back
    def load_back(self, node: TreeNode, mem_quota: Optional[int] = None) -> Optional[torch.Tensor]:
        """Queue a host -> device load of the host-only chain ending at ``node``. Returns the
        new device slots (int64, chain order) or None (nothing to load, below
        ``load_back_threshold``, over ``mem_quota`` tokens, or no device room). The chain
        stays locked and ``loading`` until ``loading_check`` sees the ack; the data arrives
        layer by layer after ``ready_to_load_host_cache()``."""
        return self._load_back(node, mem_quota)[0]

    def _truncate_chain(self, chain: list[TreeNode], n: int) -> list[TreeNode]:
        """First ``n`` tokens (a page multiple) of the root-first ``chain``, splitting the
        node the cut falls in."""
        keep: list[TreeNode] = []
        got = 0
        for x in chain:
            if got >= n:
                break
            if got + len(x.key) > n:
                x = self._split(x, n - got)
            keep.append(x)
            got += len(x.key)
        return keep

    def _load_back(self, node: TreeNode, mem_quota: Optional[int]) -> tuple[Optional[torch.Tensor], TreeNode]:
        """``load_back``; also returns the last node loaded (``node``, or the node ending
        the TP-agreed part of its chain)."""
        chain: list[TreeNode] = []
        last = node
        while not node.is_root and node.evicted:
            if not node.backed_up:  # pragma: no cover - invariant
                raise AssertionError(f"node {node.id} is neither on device nor on host")
            chain.append(node)
            node = node.parent
        ancestor = node
        chain.reverse()
        n_local = sum(len(x.key) for x in chain)
        # Every rank loads the same number of tokens (collective on every call, also when
        # this rank has nothing to load, so the ranks' collectives stay paired).
        n = tp_sync.agree_min(n_local, self.controller.tp_group)
        if n < n_local:
            chain = self._truncate_chain(chain, n)
            last = chain[-1] if chain else ancestor
        if not chain:
            return None, last
        host = torch.cat([x.host_indices for x in chain])
        if n < self.load_back_threshold or (mem_quota is not None and n > mem_quota):
            return None, last
        self.inc_lock_ref(last)  # the chain and its ancestors survive the eviction below
        c = self.controller
        dev = self._alloc_agreed(c.alloc_device, c.free_device, self.evict, n)
        if dev is None:
            self.dec_lock_ref(last)
            self.stats_.load_alloc_failures += 1
            return None, last
        ack = next(self._ack_ids)
        c.load(host, dev, ack)
        off = 0
        for x in chain:
            k = len(x.host_indices)
            self._set_device(x, dev[off:off + k])
            x.loading = True
            off += k
        self.ongoing_load[ack] = (ancestor, last)
        self.stats_.loadback_tokens += n
        return dev, last

    def init_load_back(self, last_node: TreeNode, host_hit_length: int = 0,
                       mem_quota: Optional[int] = None) -> tuple[torch.Tensor, TreeNode]:
        """SGLang's entry point: load back the host part of a match if possible; returns
        (new device slots, last node now on device). Under TP the loaded length is the
        ranks' minimum (every rank must call this, also with nothing to load)."""
        del host_hit_length  # kept for SGLang signature compatibility
        dev, loaded = self._load_back(last_node, mem_quota)
        if dev is not None:
            return dev, loaded
        while not last_node.is_root and last_node.evicted:
            last_node = last_node.parent
        return self._empty_device, last_node

    def ready_to_load_host_cache(self) -> int:
        """Issue every queued load layer by layer; returns the producer id the forward pass
        waits on (``controller.layer_counter``), -1 when nothing was queued."""
        return self.controller.start_loading()

    def loading_check(self, block: bool = False) -> int:
        """Retire acknowledged loads: unlock their chains and clear ``loading``. TP ranks agree
        (MIN) on how many. Returns loads retired."""
        c = self.controller
        if block:
            c.start_loading()
            c.wait_loads()
        results = self._agreed_results(c.load_acks_ready(), c.pop_load_result)
        for batch, ok in results:
            for ack in batch.ack_ids:
                ancestor, last = self.ongoing_load.pop(ack)
                chain = []
                x = last
                while x is not ancestor:
                    x.loading = False
                    chain.append(x)
                    x = x.parent
                self.dec_lock_ref(last)
                if not ok:
                    self._fail_load(chain)
        return len(results)

    def _fail_load(self, chain: list[TreeNode]) -> None:
        """A load-back of ``chain`` (last node first) failed: its device slots hold no valid
        KV. Drop them (the host copies stay, a later match loads again); nodes a request
        still holds become stale until their last lock is released."""
        self.fault_stats["load_failures"] += 1
        for x in reversed(chain):  # top-down: locks only shrink going down
            if x.lock_ref == 0:
                self._drop_device_subtree(x)
                return
            self._stale.add(x)

    def _drop_device_subtree(self, top: TreeNode) -> None:
        """Free the device copies of the unlocked ``top`` and its descendants (backed-up
        nodes are demoted, others deleted)."""
        for x in self._subtree_postorder(top):
            if x in self._stale:
                self._stale.discard(x)
                self.fault_stats["failed_load_device_tokens_freed"] += len(x.key)
            if x.on_device:
                self._evict_device(x)

    def check_hicache_events(self) -> None:
        """Per scheduler step: retire finished writes and loads (host and L3)."""
        self.writing_check()
        self.loading_check()
        self.check_storage_events()
