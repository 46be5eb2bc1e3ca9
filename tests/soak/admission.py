"""Host-memory admission of the soak's scheduler.

In ``sparse-hier`` every token's KV lives in the host pool (the device holds the Top-k
buffers only), so the host pool is the KV capacity. A request starts only while the pool
can hold the KV it will write next to what the running requests will still write, counting
what the prefix tree could evict for it; a serving scheduler admits by free plus evictable
KV memory the same way. The pool can then be far smaller than the running requests' worst
case (every request at full context), so the tree evicts, and prompts come back from L3.
"""
from __future__ import annotations

import time
from typing import Sequence

from hicache.radix_node import TreeNode


class HostAdmission:
    """Admission checks against one ``SparseCoordinatorMode``'s host pool and prefix tree."""

    def __init__(self, mode) -> None:
        self.mode = mode
        self.tree = mode.tree
        self.host = mode.host
        self.page_size = mode.rt.page_size

    def _host_match(self, prompt: Sequence[int]) -> tuple[int, list[TreeNode]]:
        """The prompt's host-resident prefix in the tree, without touching it (no split, no
        recency tick, no hit counted): ``(tokens, the nodes it runs through)``."""
        tree, ps = self.tree, self.page_size
        key = tuple(prompt[: len(prompt) - len(prompt) % ps])
        node, pos, path = tree._root_for(None), 0, []
        while pos < len(key):
            child = node.children.get(tree._child_key(key, pos))
            if child is None or not child.backed_up:
                break
            m = tree._match_len(child.key, key, pos)
            if m == 0:
                break
            path.append(child)
            pos += m
            if m < len(child.key):
                break
            node = child
        return pos, path

    def need(self, prompt: Sequence[int], steps: int) -> tuple[int, list[TreeNode]]:
        """Host slots the request may allocate (its prompt beyond the host-resident prefix
        it will reuse, and ``steps`` decoded tokens, in whole pages plus a page of slack)
        and the prefix's nodes (the request will lock them: not evictable for it).

        With L3 the prompt part counts twice: the prefetch reserves it, and a fetch that
        outlives its timeout keeps that reservation (an orphaned tail, released when the
        read returns) while the prefill allocates the prompt again."""
        ps = self.page_size
        hit, path = self._host_match(prompt)
        hit = min(hit, (len(prompt) - 1) // ps * ps)  # as begin_request: one token left to prefill
        new = -(-(len(prompt) - hit) // ps) * ps
        if self.tree.storage_ctl is not None:
            new *= 2
        return new + -(-steps // ps) * ps + 2 * ps, path

    def growth(self, remaining_steps: Sequence[int]) -> int:
        """Host slots the running requests may still allocate (their remaining decode steps,
        in whole pages plus one page each)."""
        ps = self.page_size
        return sum(-(-s // ps) * ps + ps for s in remaining_steps)

    def evictable(self, keep: Sequence[TreeNode] = ()) -> int:
        """Host tokens of tree nodes no request, L3 write or prefetch holds (a lock holds a
        node's whole path, so an unlocked node's subtree is unlocked too), except ``keep``."""
        skip = {id(x) for x in keep}
        return sum(len(x.host_indices) for x in self.tree.nodes()
                   if x.backed_up and x.lock_ref == 0 and x.host_lock_ref == 0 and id(x) not in skip)

    def fits(self, prompt: Sequence[int], steps: int, remaining_steps: Sequence[int]) -> bool:
        """Whether the request can start now without the pool running out for it or for the
        running requests (``remaining_steps``: theirs)."""
        need, path = self.need(prompt, steps)
        room = self.host.available_size() - self.growth(remaining_steps)
        if room >= need:  # the common case: no tree walk
            return True
        return room + self.evictable(path) >= need

    def settle(self, timeout_s: float = 10.0) -> None:
        """With nothing running: wait for the L3 writes in flight (they pin host pages) and
        for late prefetch reads (orphaned reservations), so what they hold becomes free or
        evictable."""
        tree = self.tree
        if tree.storage_ctl is None:
            return
        tree.flush_storage()
        end = time.monotonic() + timeout_s
        while tree._orphans and time.monotonic() < end:
            tree.check_storage_events()
            time.sleep(0.01)
