"""The author kit's capture-safety checks: graph-unsafe calls in retrieve_topk /
update_representations are found without a GPU (emulated capture and replay) and, on a GPU,
by a real CUDA-graph capture."""
import re
from pathlib import Path

import pytest
import torch

from sparsehi.algorithms.dsa import DSAAlgorithm
from sparsehi.algorithms.graph_safety import CaptureUnsafe, EmulatedReplay, HostSyncDetector
from sparsehi.algorithms.oracle import OracleAlgorithm
from sparsehi.algorithms.quest import QuestAlgorithm
from sparsehi.algorithms.testing import ProjectedIndexerInputs, check_algorithm
from sparsehi.input_checks import host_checks_enabled

from kit_algorithms import Window

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def sink_window(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from examples.sink_window import SinkWindow
    return SinkWindow


def _unsafe(hook: str, action):
    """A Window whose ``hook`` first runs ``action(args, kwargs)`` (then behaves correctly)."""

    class Unsafe(Window):
        pass

    base = getattr(Window, hook)

    def method(self, *args, **kw):
        action(args, kw)
        return base(self, *args, **kw)

    setattr(Unsafe, hook, method)
    return Unsafe


# (hook, action on (args, kwargs), the call the kit must name)
UNSAFE = [
    ("retrieve_topk", lambda a, kw: int(kw["seq_lens"].max()), "Tensor.__int__"),
    ("retrieve_topk", lambda a, kw: kw["candidate_end"].max().item(), "Tensor.item"),
    ("retrieve_topk", lambda a, kw: bool(a[3].any()), "Tensor.__bool__"),
    ("retrieve_topk", lambda a, kw: torch.nonzero(a[3]), "torch.nonzero"),
    ("retrieve_topk", lambda a, kw: a[0][a[3]], "boolean-mask indexing"),
    ("retrieve_topk", lambda a, kw: torch.unique(a[2]), "torch.unique"),
    ("retrieve_topk", lambda a, kw: kw["seq_lens"].masked_select(a[3]), "Tensor.masked_select"),
    ("retrieve_topk", lambda a, kw: kw["seq_lens"].cpu(), "Tensor.cpu"),
    ("update_representations", lambda a, kw: a[2].tolist(), "Tensor.tolist"),
    ("update_representations", lambda a, kw: a[3][a[1] >= 0], "boolean-mask indexing"),
    ("update_representations", lambda a, kw: a[2].to("cpu"), "Tensor.to('cpu')"),
]


@pytest.mark.parametrize("hook,action,call", UNSAFE, ids=[f"{h}-{c}" for h, _, c in UNSAFE])
def test_kit_names_the_graph_unsafe_call(hook, action, call):
    cls = _unsafe(hook, action)
    pattern = rf"capture safety \(emulated\): {hook}: {re.escape(call)}.* at tests/test_author_kit_capture.py:\d+"
    with pytest.raises(AssertionError, match=pattern):
        check_algorithm(cls, min_needle_recall=None)
    # the same algorithm without the call passes
    assert "capture safety" in check_algorithm(Window, min_needle_recall=None).checks


def test_capture_check_report_and_off():
    cls = _unsafe("retrieve_topk", lambda a, kw: kw["candidate_end"].max().item())
    rep = check_algorithm(cls, min_needle_recall=None, capture_check="report")
    assert rep.capture[0] == "emulated: FAILED" and "Tensor.item" in rep.capture_findings[0]
    assert "CAPTURE FINDINGS" in str(rep)
    rep = check_algorithm(cls, min_needle_recall=None, capture_check="off")
    assert rep.capture == ["not checked (capture_check='off')"] and "capture safety" not in rep.checks
    with pytest.raises(ValueError, match="capture_check='maybe' is invalid"):
        check_algorithm(Window, capture_check="maybe")
    with pytest.raises(ValueError, match="replay_check='off' is invalid"):
        check_algorithm(Window, replay_check="off")


class _ChecksOnlyWhenEager(Window):
    """Reads a value back only outside capture, as the built-ins' validation does."""

    def retrieve_topk(self, queries, layer_id, req_pool_indices, sparse_mask, **kw):
        if host_checks_enabled(True) and int(kw["seq_lens"].max()) < 0:
            raise ValueError("seq_lens must be >= 0")
        return super().retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, **kw)


def test_hooks_see_a_capture_in_progress():
    rep = check_algorithm(_ChecksOnlyWhenEager, min_needle_recall=None, replay_check="require")
    assert rep.capture[0].startswith("emulated: passed")


class _FailsUnderCapture(Window):
    """Would (say) grow a buffer lazily, which it refuses to do while a graph is captured."""

    def retrieve_topk(self, queries, layer_id, req_pool_indices, sparse_mask, **kw):
        if not host_checks_enabled(True):
            raise RuntimeError("cannot grow the score buffer while capturing")
        return super().retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, **kw)


def test_a_hook_that_raises_under_capture_is_named():
    match = (r"capture safety \(emulated\): retrieve_topk: raised under capture at "
             r"tests/test_author_kit_capture.py:\d+ in retrieve_topk: RuntimeError: cannot grow")
    with pytest.raises(AssertionError, match=match):
        check_algorithm(_FailsUnderCapture, min_needle_recall=None)


class _IdentityCache:
    """A value cached on the identity of some tensors: what IdentityMemo did before it
    learnt about CUDA graphs (the mistake the replay check exists to catch)."""

    def __init__(self):
        self._key, self._value = None, None

    def get(self, tensors, build):
        key = tuple((id(t), t._version) for t in tensors)
        if key != self._key:
            self._key, self._value, self._keep = key, build(), tensors
        return self._value


class _MemoisesCandidates(Window):
    """Converts the candidate range once per step, keyed on tensor identity."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._memo = _IdentityCache()

    def retrieve_topk(self, queries, layer_id, req_pool_indices, sparse_mask, **kw):
        start, end = self._memo.get((kw["candidate_start"], kw["candidate_end"]),
                                    lambda: (kw["candidate_start"].long(), kw["candidate_end"].long()))
        ids, count = self._ids(start, end, kw["top_k"], sparse_mask & (req_pool_indices >= 0))
        return ids.int(), count.int()


class _MemoisesUpdateTargets(OracleAlgorithm):
    """Derives the entries to write once per step, keyed on tensor identity."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._memo = _IdentityCache()

    def update_representations(self, layer_id, req_pool_indices, positions, new_keys, **kw):
        if self._layer(layer_id) is None:
            return
        flat = self._keys_flat[layer_id]
        idx = self._memo.get((req_pool_indices, positions), lambda: torch.where(
            req_pool_indices >= 0, req_pool_indices * self.max_context_len + positions, flat.shape[0] - 1))
        flat[idx] = new_keys.to(flat.dtype)


@pytest.mark.parametrize("cls,match", [
    (_MemoisesCandidates, "retrieve_topk replayed"),
    (_MemoisesUpdateTargets, "update_representations replayed"),
])
def test_replay_check_catches_inputs_cached_across_calls(cls, match):
    with pytest.raises(AssertionError, match=rf"capture safety \(emulated\): layer \d+: {match}"):
        check_algorithm(cls, min_needle_recall=None, replay_check="require")
    rep = check_algorithm(cls, min_needle_recall=None, replay_check="report")
    assert rep.capture[0] == "emulated: replay differs from eager"
    assert any(match in f for f in rep.capture_findings)


BUILTINS = [
    (OracleAlgorithm, {"sparse_extra_config": {"validate": False}}, None),
    (OracleAlgorithm, {"page_size": 1, "top_k": 16, "device_buffer_size": 64}, None),
    (QuestAlgorithm, {"sparse_extra_config": {"validate": False}}, None),
    (QuestAlgorithm, None, None),
    (DSAAlgorithm, {"sparse_extra_config": {"index_head_dim": 32, "validate": False}}, ProjectedIndexerInputs(32)),
]
BUILTIN_IDS = ["oracle-page", "oracle-token", "quest-novalidate", "quest", "dsa-novalidate"]


@pytest.mark.parametrize("cls,over,inputs", BUILTINS, ids=BUILTIN_IDS)
def test_builtins_make_no_graph_unsafe_call(cls, over, inputs):
    rep = check_algorithm(cls, over, inputs=inputs, context_len=96)
    assert "capture safety" in rep.checks and not any("FAILED" in c for c in rep.capture), rep.capture


@pytest.mark.parametrize("cls,over,inputs", BUILTINS, ids=BUILTIN_IDS)
def test_builtins_replay_like_eager(cls, over, inputs):
    check_algorithm(cls, over, inputs=inputs, context_len=96, replay_check="require")


def test_sink_window_replays_like_eager(sink_window):
    for over in (None, {"page_size": 1, "top_k": 16, "device_buffer_size": 64}):
        rep = check_algorithm(sink_window, over, min_needle_recall=None, replay_check="require")
        assert rep.capture[0].startswith("emulated: passed") and rep.capture[1].startswith("cuda graph: skipped")


# ----------------------------------------------------------------------------- the tools
def test_detector_leaves_graph_safe_calls_alone():
    t, m = torch.arange(6), torch.arange(6) > 2
    with HostSyncDetector("hook"):
        torch.where(m, t, 0)
        t[torch.tensor([1, 2])]
        t.clone()[m] = 0  # scalar fill through a mask: masked_fill, no count needed
        t.repeat_interleave(2)
        t.repeat_interleave(t, output_size=15)
        t.to(torch.device("cpu"))
        _ = t.shape[0] + t.dim() + t.numel()
    with pytest.raises(CaptureUnsafe, match=r"hook: Tensor.item at tests/test_author_kit_capture.py:\d+ in "):
        with HostSyncDetector("hook"):
            t[0].item()
    with pytest.raises(CaptureUnsafe, match=r"boolean-mask assignment"):
        with HostSyncDetector("hook"):
            t.clone()[m] = torch.zeros(3, dtype=t.dtype)  # index_put_: the mask becomes indices (nonzero)


def test_emulated_replay_refills_inputs_as_a_graph_replay_does():
    """New contents, same tensor object, data_ptr and version: what host code sees at replay."""
    x = torch.zeros(3)
    call = EmulatedReplay("hook", lambda: x * 2, {"x": x})
    call.capture()
    ptr, version = x.data_ptr(), x._version
    call.load({"x": torch.tensor([1.0, 2.0, 3.0])})
    assert x.data_ptr() == ptr and x._version == version
    assert torch.equal(call.replay(), torch.tensor([2.0, 4.0, 6.0]))
    with pytest.raises(ValueError, match="static input 'x' is \\(3,\\)"):
        call.load({"x": torch.zeros(4)})


# ----------------------------------------------------------------------------- GPU
GPU_BUILTINS = [
    (QuestAlgorithm, {"page_size": 16, "top_k": 128, "device_buffer_size": 256, "sink_tokens": 16,
                      "recent_tokens": 16}, None),
    (DSAAlgorithm, {"sparse_extra_config": {"index_head_dim": 64}}, ProjectedIndexerInputs(64)),
    (DSAAlgorithm, {"sparse_extra_config": {"index_head_dim": 64, "validate": False}}, ProjectedIndexerInputs(64)),
    (OracleAlgorithm, None, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("cls,over,inputs", GPU_BUILTINS, ids=["quest", "dsa", "dsa-novalidate", "oracle"])
def test_builtins_capture_in_a_cuda_graph(cls, over, inputs):
    """Captured under set_sync_debug_mode('error') without raising; whether replays equal
    eager calls is reported (see test_builtins_replay_like_eager)."""
    rep = check_algorithm(cls, over, device="cuda", inputs=inputs, context_len=320)
    assert len(rep.capture) == 2 and rep.capture[1].startswith("cuda graph:"), rep.capture
    assert not any("FAILED" in c for c in rep.capture), str(rep)


@pytest.mark.gpu
def test_sink_window_replays_in_a_cuda_graph(sink_window):
    rep = check_algorithm(sink_window, device="cuda", min_needle_recall=None, replay_check="require")
    assert rep.capture[1].startswith("cuda graph: passed"), rep.capture


class _SynchronizesDevice(Window):
    """A host sync no torch function shows (torch.cuda.synchronize): only a real capture sees it."""

    def retrieve_topk(self, queries, layer_id, req_pool_indices, sparse_mask, **kw):
        torch.cuda.synchronize()
        return super().retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, **kw)


@pytest.mark.gpu
def test_real_capture_catches_what_the_emulation_cannot():
    rep = check_algorithm(_SynchronizesDevice, device="cuda", min_needle_recall=None, capture_check="report")
    assert rep.capture[0].startswith("emulated: passed") and rep.capture[1] == "cuda graph: FAILED", rep.capture
    assert "retrieve_topk: CUDA-graph capture at tests/test_author_kit_capture.py" in rep.capture_findings[0]
    with pytest.raises(AssertionError, match=r"capture safety \(cuda graph\): retrieve_topk: CUDA-graph capture"):
        check_algorithm(_SynchronizesDevice, device="cuda", min_needle_recall=None)


class _HostBookkeeping(Window):
    """Counts decoded tokens in a Python int (no sync, so the emulation, which runs Python
    on every call, is content): a graph replay runs no Python, the count freezes at capture."""

    updates = 0

    def update_representations(self, layer_id, req_pool_indices, positions, new_keys, **kw):
        if layer_id == 0:
            self.updates += 1

    def retrieve_topk(self, queries, layer_id, req_pool_indices, sparse_mask, **kw):
        if self.updates >= 4:  # first candidates from the 4th decoded token on, the most recent before
            return super().retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, **kw)
        end, start, top_k = kw["candidate_end"].long(), kw["candidate_start"].long(), kw["top_k"]
        cols = torch.arange(top_k, device=end.device)[None, :]
        count = (end - start).clamp(0, top_k) * (sparse_mask & (req_pool_indices >= 0)).long()
        ids = torch.where(cols < count[:, None], end[:, None] - 1 - cols, -1)
        return ids.int(), count.int()


@pytest.mark.gpu
def test_real_replay_catches_host_state_frozen_at_capture():
    rep = check_algorithm(_HostBookkeeping, device="cuda", min_needle_recall=None, replay_check="report")
    assert rep.capture[0].startswith("emulated: passed"), rep.capture
    match = r"capture safety \(cuda graph\): layer 0: update_representations replayed"
    with pytest.raises(AssertionError, match=match):
        check_algorithm(_HostBookkeeping, device="cuda", min_needle_recall=None, replay_check="require")


def test_identity_memo_caches_nothing_under_capture():
    """A value built before a capture (its warm-up) must not be handed to the capture, and
    nothing built under capture may be reused: the capture records its own build."""
    from sparsehi.algorithms.graph_safety import simulated_capture
    from sparsehi.kernels.topk import IdentityMemo

    memo, calls = IdentityMemo(), []
    t = torch.zeros(3)

    def build():
        calls.append(1)
        return t + len(calls)

    first = memo.get((t,), (), build)
    assert memo.get((t,), (), build) is first and len(calls) == 1  # eager: cached
    with simulated_capture():
        a = memo.get((t,), (), build)
        b = memo.get((t,), (), build)
    assert a is not first and b is not a and len(calls) == 3
