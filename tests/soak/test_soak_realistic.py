"""The ``gpu-realistic`` soak (``realistic.py``): its full plan has the sizes users run, and
the same plan at a CPU scale (few requests, prompts and decode lengths scaled down, page
sizes 16 and 64 kept) runs through the same code path: Quest at both page sizes and DSA,
8 layers, the attention adapters, one graph bucket, admission by host room, a hot window
of prefixes sweeping over more than the host pool holds, bursts, an L3 file store under
injected faults, every token checked and the accounting checked at every quiescent
moment."""
from __future__ import annotations

import json
import time

import pytest

from soak import realistic
from soak.harness import runtime_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_full_plan_has_the_sizes_users_run():
    subs = realistic.plan(device="cuda", l3_root="/nonexistent")
    cfgs = [s.cfg for s in subs]
    assert sum(c.requests for c in cfgs) >= 5_000
    assert {c.page_size for c in cfgs if c.algorithm == "quest"} == {16, 64}
    assert {c.algorithm for c in cfgs} == {"quest", "dsa"}
    for c in cfgs:
        shortest = min(c.prefix_lengths) + c.suffix_tokens[0]
        longest = max(c.prefix_lengths) + c.suffix_tokens[1]
        assert 1024 <= shortest < 2048 and 30_000 < longest <= 32768
        assert c.decode_steps == (64, 512) and c.max_batch == 64 and c.num_layers >= 8
        assert c.top_k_pages >= 64 and c.cuda_graph and c.single_bucket and c.faults is not None
        # the prefixes' KV exceeds the host pool, which exceeds the device pool (HiCache's rule)
        device = runtime_config(c, cached=True).auto_device_tokens()
        assert device < c.host_pages * c.page_size < sum(c.prefix_lengths)
        # a bounded set of distinct prompts, each asked for many times
        assert len(c.prefix_lengths) * c.suffixes_per_prefix * 20 < c.requests


def test_plan_at_cpu_scale(tmp_path):
    # the smallest plan (of those tried) that still fills the host pool and reaches L3 in every sub-run
    subs = realistic.plan(requests=36, scale=0.015, device="cpu", seed=1, l3_root=str(tmp_path), max_batch=4)
    assert {(s.cfg.algorithm, s.cfg.page_size) for s in subs} == {("quest", 16), ("quest", 64), ("dsa", 1)}
    records = realistic.run_plan(subs, budget_s=600.0, progress=None)
    for r in records:
        res = r.result
        assert res["requests"] == r.config["requests"], r.name
        assert res["mismatched_tokens"] == 0, (r.name, res["first_mismatch"])
        assert res["leaked_slots"] == 0, (r.name, res["leaks"])
        assert res["tokens_checked"] == res["requests"] + res["decode_tokens"]
        assert res["quiescent_checks"] >= 2, r.name  # each burst drains
        assert res["faults_served_as_miss"] == res["faults_reaching_read"]
        # the host pool ran short: requests waited for room, the tree evicted, L3 was asked
        assert res["admission_waits"] > 0 and res["host_evicted_tokens"] > 0, r.name
        assert res["storage_counters"]["prefetch_ops"] > 0 and res["l3_pages_written"] > 0, r.name
        assert res["min_reference_gap"] is not None and res["min_reference_gap"] >= 0
        assert r.timings["wall_s"] >= r.timings["run_s"] > 0
    # cold prefixes came back from L3, and faults were injected
    assert sum(r.result["l3_hit_tokens"] for r in records) > 0
    assert sum(r.result["faults_injected"] for r in records) > 0
    run = realistic.summary(records, "cpu", 600.0, 1.0, 36)
    assert run["mode"] == "gpu-realistic" and run["requests"] == 36 and len(run["subruns"]) == 3
    json.dumps(run)  # the results file takes it as is


def test_time_budget_ends_the_plan_and_records_what_ran(tmp_path):
    subs = realistic.plan(requests=600, scale=0.02, device="cpu", seed=2, l3_root=str(tmp_path), max_batch=4)
    t0 = time.perf_counter()
    records = realistic.run_plan(subs, budget_s=9.0, progress=None)
    wall = time.perf_counter() - t0
    assert len(records) == 3  # every sub-run got its share and ran
    ran = [r.result["requests"] for r in records]
    assert all(0 < n < s.cfg.requests for n, s in zip(ran, subs)), ran
    # past the budget: the in-flight requests' last steps and their reference checks, which
    # took up to 9 s on a 2-core machine also running the rest of the suite; all 600
    # requests would take minutes
    assert wall < 9.0 + 12.0, wall
    for r in records:
        assert r.result["mismatched_tokens"] == 0 and r.result["leaked_slots"] == 0


def test_concurrent_plan_checks_every_sub_run_in_its_own_process(tmp_path):
    subs = realistic.plan(requests=12, scale=0.02, device="cpu", seed=3, l3_root=str(tmp_path), max_batch=2)
    records = realistic.run_plan_concurrently(subs, budget_s=120.0, progress=None)
    assert [r.name for r in records] == [s.name for s in subs]
    for r, s in zip(records, subs):
        assert r.result["requests"] == s.cfg.requests  # the budget was not the limit
        assert r.result["tokens_checked"] > 0
        assert r.result["mismatched_tokens"] == 0 and r.result["leaked_slots"] == 0
        assert r.result["quiescent_checks"] >= 1


def test_copies_split_each_shape_into_sub_runs_with_their_own_prompts(tmp_path):
    subs = realistic.plan(requests=600, scale=0.02, device="cpu", seed=5, l3_root=str(tmp_path), copies=2)
    assert [s.name for s in subs] == [f"{shape.name}#{i}" for shape in realistic.SHAPES for i in (1, 2)]
    assert sum(s.cfg.requests for s in subs) == 600
    for a, b in zip(subs[::2], subs[1::2]):
        assert a.cfg.seed != b.cfg.seed and abs(a.cfg.requests - b.cfg.requests) <= 1
        assert a.cfg.storage_extra["file_path"] != b.cfg.storage_extra["file_path"]
        assert (a.cfg.page_size, a.cfg.algorithm) == (b.cfg.page_size, b.cfg.algorithm)
    with pytest.raises(ValueError, match="copies must be an int >= 1"):
        realistic.plan(requests=600, scale=0.02, device="cpu", l3_root=str(tmp_path), copies=0)
