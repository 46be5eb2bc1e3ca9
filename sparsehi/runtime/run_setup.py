"""What ``sparsehi run`` (the demo) and ``sparsehi bench`` (the sweep) share: the model,
the modes to compare, the sparse settings and where the runtime places things."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from hicache.config import HiCacheConfig
from sparsehi.config import SparseConfig


@dataclass
class RunSetup:
    model: str = "tiny-gqa"
    model_path: Optional[str] = None
    num_layers: Optional[int] = None
    modes: list[str] = field(default_factory=lambda: ["dense", "sparse-gpu", "sparse-hier", "offload-full"])
    sparse: SparseConfig = field(default_factory=SparseConfig)
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    adapter: str = "none"
    host_layout: str = "layer_first"
    seed: int = 0
    output_dir: str = "outputs"
    cuda_graph: bool = True
    """Decode steps replay CUDA graphs on a CUDA device (False: the same step eagerly)."""
    overlap_schedule: bool = True
    """``RuntimeConfig.overlap_schedule`` (False: ``--disable-overlap-schedule``)."""
    hicache: Optional[HiCacheConfig] = None
    """SGLang's ``--hicache-*`` options; with ``hicache_storage_backend`` the sparse-hier
    tree gets that L3 backend (built once per command, shared by its runs)."""
