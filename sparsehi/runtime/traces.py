"""Calibrated query traces for decode benchmarks.

Random-weight models do not move their queries between decode steps the way trained
models do, so their Top-k selections overlap either far less or far more than real ones.
A :class:`QueryTrace` replaces each sparse layer's selection query (GQA: ``q``; DSA: the
indexer query ``index_q``) with an AR(1) process per (layer, request)::

    u_t = rho * u_{t-1} + sqrt(1 - rho^2) * eps_t,   eps_t ~ N(0, I)

scaled to the model query's mean per-head norm (DSA: with fixed head weights ``H^-0.5``). ``rho`` sets how fast the query drifts;
:func:`calibrate_rho` bisects it so that the adjacent-step Top-k overlap the *actual
algorithm* measures on the *actual representations* hits a target (85 %, the figure 003
reports for real models; ShadowKV reports ~60 %).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from sparsehi.kernels.query_trace_step import query_trace_step


NOISE_BANK = 61
"""Noise draws kept per query shape (prime, so that with any layer count the draw a layer
gets cycles through all of them)."""


class QueryTrace:
    """Per-layer AR(1) query drift; call as a RuntimeMode ``query_hook``.

    CUDA-graph safe: the noise comes from a bank of ``NOISE_BANK`` draws made eagerly (on
    the first call, the capture's warm-up), picked by a device counter; the state is updated
    in place, so every replay advances the trace."""

    def __init__(self, rho: float, seed: int = 0, layers: Optional[set[int]] = None, dsa: bool = False) -> None:
        if not 0.0 <= rho < 1.0:
            raise ValueError(f"rho must be in [0, 1), got {rho}")
        self.rho = rho
        self.seed = seed
        self.layers = layers
        self.dsa = dsa
        self._state: dict[int, torch.Tensor] = {}
        self._banks: dict[tuple, torch.Tensor] = {}
        self._counter: Optional[torch.Tensor] = None
        self._arrivals: Optional[torch.Tensor] = None  # query_trace_step's, 0 between calls
        self._scaled: dict[int, torch.Tensor] = {}  # per layer, at the model query's scale
        self._scale: dict[int, float] = {}
        self._weights: dict[tuple, torch.Tensor] = {}

    def _bank(self, like: torch.Tensor) -> torch.Tensor:
        """``[NOISE_BANK, *like.shape]`` float32 draws for ``like``'s shape (made once), and the
        draw counter on its device."""
        key = (tuple(like.shape), like.device)
        bank = self._banks.get(key)
        if bank is None:
            gen = torch.Generator(device=like.device).manual_seed(self.seed + len(self._banks))
            bank = torch.randn((NOISE_BANK, *like.shape), generator=gen, device=like.device, dtype=torch.float32)
            self._banks[key] = bank
        if self._counter is None or self._counter.device != like.device:
            self._counter = torch.zeros(1, dtype=torch.int64, device=like.device)
            self._arrivals = torch.zeros(1, dtype=torch.int32, device=like.device)
        return bank

    def _noise(self, like: torch.Tensor) -> torch.Tensor:
        bank = self._bank(like)
        self._counter.add_(1)
        return bank.index_select(0, self._counter % NOISE_BANK)[0]

    def next(self, layer: int, like: torch.Tensor) -> torch.Tensor:
        """The trace's next unit-variance query of ``like``'s shape for ``layer``."""
        st = self._state.get(layer)
        if st is None or st.shape != like.shape or st.device != like.device:
            st = self._noise(like).clone()
            self._state[layer] = st
        else:
            st.mul_(self.rho).add_(self._noise(like), alpha=math.sqrt(1.0 - self.rho ** 2))
        return st.clone()  # the state itself moves on at the next call

    def __call__(self, layer: int, q: torch.Tensor, extra: dict) -> torch.Tensor:
        """The layer's query replaced by the trace at the model query's scale: the mean
        per-head norm of the first query this layer saw (a fixed scale keeps a step at one
        launch, ``query_trace_step``)."""
        if self.layers is not None and layer not in self.layers:
            return q
        if self.dsa and "index_q" not in extra:
            return q  # a mode that selects nothing (dense): the model computed no index queries
        target = extra["index_q"] if self.dsa else q
        st = self._scaled.get(layer)
        if st is None or st.shape != target.shape or st.device != target.device:
            # first call (eager: the warm-up before any graph capture)
            scale = float(target.float().norm(dim=-1).mean()) / math.sqrt(target.shape[-1])
            self._scale[layer] = scale
            st = self._noise(target).mul_(scale)
            self._scaled[layer] = st
            new = st.to(target.dtype, copy=True)  # the state moves on at the next call
        else:  # one launch: the next draw, the update in place and the copy in the query's dtype
            c = math.sqrt(1.0 - self.rho ** 2) * self._scale[layer]
            new = torch.empty(target.shape, dtype=target.dtype, device=target.device)
            query_trace_step(st, self._bank(target), self._counter, self._arrivals, new, self.rho, c)
        if self.dsa:
            # a fixed positive head weighting, as in calibrate (the model's random
            # weights_proj would otherwise re-rank tokens every step)
            key = (tuple(new.shape[:2]), new.device)
            w = self._weights.get(key)
            if w is None:
                w = self._weights[key] = torch.full(new.shape[:2], new.shape[1] ** -0.5, device=new.device,
                                                    dtype=torch.float32)
            extra["index_q"] = new
            extra["index_w"] = w
            return q
        return new


def topk_overlap(prev: torch.Tensor, cur: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Per row, |A ∩ B| / |B| of the ids in ``[lo, hi)`` (the Top-k part of a selection,
    sink and recent window excluded). prev/cur ``[B, N] int`` (-1 padded); lo/hi ``[B]``."""
    def keep(x: torch.Tensor) -> torch.Tensor:
        return (x >= lo[:, None]) & (x < hi[:, None]) & (x >= 0)

    a, b = keep(prev), keep(cur)
    same = (cur[:, :, None] == prev[:, None, :]) & b[:, :, None] & a[:, None, :]
    inter = same.any(-1).sum(-1).float()
    return inter / b.sum(-1).clamp_min(1).float()


def calibrate_rho(measure: Callable[[float], float], target: float = 0.85, iters: int = 9,
                  lo_log: float = 0.3, hi_log: float = 5.0) -> tuple[float, float]:
    """Bisect ``rho = 1 - 10**-x`` for ``measure(rho) ≈ target`` (overlap grows with rho).
    Returns (rho, measured overlap at rho)."""
    best = None
    lo, hi = lo_log, hi_log
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        rho = 1.0 - 10.0 ** (-mid)
        got = measure(rho)
        if best is None or abs(got - target) < abs(best[1] - target):
            best = (rho, got)
        if got < target:
            lo = mid
        else:
            hi = mid
    assert best is not None
    return best
