"""Model-based test of HiRadixTree + HiCacheController on small CPU pools.

Random sequences of insert (device / host-only / both), match, lock / unlock (device and
host), device eviction, host eviction, single-node eviction, load-back and ack polling
over token sequences from a 3-letter alphabet (so they share prefixes), with injected
transfer faults (the next backup or load raises before copying anything). The KV written
for a token is a function of its whole prefix, so after every step the test can check that
every slot the tree holds and offers contains exactly the KV of the tokens it stands for.
Requests carry one of three cache salts (none, "a", "b"), and the KV is a function of the
salt too: a page shared across salts would hold the wrong KV for one of them.
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache.controller import HiCacheController
from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.kv_spec import KVCacheSpec
from hicache.radix_tree import HiRadixTree
from hicache.transfer import KVTransferEngine

LAYERS, HEADS, DIM = 2, 1, 2
PS = 2
DEV_SLOTS = 12 * PS  # 11 usable pages (page 0 is reserved)


SALTS = {None: 0, "a": 1, "b": 2}
salt_st = st.sampled_from(sorted(SALTS, key=str))


def expected(tokens, salt=None) -> torch.Tensor:
    """[L, B, n, H, D] float32 with exact integer values derived from each token's prefix
    and the cache salt."""
    codes, h = [], 11 + 97 * SALTS[salt]
    for t in tokens:
        h = (h * 1_000_003 + int(t) + 1) % 1_048_573
        codes.append(h)
    c = torch.tensor(codes, dtype=torch.int64).view(1, 1, -1, 1, 1)
    l = torch.arange(LAYERS).view(-1, 1, 1, 1, 1)
    b = torch.arange(2).view(1, 2, 1, 1, 1)
    hd = torch.arange(HEADS * DIM).view(1, 1, 1, HEADS, DIM)
    return ((c * 7 + l * 131 + b * 17 + hd) % (1 << 23)).float()


class OneShotFaultEngine(KVTransferEngine):
    """The real engine, except that the next backup / load named in ``fail_next`` raises
    without copying (a fault injection, the tree and controller are the real ones)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.fail_next: set[str] = set()

    def backup(self, *a, **k):
        if "backup" in self.fail_next:
            self.fail_next.discard("backup")
            raise RuntimeError("injected backup fault")
        return super().backup(*a, **k)

    def load(self, *a, **k):
        if "load" in self.fail_next:
            self.fail_next.discard("load")
            raise RuntimeError("injected load fault")
        return super().load(*a, **k)


tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=5).flatmap(
    lambda pages: st.lists(st.integers(0, 2), min_size=len(pages) * PS, max_size=len(pages) * PS)
)


class TreeMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]))
    def setup(self, policy):
        spec = KVCacheSpec("mha", LAYERS, HEADS, DIM, torch.float32, PS)
        self.dev = DeviceKVPool(spec, DEV_SLOTS, "cpu")
        self.host = HostKVPool(self.dev, hicache_ratio=2.0)
        self.engine = OneShotFaultEngine(self.dev, self.host, "direct")
        self.ctl = HiCacheController(self.dev, self.host, write_policy=policy, io_backend="direct",
                                     transfer=self.engine)
        self.tree = HiRadixTree(self.ctl)
        self.locks: list = []  # device-locked nodes (with their path's device slots)
        self.host_locks: list = []

    def teardown(self):
        if hasattr(self, "ctl"):
            self.ctl.close()

    # ---------------------------------------------------------------- helpers
    def _prefix_tokens(self, node):
        parts = []
        while not node.is_root:
            parts.append(node.key)
            node = node.parent
        return [t for k in reversed(parts) for t in k]

    def _salt(self, node):
        while not node.is_root:
            node = node.parent
        return node.salt

    def _path(self, node):
        out = []
        while not node.is_root:
            out.append(node)
            node = node.parent
        return out[::-1]

    def _snapshot(self):
        return sorted(
            (n.id, n.key, None if n.device_indices is None else tuple(n.device_indices.tolist()),
             None if n.host_indices is None else tuple(n.host_indices.tolist()), n.lock_ref, n.host_lock_ref)
            for n in self.tree.nodes()
        )

    def _path_slots(self, node, tier):
        """Slots of ``tier`` along root..node (None where a node lacks the tier); splits
        inside the path do not change it."""
        parts = []
        while not node.is_root:
            parts.append(getattr(node, tier))
            node = node.parent
        if any(p is None for p in parts):
            return None
        return torch.cat(list(reversed(parts))).clone()

    # ---------------------------------------------------------------- rules
    @rule(tokens=tokens_st, where=st.sampled_from(["device", "host", "both"]), salt=salt_st)
    def insert(self, tokens, where, salt):
        n = len(tokens)
        kv = expected(tokens, salt)
        dslots = hslots = None
        if where in ("device", "both"):
            dslots = self.dev.allocator.alloc(n)
            if dslots is None:
                self.tree.evict(n)
                dslots = self.dev.allocator.alloc(n)
            if dslots is None:
                return
            for layer in range(LAYERS):
                self.dev.set_kv(layer, dslots, kv[layer, 0], kv[layer, 1])
        if where in ("host", "both"):
            hslots = self.host.alloc(n)
            if hslots is None:
                self.tree.evict_host(n)
                hslots = self.host.alloc(n)
            if hslots is None:
                if dslots is not None:
                    self.dev.allocator.free(dslots)
                return
            for layer in range(LAYERS):
                self.host.write_tokens(layer, hslots, kv[layer, 0], kv[layer, 1])
        res = self.tree.insert(tokens, device_indices=dslots, host_indices=hslots, cache_salt=salt)
        if res.device_unused.numel() or res.host_unused.numel():
            event("insert: duplicate slots returned")
        self.dev.allocator.free(res.device_unused)
        self.host.free(res.host_unused)
        assert self._prefix_tokens(res.last_node) == list(tokens) and self._salt(res.last_node) == salt

    @rule(tokens=tokens_st, salt=salt_st)
    def match(self, tokens, salt):
        m = self.tree.match_prefix(tokens, cache_salt=salt)
        d, h = m.device_hit_length, m.host_hit_length
        assert d + h <= len(tokens)
        assert self._salt(m.last_host_node) == salt
        kv = expected(tokens, salt)
        got = torch.stack([torch.stack([b[m.device_indices] for b in self.dev.layer_buffers(l)]) for l in range(LAYERS)])
        # KV still loading is not ready yet (the forward pass waits per layer): check up to it
        ready = 0
        for x in self._path(m.last_device_node):
            if x.loading:
                break
            ready += len(x.key)
        assert torch.equal(got[:, :, :ready], kv[:, :, :ready])
        assert self._prefix_tokens(m.last_device_node) == list(tokens[:d])
        assert self._prefix_tokens(m.last_host_node) == list(tokens[:d + h])
        if self.tree.backup_complete(m.last_backed_node):
            b = m.backed_length
            got = torch.stack([torch.stack(self.host.read_tokens(l, m.backed_host_indices)) for l in range(LAYERS)])
            assert torch.equal(got, kv[:, :, :b])

    @rule(tokens=tokens_st, salt=salt_st)
    def lock(self, tokens, salt):
        m = self.tree.match_prefix(tokens, cache_salt=salt)
        node = m.last_device_node
        if not node.is_root:
            self.tree.inc_lock_ref(node)
            self.locks.append((node, self._path_slots(node, "device_indices")))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        node, _ = self.locks.pop(i % len(self.locks))
        self.tree.dec_lock_ref(node)

    @rule(tokens=tokens_st, salt=salt_st)
    def host_lock(self, tokens, salt):
        m = self.tree.match_prefix(tokens, cache_salt=salt)
        node = m.last_backed_node
        if not node.is_root:
            self.tree.inc_host_lock(node)
            self.host_locks.append((node, self._path_slots(node, "host_indices")))

    @precondition(lambda self: self.host_locks)
    @rule(i=st.integers(0, 100))
    def host_unlock(self, i):
        node, _ = self.host_locks.pop(i % len(self.host_locks))
        self.tree.dec_host_lock(node)

    @rule(n=st.integers(0, 30))
    def evict(self, n):
        if self.tree.evict(n):
            event("device eviction freed slots")

    @rule(n=st.integers(0, 30))
    def evict_host(self, n):
        if self.tree.evict_host(n):
            event("host eviction freed slots")

    @rule(i=st.integers(0, 1000))
    def evict_one_node(self, i):
        nodes = sorted(self.tree.nodes(), key=lambda x: x.id)
        if not nodes:
            return
        node = nodes[i % len(nodes)]
        before = self._snapshot()
        try:
            self.tree.evict_node(node)
        except ValueError:
            event("evict_node refused")
            assert self._snapshot() == before  # refused: tree unchanged

    @rule(i=st.integers(0, 1000))
    def bad_unlock(self, i):
        nodes = [x for x in self.tree.nodes() if x.lock_ref == 0]
        if not nodes:
            return
        node = sorted(nodes, key=lambda x: x.id)[i % len(nodes)]
        before = self._snapshot()
        with pytest.raises(ValueError):
            self.tree.dec_lock_ref(node)
        assert self._snapshot() == before

    @rule(tokens=tokens_st, salt=salt_st)
    def load_back(self, tokens, salt):
        m = self.tree.match_prefix(tokens, cache_salt=salt)
        if m.host_hit_length == 0:
            return
        slots, last = self.tree.init_load_back(m.last_host_node, m.host_hit_length)
        self.tree.ready_to_load_host_cache()
        if slots.numel():
            event("load-back issued")
            assert last is m.last_host_node and last.on_device

    @rule(kind=st.sampled_from(["backup", "load"]))
    def inject_fault(self, kind):
        self.engine.fail_next.add(kind)

    @rule(block=st.booleans())
    def poll(self, block):
        before = self.tree.stats()
        self.tree.writing_check(block=block)
        self.tree.loading_check(block=block)
        after = self.tree.stats()
        for k in ("write_failures", "write_retries", "load_failures"):
            if after[k] > before[k]:
                event(f"poll: {k}")
        if after["stale_nodes"]:
            event("poll: stale node held by a lock")

    # ---------------------------------------------------------------- invariants
    @invariant()
    def consistent(self):
        if not hasattr(self, "tree"):
            return
        tree = self.tree
        tree.check_invariants()
        dev_idx = tree.all_device_indices()
        host_idx = tree.all_host_indices()
        # no slot owned twice
        assert dev_idx.unique().numel() == dev_idx.numel()
        assert host_idx.unique().numel() == host_idx.numel()
        # pool free counts equal what the tree does not hold (page 0 is reserved)
        assert self.dev.allocator.available_size() == DEV_SLOTS - PS - dev_idx.numel()
        assert self.host.available_size() == self.host.num_slots - PS - host_idx.numel()
        if dev_idx.numel():
            assert not bool(self.dev.allocator.is_free(dev_idx[::PS] // PS).any())
        if host_idx.numel():
            assert not bool(self.host.allocator.is_free(host_idx[::PS] // PS).any())
        # locked nodes keep their slots
        for node, slots in self.locks:
            now = self._path_slots(node, "device_indices")
            assert now is not None and torch.equal(now, slots), "a locked node lost its device slots"
        for node, slots in self.host_locks:
            now = self._path_slots(node, "host_indices")
            assert now is not None and torch.equal(now, slots), "a host-locked node lost its host slots"
        # every slot holds the KV of the tokens it stands for
        for x in tree.nodes():
            kv = expected(self._prefix_tokens(x), self._salt(x))[:, :, -len(x.key):]
            if x.on_device and not x.loading and x not in tree._stale:
                got = torch.stack([torch.stack([b[x.device_indices] for b in self.dev.layer_buffers(l)])
                                   for l in range(LAYERS)])
                assert torch.equal(got, kv), f"device KV mismatch at {x}"
            if x.backed_up and x.write_ack is None:
                got = torch.stack([torch.stack(self.host.read_tokens(l, x.host_indices)) for l in range(LAYERS)])
                assert torch.equal(got, kv), f"host KV mismatch at {x}"


TreeMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("HICACHE_STATEFUL_EXAMPLES", "40")), stateful_step_count=80, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_tree_model = TreeMachine.TestCase
