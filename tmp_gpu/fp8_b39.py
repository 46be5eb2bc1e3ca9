import sys
sys.path.insert(0, ".")
from benchmarks.bench_attention import time_mla_variants
from benchmarks.common import hbm_copy_gbps, bf16_gemm_tflops
from sparsehi.kernels.sparse_mla_gluon import MlaGluonConfig as C
roof, gemm = hbm_copy_gbps(), bf16_gemm_tflops()
for B in (39, 32):
    v = [("default", True, None), ("ws_regs_s2", True, C(num_splits=2)), ("ws_regs_s3", True, C(num_splits=3)),
         ("ws_regs_s4", True, C(num_splits=4)),
         ("staged_64x1", True, C(64, 1, fp8_stages=1)), ("staged_64x1_s2", True, C(64, 1, fp8_stages=1, num_splits=2)),
         ("staged_64x1_s4", True, C(64, 1, fp8_stages=1, num_splits=4)),
         ("staged_32x2", True, C(32, 2, fp8_stages=1)), ("staged_32x3_s2", True, C(32, 3, fp8_stages=2)),
         ("bf16_default", False, None)]
    good = []
    for name, fp8, cfg in v:
        try:
            time_mla_variants(B, 1, 2176, 128, [(name, fp8, cfg)], roof, gemm)
        except Exception as e:
            print(name, "failed", repr(e)[:200])
