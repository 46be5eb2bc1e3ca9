"""The plugin's decode path through SGLang's decode CUDA-graph protocol, with SGLang's real
``ForwardBatch``, pools, ``RadixAttention`` (hooked by ``load_plugins()``) and CPU attention
backend: the hooks ``alloc_memory_pool`` adds to the model runner's ``capture_head_hooks`` /
``capture_tail_hooks`` frame a capture batch of padding rows (SGLang 0.5.23's
``DecodeCudaGraphRunner.capture_one_shape``: head hooks, the model, tail hooks); at each
step the forward hook's host part runs, the step's inputs go into the capture batch's
static tensors padded to the bucket (row 0, length 1, slot 0, as SGLang pads), and the
recorded path runs again (on CPU: under a simulated capture, as nothing can be replayed;
``tests/test_sglang_bridge_graphs.py`` replays a real CUDA graph of the same path on a GPU).
"""
from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.plugins", reason="SGLang is not installed (run scripts/setup_sglang_env.sh)")

import torch  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context  # noqa: E402
from sparsehi.algorithms.graph_safety import simulated_capture  # noqa: E402
from sparsehi.sglang_plugin import hooks  # noqa: E402

from sgl_kit import D, HKV, HQ, L, PS, World, qkv, sparse_config  # noqa: E402


class Recorded:
    """SGLang's decode graph runner for one world: capture batches of 2 and 4 rows."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.model_runner = world.runner  # what the capture hooks read off SGLang's graph runner
        self.shapes = {bs: self._capture(bs) for bs in (2, 4)}

    def _run_once(self, fb: ForwardBatch, layers) -> list[torch.Tensor]:
        w = self.world
        with forward_context(ForwardContext(attn_backend=w.backend), forward_batch=fb):
            for hook in w.runner.capture_head_hooks:
                hook(self, fb)
            w.backend.init_forward_metadata(fb)
            out = [w.layers[i].forward(q, k, v, fb) for i, (q, k, v) in enumerate(layers)]
            for hook in w.runner.capture_tail_hooks:
                hook(self, out, fb, fb.batch_size)
        return out

    def _capture(self, bs: int):
        z = torch.zeros(bs, dtype=torch.int64)
        fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=z.clone(),
                          req_pool_indices=z.clone(), seq_lens=torch.ones(bs, dtype=torch.int64),
                          out_cache_loc=z.clone(), seq_lens_sum=bs, seq_lens_cpu=torch.ones(bs, dtype=torch.int64),
                          positions=z.clone())
        layers = [(torch.zeros(bs, HQ * D), torch.zeros(bs, HKV * D), torch.zeros(bs, HKV * D)) for _ in range(L)]
        self._run_once(fb, layers)  # SGLang's warm-up run: executed, padding rows only
        with simulated_capture():
            self._run_once(fb, layers)  # the recorded run
        return fb, layers

    def replay(self, runner, fb: ForwardBatch, layers) -> list[torch.Tensor]:
        b = fb.batch_size
        bs = 2 if b <= 2 else 4
        sfb, slayers = self.shapes[bs]
        for name, pad in (("req_pool_indices", 0), ("seq_lens", 1), ("out_cache_loc", 0), ("seq_lens_cpu", 1)):
            dst = getattr(sfb, name)
            dst.fill_(pad)
            dst[:b] = getattr(fb, name)
        for src, dst in zip(layers, slayers):
            for s, d in zip(src, dst):
                d.zero_()
                d[:b] = s
        with simulated_capture():
            out = self._run_once(sfb, slayers)
        return [o[:b].clone() for o in out]


@pytest.mark.parametrize("host_kv_dtype", ["auto", "fp8_e4m3"])
def test_recorded_decode_equals_the_eager_one_with_sglangs_classes(host_kv_dtype):
    """FP8 host KV (SGLang's page size = the sparse page size): the recorded layer path
    rounds the pages a step completes as the eager one does."""
    cfg = sparse_config(backend="triton", host_kv_dtype=host_kv_dtype)
    page = PS if host_kv_dtype == "fp8_e4m3" else 1
    eager, graphed = World(cfg, sgl_page=page), World(cfg, sgl_page=page)
    assert graphed.runner.capture_head_hooks == [hooks.capture_head]
    assert graphed.runner.capture_tail_hooks == [hooks.capture_tail]
    recorded = Recorded(graphed)
    gen = torch.Generator().manual_seed(5)
    lens = {1: 61, 2: 50, 3: 12}
    for row, n in lens.items():
        layers = qkv(n, gen)
        for w in (eager, graphed):
            w.run(w.extend([row], [n]), layers)
    # the larger bucket, the short row alone (no row of ours), the smaller bucket, the
    # larger one again, then the short request ends
    schedule = [[1, 2, 3]] * 3 + [[3]] + [[1, 2]] * 2 + [[1, 2, 3]] * 2 + [[1, 2]] * 2
    for step, rows in enumerate(schedule):
        if step == 8:
            for w in (eager, graphed):
                w.req_pool.free_rows(torch.tensor([3]))  # SGLang frees the short request's row
        for r in rows:
            lens[r] += 1
        layers = qkv(len(rows), gen)
        want = eager.run(eager.decode(rows, [lens[r] for r in rows]), layers)
        fb = graphed.decode(rows, [lens[r] for r in rows])
        got = hooks.around_forward_raw(lambda runner, b: recorded.replay(runner, b, layers), graphed.runner, fb)
        for i in range(L):
            torch.testing.assert_close(got[i], want[i], rtol=1e-5, atol=1e-5)
        sfb = recorded.shapes[2 if len(rows) <= 2 else 4][0]
        assert sfb.seq_lens[: len(rows)].tolist() == [1 if r != 3 else lens[r] for r in rows]
        assert fb.seq_lens.tolist() == [lens[r] for r in rows]  # SGLang's own batch is given back unchanged
    se, sg = eager.bridge.coord.stats(), graphed.bridge.coord.stats()
    assert se["misses"] > 0 and (sg["hits"], sg["misses"]) == (se["hits"], se["misses"])
    assert graphed.bridge.registrations == eager.bridge.registrations == 2
    for i in range(L):
        assert torch.equal(graphed.kv_pool.k_buffer[i][4:], eager.kv_pool.k_buffer[i][4:])  # past padding page 0
