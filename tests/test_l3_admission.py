"""How long the sparse-hier runtime (``sparsehi run``) holds a request's admission for its L3
prefetch, per policy, with a backend whose reads hang: ``best_effort`` admits at once with
what has arrived (nothing), ``timeout`` at its deadline (sized by what the existence check
found), ``wait_complete`` when the fetch is done (a read that never returns ends it at
``backend_call_timeout_s``). Whatever arrives late is released, never adopted or leaked."""
from __future__ import annotations

import threading
import time
from typing import Optional, Sequence

import pytest
import torch

from hicache.storage_controller import StoragePolicy
from memory_storage import MemoryStorage
from sparsehi.config import SparseConfig
from sparsehi.runtime.model_config import get_model_config
from sparsehi.runtime.runtime_config import RuntimeConfig
from sparsehi.runtime.runner import ModelRunner
from sparsehi.runtime.weights import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

PS = 4
STORED = [(7 * i + 3) % 512 for i in range(32)]  # 8 pages that the first run writes to L3
PROMPT = STORED + [(11 * i + 5) % 512 for i in range(24)]  # ... continued by 6 pages L3 lacks


class HangingReads(MemoryStorage):
    """Every page read blocks until ``release`` is set (a hung network file system);
    existence checks answer at once."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.release = threading.Event()

    def batch_get(self, keys: Sequence[str], targets: Optional[Sequence[torch.Tensor]] = None):
        self.release.wait()
        return super().batch_get(keys, targets)


def _runner(storage=None, policy: Optional[StoragePolicy] = None) -> ModelRunner:
    model = build_model(config=get_model_config("tiny-gqa", num_layers=2))
    sc = SparseConfig(algorithm="quest", page_size=PS, top_k=2 * PS, device_buffer_size=4 * PS, sink_tokens=PS,
                      recent_tokens=PS, min_sparse_prompt_len=0, dense_layers=(0,), io_backend="direct")
    rt = RuntimeConfig(mode="sparse-hier", sparse=sc, max_num_reqs=1, max_context_len=64, host_kv_tokens=64 * PS,
                       host_layout="page_first_direct", storage=storage, storage_policy=policy)
    return ModelRunner(model, rt)


@pytest.fixture(scope="module")
def written():
    """L3 objects holding STORED's pages, and the tokens a run without L3 generates."""
    s = MemoryStorage()
    first = _runner(s, StoragePolicy(prefetch_policy="wait_complete", prefetch_threshold=PS))
    first.generate([STORED], 1)
    assert first.mode.l3_stats()["l3_pages_written"] == 8
    first.mode.close()
    cold = _runner().generate([PROMPT], 2).tokens
    return s.objects, cold


def _run(objects, **policy):
    storage = HangingReads(objects=dict(objects))
    runner = _runner(storage, StoragePolicy(prefetch_threshold=PS, **policy))
    return storage, runner


def _release_and_check_nothing_leaks(storage, runner) -> dict:
    tree = runner.mode.tree
    storage.release.set()
    assert tree.storage_ctl.wait_idle(5.0)
    assert tree.storage_ctl.calls.wait_returned(5.0)
    runner.mode.step_events()
    st = tree.stats()
    assert tree.storage_leaks() == 0 and st["prefetch_reserved_pages"] == 0
    assert not tree._orphans and not tree.ongoing_prefetch and st["l3_stages_retired"] == 0
    runner.mode.close()
    return st


def test_best_effort_admits_at_once_with_what_has_arrived(written):
    objects, cold = written
    # the timeout formula would allow 5 s: best_effort must not wait for it
    storage, runner = _run(objects, prefetch_policy="best_effort", prefetch_timeout_base=5.0)
    res = runner.generate([PROMPT], 2)
    assert res.prefill_s < 2.5, res.prefill_s
    assert res.prefix_hits == [0]  # the hung read delivered nothing by admission
    assert res.tokens == cold
    st = _release_and_check_nothing_leaks(storage, runner)
    assert st["l3_hit_tokens"] == 0 and st["prefetch_adopted_pages"] == 0  # late pages dropped


def test_timeout_admits_at_the_deadline_of_what_l3_holds(written):
    objects, cold = written
    # 8 of the 14 reserved pages are in L3: the deadline is 0.5 + 64 * 32 / 1024 = 2.5 s,
    # not the 4.0 s of the whole reservation
    storage, runner = _run(objects, prefetch_policy="timeout", prefetch_timeout_base=0.5,
                           prefetch_timeout_per_ki_token=64.0)
    res = runner.generate([PROMPT], 2)
    assert 2.5 <= res.prefill_s < 3.5, res.prefill_s
    assert res.prefix_hits == [0] and res.tokens == cold
    st = _release_and_check_nothing_leaks(storage, runner)
    assert st["l3_hit_tokens"] == 0 and st["prefetch_truncated"] == 1


def test_wait_complete_waits_for_a_slow_read(written):
    objects, cold = written
    storage, runner = _run(objects, prefetch_policy="wait_complete")
    delay = 1.0
    timer = threading.Timer(delay, storage.release.set)
    t0 = time.monotonic()
    timer.start()
    res = runner.generate([PROMPT], 2)
    timer.join()
    assert time.monotonic() - t0 >= delay and res.prefill_s >= delay * 0.9
    assert res.prefix_hits == [32]  # every page L3 held
    assert res.tokens == cold
    st = _release_and_check_nothing_leaks(storage, runner)
    assert st["l3_hit_tokens"] == 32


def test_wait_complete_admits_at_the_call_deadline_when_a_read_never_returns(written):
    objects, cold = written
    storage, runner = _run(objects, prefetch_policy="wait_complete", backend_call_timeout_s=1.0)
    res = runner.generate([PROMPT], 2)
    assert 1.0 <= res.prefill_s < 3.0, res.prefill_s
    assert res.prefix_hits == [0] and res.tokens == cold
    # the read still hangs, on a staging buffer of the controller: no host page is held for it
    tree = runner.mode.tree
    hung = tree.stats()
    assert hung["l3_stages_retired"] == 1 and hung["prefetch_reserved_pages"] == 0 and tree.storage_leaks() == 0
    st = _release_and_check_nothing_leaks(storage, runner)
    assert st["l3_call_timeouts"] == 1 and st["l3_fetch_faults"] == 1 and st["l3_hit_tokens"] == 0
