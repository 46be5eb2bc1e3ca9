"""A store shared by two ``--model-path`` checkpoints never mixes their KV: the L3 namespace
names a checkpoint by a digest of what decides its KV (``checkpoint_identity``), not by its
directory's name."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from sparsehi.cli import main
from sparsehi.runtime.checkpoint_identity import checkpoint_digest, load_with_identity
from sparsehi.runtime.weights import CheckpointError

HF = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48}


def write_checkpoint(path: Path, seed: int) -> Path:
    """A 2-layer Llama-layout checkpoint (config.json + model.safetensors) whose random
    weights depend on ``seed``; every seed gives the same shapes and file size."""
    from safetensors.torch import save_file

    from sparsehi.runtime.gqa_model import GQAModel
    from sparsehi.runtime.model_config import ModelConfig

    path.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig(name="ck", family="gqa", vocab_size=96, hidden_size=32, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, intermediate_size=48, seed=seed)
    m = GQAModel(cfg)
    m.random_init()
    (path / "config.json").write_text(json.dumps(HF))
    state = {(k if k == "lm_head.weight" else f"model.{k}"): v.contiguous() for k, v in m.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))
    return path


def _run(tmp_path: Path, ckpt: Path, name: str, store: Path = None, *extra: str) -> tuple[dict, dict]:
    argv = ["run", "--model-path", str(ckpt), "--context", "96", "--batch", "1", "--decode-tokens", "4",
            "--modes", "sparse-hier", "--top-k", "32", "--sink-tokens", "16", "--recent-tokens", "16",
            "--page-size", "16", "--device", "cpu", "--no-forced", "--no-progress", "--output-dir",
            str(tmp_path / "out" / name), "--hicache-mem-layout", "page_first_direct", "--hicache-io-backend",
            "direct", *extra]
    if store is not None:
        argv += ["--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", "wait_complete",
                 "--hicache-storage-backend-extra-config",
                 json.dumps({"prefetch_threshold": 32, "file_path": str(store)})]
    assert main(argv) == 0
    data = json.loads((tmp_path / "out" / name / "run.json").read_text())
    return data, next(r for r in data["rows"] if r["mode"] == "sparse-hier")


def test_checkpoints_with_the_same_directory_name_never_read_each_others_kv(tmp_path, one_thread):
    a = write_checkpoint(tmp_path / "a" / "model", seed=1)
    b = write_checkpoint(tmp_path / "b" / "model", seed=2)
    cold_a, _ = _run(tmp_path, a, "cold-a")
    cold_b, _ = _run(tmp_path, b, "cold-b")
    assert cold_a["tokens"] != cold_b["tokens"]  # the weights differ enough to tell the runs apart
    store = tmp_path / "l3"
    run_a, ra = _run(tmp_path, a, "a1", store)
    assert ra["l3_hit_tokens"] == 0 and ra["l3_pages_written"] > 0 and run_a["tokens"] == cold_a["tokens"]
    run_b, rb = _run(tmp_path, b, "b1", store)
    assert rb["l3_hit_tokens"] == 0 and rb["l3_pages_fetched"] == 0  # nothing of a's is found
    assert run_b["tokens"] == cold_b["tokens"]
    assert run_a["l3_model_name"] != run_b["l3_model_name"]
    assert run_a["l3_model_name"].startswith("model-") and run_b["l3_model_name"].startswith("model-")
    assert len([d for d in store.iterdir() if d.is_dir()]) == 2  # one namespace directory each
    # each still finds its own pages
    again_a, ra2 = _run(tmp_path, a, "a2", store)
    again_b, rb2 = _run(tmp_path, b, "b2", store)
    assert ra2["l3_hit_tokens"] == rb2["l3_hit_tokens"] == 96
    assert again_a["tokens"] == cold_a["tokens"] and again_b["tokens"] == cold_b["tokens"]


def test_content_identity_shares_kv_between_identical_copies(tmp_path, one_thread):
    a = write_checkpoint(tmp_path / "a" / "model", seed=1)
    copy = tmp_path / "copy" / "model"
    shutil.copytree(a, copy, copy_function=shutil.copy)  # same bytes, new time stamps
    store = tmp_path / "l3"
    cold, _ = _run(tmp_path, a, "cold")
    _run(tmp_path, a, "meta-a", store)
    meta_copy, r = _run(tmp_path, copy, "meta-copy", store)
    assert r["l3_hit_tokens"] == 0 and meta_copy["tokens"] == cold["tokens"]  # metadata: another name, a miss
    _run(tmp_path, a, "content-a", store, "--l3-checkpoint-identity", "content")
    content_copy, r = _run(tmp_path, copy, "content-copy", store, "--l3-checkpoint-identity", "content")
    assert r["l3_hit_tokens"] == 96 and content_copy["tokens"] == cold["tokens"]


def _set_mtime(path: Path, ns: int) -> None:
    os.utime(path, ns=(ns, ns))


def test_digest_follows_what_decides_the_kv(tmp_path):
    a = write_checkpoint(tmp_path / "a", seed=1)
    weights = a / "model.safetensors"
    meta, content = checkpoint_digest(a), checkpoint_digest(a, "content")
    assert len(meta) == 64 and meta != content
    assert checkpoint_digest(a) == meta and checkpoint_digest(a, "content") == content  # stable
    # touching a weight file: a new metadata identity, the same content
    st = weights.stat()
    _set_mtime(weights, st.st_mtime_ns + 1_000_000)
    assert checkpoint_digest(a) != meta and checkpoint_digest(a, "content") == content
    _set_mtime(weights, st.st_mtime_ns)
    assert checkpoint_digest(a) == meta
    # other weights of the same shapes (same size and header) written over the file
    other = write_checkpoint(tmp_path / "other", seed=2) / "model.safetensors"
    assert other.stat().st_size == st.st_size
    shutil.copyfile(other, weights)
    assert checkpoint_digest(a) != meta and checkpoint_digest(a, "content") != content
    # ... with the old time stamp restored: only the content identity sees it (the documented limit)
    _set_mtime(weights, st.st_mtime_ns)
    assert checkpoint_digest(a) == meta and checkpoint_digest(a, "content") != content
    # config.json is covered; so is every weight file the loader reads
    b = write_checkpoint(tmp_path / "b", seed=1)
    before = checkpoint_digest(b), checkpoint_digest(b, "content")
    (b / "config.json").write_text(json.dumps({**HF, "rope_theta": 500000.0}))
    after = checkpoint_digest(b), checkpoint_digest(b, "content")
    assert after[0] != before[0] and after[1] != before[1]
    from safetensors.torch import save_file

    save_file({"model.extra": torch.zeros(2)}, str(b / "model-extra.safetensors"))
    assert checkpoint_digest(b) != after[0] and checkpoint_digest(b, "content") != after[1]


def test_copies_share_a_digest_when_their_metadata_does(tmp_path):
    a = write_checkpoint(tmp_path / "a" / "model", seed=1)
    kept = tmp_path / "kept" / "model"
    shutil.copytree(a, kept)  # copy2: time stamps kept
    fresh = tmp_path / "fresh" / "model"
    shutil.copytree(a, fresh, copy_function=shutil.copy)
    _set_mtime(fresh / "model.safetensors", (a / "model.safetensors").stat().st_mtime_ns + 1_000_000)
    assert checkpoint_digest(kept) == checkpoint_digest(a)
    assert checkpoint_digest(fresh) != checkpoint_digest(a)  # a miss, never a wrong answer
    assert checkpoint_digest(fresh, "content") == checkpoint_digest(kept, "content") == checkpoint_digest(a, "content")


def test_checkpoint_changed_while_loading_is_an_error(tmp_path):
    a = write_checkpoint(tmp_path / "a", seed=1)
    weights = a / "model.safetensors"

    def load_while_rewritten():
        _set_mtime(weights, weights.stat().st_mtime_ns + 1_000_000)
        return "loaded"

    with pytest.raises(CheckpointError, match="changed while it was loaded"):
        load_with_identity(a, "metadata", load_while_rewritten)
    assert load_with_identity(a, "content", lambda: "loaded") == ("loaded", checkpoint_digest(a, "content"))


def test_bad_identity_input_is_a_clear_error(tmp_path, capsys):
    a = write_checkpoint(tmp_path / "a", seed=1)
    with pytest.raises(ValueError, match=r"mode='sha1' is not an identity mode: allowed \('metadata', 'content'\)"):
        checkpoint_digest(a, "sha1")
    (a / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        checkpoint_digest(a)
    from sparsehi.runtime.demo import DemoConfig, run_demo

    with pytest.raises(ValueError, match="l3_checkpoint_identity='fast'"):
        run_demo(DemoConfig(l3_checkpoint_identity="fast", output_dir=str(tmp_path / "o")))
    b = write_checkpoint(tmp_path / "b", seed=1)
    base = ["run", "--context", "96", "--output-dir", str(tmp_path / "out")]
    for argv, needle in (
            ([*base, "--l3-checkpoint-identity", "content"], "without --model-path"),
            ([*base, "--model-path", str(b), "--l3-checkpoint-identity", "content"],
             "without --hicache-storage-backend"),
            ([*base, "--l3-checkpoint-identity", "fast"], "invalid choice: 'fast'")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--l3-checkpoint-identity" in err and needle in err, err


def test_built_in_models_keep_their_fixed_name():
    from sparsehi.config import SparseConfig
    from sparsehi.runtime.demo import DemoConfig, l3_model_name
    from sparsehi.runtime.model_config import get_model_config

    cfg = DemoConfig(sparse=SparseConfig(page_size=16), host_layout="page_first_direct", dtype=torch.float32)
    # the name stores written before checkpoint identities keep answering to
    assert l3_model_name(cfg, get_model_config("tiny-gqa", 2), None) == "tiny-gqa-L2-float32-p16-page_first_direct"
    assert l3_model_name(cfg, get_model_config("tiny-gqa", 2), "ab" * 32) == \
        f"tiny-gqa-{'ab' * 16}-L2-float32-p16-page_first_direct"
