import sparsehi
import hicache
from sparsehi.config import SparseConfig
import pytest


def test_config_rejects_buffer_below_top_k():
    with pytest.raises(ValueError, match="device_buffer_size"):
        SparseConfig(top_k=2048, device_buffer_size=1024)
