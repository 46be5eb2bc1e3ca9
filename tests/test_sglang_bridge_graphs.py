"""The SGLang plugin's decode path recorded into a CUDA graph, as SGLang's decode graph
runner records it, equals the same steps run eagerly.

SGLang itself cannot be installed where the GPU tests run, so its pieces the bridge
touches are stood in here by small classes with the attributes the bridge reads (the
``ReqToTokenPool``, an MHA token-to-KV pool, ``ForwardBatch``, ``RadixAttention``'s layer
fields) and a dense attention with SGLang's decode contract (writes the new token at
``out_cache_loc``, attends ``req_to_token[row, :seq_len]``). The code under test is the
plugin's own: ``SGLangSparseBridge`` and the hooks of ``sparsehi.sglang_plugin.hooks``
(forward, layer, and the capture head / tail hooks). The protocol is SGLang 0.5.23's
``DecodeCudaGraphRunner``: a capture batch of padding rows, warm-up runs, then the capture
of head hooks + model + tail hooks; at each step, the model runner's forward hook (the
host part) runs, then the step's inputs are copied into the capture batch's static tensors
(padded up to the bucket: row 0, length 1, slot 0) and the graph replays. On CPU the
"replay" runs the recorded Python path again under a simulated capture; on a GPU the
graph is a real ``torch.cuda.CUDAGraph``. The tests under ``tests/sglang`` run the same
hooks over SGLang's real classes on CPU.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from sparsehi.algorithms.graph_safety import simulated_capture, sync_debug_errors
from sparsehi.config import SparseConfig
from sparsehi.sglang_plugin import hooks

L, HQ, HKV, D = 3, 4, 2, 16
SCALE = D ** -0.5


class Mode:
    def __init__(self, name: str) -> None:
        self.name = name

    def is_decode(self) -> bool:
        return self.name == "decode"

    def is_extend(self) -> bool:
        return self.name == "extend"

    def is_mixed(self) -> bool:
        return False


@dataclass
class Batch:
    """SGLang's ``ForwardBatch`` fields the plugin reads in a decode forward."""

    forward_mode: Mode
    batch_size: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens_cpu: Optional[torch.Tensor] = None
    req_pool_indices_cpu: Optional[torch.Tensor] = None
    seq_lens_sum: Optional[int] = None


class ReqToTokenPool:
    def __init__(self, rows: int, ctx: int, device: torch.device) -> None:
        self.size = rows
        self.req_to_token = torch.zeros(rows, ctx, dtype=torch.int32, device=device)


class MHAPool:
    """An MHA token-to-KV pool: one ``[size + page_size, heads, dim]`` tensor per layer."""

    def __init__(self, size: int, page_size: int, device: torch.device) -> None:
        self.size, self.page_size, self.device = size, page_size, device
        self.dtype = self.store_dtype = torch.float32
        self.k_buffer = [torch.zeros(size + page_size, HKV, D, device=device) for _ in range(L)]
        self.v_buffer = [torch.zeros(size + page_size, HKV, D, device=device) for _ in range(L)]

    def set_kv_buffer(self, layer, loc, k, v) -> None:
        self.k_buffer[layer.layer_id][loc.long()] = k.view(-1, HKV, D)
        self.v_buffer[layer.layer_id][loc.long()] = v.view(-1, HKV, D)


@dataclass
class Layer:
    layer_id: int
    tp_q_head_num: int = HQ
    tp_k_head_num: int = HKV
    qk_head_dim: int = D
    v_head_dim: int = D
    scaling: float = SCALE


@dataclass
class Runner:
    server_args: object
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHAPool
    max_running_requests: int
    capture_head_hooks: list
    capture_tail_hooks: list


def dense_decode(world: "World"):
    """SGLang's attention of a decode forward (its contract, in fixed shapes): the new token
    to ``out_cache_loc``, then every row over ``req_to_token[row, :seq_len]``."""
    def attend(layer, q, k, v, fb, save_kv_cache=True):
        pool = world.kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(layer, fb.out_cache_loc, k, v)
        b = q.shape[0]
        slots = world.req_pool.req_to_token[fb.req_pool_indices.long()].long()  # [B, ctx]
        keys = pool.k_buffer[layer.layer_id][slots]  # [B, ctx, HKV, D]
        vals = pool.v_buffer[layer.layer_id][slots]
        q4 = q.view(b, HKV, HQ // HKV, D)
        s = torch.einsum("bhgd,bthd->bhgt", q4, keys) * layer.scaling
        valid = torch.arange(slots.shape[1], device=q.device)[None, :] < fb.seq_lens[:, None]
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
        return torch.einsum("bhgt,bthd->bhgd", s.softmax(-1), vals).reshape(b, HQ * D)
    return attend


class World:
    """The stand-in model runner with the plugin's hooks; ``graphs``: decode through
    captured graphs (buckets 2 and 4) instead of eager forwards."""

    PS, CTX, ROWS, POOL = 4, 96, 5, 640

    def __init__(self, cfg: SparseConfig, device: torch.device, graphs: bool) -> None:
        self.device, self.graphs = device, graphs
        self.req_pool = ReqToTokenPool(self.ROWS, self.CTX, device)
        self.kv_pool = MHAPool(self.POOL, self.PS, device)
        args = type("Args", (), {"sparsehi_config": cfg})()
        self.runner = Runner(args, self.req_pool, self.kv_pool, 4, [], [])
        hooks.after_alloc_memory_pool(None, self.runner)
        self.layers = [Layer(i) for i in range(L)]
        self.attend = dense_decode(self)
        self.next_page = 1
        self.slots: dict[int, list[int]] = {}
        self.graph_runner = type("GraphRunner", (), {"model_runner": self.runner})()
        self.captured: dict[int, tuple] = {}
        if graphs:
            for bs in (2, 4):
                self.captured[bs] = self._capture(bs)

    @property
    def bridge(self):
        return getattr(self.runner, hooks.BRIDGE_ATTR)

    def _grow(self, row: int) -> int:
        have = self.slots.setdefault(row, [])
        slot = self.next_page * self.PS if len(have) % self.PS == 0 else have[-1] + 1
        if len(have) % self.PS == 0:
            self.next_page += 1
        have.append(slot)
        self.req_pool.req_to_token[row, len(have) - 1] = slot
        return slot

    def prompt(self, row: int, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """SGLang's prefill of ``row``: its KV in SGLang's slots (the plugin registers it at
        its first decode forward)."""
        locs = torch.tensor([self._grow(row) for _ in range(k[0].shape[0])], device=self.device)
        for i in range(L):
            self.kv_pool.k_buffer[i][locs] = k[i].view(-1, HKV, D)
            self.kv_pool.v_buffer[i][locs] = v[i].view(-1, HKV, D)

    def _model(self, fb: Batch, qkv) -> list[torch.Tensor]:
        return [hooks.around_radix_attention(self.attend, self.layers[i], q, k, v, fb)
                for i, (q, k, v) in enumerate(qkv)]

    def _run_once(self, fb: Batch, qkv) -> list[torch.Tensor]:
        """One run of SGLang's capture closure: head hooks, the model, tail hooks."""
        for hook in self.runner.capture_head_hooks:
            hook(self.graph_runner, fb)
        out = self._model(fb, qkv)
        for hook in self.runner.capture_tail_hooks:
            hook(self.graph_runner, out, fb, fb.batch_size)
        return out

    def _capture(self, bs: int):
        dev = self.device
        zeros = torch.zeros(bs, dtype=torch.int64, device=dev)
        fb = Batch(Mode("decode"), bs, zeros.clone(), torch.ones(bs, dtype=torch.int64, device=dev), zeros.clone())
        qkv = [(torch.zeros(bs, HQ * D, device=dev), torch.zeros(bs, HKV * D, device=dev),
                torch.zeros(bs, HKV * D, device=dev)) for _ in range(L)]
        if dev.type != "cuda":
            self._run_once(fb, qkv)  # the warm-up (executed)
            return None, fb, qkv, None
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run_once(fb, qkv)
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._run_once(fb, qkv)
        return graph, fb, qkv, out

    def _replay(self, runner, fb: Batch, qkv) -> list[torch.Tensor]:
        """SGLang's graph runner inside ``_forward_raw``: the step's inputs into the static
        tensors (padded), then the replay."""
        bs = 2 if fb.batch_size <= 2 else 4
        graph, sfb, sqkv, out = self.captured[bs]
        b = fb.batch_size
        sfb.req_pool_indices.zero_()
        sfb.req_pool_indices[:b] = fb.req_pool_indices
        sfb.seq_lens.fill_(1)
        sfb.seq_lens[:b] = fb.seq_lens  # what the forward hook left there: ours cut to one token
        sfb.out_cache_loc.zero_()
        sfb.out_cache_loc[:b] = fb.out_cache_loc
        for (q, k, v), (sq, sk, sv) in zip(qkv, sqkv):
            for src, dst in ((q, sq), (k, sk), (v, sv)):
                dst.zero_()
                dst[:b] = src
        if graph is None:
            with simulated_capture():
                out = self._run_once(sfb, sqkv)
        else:
            graph.replay()
        return [o[:b].clone() for o in out]

    def decode(self, rows: list[int], lens: list[int], qkv, no_sync: bool = False) -> list[torch.Tensor]:
        """One decode step through the forward hook; ``no_sync``: under
        ``torch.cuda.set_sync_debug_mode("error")`` (CUDA), as SGLang's overlap scheduler
        needs the host part and the replay to leave the device running."""
        dev = self.device
        locs = [self._grow(r) for r in rows]
        assert all(len(self.slots[r]) == n for r, n in zip(rows, lens))
        fb = Batch(Mode("decode"), len(rows), torch.tensor(rows, device=dev), torch.tensor(lens, device=dev),
                   torch.tensor(locs, device=dev), seq_lens_cpu=torch.tensor(lens),
                   req_pool_indices_cpu=torch.tensor(rows), seq_lens_sum=sum(lens))
        if self.graphs:
            step = lambda runner, b: self._replay(runner, b, qkv)  # noqa: E731
        else:
            step = lambda runner, b: [o.clone() for o in self._model(b, qkv)]  # noqa: E731
        with sync_debug_errors() if no_sync and dev.type == "cuda" else contextlib.nullcontext():
            return hooks.around_forward_raw(step, self.runner, fb)


def _config() -> SparseConfig:
    return SparseConfig(algorithm="quest", backend="flashattention", top_k=8, device_buffer_size=12, page_size=4,
                        sink_tokens=4, recent_tokens=4, min_sparse_prompt_len=40, dense_layers=(0,),
                        host_to_device_ratio=2.0)


def _devices() -> list:
    return [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", _devices())
def test_recorded_decode_equals_the_eager_one(device):
    """Three long prompts and a short one decode over page boundaries with host loads; then
    requests end: the batch falls to three rows in the same bucket (the fourth row of the
    graph is padding again) and then to the smaller bucket. Every layer's output,
    the hit counters and SGLang's KV slots match between graph replays and eager forwards,
    and the short row gets SGLang's own attention output in both. On a GPU, the host part and
    the replay of every step after the first make no host sync."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device(device)
    eager, graphed = World(_config(), dev, graphs=False), World(_config(), dev, graphs=True)
    assert hooks.capture_head in graphed.runner.capture_head_hooks
    assert hooks.capture_tail in graphed.runner.capture_tail_hooks
    gen = torch.Generator().manual_seed(3)
    lens = {1: 45, 2: 58, 3: 9, 4: 41}
    for row, n in lens.items():
        k = [torch.randn(n, HKV * D, generator=gen).to(dev) for _ in range(L)]
        v = [torch.randn(n, HKV * D, generator=gen).to(dev) for _ in range(L)]
        for w in (eager, graphed):
            w.prompt(row, k, v)
    schedule = [[1, 2, 3, 4]] * 4 + [[1, 2, 3]] * 3 + [[1, 2]] * 4
    for step, rows in enumerate(schedule):
        for gone in ({4} if step == 4 else {3} if step == 7 else set()):
            for w in (eager, graphed):
                w.bridge.release_rows([gone])
        for r in rows:
            lens[r] += 1
        qkv = [tuple(torch.randn(len(rows), n * D, generator=gen).to(dev) for n in (HQ, HKV, HKV))
               for _ in range(L)]
        want = eager.decode(rows, [lens[r] for r in rows], qkv)
        # past the first step (registration: the prompts' offload), no host sync
        got = graphed.decode(rows, [lens[r] for r in rows], qkv, no_sync=step > 0)
        for i in range(L):
            torch.testing.assert_close(got[i], want[i], rtol=1e-5, atol=1e-5)
        # SGLang's attention read one token of each row of ours (the graph's static lengths)
        seen = graphed.captured[2 if len(rows) <= 2 else 4][1].seq_lens[: len(rows)].tolist()
        assert seen == [1 if r != 3 else lens[r] for r in rows]
        if 3 in rows:  # the short row: SGLang's own attention over its whole context
            fb = Batch(Mode("decode"), 1, torch.tensor([3], device=dev), torch.tensor([lens[3]], device=dev),
                       torch.tensor([graphed.slots[3][-1]], device=dev))
            q, k, v = (x[2:3] for x in qkv[1])
            torch.testing.assert_close(got[1][2:3], graphed.attend(graphed.layers[1], q, k, v, fb, False),
                                       rtol=1e-5, atol=1e-5)
    se, sg = eager.bridge.coord.stats(), graphed.bridge.coord.stats()
    assert se["misses"] > 0 and (sg["hits"], sg["misses"]) == (se["hits"], se["misses"])
    assert graphed.bridge.registrations == eager.bridge.registrations == 3
    for i in range(L):
        pad = World.PS  # page 0: SGLang's padding page, where padded graph rows write
        assert torch.equal(graphed.kv_pool.k_buffer[i][pad:], eager.kv_pool.k_buffer[i][pad:])
        assert torch.equal(graphed.kv_pool.v_buffer[i][pad:], eager.kv_pool.v_buffer[i][pad:])
