"""SparseConfig defaults, derived unit sizes and validation messages."""
from __future__ import annotations

import pytest

from sparsehi.config import SparseConfig


def test_defaults_follow_sglang_names():
    c = SparseConfig()
    assert (c.top_k, c.device_buffer_size, c.page_size) == (2048, 4096, 64)
    assert (c.top_k_units, c.buffer_units) == (32, 64)
    assert c.sink_units == 1 and c.recent_units == 1


def test_units_round_up_partial_pages():
    c = SparseConfig(page_size=16, top_k=64, device_buffer_size=96, sink_tokens=20, recent_tokens=17)
    assert (c.top_k_units, c.buffer_units, c.sink_units, c.recent_units) == (4, 6, 2, 2)
    t = SparseConfig(page_size=1, top_k=5, device_buffer_size=5, sink_tokens=0, recent_tokens=3)
    assert (t.top_k_units, t.buffer_units, t.sink_units, t.recent_units) == (5, 5, 0, 3)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"backend": "xformers"}, "backend"),
        ({"page_size": 3}, "page_size"),
        ({"page_size": 512, "top_k": 1024, "device_buffer_size": 2048}, "page_size"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": 100}, "top_k"),
        ({"top_k": 2048, "device_buffer_size": 1024}, "device_buffer_size"),
        ({"device_buffer_size": 4100}, "device_buffer_size"),
        ({"page_size": 1, "device_buffer_size": 16385}, "device_buffer_size"),  # LRU diff kernel limit
        ({"host_to_device_ratio": 1.0}, "host_to_device_ratio"),
        ({"min_sparse_prompt_len": -1}, "min_sparse_prompt_len"),
        ({"sink_tokens": -1}, "sink_tokens"),
        ({"recent_tokens": 0}, "recent_tokens"),
        ({"dense_layers": (0, -1)}, "dense_layers"),
        ({"io_backend": "nvme"}, "io_backend"),
        ({"sparse_extra_config": []}, "sparse_extra_config"),
        ({"algorithm": ""}, "algorithm"),
    ],
)
def test_bad_fields_name_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"SparseConfig\.{field}="):
        SparseConfig(**kw)


def test_dense_layers_list_becomes_tuple():
    assert SparseConfig(dense_layers=[0, 1]).dense_layers == (0, 1)


def test_buffer_equal_to_top_k_is_allowed():
    c = SparseConfig(top_k=1024, device_buffer_size=1024)
    assert c.top_k_units == c.buffer_units


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"host_to_device_ratio": "3"}, "host_to_device_ratio"),
        ({"host_to_device_ratio": None}, "host_to_device_ratio"),
        ({"host_to_device_ratio": float("inf")}, "host_to_device_ratio"),
        ({"host_to_device_ratio": True}, "host_to_device_ratio"),
        ({"dense_layers": 3}, "dense_layers"),
        ({"dense_layers": (True,)}, "dense_layers"),
        ({"dense_layers": (0, 1.0)}, "dense_layers"),
        ({"page_size": True, "top_k": 1, "device_buffer_size": 4}, "page_size"),
        ({"page_size": 1, "top_k": True, "device_buffer_size": 4}, "top_k"),
        ({"page_size": 1, "top_k": 2, "device_buffer_size": 2.0}, "device_buffer_size"),
        ({"min_sparse_prompt_len": False}, "min_sparse_prompt_len"),
        ({"sink_tokens": "64"}, "sink_tokens"),
        ({"recent_tokens": True}, "recent_tokens"),
        ({"io_backend": ["kernel"]}, "io_backend"),
        ({"backend": ["triton"]}, "backend"),
    ],
)
def test_wrong_types_and_bools_name_the_field(kw, field):
    """Wrong types (strings, None, bools standing in for ints) are a ValueError naming the
    field, never a TypeError from a comparison or a silently accepted ``True == 1``."""
    with pytest.raises(ValueError, match=rf"SparseConfig\.{field}="):
        SparseConfig(**kw)


def test_integer_ratio_is_accepted():
    assert SparseConfig(host_to_device_ratio=3).host_to_device_ratio == 3
