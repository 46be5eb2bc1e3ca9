"""Registry: names, import paths, clear errors."""
from pathlib import Path

import pytest
import torch

from sparsehi.algorithms import BaseSparseAlgorithm, SparseMode, create_algorithm, register_algorithm, registered_algorithms
from sparsehi.algorithms.registry import resolve_algorithm
from sparsehi.config import SparseConfig

ROOT = Path(__file__).resolve().parents[1]


def test_builtins_registered_and_created():
    names = registered_algorithms()
    assert {"oracle", "quest", "dsa"} <= set(names)
    for name, ps in (("quest", 16), ("oracle", 16), ("dsa", 1), ("oracle", 1)):
        alg = create_algorithm(SparseConfig(algorithm=name, page_size=ps, top_k=64, device_buffer_size=128), "cpu")
        assert isinstance(alg, resolve_algorithm(name)) and alg.device == torch.device("cpu")


def test_import_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    cfg = SparseConfig(algorithm="examples.sink_window:SinkWindow", page_size=16, top_k=64, device_buffer_size=128)
    alg = create_algorithm(cfg, "cpu")
    assert type(alg).__name__ == "SinkWindow" and alg.mode is SparseMode.PAGE_WISE
    alg = create_algorithm(SparseConfig(algorithm="sparsehi.algorithms.quest:QuestAlgorithm", page_size=16,
                                        top_k=64, device_buffer_size=128), "cpu")
    assert alg.dense_layers() == (0, 1)


@pytest.mark.parametrize("path,match", [
    ("sparsehi.config:SparseConfig", "BaseSparseAlgorithm subclass"),
    ("no_such_pkg.mod:Cls", "cannot import"),
    ("sparsehi.algorithms.quest:Nope", "no attribute"),
])
def test_bad_import_paths(path, match):
    with pytest.raises(ValueError, match=match):
        create_algorithm(SparseConfig(algorithm=path, page_size=16, top_k=64, device_buffer_size=128), "cpu")


def test_unknown_name_lists_registered():
    with pytest.raises(ValueError, match=r"unknown.*'dsa'.*'oracle'.*'quest'"):
        create_algorithm(SparseConfig(algorithm="snapkv", page_size=16, top_k=64, device_buffer_size=128), "cpu")


def test_register_rules():
    class Mine(BaseSparseAlgorithm):
        def initialize_representation_pool(self, *a, **k): pass
        def construct_representations(self, *a, **k): pass
        def update_representations(self, *a, **k): pass
        def retrieve_topk(self, *a, **k): pass

    register_algorithm("test-mine")(Mine)
    register_algorithm("test-mine")(Mine)  # same class again (module reload) is fine
    assert resolve_algorithm("test-mine") is Mine
    with pytest.raises(ValueError, match="already registered"):
        register_algorithm("quest")(Mine)
    with pytest.raises(ValueError, match="subclass"):
        register_algorithm("test-bad")(dict)
    with pytest.raises(ValueError, match="name"):
        register_algorithm("a:b")


@pytest.mark.parametrize("algorithm,extra", [
    ("oracle", {}), ("quest", {}), ("dsa", {"index_head_dim": 8, "index_dtype": "fp32"}),
])
@pytest.mark.parametrize("bad,match", [
    ({"max_num_reqs": 0}, "max_num_reqs=0"),
    ({"max_context_len": -4}, "max_context_len=-4"),
    ({"start_layer": 2, "end_layer": 2}, "start_layer=2, end_layer=2"),
])
def test_builtin_algorithms_reject_bad_pool_arguments(algorithm, extra, bad, match):
    cfg = SparseConfig(algorithm=algorithm, page_size=1 if algorithm == "dsa" else 4, top_k=16,
                       device_buffer_size=64, sparse_extra_config=extra)
    alg = create_algorithm(cfg, "cpu")
    args = {"start_layer": 0, "end_layer": 2, "max_num_reqs": 2, "max_context_len": 64, **bad}
    with pytest.raises(ValueError, match=match):
        alg.initialize_representation_pool(args["start_layer"], args["end_layer"], args["max_num_reqs"],
                                           args["max_context_len"], kv_heads=2, head_dim=8, dtype=torch.float32)
