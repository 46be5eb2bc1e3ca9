"""Hit / miss counters of the LRU buffers, kept on the device so a CUDA-graph-captured
decode step updates them without a host sync.

Each sparse layer's swap-in records how many ids it attended (``valid``) and how many it
loaded (``num_loads``) into the open step's ``[n_sparse, B]`` tables, and, with loading
ahead on (``SparseConfig.lookahead_tokens``), how many pages it loaded ahead for the next
step (``ahead_loads``) and how many of its hits such a load had brought in (``hidden``:
misses taken off the critical path); ``close_step`` folds them into per-layer totals and
into a ring of the last ``history`` steps (written at
``step % history``, the step number read from the device step counter). Steps whose batch
had no live row (the padded warm-up runs of graph capture) are marked and left out of
``read``.
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import Optional

import torch

from sparsehi.kernels.step_counters import close_step_counts


@dataclass
class StepCounts:
    """One decode step's per-layer tables (built once per step, shared by its layers).

    valid:       ``[n_sparse, B] int32`` ids each sparse layer attended per row (0 for
                 layers that did not run the diff this step).
    loads:       ``[n_sparse, B] int32`` of them loaded from host on the critical path.
    ahead_loads: ``[n_sparse, B] int32`` pages loaded ahead for the next step.
    hidden:      ``[n_sparse, B] int32`` hits whose page a load ahead had brought in.
    table:       ``[4, n_sparse, B] int32`` the one allocation the four view.
    """

    CHANNELS = 4

    valid: torch.Tensor
    loads: torch.Tensor
    ahead_loads: torch.Tensor
    hidden: torch.Tensor
    table: torch.Tensor

    @classmethod
    def empty(cls, n_sparse: int, batch: int, device: torch.device) -> "StepCounts":
        """Zeroed tables (one allocation and one fill)."""
        return cls.of(torch.zeros(cls.CHANNELS, n_sparse, batch, dtype=torch.int32, device=device))

    @classmethod
    def uninitialized(cls, n_sparse: int, batch: int, device: torch.device) -> "StepCounts":
        """Tables to be zeroed by the caller (``begin_step`` zeroes them in its own launch)."""
        return cls.of(torch.empty(cls.CHANNELS, n_sparse, batch, dtype=torch.int32, device=device))

    @classmethod
    def of(cls, table: torch.Tensor) -> "StepCounts":
        """Views of a ``[4, n_sparse, B] int32`` table (valid, loads, ahead_loads, hidden)."""
        if (table.dim() != 3 or table.shape[0] != cls.CHANNELS or table.dtype != torch.int32
                or not table.is_contiguous()):
            raise ValueError(f"table must be a contiguous [{cls.CHANNELS}, n_sparse, B] int32 tensor, got "
                             f"{tuple(table.shape)} {table.dtype}")
        return cls(table[0], table[1], table[2], table[3], table)


class SwapInCounters:
    """Per-layer hits and misses: running totals and the last ``history`` steps."""

    def __init__(self, num_layers: int, sparse_layers: tuple[int, ...], device: torch.device,
                 history: int = 4096) -> None:
        if not isinstance(history, int) or history < 1:
            raise ValueError(f"history={history!r} is invalid: an integer >= 1")
        self.num_layers = num_layers
        self.history = history
        self.device = device
        slot = [-1] * num_layers  # sparse index of each layer, -1 for the others
        for i, layer in enumerate(sparse_layers):
            slot[layer] = i
        self._layer_slot = torch.tensor(slot, dtype=torch.int32, device=device)
        self.sparse_layers = tuple(sparse_layers)
        L, H, dev = num_layers, history, device
        C = StepCounts.CHANNELS
        self.totals = torch.zeros(C, L, dtype=torch.int64, device=dev)  # [hits, misses, ahead_loads, hidden]
        self.ring = torch.zeros(H, C, L, dtype=torch.int64, device=dev)
        self.ring_step = torch.full((H,), -1, dtype=torch.int64, device=dev)
        self.steps_closed = torch.zeros(1, dtype=torch.int64, device=dev)

    def reset(self) -> None:
        """Zero every counter in place: a captured decode graph keeps updating these very
        tensors (replacing them would leave the graph writing freed memory)."""
        self.totals.zero_()
        self.ring.zero_()
        self.ring_step.fill_(-1)
        self.steps_closed.zero_()

    def close_step(self, counts: StepCounts, step_t: torch.Tensor, live: torch.Tensor) -> None:
        """Fold one step in one launch (graph-safe: fixed shapes, no host sync; see
        sparsehi/kernels/step_counters.py).

        counts: the step's tables; step_t: ``[1] int32`` device step number;
        live: ``[B] bool`` rows that are real requests (padding rows count nothing anyway).
        """
        close_step_counts(counts.table, step_t, live, self._layer_slot, self.totals, self.ring, self.ring_step,
                          self.steps_closed)

    def read(self) -> tuple[int, list[int], list[int], list[tuple[int, list[int], list[int]]]]:
        """Host copy (syncs): ``(steps closed, total hits per layer, total misses per layer,
        [(step, hits per layer, misses per layer)] of the kept steps in step order)``."""
        tot = self.totals.tolist()
        ring = self.ring.tolist()
        steps = self.ring_step.tolist()
        kept = sorted((s, i) for i, s in enumerate(steps) if s >= 0)
        per_step = [(s, ring[i][0], ring[i][1]) for s, i in kept]
        return int(self.steps_closed.item()), tot[0], tot[1], per_step

    def read_ahead(self) -> tuple[list[int], list[int]]:
        """Host copy (syncs): ``(pages loaded ahead per layer, hits a load ahead brought in
        per layer)`` since the last reset."""
        tot = self.totals.tolist()
        return tot[2], tot[3]

    def report(self, page_bytes: int, with_ahead: bool = False) -> dict:
        """The counters as a decode path's ``stats()`` (syncs): steps, hits, misses, bytes
        loaded, hit rates in all and per layer, and ``per_step`` for the kept steps. With
        ``with_ahead``: pages loaded ahead and the hits they became (``hidden_misses``:
        misses taken off the critical path), in all and per sparse layer; ``hidden_frac``
        is the share of the pages the selections needed from host that were loaded ahead
        (pages of one size: the share of miss bytes), ``ahead_precision`` the share of
        pages loaded ahead that a later selection used (None where nothing counted)."""
        steps, lh, lm, kept = self.read()
        per_step = []
        for step, h, m in kept:
            sh, sm = sum(h), sum(m)
            per_step.append({"step": step, "hits": h, "misses": m, "bytes_loaded": [x * page_bytes for x in m],
                             "hit_rate": sh / (sh + sm) if sh + sm else 1.0})
        tot_h, tot_m = sum(lh), sum(lm)
        out = {
            "steps": steps, "hits": tot_h, "misses": tot_m, "bytes_loaded": tot_m * page_bytes,
            "hit_rate": tot_h / (tot_h + tot_m) if tot_h + tot_m else 1.0,
            "per_layer_hit_rate": [h / (h + m) if h + m else 1.0 for h, m in zip(lh, lm)],
            "per_step": per_step,
        }
        if not with_ahead:
            return out
        ahead, hidden = self.read_ahead()

        def frac(a: int, b: int) -> Optional[float]:
            return a / b if b else None

        ta, th = sum(ahead), sum(hidden)
        out.update({
            "ahead_loads": ta, "hidden_misses": th, "ahead_bytes_loaded": ta * page_bytes,
            "hidden_frac": frac(th, th + tot_m), "ahead_precision": frac(th, ta),
            "per_layer_hidden_frac": {x: frac(hidden[x], hidden[x] + lm[x]) for x in self.sparse_layers},
            "per_layer_ahead_precision": {x: frac(hidden[x], ahead[x]) for x in self.sparse_layers},
        })
        return out
