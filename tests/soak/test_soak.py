"""Soak runs (see ``harness``). CI mode by default: 2,000 requests through sparse-hier with the
tree and a file L3 wrapped in the fault injector, and a shorter run against a real Mooncake
master killed and restarted mid-run. ``SPARSEHI_SOAK=long`` runs the long mode (50,000
requests; ``SPARSEHI_SOAK_REQUESTS`` overrides the count)."""
from __future__ import annotations

import os

import pytest

from hicache.storage.fault_injection import FaultPlan
from mooncake_server import MooncakeMaster, missing_reason
from soak.harness import SoakConfig, run_soak

pytestmark = pytest.mark.usefixtures("one_thread")

LONG = os.environ.get("SPARSEHI_SOAK", "ci") == "long"
REQUESTS = int(os.environ.get("SPARSEHI_SOAK_REQUESTS", 50_000 if LONG else 2_000))

CI_FAULTS = FaultPlan(seed=1, raise_rate=0.02, delay_rate=0.02, delay_s=0.12, drop_write_rate=0.02,
                      truncate_rate=0.02, corrupt_rate=0.02)
"""Rates per call / page; the delay is past the 0.05 s prefetch timeout of ``SoakConfig``."""


def _assert_clean(res, requests):
    assert res.requests == requests
    assert res.mismatched_tokens == 0, res.first_mismatch
    assert res.leaked_slots == 0, res.leaks
    assert res.tokens_checked >= requests
    assert res.rss_growth_mib < 64, res  # bounded: the pools are fixed, the caches per distinct prompt


def test_soak_with_injected_storage_faults(tmp_path):
    res = run_soak(SoakConfig(requests=REQUESTS, seed=1, storage="file", storage_extra={"file_path": str(tmp_path)},
                              faults=CI_FAULTS))
    _assert_clean(res, REQUESTS)
    fc = res.fault_counts
    # every kind fired, and every fault that reached a read was served as one cache miss
    # (writes are few, a write-side kind alone can draw no fault in a run: counted together)
    assert all(fc[k] > 0 for k in ("raise_read", "raise_exists", "delay", "truncate", "corrupt")), fc
    assert fc["raise_write"] + fc["drop_write"] > 0, fc
    assert res.faults_injected == fc["total"] > 0
    assert res.faults_served_as_miss == res.faults_reaching_read > 0
    # ... while the cache kept working: prefixes reused from host and from L3
    sc = res.storage_counters
    assert res.prefix_hit_tokens > 0 and res.l3_hit_tokens > 0 and res.l3_pages_written > 0
    assert sc["l3_write_faults"] > 0 and sc["storage_orphans_released"] > 0 and sc["prefetch_truncated"] > 0


@pytest.mark.skipif(missing_reason() is not None, reason=missing_reason() or "")
def test_soak_with_mooncake_master_killed_and_restarted():
    n = max(400, REQUESTS // 5)
    with MooncakeMaster() as master:
        seen: dict[str, dict] = {}
        soak = None

        def snapshot(name):
            seen[name] = dict(soak.tree.stats()) if soak is not None else {}

        def kill():
            snapshot("kill")
            master.kill()

        def restart():
            snapshot("restart")
            master.start()

        from soak.harness import Soak
        # a small host pool, so prompts come back from L3 early and often
        cfg = SoakConfig(requests=n, seed=2, max_batch=4, host_pages=48, storage="mooncake",
                         storage_extra=master.extra_config(op_timeout_s=1.0, retry_interval_s=0.3,
                                                         global_segment_size="256mb"),  # never full here
                         events={n // 4: kill, n // 2: restart})
        soak = Soak(cfg)
        try:
            res = soak.run()
            faults = soak.storage.stats.faults
        finally:
            soak.close()
    _assert_clean(res, n)
    hits = (seen["kill"]["l3_hit_tokens"], seen["restart"]["l3_hit_tokens"], res.l3_hit_tokens)
    print(f"mooncake soak: store faults {faults}, L3 hit tokens at kill / restart / end {hits}")
    assert faults > 0  # the outage was felt, as misses ...
    assert hits[0] > 0, hits  # ... L3 served before it ...
    assert hits[2] > hits[1], hits  # ... and again after the restart


def test_the_soak_catches_wrong_kv():
    """The token check is not vacuous: a backend that hands out garbage pages as hits (no
    integrity check) makes the soak report mismatched tokens."""
    import torch

    from hicache.storage.registry import register_storage_backend, unregister_storage_backend
    from memory_storage import MemoryStorage

    class LyingStorage(MemoryStorage):
        def batch_get(self, keys, targets=None):
            out = super().batch_get(keys, targets)
            like = self.host_pool.page_tensor(0)
            for i, got in enumerate(out):
                if got is not None:  # a hit: its bytes replaced by garbage of the page's dtype
                    page = got.view(like.dtype).view(like.shape)
                    page.copy_(torch.randn(page.shape, generator=torch.Generator().manual_seed(i)) * 4)
            return out

    register_storage_backend("lying-test", lambda cfg: LyingStorage(cfg), replace=True)
    try:
        res = run_soak(SoakConfig(requests=150, seed=3, max_batch=4, host_pages=48, storage="lying-test"))
    finally:
        unregister_storage_backend("lying-test")
    assert res.l3_hit_tokens > 0
    assert res.mismatched_tokens > 0 and res.first_mismatch is not None
