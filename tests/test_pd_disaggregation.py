"""Prefill/decode disaggregation over a real ``mooncake_master`` (docs/disaggregation.md).

- Two OS processes, ``sparsehi run --disaggregation prefill`` and ``... decode``: the decode
  process generates exactly the tokens a single-process ``sparsehi run`` generates for the
  same prompt, and its model computed no prompt position (a forward hook counts them).
- The decode output is written back to the store: a third reader's prefix tree prefetches
  the decoded tokens' pages from L3.
- A prefill process SIGKILLed mid-transfer (pages stored, no ready record): the decode side
  recomputes the prompt (same tokens) or, told to, refuses with a clear error and exit code 3.
- A ready record whose page has gone from the store: refused or recomputed, never adopted.

The pages outlive the processes that wrote them in a standalone Mooncake store client's
segment (the prefill and decode clients contribute none), as in a deployment where the
store runs apart from the prefill instances.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mooncake_server import MooncakeMaster, MooncakeSegmentHolder, missing_reason

_MISSING = missing_reason()

ROOT = Path(__file__).resolve().parents[1]
CONTEXT, STEPS, PAGE = 90, 24, 16  # 5 full pages + a 10-token tail; decoding fills 2 more pages
RUN = ["run", "--context", str(CONTEXT), "--batch", "1", "--decode-tokens", str(STEPS), "--num-layers", "4",
       "--top-k", "32", "--sink-tokens", "16", "--recent-tokens", "16", "--page-size", str(PAGE), "--device", "cpu",
       "--no-forced", "--no-progress", "--hicache-mem-layout", "page_first", "--modes", "sparse-hier"]


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def cluster():
    """A master and a standalone store client holding the pages; the extra config of clients
    that contribute no memory (their objects outlive them)."""
    if _MISSING is not None:
        pytest.skip(_MISSING)
    with MooncakeMaster() as master, MooncakeSegmentHolder(master):
        yield master, master.extra_config(global_segment_size=0)


def _l3_args(extra: dict) -> list[str]:
    return ["--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config", json.dumps(extra)]


def _spawn(args: list[str], script: list[str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, *(script or ["-m", "sparsehi"]), *args]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def _finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _reference_tokens(seed: int, out_dir: Path) -> list[list[int]]:
    """What a single-process ``sparsehi run`` (no L3, no split) generates."""
    from sparsehi.cli import main

    assert main(RUN + ["--seed", str(seed), "--output-dir", str(out_dir)]) == 0
    return json.loads((out_dir / "run.json").read_text())["tokens"]["sparse-hier"]


def _store(extra: dict, namespace: str):
    from hicache.storage.base import StorageConfig
    from hicache.storage.mooncake_store import MooncakeStorage

    return MooncakeStorage(StorageConfig(model_name=namespace, extra=dict(extra)))


def _prompt(seed: int) -> list[int]:
    from sparsehi.runtime.demo import make_prompts
    from sparsehi.runtime.model_config import get_model_config

    return make_prompts(get_model_config("tiny-gqa").vocab_size, 1, CONTEXT, seed)[0]


@pytest.mark.parametrize("extra, message", [
    ([], "--disaggregation needs --hicache-storage-backend"),
    (["--hicache-storage-backend", "file", "--modes", "dense"], "--disaggregation runs the sparse-hier mode only"),
    (["--hicache-storage-backend", "file", "--disaggregation-wait-timeout", "-1"], "wait_timeout_s must be"),
])
def test_bad_disaggregation_options_are_named(extra, message, capsys):
    from sparsehi.cli import main

    args = [a for a in RUN if a not in ("--modes", "sparse-hier")] + ["--disaggregation", "decode", *extra]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_on_missing_without_disaggregation_is_rejected(capsys):
    from sparsehi.cli import main

    with pytest.raises(SystemExit):
        main(RUN + ["--disaggregation-on-missing", "refuse"])
    assert "--disaggregation-on-missing applies with --disaggregation decode" in capsys.readouterr().err


def test_decode_process_takes_the_prefill_processes_kv_and_writes_its_output_back(cluster, tmp_path):
    master, extra = cluster
    seed = 11
    # the decode process starts first and waits for the prefill's ready record
    decode = _spawn(RUN + _l3_args(extra) + ["--seed", str(seed), "--disaggregation", "decode",
                                            "--disaggregation-wait-timeout", "60", "--output-dir",
                                            str(tmp_path / "decode")])
    prefill = _spawn(RUN + _l3_args(extra) + ["--seed", str(seed), "--disaggregation", "prefill",
                                             "--output-dir", str(tmp_path / "prefill")])
    reference = _reference_tokens(seed, tmp_path / "ref")
    rc, out, err = _finish(prefill)
    assert rc == 0, err[-2000:]
    assert "6 pages published" in out  # 5 full pages and the tail
    rc, out, err = _finish(decode)
    assert rc == 0, err[-2000:]
    run = json.loads((tmp_path / "decode" / "run.json").read_text())
    assert run["handoff"][0]["adopted"] and run["handoff"][0]["pages"] == 6
    assert run["prompt_positions_computed"] == 0  # no prefill forward ran for the prompt
    assert run["tokens"]["sparse-hier"] == reference
    assert run["l3"]["l3_pages_written"] == 2  # the pages the decoded tokens filled

    # a third reader: its prefix tree finds the decoded tokens' pages in L3 and prefetches them
    from hicache.storage.keys import page_hash_chain, storage_key
    from hicache.storage_controller import StoragePolicy
    from sparsehi.config import SparseConfig
    from sparsehi.runtime.runner import ModelRunner
    from sparsehi.runtime.runtime_config import RuntimeConfig
    from sparsehi.runtime.weights import build_model

    tokens = _prompt(seed) + reference[0][:STEPS]  # prompt + what the decode steps consumed
    st = _store(extra, run["l3_model_name"])
    try:
        keys = [storage_key(h) for h in page_hash_chain(tokens, PAGE)]
        assert len(keys) == 7 and st.batch_exists(keys) == [True] * 7
        sc = SparseConfig(algorithm="quest", page_size=PAGE, top_k=32, device_buffer_size=64, sink_tokens=16,
                          recent_tokens=16, min_sparse_prompt_len=0, io_backend="kernel")
        rt = RuntimeConfig(mode="sparse-hier", sparse=sc, max_num_reqs=1, max_context_len=160, host_layout="page_first",
                           storage=st, storage_policy=StoragePolicy(prefetch_policy="wait_complete",
                                                                    prefetch_threshold=16))
        runner = ModelRunner(build_model("tiny-gqa", num_layers=4), rt)
        res = runner.generate([tokens + [1]], 1)
        assert res.prefix_hits == [7 * PAGE]
        assert runner.mode.l3_stats()["l3_hit_tokens"] == 7 * PAGE
        runner.mode.close()
    finally:
        st.close()


def test_prefill_killed_mid_transfer_is_recomputed_or_refused(cluster, tmp_path):
    master, extra = cluster
    seed = 12
    prefill = _spawn(["3"] + RUN + _l3_args(extra) + ["--seed", str(seed), "--disaggregation", "prefill",
                                                     "--output-dir", str(tmp_path / "prefill")],
                     script=[str(ROOT / "tests" / "pd_prefill_stall.py")])
    reference = _reference_tokens(seed, tmp_path / "ref")
    try:
        deadline = time.monotonic() + 60
        line = ""
        while not line.startswith("STALLED") and time.monotonic() < deadline and prefill.poll() is None:
            line = prefill.stdout.readline()
        assert line.startswith("STALLED 3"), prefill.stderr.read()[-2000:] if prefill.poll() is not None else line
    finally:
        prefill.send_signal(signal.SIGKILL)
        prefill.wait(timeout=10)

    from hicache.storage.kv_handoff import handoff_keys

    keys = handoff_keys(_prompt(seed), PAGE)
    st = _store(extra, "tiny-gqa-L4-float32-p16-page_first")
    try:  # really mid-transfer: three pages stored, the rest and the ready record not
        assert st.batch_exists(list(keys.page_keys) + [keys.tail_key, keys.ready_key]) == [True] * 3 + [False] * 4
    finally:
        st.close()

    common = RUN + _l3_args(extra) + ["--seed", str(seed), "--disaggregation", "decode",
                                      "--disaggregation-wait-timeout", "1"]
    refuse = _spawn(common + ["--disaggregation-on-missing", "refuse", "--output-dir", str(tmp_path / "refuse")])
    recompute = _spawn(common + ["--output-dir", str(tmp_path / "recompute")])
    rc, out, err = _finish(refuse)
    assert rc == 3, err[-2000:]
    assert "refused" in err and "no ready record" in err
    assert not (tmp_path / "refuse" / "run.json").exists()
    rc, out, err = _finish(recompute)
    assert rc == 0, err[-2000:]
    run = json.loads((tmp_path / "recompute" / "run.json").read_text())
    assert not run["handoff"][0]["adopted"] and "no ready record" in run["handoff"][0]["reason"]
    assert run["prompt_positions_computed"] > 0
    assert run["tokens"]["sparse-hier"] == reference


def test_a_record_whose_page_is_gone_is_never_adopted(cluster):
    """Runtime API: a published prompt loses a page (evicted, removed); the decode side
    refuses or recomputes it, and the recomputed tokens are a local run's."""
    from hicache.storage.kv_handoff import HandoffIncomplete, handoff_keys
    from sparsehi.config import SparseConfig
    from sparsehi.runtime.disaggregation import HandoffRefused, decode_from_handoff, prefill_and_publish
    from sparsehi.runtime.runner import ModelRunner
    from sparsehi.runtime.runtime_config import RuntimeConfig
    from sparsehi.runtime.weights import build_model

    master, extra = cluster
    model = build_model("tiny-gqa", num_layers=4)
    prompt = _prompt(13)
    sc = SparseConfig(algorithm="quest", page_size=PAGE, top_k=32, device_buffer_size=64, sink_tokens=16,
                      recent_tokens=16, min_sparse_prompt_len=0, io_backend="kernel")
    st = _store(extra, "api-test")

    def run(fn, storage=None):
        r = ModelRunner(model, RuntimeConfig(mode="sparse-hier", sparse=sc, max_num_reqs=1, max_context_len=160,
                                             host_layout="page_first", storage=storage))
        try:
            return fn(r)
        finally:
            r.mode.close()

    try:
        local = run(lambda r: r.generate([prompt], 6).tokens)
        run(lambda r: prefill_and_publish(r, [prompt]), st)
        good = run(lambda r: decode_from_handoff(r, [prompt], 6, timeout_s=5), st)
        assert good.outcomes[0].adopted and good.prompt_positions_computed == 0
        assert good.generation.tokens == local
        gone = handoff_keys(prompt, PAGE).page_keys[2]
        page_bytes = st.get(gone).numel()
        st._client.store.remove(st.object_key(gone), True)  # the store lost one page
        with pytest.raises(HandoffRefused, match=r"page 2 of 6 .* missing") as refused:
            run(lambda r: decode_from_handoff(r, [prompt], 6, timeout_s=5, on_missing="refuse"), st)
        assert isinstance(refused.value.__cause__, HandoffIncomplete)
        res = run(lambda r: decode_from_handoff(r, [prompt], 6, timeout_s=5), st)
        assert not res.outcomes[0].adopted and "page 2 of 6" in res.outcomes[0].reason
        assert res.prompt_positions_computed > 0
        assert res.generation.tokens == local
        # a page of the right size that the backend's own check accepts, but other bytes
        st._client.store.remove(st.object_key(gone), True)
        assert st.batch_set([gone], [torch.randint(0, 255, (page_bytes,), dtype=torch.uint8)])
        with pytest.raises(HandoffRefused, match=r"page 2 of 6 .* differs from the one the prefill published"):
            run(lambda r: decode_from_handoff(r, [prompt], 6, timeout_s=5, on_missing="refuse"), st)
    finally:
        st.close()

