"""What the SGLang bridge keeps of one forward between its begin and end hooks, and the
host copies of a forward batch's per-row values it reads."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from sparsehi.forward_batch import ForwardBatch as SparseBatch

logger = logging.getLogger(__name__)

ROWS_CPU_ATTR = "sparsehi_req_pool_indices_cpu"
"""Attribute of a decode ``ForwardBatch``: the scheduler's host copy of its row ids, which
SGLang's ``ForwardBatch.init_new`` keeps for extend batches only (set by the plugin's hook
on ``init_new``), so that the forward hook never reads ``req_pool_indices`` back."""
PROMPT_LENS_ATTR = "sparsehi_prompt_lens"
"""Attribute of an extend ``ForwardBatch``: each row's full prompt length (set by the hook
on ``init_new``), which tells at the first chunk whether the request will decode sparsely."""

_READ_BACKS: set[str] = set()


def host_ints(name: str, cpu: Any, dev: Optional[torch.Tensor]) -> np.ndarray:
    """Host copy of a per-row value: SGLang's CPU copy, else a read-back from the device (a
    host sync, which takes the host's lead over the device; logged once per value)."""
    if cpu is not None:
        return np.asarray(cpu.tolist() if isinstance(cpu, torch.Tensor) else cpu, dtype=np.int64)
    if dev.device.type != "cpu" and name not in _READ_BACKS:
        _READ_BACKS.add(name)
        logger.warning("sparsehi: the forward batch has no host copy of %s; reading it back from the device "
                       "(a host sync each forward: the host no longer runs ahead of the device)", name)
    return dev.cpu().numpy().astype(np.int64)


def host_rows(fb: Any) -> np.ndarray:
    """[B] int64: a forward batch's ``ReqToTokenPool`` rows on the host."""
    cpu = getattr(fb, "req_pool_indices_cpu", None)
    if cpu is None:
        cpu = getattr(fb, ROWS_CPU_ATTR, None)
        if cpu is not None and len(cpu) != len(fb.req_pool_indices):  # padded since (e.g. by SGLang's DP sync)
            cpu = None
    return host_ints("req_pool_indices", cpu, fb.req_pool_indices)


@dataclass
class DecodeState:
    """One decode forward over B rows, eager or recorded into a CUDA graph: static views
    of the bridge's row buffers (rows that are not ours are padding rows, -1) and, from its
    first layer on, the coordinator's step over them."""

    slots: torch.Tensor  # [B] int64: coordinator request slots, -1 where not ours
    sgl_rows: torch.Tensor  # [B] int64: SGLang rows of our rows (0 where not ours)
    seq: torch.Tensor  # [B] int32: lengths with the new token (1 where not ours)
    ours: torch.Tensor  # [B] bool
    all_ours: bool  # host fact of an eager forward: no row takes SGLang's dense path
    recorded: bool = False  # a CUDA-graph capture's forward: no host fact holds at replay
    batch: Optional[SparseBatch] = None  # the coordinator's step, begun at the first layer
    fb: Any = None  # SGLang's ForwardBatch (eager and replayed forwards)
    host_rows: Optional[np.ndarray] = None  # [B] SGLang rows
    host_ours: Optional[np.ndarray] = None  # [B] bool
    host_seq: Optional[np.ndarray] = None  # [B] lengths with the new token
    registered_now: Optional[np.ndarray] = None  # SGLang rows registered at this step


@dataclass
class ExtendState:
    """One extend forward: its rows, and which of them will decode sparsely."""

    fb: Any
    rows: np.ndarray
    seq: np.ndarray
    sparse: np.ndarray  # [B] bool: rows with a coordinator slot (representations built after)
    prev_pinned: np.ndarray  # [B] pinned lengths before this forward (undone if it raises)
    new_slots: list[int]  # rows that got their coordinator slot in this forward


class NoRowsOfOurs:
    """A decode forward with no row of ours (SGLang's own path runs): what its end still
    needs (write-through, the pins of SGLang's rows)."""

    def __init__(self, state: DecodeState) -> None:
        self.state = state
