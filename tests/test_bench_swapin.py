"""benchmarks/bench_swapin.py: the quick run end to end (rows, keys, correctness; FP8 host
pages included), the trace rule, and the per-step check catching a wrong device row or a
wrong table."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_swapin as bs
from benchmarks.swapin import hisparse, steps, workload
from benchmarks.swapin.row import ROW_KEYS, run_configuration
from sparsehi.kernels.selection_table import SelectionTable
from sparsehi.kv_manager import SparseKVCacheManager

pytestmark = pytest.mark.usefixtures("one_thread")


def test_quick_run_writes_every_row_correct(tmp_path):
    bs.main(["--quick", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "swapin.json").read_text())
    assert res["device"] and res["date"]
    want = {(sh.kind, sh.layout, b, ov) for sh, cfgs in workload.configurations(True, None) for b, ov in cfgs}
    got = {(r["kind"], r["layout"], r["B"], r["overlap"]) for r in res["rows"]}
    assert got == want and len(res["rows"]) == len(want)
    assert {r["kind"] for r in res["rows"]} == {"mla", "mha"}
    assert {r["layout"] for r in res["rows"] if r["kind"] == "mha"} == {"layer_first", "page_first"}
    for r in res["rows"]:
        assert set(ROW_KEYS) <= set(r), set(ROW_KEYS) - set(r)
        assert r["correct"] is True
        assert r["hisparse_us"] is None  # quick: no HiSparse
        assert r["us"] > 0 and r["eager_host_us"] > 0
        assert r["misses_per_step"] > 0  # steady state still misses at overlap < 1
        page_bytes = workload.mla_shape(True).spec().page_bytes_per_layer if r["kind"] == "mla" else \
            workload.mha_shape(r["layout"], True).spec().page_bytes_per_layer
        assert abs(r["bytes_per_step"] - r["misses_per_step"] * page_bytes) <= 0.05 * page_bytes + 1
    assert res["hisparse"]["available"] is False and "quick" in res["hisparse"]["why_not"]
    assert len(res["targets"]) == len(res["rows"])
    for t in res["targets"]:
        assert t["status"] in ("MET", "MISSED", "UNMEASURED")
        if not torch.cuda.is_available():
            assert t["status"] == "UNMEASURED" and res["h2d_gbps"] is None


def test_quick_fp8_rows_are_correct_and_move_fp8_bytes(tmp_path):
    bs.main(["--quick", "--only", "mha", "--fp8", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "swapin.json").read_text())
    fp8 = [r for r in res["rows"] if r["host_kv_dtype"] == "fp8_e4m3"]
    bf16 = [r for r in res["rows"] if r["host_kv_dtype"] == "auto" and r["layout"] == "page_first"]
    assert [r["B"] for r in fp8] == [r["B"] for r in bf16] and fp8 and {r["layout"] for r in fp8} == {"page_first"}
    shape = workload.mha_shape("page_first", True, "fp8_e4m3")
    spec = shape.spec()
    # a page of one layer: E4M3 values plus a float32 scale per buffer and head
    heads = spec.num_buffers * spec.kv_heads
    page_bytes = spec.page_size * heads * spec.head_dim + heads * 4
    for r in fp8:
        assert r["correct"] is True and r["us"] > 0 and r["misses_per_step"] > 0
        assert abs(r["bytes_per_step"] - r["misses_per_step"] * page_bytes) <= 0.05 * page_bytes + 1
    assert "mha/page_first/fp8" in res["settings"]["shapes"] and "mha/page_first" in res["settings"]["shapes"]


def test_trace_keeps_exactly_the_overlap():
    k, lo, hi = 40, 5, 300
    tr = workload.SelectionTrace(3, k, lo, hi, 0.85, seed=1)
    prev = tr.next()
    for _ in range(5):
        cur = tr.next()
        assert cur.dtype == torch.int32 and cur.shape == (3, k)
        assert bool((cur[:, 1:] > cur[:, :-1]).all()), "ascending and distinct"
        assert bool(((cur >= lo) & (cur < hi)).all())
        for b in range(3):
            assert len(set(cur[b].tolist()) & set(prev[b].tolist())) == round(k * 0.85)
        prev = cur


def _shape(kind: str, layout: str):
    if kind == "mla":
        return workload.mla_shape(True)
    if kind == "mha-fp8":
        return workload.mha_shape("page_first", True, "fp8_e4m3")
    return workload.mha_shape(layout, True)


def _one_step(shape, batch=2):
    pools = workload.ShapePools(shape, batch, 64, torch.device("cpu"))
    cfg = shape.sparse_config()
    mgr = SparseKVCacheManager(cfg, pools.device_pool, mode="hierarchical", host_pool=pools.host_pool,
                               sparse_layers=(workload.LAYER,), max_num_reqs=batch, max_context_len=shape.context + 8,
                               validate=False)
    host_slots = workload.open_requests(pools, mgr, batch)
    n_prompt = shape.context // shape.page_size
    trace = workload.SelectionTrace(batch, cfg.top_k_units, cfg.sink_units, n_prompt - cfg.recent_units, 0.85, seed=3)
    s = steps.SwapInStep(mgr, batch, cfg.top_k_units, shape.context)
    s.prepare(trace.next())
    _, tab = s.body()
    return pools, mgr, host_slots, s, tab


@pytest.mark.parametrize("kind", ["mla", "mha", "mha-fp8"])
def test_check_catches_a_wrong_row_and_a_wrong_table(kind):
    shape = _shape(kind, "page_first")
    pools, mgr, host_slots, s, tab = _one_step(shape)
    check = lambda t, topk: workload.selection_holds_host_data(pools, t, topk, host_slots, mgr.sizes.sink, mgr.sizes.recent)  # noqa: E731
    assert check(tab, s.topk)
    # one selected id's device row loses the end of its last head
    ps = shape.page_size
    slot = int(tab.physical[1, mgr.sizes.sink + 3]) * ps + ps - 1
    kv32 = pools.device_pool.kv_data.view(torch.int32)
    saved = kv32[-1, workload.LAYER, slot, -1, -1].clone()
    kv32[-1, workload.LAYER, slot, -1, -1] += 1
    assert not check(tab, s.topk)
    kv32[-1, workload.LAYER, slot, -1, -1] = saved
    assert check(tab, s.topk)
    # a table pointing a selected id at another id's page
    bad = SelectionTable(tab.logical, tab.physical.clone(), tab.page_table, tab.num_valid, tab.attended)
    bad.physical[0, mgr.sizes.sink], bad.physical[0, mgr.sizes.sink + 1] = tab.physical[0, mgr.sizes.sink + 1], tab.physical[0, mgr.sizes.sink]
    assert not check(bad, s.topk)
    # a table that lists another selection
    other = s.topk.clone()
    other[0, 0] -= 1 if int(other[0, 0]) > mgr.sizes.sink else -1
    assert not check(tab, other)


@pytest.mark.parametrize("kind", ["mla", "mha", "mha-fp8"])
def test_split_parts_do_what_swap_in_does(kind):
    """The split times the swap-in's kernels one by one: run that way, each step leaves the
    same buffer state and table as the manager's own swap_in does on a twin manager."""
    shape = _shape(kind, "layer_first")
    a = _one_step(shape)
    b = _one_step(shape)
    parts = steps.SwapInParts(b[3], b[0].host_pool, b[0].device_pool)
    n_prompt = shape.context // shape.page_size
    cfg = shape.sparse_config()
    trace = workload.SelectionTrace(2, cfg.top_k_units, cfg.sink_units, n_prompt - cfg.recent_units, 0.5, seed=4)
    for _ in range(4):
        topk = trace.next()
        a[3].prepare(topk)
        b[3].prepare(topk)
        _, tab_a = a[3].body()
        tab_b = parts.run()
        assert workload.selection_holds_host_data(b[0], tab_b, b[3].topk, b[2], b[1].sizes.sink, b[1].sizes.recent)
        assert torch.equal(tab_a.physical, tab_b.physical) and torch.equal(tab_a.logical, tab_b.logical)
        for x, y in zip(a[3].dec.lru.layer(0), b[3].dec.lru.layer(0)):
            assert torch.equal(x, y)
    # padding rows (the warm-up before capture) change nothing, even on a selection that
    # would miss
    b[3].topk.copy_(trace.next())
    kv = b[0].device_pool.kv_data.view(torch.int16)  # the pattern words read as bf16 hold NaNs
    before = [t.clone() for t in b[3].dec.lru.layer(0)] + [kv.clone()]
    parts.run(torch.full((2,), -1, dtype=torch.int64))
    after = list(b[3].dec.lru.layer(0)) + [kv]
    assert all(torch.equal(x, y) for x, y in zip(before, after))


def test_targets_follow_the_issue_rules():
    split = {"diff": 10.0, "copy": 30.0, "table": 3.0}
    mla = {"kind": "mla", "layout": "layer_first", "B": 64, "overlap": 0.85, "io_limit_us": 30.0, "split_us": split}
    assert bs.judge({**mla, "us": 40.0, "hisparse_us": 45.0})["status"] == "MET"  # bound min(45, 49.5)
    t = bs.judge({**mla, "us": 46.0, "hisparse_us": 45.0})
    assert t["status"] == "MISSED" and t["bound_us"] == 45.0 and t["largest_term"] == "copy"
    t = bs.judge({**mla, "us": 46.0, "hisparse_us": 60.0})  # the IO term binds: 1.15 * 30 + 15
    assert t["status"] == "MET" and t["bound_us"] == 49.5
    t = bs.judge({**mla, "us": 46.0, "hisparse_us": None})
    assert t["status"] == "MET" and "HiSparse absent" in t["rule"]
    mha = {**mla, "kind": "mha", "hisparse_us": None}
    t = bs.judge({**mha, "us": 50.0})
    assert t["status"] == "MISSED" and "hisparse" not in t["rule"] and t["split_us"] == split
    assert bs.judge({**mha, "us": 50.0, "io_limit_us": None})["status"] == "UNMEASURED"


def test_hisparse_absence_says_why():
    fn, why = hisparse.load_hisparse()
    assert (fn is None) == bool(why)


@pytest.mark.gpu
def test_graph_path_small_rows_are_correct():
    """The GPU path (graph replays, split graphs, HiSparse when present) on quick shapes."""
    fn, _ = hisparse.load_hisparse()
    for shape in (workload.mla_shape(True), workload.mha_shape("layer_first", True),
                  workload.mha_shape("page_first", True, "fp8_e4m3")):
        pools = workload.ShapePools(shape, 2, 64, torch.device("cuda"))
        row = run_configuration(pools, 2, 0.85, timed=3, split_steps=2, warm_min=2, graphs=True,
                                   hisparse_fn=fn if shape.kind == "mla" else None)
        assert row["correct"] is True and row["us"] > 0
        assert set(row["split_us"]) == {"diff", "copy", "table"}
        if row["hisparse_us"] is not None:
            assert row["hisparse_correct"] is True
