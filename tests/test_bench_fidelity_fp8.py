"""bench_fidelity's FP8 host KV section: the synthetic KV is rounded page by page exactly as
the FP8 page format stores it; a prompt's Quest bounds are built from its unrounded keys,
as the section's ``bf16_keys`` rows assume; a CPU --quick run merges Quest's FP8 rows
(beside bf16) and the tiny models' forced top-1 agreement into an existing fidelity.json."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_fidelity
from benchmarks.fidelity_fp8 import round_complete_pages
from hicache.kv_page_format import KVPageFormat
from hicache.kv_spec import KVCacheSpec
from sparsehi.config import SparseConfig
from sparsehi.runtime.model_config import get_model_config
from sparsehi.runtime.runner import ModelRunner
from sparsehi.runtime.runtime_config import RuntimeConfig
from sparsehi.runtime.weights import build_model


def test_complete_pages_round_as_fp8_host_pages_store_them():
    page, heads, dim, t = 16, 2, 32, 3 * 16 + 5
    g = torch.Generator().manual_seed(0)
    # buffers (k, v), pages and heads 2**10 and more apart in magnitude: with a scale shared
    # across any of them, the smaller block's values would fall into E4M3's subnormal range
    kv = torch.randn(2, t, heads, dim, generator=g) * (2.0 ** (12 * torch.arange(heads)))[None, None, :, None]
    kv = kv * (2.0 ** (10 * (torch.arange(t) // page)))[None, :, None, None]
    kv = kv * torch.tensor([1.0, 2.0 ** 10])[:, None, None, None]
    kv = kv.to(torch.bfloat16)
    got = round_complete_pages(kv, page)
    # the page format's own path: one record per page ([layers=1, buffers=(k, v), page, heads, dim])
    fmt = KVPageFormat(KVCacheSpec(attention="mha", num_layers=1, kv_heads=heads, head_dim=dim,
                                   dtype=torch.bfloat16, page_size=page), "fp8_e4m3")
    pages = kv[:, : 3 * page].unflatten(1, (3, page)).transpose(0, 1)[:, None].contiguous()  # [3, 1, 2, page, H, D]
    records = torch.empty(3, fmt.page_bytes, dtype=torch.uint8)
    fmt.quantize_into(pages, records)
    back = torch.empty_like(pages)
    fmt.dequantize(records, back)
    assert torch.equal(got[:, : 3 * page], back[:, 0].transpose(0, 1).flatten(1, 2))
    assert torch.equal(got[:, 3 * page:], kv[:, 3 * page:])  # the partial last page stays as it was
    x = kv[:, : 3 * page].float().unflatten(1, (3, page))  # [2, 3, page, H, D]
    err = (got[:, : 3 * page].float().unflatten(1, (3, page)) - x).abs()
    assert err.max() > 0
    # a block's scale s < amax / 224, so E4M3's normal range (>= 2**-6 s) holds |x| >= amax / 2**12
    normal = x.abs() >= x.abs().amax(dim=(2, 4), keepdim=True) / 2 ** 12
    assert normal.float().mean() > 0.99
    assert (err[normal] <= 2 ** -4 * x.abs()[normal]).all()


@pytest.mark.usefixtures("one_thread")
def test_quick_fp8_section_merges_beside_the_existing_rows(tmp_path):
    existing = {"device": "NVIDIA H200", "date": "2026-11-23", "benchmark": "fidelity",
                "results": [{"context": 16384, "algorithm": "quest"}], "targets": {"met": True}}
    (tmp_path / "fidelity.json").write_text(json.dumps(existing))
    assert bench_fidelity.main(["--quick", "--fp8-host-kv", "only", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "fidelity.json").read_text())
    assert {k: data[k] for k in existing} == existing
    sec = data["fp8_host_kv"]
    rows = sec["results"]
    assert {(r["context"], r["budget_tokens"]) for r in rows} == {(t, b) for t in (2048, 4101) for b in (256, 512)}
    for t in (2048, 4101):
        for b in (256, 512):
            at = {(r["kv"], r["quest_bounds_from"]): r for r in rows if r["context"] == t and r["budget_tokens"] == b}
            assert set(at) == {("bf16", "bf16_keys"), ("fp8_e4m3", "bf16_keys"), ("fp8_e4m3", "fp8_keys")}
            ref = at[("bf16", "bf16_keys")]
            assert ref["output_rel_error_vs_bf16_same_selection"] == 0 and "mass_recall_drop" not in ref
            for bounds in ("bf16_keys", "fp8_keys"):
                r = at[("fp8_e4m3", bounds)]
                assert 0 < r["output_rel_error_vs_bf16_same_selection"] < 0.15
                assert abs(r["mass_recall_drop"] - (ref["mass_recall"] - r["mass_recall"])) < 1e-5
                assert r["mass_recall_drop"] < 0.005 and r["needle_recall"] == ref["needle_recall"]
            # bounds of the bf16 keys (a prompt prefilled in the request): the bf16 selection
            assert at[("fp8_e4m3", "bf16_keys")]["selection_overlap_with_bf16"] == 1.0
            assert at[("fp8_e4m3", "bf16_keys")]["mass_recall"] == ref["mass_recall"]
    rounding = {r["context"]: r for r in sec["kv_rounding"]}
    assert rounding[4101]["tokens_left_in_bf16"] == 5 and rounding[4101]["rounded_pages"] == 256
    for r in rounding.values():
        assert 0.005 < r["key_rel_error"] < 2 ** -4 and 0.005 < r["value_rel_error"] < 2 ** -4
        assert 0 < r["dense_output_rel_error"] < 0.15
    assert sec["summary"]["drop_over_limit"] is False
    tiny = {r["model"]: r for r in sec["tiny_models"]}
    assert set(tiny) == {"tiny-gqa", "tiny-dsa"}
    for r in tiny.values():
        assert r["positions"] == len(r["prompt_lengths"]) * r["decode_steps"]
        assert 0.75 <= r["forced_top1_agreement"] <= 1.0
        assert r["fp8_pages_loaded"] > 0  # decode read pages back from the FP8 host pool
        assert r["host_kv_bytes"]["fp8_e4m3"] < 0.5 * r["host_kv_bytes"]["model_dtype"]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("mode", ["sparse-gpu", "sparse-hier"])
def test_quest_bounds_of_a_prefilled_prompt_are_those_of_its_unrounded_keys(mode):
    """What the ``bf16_keys`` rows assume: with FP8 host KV a prompt's Quest bounds are
    built before its pages are rounded, so they equal the bounds of a run in the model's dtype."""
    model = build_model(config=get_model_config("tiny-gqa", num_layers=3))
    prompt = torch.randint(0, 512, (333,), generator=torch.Generator().manual_seed(0)).tolist()
    bounds, keys = {}, {}
    for dtype in ("auto", "fp8_e4m3"):
        sc = SparseConfig(algorithm="quest", page_size=16, top_k=48, device_buffer_size=64, sink_tokens=16,
                          recent_tokens=16, min_sparse_prompt_len=0, io_backend="kernel", host_kv_dtype=dtype)
        runner = ModelRunner(model, RuntimeConfig(mode=mode, sparse=sc, max_num_reqs=1, max_context_len=400,
                                                  host_layout="page_first"))
        runner.prefill(runner.new_requests([prompt])[0])
        coord = runner.mode.coord
        layers = sorted(coord.algorithm._kmin)
        assert layers  # Quest's sparse layers
        bounds[dtype] = [(coord.algorithm._kmin[i].clone(), coord.algorithm._kmax[i].clone()) for i in layers]
        keys[dtype] = [coord.device_pool.get_key_buffer(i).clone() for i in layers]
    for (lo, hi), (lo8, hi8) in zip(bounds["auto"], bounds["fp8_e4m3"]):
        assert torch.equal(lo, lo8) and torch.equal(hi, hi8)
    if mode == "sparse-gpu":  # the KV the FP8 run attends was rounded after the bounds were built
        assert all(not torch.equal(k, k8) for k, k8 in zip(keys["auto"], keys["fp8_e4m3"]))
