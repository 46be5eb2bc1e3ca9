"""The SGLang plugin's decode path recorded into a CUDA graph, as SGLang's decode graph
runner records it, equals the same steps run eagerly.

SGLang cannot be installed where the GPU tests run, so its classes the bridge touches are
stood in (``benchmarks/sglang_standins.py``: pools, ``ForwardBatch``, layer fields, its
FlashAttention decode contract, and the ``DecodeCudaGraphRunner`` protocol: a capture batch
of padding rows, the model runner's capture head / tail hooks, padded replays). The code
under test is the plugin's own: ``SGLangSparseBridge`` and ``sparsehi.sglang_plugin.hooks``.
On CPU the "replay" runs the recorded Python path again under a simulated capture; on a
GPU the graph is a real ``torch.cuda.CUDAGraph``. ``tests/sglang`` runs the same hooks over
SGLang's real classes on CPU.
"""
from __future__ import annotations

import pytest
import torch

from benchmarks.sglang_standins import Batch, Mode, SGLangWorld, Shape
from sparsehi.config import SparseConfig
from sparsehi.sglang_plugin import hooks


def _config(host_kv_dtype: str = "auto") -> SparseConfig:
    # FP8 host pages need the sparse page size equal to SGLang's (the stand-ins': 1), where
    # selection is token-wise (oracle; Quest bounds pages of >= 2 tokens)
    fp8 = host_kv_dtype == "fp8_e4m3"
    return SparseConfig(algorithm="oracle" if fp8 else "quest", backend="flashattention", top_k=8,
                        device_buffer_size=12, page_size=1 if fp8 else 4, sink_tokens=4, recent_tokens=4, min_sparse_prompt_len=40, dense_layers=(0,),
                        host_to_device_ratio=2.0, host_kv_dtype=host_kv_dtype)


@pytest.mark.parametrize("host_kv_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("device", [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_recorded_decode_equals_the_eager_one(device, host_kv_dtype):
    """Three long prompts and a short one decode over page boundaries with host loads; then
    a request ends: the batch falls to three rows in the same bucket (the fourth row of the
    graph is padding again); a step runs the short row alone (no row of ours: the replayed
    graph's rows are all padding), then the smaller bucket, the larger one again, and the
    short request ends. Every layer's output, the hit counters and SGLang's KV slots match
    between graph replays and eager forwards, SGLang's attention saw our rows as one token,
    and the short row gets SGLang's own attention output. On a GPU, the host part and the
    replay of every step after the first make no host sync (the decode batches carry no
    ``req_pool_indices_cpu``, as SGLang's); the one wait left is the staging slot's, on its
    own copy of two steps back, which bounds how far the host runs ahead. FP8 host KV
    (``host_kv_dtype``, pages of one token): the recorded path rounds what the eager one
    rounds and the host records match."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device(device)
    s = Shape()
    cfg = _config(host_kv_dtype)
    eager, graphed = SGLangWorld(cfg, dev, graphs=False), SGLangWorld(cfg, dev, graphs=True)
    assert graphed.runner.capture_head_hooks == [hooks.capture_head]
    assert graphed.runner.capture_tail_hooks == [hooks.capture_tail]
    gen = torch.Generator().manual_seed(3)
    lens = {1: 45, 2: 58, 3: 9, 4: 41}
    for row, n in lens.items():
        k = [torch.randn(n, s.kv_heads * s.head_dim, generator=gen).to(dev) for _ in range(s.layers)]
        v = [torch.randn(n, s.kv_heads * s.head_dim, generator=gen).to(dev) for _ in range(s.layers)]
        for w in (eager, graphed):
            w.prompt(row, k, v)
    schedule = [[1, 2, 3, 4]] * 4 + [[1, 2, 3]] * 2 + [[3]] + [[1, 2]] * 2 + [[1, 2, 3]] * 2 + [[1, 2]] * 2
    for step, rows in enumerate(schedule):
        for gone in ({4} if step == 4 else {3} if step == 11 else set()):
            for w in (eager, graphed):
                w.release(gone)
        for r in rows:
            lens[r] += 1
        qkv = [tuple(torch.randn(len(rows), h * s.head_dim, generator=gen).to(dev)
                     for h in (s.q_heads, s.kv_heads, s.kv_heads)) for _ in range(s.layers)]
        want = eager.forward(eager.batch(rows, [lens[r] for r in rows]), qkv)
        fb = graphed.batch(rows, [lens[r] for r in rows])
        # past the first step (registration: the prompts' offload), no host sync
        got = graphed.forward(fb, qkv, no_sync=step > 0)
        for i in range(s.layers):
            torch.testing.assert_close(got[i], want[i], rtol=1e-5, atol=1e-5)
        bucket = graphed.captured[2 if len(rows) <= 2 else 4][1]
        assert bucket.seq_lens[: len(rows)].tolist() == [1 if r != 3 else lens[r] for r in rows]
        assert fb.seq_lens.tolist() == [lens[r] for r in rows]  # the scheduler's batch is given back unchanged
        # the short row: SGLang's own attention over its whole context (recomputed after the
        # forward, so not with FP8 pages: their write-through rounds what the forward read)
        if 3 in rows and host_kv_dtype == "auto":
            j = slice(rows.index(3), rows.index(3) + 1)
            one = Batch(Mode("decode"), 1, fb.req_pool_indices[j], fb.seq_lens[j], fb.out_cache_loc[j])
            q, k, v = (x[j] for x in qkv[1])
            torch.testing.assert_close(got[1][j], graphed.attend(graphed.layers[1], q, k, v, one, False),
                                       rtol=1e-5, atol=1e-5)
    se, sg = eager.bridge.coord.stats(), graphed.bridge.coord.stats()
    assert se["misses"] > 0 and (sg["hits"], sg["misses"]) == (se["hits"], se["misses"])
    assert graphed.bridge.registrations == eager.bridge.registrations == 3
    # the same KV in both: every live token in the host pool at its virtual slot, and the
    # GPU pages SGLang's kernels still address (slot 0: the padding slot padded rows write)
    for r, n in eager.lens.items():
        vids = eager.req_pool.req_to_token[r, :n].long()
        assert torch.equal(vids, graphed.req_pool.req_to_token[r, :n].long())
        for i in range(s.layers):
            he = eager.bridge.host_pool.read_tokens(i, vids.cpu())
            hg = graphed.bridge.host_pool.read_tokens(i, vids.cpu())
            assert all(torch.equal(a, b) for a, b in zip(he, hg))
    assert torch.equal(graphed.bridge.residency.v2p, eager.bridge.residency.v2p)
    for i in range(s.layers):
        assert torch.equal(graphed.kv_pool.k_buffer[i][1:], eager.kv_pool.k_buffer[i][1:])
