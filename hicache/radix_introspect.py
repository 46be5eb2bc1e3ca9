"""The HiRadixTree's introspection (mixed into :class:`hicache.radix_tree.HiRadixTree`):
node iteration over every root (the plain one and each cache salt's), slot listings,
``stats()`` and ``check_invariants()`` (the invariants are listed in ``hicache.radix_tree``)."""
from __future__ import annotations

from typing import Iterable

import torch

from hicache.radix_node import _EMPTY, TreeNode


class TreeIntrospection:
    """Read-only views of a HiRadixTree's state."""

    # ------------------------------------------------------------------ introspection
    def nodes(self) -> Iterable[TreeNode]:
        stack = list(self.root.children.values())
        for r in self.salt_roots.values():
            stack.extend(r.children.values())
        while stack:
            x = stack.pop()
            yield x
            stack.extend(x.children.values())

    def all_device_indices(self) -> torch.Tensor:
        xs = [x.device_indices for x in self.nodes() if x.on_device]
        return torch.cat(xs) if xs else _EMPTY

    def all_host_indices(self) -> torch.Tensor:
        xs = [x.host_indices for x in self.nodes() if x.backed_up]
        return torch.cat(xs) if xs else _EMPTY

    def stats(self) -> dict[str, int]:
        """Hit tokens per tier, bytes moved per direction, evictions, queue depths, sizes."""
        out = self.stats_.as_dict()
        out.update(self.controller.stats())
        out.update(
            device_tokens=self.device_tokens(), evictable_device_tokens=self._evictable,
            protected_device_tokens=self._protected, host_tokens=self._host_tokens,
            ongoing_writes=len(self.ongoing_write), ongoing_loads=len(self.ongoing_load),
            stale_nodes=len(self._stale),
        )
        out.update(self.fault_stats)
        out.update(self.storage_stats_dict())
        return out

    def check_invariants(self) -> None:
        """Assert the structural invariants listed in the module docstring."""
        ps = self.page_size
        ev = pr = ht = 0
        dleaves, hleaves = set(), set()
        for x in self.nodes():
            p = x.parent
            assert p is not None and p.children.get(self._child_key(x.key)) is x, f"{x}: broken parent link"
            assert len(x.key) > 0 and len(x.key) % ps == 0, f"{x}: key not whole pages"
            assert x.on_device or x.backed_up, f"{x}: holds no KV"
            if x.on_device:
                assert len(x.device_indices) == len(x.key), f"{x}: device length"
                assert p.is_root or p.on_device, f"{x}: on device under an evicted parent"
                if x.lock_ref > 0:
                    pr += len(x.key)
                else:
                    ev += len(x.key)
            if x.backed_up:
                assert len(x.host_indices) == len(x.key), f"{x}: host length"
                assert p.is_root or p.backed_up, f"{x}: backup continuity broken"
                ht += len(x.key)
            assert x.lock_ref >= sum(c.lock_ref for c in x.children.values()), f"{x}: lock_ref below children's"
            assert x.host_lock_ref >= sum(c.host_lock_ref for c in x.children.values()), f"{x}: host lock"
            assert x.lock_ref >= 0 and x.host_lock_ref >= 0
            if x.host_lock_ref > 0:
                assert x.backed_up, f"{x}: host-locked without host copy"
            if x.loading or x.write_ack is not None:
                assert x.lock_ref > 0, f"{x}: in-flight transfer without a lock"
            if x.storage_op is not None:
                assert x.host_lock_ref > 0 and x.storage_op in self.ongoing_backup, f"{x}: L3 write without a host lock"
            if self._is_device_leaf(x):
                dleaves.add(x)
            if self._is_host_leaf(x):
                hleaves.add(x)
        assert (ev, pr, ht) == (self._evictable, self._protected, self._host_tokens), "size counters drifted"
        live = set(self.nodes())
        for x in self._stale:
            assert x in live and x.on_device and x.lock_ref > 0, f"{x}: stale node not held on the device"
        for op in self.ongoing_prefetch.values():
            st = op.start_node
            assert st.is_root or (st in live and st.host_lock_ref > 0), f"{st}: prefetch start not host-locked"
        for salt, r in self.salt_roots.items():
            assert r.is_root and r.salt == salt and r.lock_ref == 1, f"{r}: broken salt root {salt!r}"
            assert r.children, f"empty salt root {salt!r} not dropped"
        assert dleaves == self.device_leaves, "device leaf set drifted"
        assert hleaves == self.host_leaves, "host leaf set drifted"
