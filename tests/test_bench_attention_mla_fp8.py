"""benchmarks/bench_attention.py --parts mla_fp8: the quick run's rows (FP8 layout beside
bf16, the byte count of each layout, the outputs of both layouts agreeing)."""
from __future__ import annotations

import json

from benchmarks import bench_attention as ba


def test_quick_mla_fp8_rows(tmp_path):
    assert ba.main(["--quick", "--parts", "mla_fp8", "--out", str(tmp_path)]) == 0
    assert not (tmp_path / "attention.json").exists()         # only the part asked for
    res = json.loads((tmp_path / "attention_mla_fp8.json").read_text())
    rows = res["rows"]
    assert {(r["kernel"], r["B"], r["q_tokens"]) for r in rows} == {
        (k, b, t) for k in ("sparse_mla_bf16", "sparse_mla_bf16_fused", "sparse_mla_fp8", "sparse_mla_fp8_fused")
        for b, t in ((1, 1), (2, 2))}
    for r in rows:
        fp8 = r["kernel"].startswith("sparse_mla_fp8")
        # quick shape: latent 128 + rope 64 -> 128 + 4 + 128 FP8 bytes or 384 bf16 bytes a token
        assert r["kv_bytes_per_token"] == (260 if fp8 else 384)
        assert r["rows"] == r["B"] * r["q_tokens"]
        nbytes = ba.mla_bytes(r["rows"], r["K"], r["heads"], 128, 64, r["kv_bytes_per_token"])
        assert abs(r["gbps"] - nbytes / (r["us"] * 1e-6) / 1e9) < 0.1
        assert r["us"] > 0 and r["max_diff_vs_fused"] < 2e-2
