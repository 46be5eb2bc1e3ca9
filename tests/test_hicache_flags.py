"""SGLang's --enable-hierarchical-cache, --hicache-ratio, --hicache-size and
--hicache-write-policy in `sparsehi run` / `bench`: each sizes or governs the host tier of
the host modes with SGLang's meaning, or is rejected naming the flag and where it applies."""
from __future__ import annotations

import pytest
import torch

from sparsehi.cli import main
from sparsehi.config import SparseConfig
from sparsehi.runtime.runtime_mode import host_token_bytes
from sparsehi.runtime.model_config import get_model_config
from sparsehi.runtime.runtime_config import RuntimeConfig, round_up
from sparsehi.runtime.runner import ModelRunner
from sparsehi.runtime.weights import build_model


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("argv,needles", [
    (["run", "--modes", "dense,sparse-gpu", "--hicache-ratio", "3"],
     ["--hicache-ratio sizes the host KV tier", "sparse-hier, offload-full", "--modes dense,sparse-gpu"]),
    (["bench", "--modes", "sparse-gpu", "--hicache-size", "4"], ["--hicache-size", "--modes sparse-gpu"]),
    (["run", "--modes", "dense", "--enable-hierarchical-cache"], ["--enable-hierarchical-cache"]),
    (["run", "--hicache-write-policy", "write_back"], ["--hicache-write-policy write_back cannot apply",
                                                       "Use write_through"]),
    (["bench", "--hicache-write-policy", "write_through_selective"], ["write_through_selective cannot apply"]),
    (["bench", "--hicache-storage-backend", "file", "--host-layout", "page_first"],
     ["--hicache-storage-backend applies to sparsehi run"]),
    (["run", "--modes", "sparse-gpu", "--hicache-storage-backend", "file", "--host-layout", "page_first"],
     ["--hicache-storage-backend applies to the sparse-hier mode"]),
    (["run", "--hicache-ratio", "1"], ["--hicache-ratio=1.0 is invalid"]),
    (["run", "--model", "llama-8b-shape", "--context", "65536", "--batch", "4", "--hicache-size", "1",
      "--device", "cpu"], ["--hicache-size 1 GB holds", "raise it"]),
])
def test_flags_that_cannot_apply_are_rejected(argv, needles, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--output-dir", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    for n in needles:
        assert n in err, (n, err)


def test_flags_reach_the_runtime(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr("sparsehi.runtime.demo.run_demo", lambda cfg: seen.append(cfg) or {})
    base = ["run", "--context", "512", "--output-dir", str(tmp_path)]
    main([*base, "--enable-hierarchical-cache", "--hicache-ratio", "3.5", "--hicache-write-policy", "write_through"])
    main([*base, "--modes", "sparse-hier", "--hicache-size", "2", "--hicache-ratio", "0.5"])
    main(base)
    a, b, c = seen
    assert a.sparse.host_to_device_ratio == 3.5 and a.hicache.hicache_size == 0
    assert b.hicache.hicache_size == 2  # the size overrides the ratio (which may then be <= 1)
    assert c.sparse.host_to_device_ratio == 2.0 and c.hicache.hicache_ratio == 2.0


_MODEL = {}


def _tiny():
    if not _MODEL:
        _MODEL["m"] = build_model(config=get_model_config("tiny-gqa", num_layers=1))
    return _MODEL["m"]


def _rt(mode, **kw):
    sc = SparseConfig(algorithm="quest", top_k=32, device_buffer_size=64, page_size=16, sink_tokens=16,
                      recent_tokens=16, io_backend="direct", **kw.pop("sparse", {}))
    return RuntimeConfig(mode=mode, sparse=sc, max_num_reqs=2, max_context_len=200, **kw)


@pytest.mark.parametrize("mode", ["sparse-hier", "offload-full"])
def test_ratio_and_size_set_the_host_pool(mode, one_thread):
    """--hicache-ratio: host slots = ratio x the KV the running requests can hold (the
    device pool SGLang's ratio refers to); --hicache-size: GB of this model's KV, overriding
    the ratio; both in the runtime's host pool, not just accepted."""
    model = _tiny()
    need = 2 * round_up(200, 16)
    r3 = ModelRunner(model, _rt(mode, sparse={"host_to_device_ratio": 3.0})).mode.host
    r2 = ModelRunner(model, _rt(mode)).mode.host
    assert r3.num_slots >= 3 * need > r2.num_slots >= 2 * need
    tb = host_token_bytes(model.cfg, torch.float32)
    gb = 5 * need * tb / 1e9
    sized = ModelRunner(model, _rt(mode, host_kv_gb=gb, sparse={"host_to_device_ratio": 3.0})).mode.host
    assert sized.spec.token_bytes == tb
    assert abs(sized.num_slots - int(gb * 1e9 // tb)) <= 3 * 16  # whole pages + the reserved page
    with pytest.raises(ValueError, match="--hicache-size .* holds .* needs at least"):
        ModelRunner(model, _rt(mode, host_kv_gb=need * tb / 2e9))


def test_a_run_with_a_sized_host_pool_generates(tmp_path, one_thread, capsys):
    out = tmp_path / "o"
    assert main(["run", "--context", "96", "--batch", "1", "--decode-tokens", "2", "--num-layers", "1", "--modes",
                 "sparse-hier", "--top-k", "32", "--sink-tokens", "16", "--recent-tokens", "16", "--page-size", "16",
                 "--device", "cpu", "--no-forced", "--no-progress", "--enable-hierarchical-cache",
                 "--hicache-size", "1", "--output-dir", str(out)]) == 0
    assert (out / "run.json").exists()
