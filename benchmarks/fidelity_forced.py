"""Teacher-forced top-1 agreement of sparse-hier with FP8 host KV and sparse-hier with host
KV in the model's dtype, on the compact runtime's tiny random-weight models.

Per model, three runs over the same prompts: dense (free-running greedy decode), then
sparse-hier in the model's dtype and sparse-hier with ``host_kv_dtype="fp8_e4m3"``, both
teacher-forced with dense's tokens (``ModelRunner.generate(force_tokens=...)``, as the
forced columns of ``sparsehi run``): at each decode step both runs consumed the same
history, and their next-token argmaxes are compared position by position
(``sparsehi.runtime.report.forced_agreement``). The prefill's own prediction is left out
(prefill attends densely, before any page is rounded). Each sparse run's forced agreement
with dense is reported beside it: what the sparsity alone changes, the scale to read the
FP8 figure against. Both sparse runs use the ``page_first`` host layout, so they differ in
the host KV dtype only.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch

from sparsehi.config import SparseConfig
from sparsehi.runtime.model_config import get_model_config
from sparsehi.runtime.report import forced_agreement
from sparsehi.runtime.runner import GenerationResult, ModelRunner
from sparsehi.runtime.runtime_config import RuntimeConfig
from sparsehi.runtime.weights import build_model

VOCAB_FOR_PROMPTS = 512


@dataclass(frozen=True)
class TinyCase:
    """One tiny model and the sparse-hier settings it decodes with."""

    model: str
    layers: int
    algorithm: str
    page_size: int
    top_k: int
    device_buffer_size: int
    fixed_tokens: int
    """Sink and recent window, each."""
    prompt_lengths: tuple[int, ...]
    decode_steps: int

    def sparse(self, host_kv_dtype: str) -> SparseConfig:
        return SparseConfig(algorithm=self.algorithm, page_size=self.page_size, top_k=self.top_k,
                            device_buffer_size=self.device_buffer_size, sink_tokens=self.fixed_tokens,
                            recent_tokens=self.fixed_tokens, min_sparse_prompt_len=0, io_backend="kernel",
                            host_kv_dtype=host_kv_dtype)


# CPU: the sizes of tests/test_fp8_host_kv.py (prompt lengths not page multiples: the last
# prompt page completes during decode)
QUICK_CASES = (
    TinyCase("tiny-gqa", 3, "quest", 16, 48, 64, 16, (300, 333), 24),
    TinyCase("tiny-dsa", 3, "dsa", 1, 32, 64, 8, (160, 137), 16),
)
GPU_CASES = (
    TinyCase("tiny-gqa", 8, "quest", 16, 512, 1024, 64, (8192, 8000, 7777, 6150), 256),
    TinyCase("tiny-dsa", 3, "dsa", 1, 512, 1024, 64, (8192, 8000, 7777, 6150), 256),
)


def _prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB_FOR_PROMPTS, (n,), generator=g).tolist() for n in lengths]


def _generate(model: Any, mode: str, sc: SparseConfig, prompts: list[list[int]], steps: int, device: str,
              dtype: torch.dtype, force: Optional[list[list[int]]] = None) -> GenerationResult:
    rt = RuntimeConfig(mode=mode, sparse=sc, device=device, dtype=dtype, max_num_reqs=len(prompts),
                       max_context_len=max(map(len, prompts)) + steps + 1, host_layout="page_first",
                       adapter="auto" if device == "cuda" else "none", validate=device != "cuda")
    runner = ModelRunner(model, rt)
    try:
        return runner.generate(prompts, steps, force_tokens=force)
    finally:
        runner.mode.close()


def _decoded(res: GenerationResult) -> list[list[int]]:
    """Each request's decode-step predictions (the prefill's token dropped)."""
    return [t[1:] for t in res.tokens]


def forced_agreement_row(case: TinyCase, device: str) -> dict[str, Any]:
    """``case``'s row: forced top-1 agreement of FP8 with model-dtype sparse-hier, and of
    each with dense; the FP8 run's page loads and both runs' host KV bytes."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(config=get_model_config(case.model, num_layers=case.layers), device=device, dtype=dtype)
    prompts = _prompts(case.prompt_lengths)
    dense = _generate(model, "dense", case.sparse("auto"), prompts, case.decode_steps, device, dtype)
    history = [t[:-1] for t in dense.tokens]
    plain = _generate(model, "sparse-hier", case.sparse("auto"), prompts, case.decode_steps, device, dtype, history)
    fp8 = _generate(model, "sparse-hier", case.sparse("fp8_e4m3"), prompts, case.decode_steps, device, dtype, history)
    ref = _decoded(dense)
    return {
        **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(case).items()},
        "model_dtype": str(dtype).removeprefix("torch."), "positions": sum(map(len, ref)),
        "forced_top1_agreement": round(forced_agreement(_decoded(fp8), _decoded(plain)), 6),
        "forced_top1_agreement_model_dtype_vs_dense": round(forced_agreement(_decoded(plain), ref), 6),
        "forced_top1_agreement_fp8_vs_dense": round(forced_agreement(_decoded(fp8), ref), 6),
        "fp8_pages_loaded": int(fp8.stats.get("misses", 0)),
        "host_kv_bytes": {"model_dtype": plain.memory["host_kv_bytes"], "fp8_e4m3": fp8.memory["host_kv_bytes"]},
    }


def forced_agreement_rows(quick: bool, device: str) -> list[dict[str, Any]]:
    """One row per tiny model (``QUICK_CASES`` or ``GPU_CASES``). On the CPU the runs use
    one torch thread: the tiny models' many small matmuls run faster on one."""
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    try:
        return [forced_agreement_row(c, device) for c in (QUICK_CASES if quick else GPU_CASES)]
    finally:
        torch.set_num_threads(threads)
