"""HiRadixTree: page-granular radix tree over token ids whose nodes record where their KV
lives — device pool slots (L1), host pool slots (L2), or both — following SGLang's
``HiRadixCache`` (``match_prefix``, ``insert``, ``evict``, ``evict_host``, ``load_back``,
``init_load_back``, ``writing_check``, ``loading_check``, ``inc_lock_ref`` /
``dec_lock_ref``).

Invariants (``check_invariants`` asserts them; the model-based test runs it every step):

* every key is a whole number of pages and every split happens at a page boundary;
* on any root-to-leaf path the device-resident nodes form a prefix (device eviction goes
  leaf first, load-back loads a whole host chain), and so do the backed-up nodes
  (*backup continuity*: a node is backed up only after its parent);
* a non-root node holds its KV in at least one tier;
* a node with ``lock_ref > 0`` keeps its device slots; with ``host_lock_ref > 0`` or
  ``lock_ref > 0`` it keeps its host slots; in-flight writes and loads hold ``lock_ref``
  on their node's path until the controller acknowledges them.

Recency is a logical clock, not wall time, so every tensor-parallel rank that applies the
same operations evicts the same nodes. Under tensor parallelism (``torch.distributed``
initialised with more than one rank in ``controller.tp_group``) the ranks also agree with
``all_reduce(MIN)`` on the usable hit length of every ``match_prefix`` and on the length of
every load-back, cutting a longer local match at the agreed page boundary, so all ranks load
the same tokens and report the same hit to the scheduler.

Failed transfers (the controller acks them with ``ok=False``) degrade to a cache miss: a
failed backup frees the host slots reserved for the node and leaves it device-only (a later
hit retries the write); a failed load-back frees the device slots and leaves the node
host-only. If a request still holds a lock on a node whose load failed, the node is marked
stale — ``match_prefix`` stops before it — and its device copy is dropped when the last lock
is released.

Cache salts (tenant isolation, vLLM's ``cache_salt``): ``match_prefix`` and ``insert``
take ``cache_salt``; each salt has its own root (``salt_roots``), and its L3 hash chain
starts at ``salt_root(salt)``, so requests with different salts share no node and no L3
key. Without a salt everything is as before (the plain ``root``, the unsalted chain).

The L3 storage paths (prefetch from a storage backend into host nodes, write-through of
host pages to it, runtime attach/detach) live in ``hicache.radix_storage``; the tree's tier
moves (backups, evictions, load-back) in ``hicache.radix_transfers``.

Beyond SGLang, the sparse runtime inserts a request whose KV it already offloaded to host
*host-only* and keeps those host pages locked while the request decodes::

    m = tree.match_prefix(tokens)                  # device + host hit of the prompt
    tree.inc_host_lock(m.last_backed_node)         # its host pages stay while we read them
    new = host_pool.alloc(len(tokens) - m.backed_length)
    ...                                            # prefill, offload new KV into `new`
    res = tree.insert(tokens, host_indices=torch.cat([m.backed_host_indices, new]))
    tree.inc_host_lock(res.last_node)              # whole prompt now pinned on host
    tree.dec_host_lock(m.last_backed_node)
    ...                                            # decode reads host pages of res.last_node's path
    tree.dec_host_lock(res.last_node)              # request end: pages become evictable
    host_pool.free(res.host_unused)                # our copies the tree did not adopt
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from hicache.config import write_through_threshold
from hicache.hicache_stats import HiCacheStats
from hicache.radix_node import _EMPTY, InsertResult, MatchResult, TreeNode, _as_tokens, check_salt
from hicache.radix_introspect import TreeIntrospection
from hicache.radix_storage import StorageTier
from hicache.radix_transfers import TierMoves
from hicache.storage.keys import page_hash_chain, salt_root
from hicache import tp_sync

if TYPE_CHECKING:  # pragma: no cover
    from hicache.config import HiCacheConfig
    from hicache.controller import HiCacheController
    from hicache.device_pool import DeviceKVPool
    from hicache.storage.base import HiCacheStorage

__all__ = ["HiRadixTree", "TreeNode", "MatchResult", "InsertResult"]


class HiRadixTree(TierMoves, StorageTier, TreeIntrospection):
    """GPU (L1) + host (L2) radix cache. Pools, transfers and write policy come from
    ``controller`` (a :class:`hicache.controller.HiCacheController`)."""

    def __init__(self, controller: "HiCacheController", load_back_threshold: int = 0) -> None:
        self.controller = controller
        self.page_size: int = controller.page_size
        self.write_policy: str = controller.write_policy
        self.write_through_threshold = write_through_threshold(self.write_policy)
        self.load_back_threshold = load_back_threshold
        self.stats_ = HiCacheStats()
        self._empty_device = torch.empty((0,), dtype=torch.int64, device=controller.device_pool.device)
        self.reset()

    @classmethod
    def from_config(cls, config: "HiCacheConfig", device_pool: "DeviceKVPool", tp_group=None,
                    pin_memory: Optional[bool] = None, storage: Optional["HiCacheStorage"] = None) -> "HiRadixTree":
        """Build host pool (``--hicache-ratio/size``, ``--hicache-mem-layout``), controller
        (``--hicache-write-policy``, ``--hicache-io-backend``) and tree over ``device_pool``;
        with ``storage`` (see ``hicache.storage_setup.backend_from_config``) attach it as L3
        under ``--hicache-storage-prefetch-policy`` and the extra config's prefetch keys."""
        from hicache.controller import HiCacheController
        from hicache.host_pool import HostKVPool

        if config.page_size != device_pool.page_size:
            raise ValueError(f"--page-size={config.page_size} must equal the device pool's page_size="
                             f"{device_pool.page_size}")
        host = HostKVPool(device_pool, hicache_ratio=config.hicache_ratio, hicache_size=config.hicache_size,
                          layout=config.hicache_mem_layout, pin_memory=pin_memory)
        tree = cls(HiCacheController.from_config(config, device_pool, host, tp_group))
        if storage is not None:
            from hicache.storage_controller import StoragePolicy

            tree.attach_storage_backend(storage, StoragePolicy.from_config(config))
        return tree

    def close(self) -> None:
        """Finish L3 operations (drain; abandoned after 10 s) and stop the worker threads."""
        if self.storage_ctl is not None:
            try:
                self.detach_storage_backend(timeout=10.0)
            except TimeoutError:
                self.detach_storage_backend(force=True)
        self.controller.close()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget every node (does not free pool slots; pair with fresh pools)."""
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted
        # One root per cache salt (vLLM's ``cache_salt``): requests with different salts
        # walk disjoint subtrees, so they never share a page on any tier. A salt's root is
        # dropped when its subtree empties (see ``_remove_leaf``).
        self.salt_roots: dict[str, TreeNode] = {}
        self._clock = 0
        self._evictable = 0  # device tokens in unlocked nodes
        self._protected = 0  # device tokens in locked nodes
        self._host_tokens = 0
        self.device_leaves: set[TreeNode] = set()
        self.host_leaves: set[TreeNode] = set()
        self.ongoing_write: dict[int, list[TreeNode]] = {}  # ack id -> [locked node, split-off parents...]
        self.ongoing_load: dict[int, tuple[TreeNode, TreeNode]] = {}  # ack id -> (ancestor, last node)
        self._ack_ids = itertools.count(1)
        # Nodes whose load-back failed while a request still held them: their device slots
        # hold no valid KV; matched never, dropped from the device when the last lock goes.
        self._stale: set[TreeNode] = set()
        self._reset_storage()
        self.fault_stats = {"write_failures": 0, "write_retries": 0, "load_failures": 0,
                            "failed_write_host_tokens_freed": 0, "failed_load_device_tokens_freed": 0}

    def _tick(self, node: TreeNode) -> None:
        self._clock += 1
        node.last_access = self._clock

    def evictable_size(self) -> int:
        """Device tokens held by unlocked nodes."""
        return self._evictable

    def protected_size(self) -> int:
        """Device tokens held by locked nodes."""
        return self._protected

    def device_tokens(self) -> int:
        return self._evictable + self._protected

    def host_tokens(self) -> int:
        return self._host_tokens

    # ------------------------------------------------------------------ tier bookkeeping
    def _set_device(self, node: TreeNode, idx: Optional[torch.Tensor]) -> None:
        if node.device_indices is not None:
            n = len(node.device_indices)
            if node.lock_ref > 0:
                self._protected -= n
            else:
                self._evictable -= n
        node.device_indices = idx
        if idx is not None:
            if node.lock_ref > 0:
                self._protected += len(idx)
            else:
                self._evictable += len(idx)
        self._refresh(node)

    def _set_host(self, node: TreeNode, idx: Optional[torch.Tensor]) -> None:
        if node.host_indices is not None:
            self._host_tokens -= len(node.host_indices)
        node.host_indices = idx
        if idx is not None:
            self._host_tokens += len(idx)
        self._refresh(node)

    def _is_device_leaf(self, node: TreeNode) -> bool:
        return (not node.is_root and node.on_device
                and not any(c.on_device for c in node.children.values()))

    def _is_host_leaf(self, node: TreeNode) -> bool:
        return not node.is_root and not node.on_device and node.backed_up and not node.children

    def _refresh_one(self, node: TreeNode) -> None:
        (self.device_leaves.add if self._is_device_leaf(node) else self.device_leaves.discard)(node)
        (self.host_leaves.add if self._is_host_leaf(node) else self.host_leaves.discard)(node)

    def _refresh(self, node: TreeNode) -> None:
        self._refresh_one(node)
        if node.parent is not None:
            self._refresh_one(node.parent)

    def _child_key(self, key: tuple[int, ...], pos: int = 0) -> tuple[int, ...]:
        return key[pos:pos + self.page_size]

    def _match_len(self, node_key: tuple[int, ...], key: tuple[int, ...], pos: int) -> int:
        """Whole pages of ``node_key`` equal to ``key[pos:]``."""
        ps = self.page_size
        n = min(len(node_key), len(key) - pos)
        n -= n % ps
        if node_key[:n] == key[pos:pos + n]:
            return n
        for i in range(0, n, ps):
            if node_key[i:i + ps] != key[pos + i:pos + i + ps]:
                return i
        return n  # pragma: no cover

    def _walk_splitting(self, start: TreeNode, key: tuple[int, ...]):
        """The children along ``key`` below ``start`` (ticked), splitting the one the key
        leaves part-way: yields ``(child, pos, m)``, ``key[pos:pos + m] == child.key``. The
        insert paths walk with it and attach the rest with ``_new_leaf``."""
        node, pos = start, 0
        self._tick(start)
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                return
            m = self._match_len(child.key, key, pos)
            if m < len(child.key):
                child = self._split(child, m)
            self._tick(child)
            yield child, pos, m
            node, pos = child, pos + m

    def _new_leaf(self, parent: TreeNode, key: tuple[int, ...], pos: int) -> TreeNode:
        """A new child of ``parent`` holding ``key[pos:]`` (linked and ticked; no KV yet)."""
        new = TreeNode(key[pos:], parent)
        parent.children[self._child_key(new.key)] = new
        self._tick(new)
        return new

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Split ``child`` at ``m`` tokens (a page multiple, 0 < m < len): returns the new
        parent holding the first ``m`` tokens."""
        assert 0 < m < len(child.key) and m % self.page_size == 0
        parent = child.parent
        new = TreeNode(child.key[:m], parent)
        # Locks are per path, so the new node is held by exactly the holders of `child`.
        new.lock_ref, new.host_lock_ref = child.lock_ref, child.host_lock_ref
        new.hit_count, new.last_access, new.loading = child.hit_count, child.last_access, child.loading
        new.device_indices = None if child.device_indices is None else child.device_indices[:m]
        new.host_indices = None if child.host_indices is None else child.host_indices[:m]
        if child.device_indices is not None:
            child.device_indices = child.device_indices[m:]
        if child.host_indices is not None:
            child.host_indices = child.host_indices[m:]
        if child.hash_keys is not None:
            new.hash_keys = child.hash_keys[: m // self.page_size]
            child.hash_keys = child.hash_keys[m // self.page_size:]
        if child.write_ack is not None:
            new.write_ack = child.write_ack
            self.ongoing_write[child.write_ack].append(new)
        new.in_storage = child.in_storage
        if child.storage_op is not None:
            new.storage_op = child.storage_op
            self.ongoing_backup[child.storage_op].nodes.append(new)
        if child in self._stale:
            self._stale.add(new)
        child.key = child.key[m:]
        child.parent = new
        new.children[self._child_key(child.key)] = child
        parent.children[self._child_key(new.key)] = new
        self._refresh_one(child)
        self._refresh_one(new)
        return new

    def _remove_leaf(self, node: TreeNode) -> None:
        assert not node.children and node.device_indices is None and node.host_indices is None
        parent = node.parent
        del parent.children[self._child_key(node.key)]
        self.device_leaves.discard(node)
        self.host_leaves.discard(node)
        self._refresh_one(parent)
        if parent.salt is not None and not parent.children and self.salt_roots.get(parent.salt) is parent:
            # An empty salt root holds nothing; a caller still holding it (a match result,
            # a prefetch's start) gets the salt's current root back from ``_live_root``.
            del self.salt_roots[parent.salt]

    # ------------------------------------------------------------------ cache salts
    def _root_for(self, cache_salt: Optional[str]) -> TreeNode:
        """The root of ``cache_salt``'s subtree (the plain root without a salt). A salt seen
        for the first time gets a root that is registered once something is inserted."""
        salt = check_salt(cache_salt)
        if salt is None:
            return self.root
        root = self.salt_roots.get(salt)
        if root is None:
            root = TreeNode(salt=salt)
            root.lock_ref = 1
        return root

    def _live_root(self, node: TreeNode, register: bool = True) -> TreeNode:
        """``node``, or for a salt root the registered root of its salt (registering
        ``node`` when there is none and ``register``), so inserts below a root a caller
        kept always land in the live tree."""
        if not node.is_root or node.salt is None:
            return node
        if register:
            return self.salt_roots.setdefault(node.salt, node)
        return self.salt_roots.get(node.salt, node)

    def _hash_prior(self, node: TreeNode) -> str:
        """The hash chain value a page following ``node`` chains onto: the last page hash
        of ``node``, or at a root its salt's starting value (``salt_root``)."""
        if node.is_root:
            return salt_root(node.salt)
        return self.page_hashes(node)[-1]

    # ------------------------------------------------------------------ hashes (L3 keys)
    def page_hashes(self, node: TreeNode) -> list[str]:
        """Hash chain keys of ``node``'s pages (``hicache.storage.keys``): each covers the
        page and its whole prefix."""
        if node.is_root:
            return []
        if node.hash_keys is None:
            node.hash_keys = page_hash_chain(node.key, self.page_size, self._hash_prior(node.parent))
        return node.hash_keys

    # ------------------------------------------------------------------ locks
    def _path(self, node: TreeNode) -> list[TreeNode]:
        out = []
        while not node.is_root:
            out.append(node)
            node = node.parent
        return out

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Protect ``node`` and its ancestors from device (and host) eviction. Returns the
        device tokens that moved from evictable to protected."""
        delta = 0
        for n in self._path(node):
            if n.lock_ref == 0 and n.device_indices is not None:
                k = len(n.device_indices)
                self._evictable -= k
                self._protected += k
                delta += k
            n.lock_ref += 1
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one ``inc_lock_ref(node)``. Unlocking below zero -> ValueError, tree unchanged."""
        path = self._path(node)
        if any(n.lock_ref <= 0 for n in path):
            raise ValueError(f"dec_lock_ref: node {node.id} is not locked (lock_ref would go below zero)")
        delta = 0
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0 and n.device_indices is not None:
                k = len(n.device_indices)
                self._evictable += k
                self._protected -= k
                delta += k
        if self._stale:
            # Locks only shrink going down a path, so the highest stale node that is now
            # unlocked covers every stale node below it.
            for n in reversed(path):
                if n in self._stale and n.lock_ref == 0:
                    self._drop_device_subtree(n)
                    break
        return delta

    def inc_host_lock(self, node: TreeNode) -> None:
        """Keep the host slots of ``node``'s path (a running sparse request reads them).
        The node must be backed up."""
        path = self._path(node)
        if any(not n.backed_up for n in path):
            raise ValueError(f"inc_host_lock: node {node.id} (or an ancestor) has no host copy to lock")
        for n in path:
            n.host_lock_ref += 1

    def dec_host_lock(self, node: TreeNode) -> None:
        """Undo one ``inc_host_lock(node)``; below zero -> ValueError, tree unchanged."""
        path = self._path(node)
        if any(n.host_lock_ref <= 0 for n in path):
            raise ValueError(f"dec_host_lock: node {node.id} is not host-locked (host_lock_ref would go below zero)")
        for n in path:
            n.host_lock_ref -= 1

    def backup_complete(self, node: TreeNode) -> bool:
        """True when the host copy of ``node``'s whole path has been written (acked)."""
        return all(n.backed_up and n.write_ack is None for n in self._path(node))

    # ------------------------------------------------------------------ match
    def match_prefix(self, token_ids: Sequence[int] | torch.Tensor,
                     cache_salt: Optional[str] = None) -> MatchResult:
        """Longest cached page-aligned prefix of ``token_ids`` across tiers, among what was
        inserted under the same ``cache_salt`` (None: the unsalted tree). A match ending
        inside a node splits it at that page boundary. Counts a hit on every matched node
        (write-through policies may start backups)."""
        root = self._root_for(cache_salt)
        key = _as_tokens(token_ids)
        key = key[: len(key) - len(key) % self.page_size]
        query_len = len(key)
        key = key[:self._agreed_hit_length(key, root)]
        dev: list[torch.Tensor] = []
        host: list[torch.Tensor] = []
        backed: list[torch.Tensor] = []
        node = root
        last_dev = last_backed = root
        pos = 0
        self._tick(root)
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None or child in self._stale:
                break
            m = self._match_len(child.key, key, pos)
            if m == 0:  # pragma: no cover - a child is keyed by its first page
                break
            if m < len(child.key):
                child = self._split(child, m)
            self._tick(child)
            self._inc_hit_count(child)
            if child.on_device:
                dev.append(child.device_indices)
                last_dev = child
            else:
                host.append(child.host_indices)
            if child.backed_up and last_backed is node:
                backed.append(child.host_indices)
                last_backed = child
            node = child
            pos += m
        res = MatchResult(
            device_indices=torch.cat(dev) if dev else self._empty_device,
            last_device_node=last_dev,
            host_indices=torch.cat(host) if host else _EMPTY,
            last_host_node=node,
            backed_host_indices=torch.cat(backed) if backed else _EMPTY,
            last_backed_node=last_backed,
        )
        st = self.stats_
        st.match_queries += 1
        st.query_tokens += query_len
        st.device_hit_tokens += res.device_hit_length
        st.host_hit_tokens += res.host_hit_length
        st.miss_tokens += query_len - res.total_hit_length
        return res

    def _peek_hit(self, key: tuple[int, ...], root: TreeNode) -> tuple[int, int]:
        """(device hit, device + host hit) of page-aligned ``key`` below ``root``, tree
        untouched."""
        node, pos, dev = root, 0, 0
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None or child in self._stale:
                break
            m = self._match_len(child.key, key, pos)
            if m == 0:  # pragma: no cover - a child is keyed by its first page
                break
            if child.on_device:  # device nodes form a prefix of the path
                dev += m
            pos += m
            if m < len(child.key):
                break
            node = child
        return dev, pos

    def _agreed_hit_length(self, key: tuple[int, ...], root: TreeNode) -> int:
        """Tokens of ``key`` every TP rank may use: the smallest total hit over the ranks.
        If the ranks disagree even on the device hit, only the smallest device hit is used
        (no rank could load back a part another rank holds on the device). Without a TP
        group of several ranks: ``len(key)`` (no collective)."""
        group = self.controller.tp_group
        if tp_sync.world_size(group) <= 1:
            return len(key)
        dev, total = self._peek_hit(key, root)
        dmin, tmin, neg_dmax = tp_sync.agree_min_many([dev, total, -dev], group)
        return tmin if dmin == -neg_dmax else dmin

    # ------------------------------------------------------------------ insert
    def _check_indices(self, name: str, idx: Optional[torch.Tensor], n: int, limit: int,
                       device: torch.device) -> Optional[torch.Tensor]:
        if idx is None:
            return None
        if not isinstance(idx, torch.Tensor) or idx.dim() != 1 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name} must be a 1-D int64 tensor of slots")
        if idx.numel() != n:
            raise ValueError(f"{name} has {idx.numel()} slots but token_ids has {n} tokens: they must match")
        if n and (int(idx.min()) < 0 or int(idx.max()) >= limit):
            raise ValueError(f"{name} must hold slots in [0, {limit}) (no -1 padding)")
        idx = idx.to(device=device, dtype=torch.int64)  # the tree keeps each tier's slots on one device
        ps = self.page_size
        if ps > 1 and n:
            rows = idx.view(-1, ps)
            offs = torch.arange(ps, dtype=torch.int64, device=idx.device)
            if not bool(((rows[:, :1] % ps == 0) & (rows - rows[:, :1] == offs)).all()):
                raise ValueError(f"{name} must list whole pages: each run of page_size={ps} slots is "
                                 f"p*{ps} .. p*{ps}+{ps - 1}")
        return idx

    def insert(self, token_ids: Sequence[int] | torch.Tensor, device_indices: Optional[torch.Tensor] = None,
               host_indices: Optional[torch.Tensor] = None, cache_salt: Optional[str] = None) -> InsertResult:
        """Add a sequence whose KV is in ``device_indices`` and/or ``host_indices`` (int64
        [len(token_ids)], a whole number of pages) under ``cache_salt`` (None: unsalted).
        Nodes already in the tree keep their slots; a tier a node lacks is adopted from the
        caller's slots (a host-only node gets the new device slots, an unbacked node the new
        host slots). See :class:`InsertResult` for what the caller must free."""
        root = self._root_for(cache_salt)
        key = _as_tokens(token_ids)
        n = len(key)
        if device_indices is None and host_indices is None:
            raise ValueError("insert needs device_indices and/or host_indices")
        if n % self.page_size:
            raise ValueError(f"token_ids has {n} tokens: insert takes whole pages (a multiple of page_size={self.page_size})")
        dev = self._check_indices("device_indices", device_indices, n, self.controller.device_num_slots,
                                  self.controller.device_pool.device)
        hst = self._check_indices("host_indices", host_indices, n, self.controller.host_num_slots,
                                  torch.device("cpu"))
        dev_unused: list[torch.Tensor] = []
        host_unused: list[torch.Tensor] = []
        root = self._live_root(root) if n else root
        node = root
        pos = 0
        prefix_len = 0
        device_prefix = True
        for child, pos, m in self._walk_splitting(root, key):
            if dev is not None:
                seg = dev[pos:pos + m]
                if child.on_device:
                    dev_unused.append(seg[seg != child.device_indices])
                    if device_prefix:
                        prefix_len += m
                else:
                    # KV recomputed for a host-only node: take the fresh device copy.
                    self._set_device(child, seg.clone())
                    device_prefix = False
            elif not child.on_device:
                device_prefix = False
            if hst is not None:
                seg = hst[pos:pos + m]
                if child.backed_up:
                    host_unused.append(seg[seg != child.host_indices])
                else:
                    self._set_host(child, seg.clone())
            if child.on_device:
                self._inc_hit_count(child)
            node = child
            pos += m
        if pos < n:
            new = self._new_leaf(node, key, pos)
            if dev is not None:
                self._set_device(new, dev[pos:].clone())
            if hst is not None:
                self._set_host(new, hst[pos:].clone())
            self._refresh(new)
            self.stats_.inserted_tokens += n - pos
            if new.on_device:
                self._inc_hit_count(new)
            node = new
        return InsertResult(prefix_len=prefix_len, last_node=node,
                            device_unused=torch.cat(dev_unused) if dev_unused else self._empty_device,
                            host_unused=torch.cat(host_unused) if host_unused else _EMPTY)
