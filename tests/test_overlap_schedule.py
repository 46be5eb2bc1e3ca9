"""The overlap schedule (SGLang's overlap scheduler): ``generate`` issues decode step t+1
before it reads step t's tokens, which then feed step t+1 on the device. The tokens, the
consumed tokens (``Request.consumed``, which the prefix tree caches) and the mode's counters
must equal those of the schedule that waits for every step; on a GPU, issuing a step must
not wait for the device."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsehi.config import SparseConfig
from sparsehi.runtime.decode_graph import DecodeGraphRunner, DecodeInputs
from sparsehi.runtime.model_config import get_model_config
from sparsehi.runtime.runtime_config import RuntimeConfig
from sparsehi.runtime.runner import ModelRunner
from sparsehi.runtime.weights import build_model

MODES = ["dense", "sparse-gpu", "sparse-hier", "offload-full"]
GQA = dict(algorithm="quest", page_size=16, top_k=64, device_buffer_size=96, sink_tokens=16, recent_tokens=16)
DSA = dict(algorithm="dsa", page_size=1, top_k=48, device_buffer_size=96, sink_tokens=8, recent_tokens=8)
_MODELS: dict = {}


def _model(name: str, device: str):
    key = (name, device)
    if key not in _MODELS:
        cfg = get_model_config(name, num_layers=3)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        _MODELS[key] = build_model(config=cfg, device=device, dtype=dtype)
    return _MODELS[key]


def _prompts(lengths, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _runner(name, mode, kw, prompts, steps, device="cpu", overlap=True, **rt_kw):
    rt = RuntimeConfig(mode=mode, sparse=SparseConfig(min_sparse_prompt_len=0, **kw), device=device,
                       dtype=torch.bfloat16 if device == "cuda" else torch.float32, max_num_reqs=len(prompts) + 1,
                       max_context_len=max(map(len, prompts)) + steps + 1, adapter="auto" if device == "cuda" else "none",
                       validate=device != "cuda", overlap_schedule=overlap, **rt_kw)
    return ModelRunner(_model(name, device), rt)


def _run_both(name, mode, kw, prompts, steps, device="cpu", force=None):
    out = {}
    for overlap in (True, False):
        runner = _runner(name, mode, kw, prompts, steps, device, overlap)
        reqs_seen = []
        real_end = runner.mode.end_request
        runner.mode.end_request = lambda r, _real=real_end: reqs_seen.append((list(r.consumed), r.seq_len - len(r.prompt))) or _real(r)
        res = runner.generate(prompts, steps, force_tokens=force)
        out[overlap] = (res, reqs_seen)
    return out


@pytest.mark.parametrize("mode", MODES)
def test_overlapped_generate_equals_the_waiting_schedule_cpu(mode):
    prompts = _prompts((70, 95, 64))
    out = _run_both("tiny-gqa", mode, GQA, prompts, 24)
    (a, fa), (b, fb) = out[True], out[False]
    assert a.tokens == b.tokens
    assert fa == fb, "the requests consumed the same tokens (the prefix tree caches them)"
    for toks, (fed, decoded) in zip(a.tokens, fa):
        assert fed == toks[:-1] and decoded == len(fed) == 24
    if mode.startswith("sparse"):
        assert a.stats["hits"] == b.stats["hits"] and a.stats["misses"] == b.stats["misses"]


def test_overlap_with_teacher_forcing_cpu():
    """Forced tokens are known on the host: the next step is still issued before the
    previous one is read, and every step consumes its forced token."""
    prompts = _prompts((70, 90), seed=2)
    force = _prompts((12, 12), seed=5)
    out = _run_both("tiny-gqa", "sparse-hier", GQA, prompts, 12, force=force)
    assert out[True][0].tokens == out[False][0].tokens
    assert [f for f, _ in out[True][1]] == force


def test_launch_decode_with_other_rows_finishes_the_previous_step_first():
    """Tokens can only come from the device for the same requests in the same order;
    otherwise the previous step is read first and its tokens go in from the host."""
    prompts = _prompts((70, 90), seed=1)
    runner = _runner("tiny-gqa", "dense", GQA, prompts, 8)
    reqs = runner.new_requests(prompts)
    for r in reqs:
        runner.prefill(r)
    first = runner.launch_decode(reqs)
    second = runner.launch_decode(list(reversed(reqs)), after=first)
    assert first.finished and not first.feeds_next
    runner.finish_decode(second)
    for r in reqs:
        assert len(r.output) == 3 and r.consumed == r.output[:2]
    with pytest.raises(ValueError, match="already finished"):
        runner.finish_decode(second)


def test_inputs_take_token_ids_from_the_device():
    inp = DecodeInputs.allocate(4, torch.device("cpu"))
    inp.next_tokens[:] = torch.tensor([41, 42, 43, 44])
    inp.fill(None, [10, 20, 30], [3, 1, 0], [11, 21, 31], 4, ids_on_device=True)
    assert inp.input_ids.tolist() == [41, 42, 43, 0]
    assert inp.req_pool_indices.tolist() == [3, 1, 0, -1]
    # the staging buffers alternate: the one just used is not written by the next fill
    used = inp.staging[0].clone()
    inp.fill([5, 6], [11, 21], [3, 1], [12, 22], 2, np.array([[0, 1, 2, 30]]))
    assert torch.equal(inp.staging[0], used) and inp.input_ids[:2].tolist() == [5, 6]
    assert inp.page_entries[0].tolist() == [0, 1, 2, 30]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,kw", [("tiny-gqa", GQA), ("tiny-dsa", DSA)], ids=["gqa", "mla"])
def test_overlapped_replays_equal_the_waiting_schedule(mode, name, kw):
    prompts = _prompts((300, 333, 290))  # bucket 4: a padding row every step
    out = _run_both(name, mode, kw, prompts, 40, device="cuda")
    (a, fa), (b, fb) = out[True], out[False]
    assert a.tokens == b.tokens and fa == fb
    if mode == "sparse-hier":
        assert a.stats["misses"] > 0
        assert [s["misses"] for s in a.stats["per_step"]] == [s["misses"] for s in b.stats["per_step"]]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_issuing_a_step_never_waits_for_the_device(mode):
    """``launch_decode`` (host part, inputs, replay, token read-back start, end_decode) runs
    with CUDA's sync debug mode set to error, across page boundaries, while the previous
    step is still unread: nothing in it waits for the device."""
    prompts = _prompts((300, 333))
    runner = _runner("tiny-gqa", mode, GQA, prompts, 40, device="cuda")
    reqs = runner.new_requests(prompts)
    for r in reqs:
        runner.prefill(r)
    pending = runner.launch_decode(reqs)  # captures; the first step also waits for the prefill offload
    runner.finish_decode(pending)
    pending = runner.launch_decode(reqs)
    for _ in range(36):  # crosses two page boundaries (page 16)
        torch.cuda.set_sync_debug_mode("error")
        try:
            nxt = runner.launch_decode(reqs, after=pending)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert pending.feeds_next, "the tokens went in on the device"
        runner.finish_decode(pending)
        pending = nxt
    runner.finish_decode(pending)
    assert all(r.consumed == r.output[:-1] for r in reqs)


@pytest.mark.gpu
def test_a_capture_between_overlapped_steps_keeps_the_previous_steps_tokens():
    """A step whose graph is captured while the previous step's tokens are still its ids
    (overlap schedule, a new graph key for the same rows): the capture's padding runs must
    not replace those tokens."""
    def body(inputs: DecodeInputs, nb: int, graph_key) -> dict:
        torch.add(inputs.input_ids[:nb], 1000 if graph_key == "b" else 1, out=inputs.next_tokens[:nb])
        return {}

    runner = DecodeGraphRunner(body, 4, torch.device("cuda"), enabled=True)
    first, _ = runner.run([7, 8, 9], [0, 0, 0], [0, 1, 2], [1, 1, 1], graph_key="a")
    assert first.tolist()[:3] == [8, 9, 10]
    second, _ = runner.run(None, [1, 1, 1], [0, 1, 2], [2, 2, 2], graph_key="b", ids_on_device=True)  # captured now
    assert second.tolist()[:3] == [1008, 1009, 1010]
