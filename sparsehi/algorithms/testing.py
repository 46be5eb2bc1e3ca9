"""Author test kit: check a ``BaseSparseAlgorithm`` subclass the way the coordinator will
use it, on small synthetic inputs, in one call::

    from sparsehi.algorithms.testing import check_algorithm
    report = check_algorithm(MyAlgorithm)          # AssertionError with a reason on failure
    print(report)                                  # the numbers

Checks, in order: API conformance (a subclass, ``mode`` set, the four hooks implemented
with the base signatures), a prefill + decode run on a batch with awkward rows (partial
pages, fewer candidates than ``top_k``, an empty candidate range, a ``sparse_mask`` False
row, request slots that are not the batch order), every ``retrieve_topk`` result against
:func:`~sparsehi.algorithms.base.check_selection` (int32, ``[B, <= top_k]``, ``-1``
padding after the valid ids, ids inside ``[candidate_start, candidate_end)``, no
duplicates), determinism (same inputs → same output), padding rows (an
``update_representations`` call whose rows all have ``req_pool_index == -1``, as the unused
rows of a CUDA-graph batch do, must not change any live row's selection; the last request
slot is in use so a ``-1`` that wraps around to it is caught), and recall against the oracle on
planted-needle inputs: the fraction of planted needles selected, and the share of the
best-possible top-k attention mass the selection captures.

Algorithms whose inputs are not the attention queries/keys (DSA: index keys, index
queries and weights) pass an ``inputs`` object; :class:`ProjectedIndexerInputs` derives
them from the attention keys by a fixed random projection.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from sparsehi.algorithms.base import BaseSparseAlgorithm, SparseMode, check_selection

_HOOKS = ("initialize_representation_pool", "construct_representations", "update_representations", "retrieve_topk")


# ---------------------------------------------------------------------------- inputs
class AttentionInputs:
    """The algorithm sees the attention queries and keys themselves (Quest, oracle, most
    training-free algorithms)."""

    def prefill_kwargs(self, layer_id: int, keys: torch.Tensor) -> dict[str, Any]:
        """Extra ``construct_representations`` kwargs for prefill keys ``[B, T, Hkv, D]``."""
        return {}

    def decode_kwargs(self, layer_id: int, new_keys: torch.Tensor) -> dict[str, Any]:
        """Extra ``update_representations`` kwargs for one new key per row ``[B, Hkv, D]``."""
        return {}

    def queries(self, layer_id: int, q: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """``retrieve_topk`` queries and extra kwargs for attention queries ``[B, Hq, D]``."""
        return q, {}


class ProjectedIndexerInputs(AttentionInputs):
    """DSA-style inputs from attention q/k by a fixed random projection (Johnson–Lindenstrauss):
    ``index_key_t = P · concat_g(k_{t,g})`` ``[index_head_dim]``, one index query per
    attention head ``P · (q_h placed in its group's block)``, weights all one. So
    ``index_q_h · index_k_t ≈ q_h · k_{t, g(h)}`` and the indexer score is
    ``Σ_h ReLU(≈ q_h · k_t)``.
    """

    def __init__(self, index_head_dim: int = 128, seed: int = 1234) -> None:
        if not isinstance(index_head_dim, int) or index_head_dim <= 0:
            raise ValueError(f"index_head_dim={index_head_dim!r} is invalid: an integer > 0")
        self.index_head_dim = index_head_dim
        self.seed = seed
        self._proj: Optional[torch.Tensor] = None

    def projection(self, kv_heads: int, head_dim: int, device: torch.device) -> torch.Tensor:
        """``P [index_head_dim, kv_heads * head_dim] float32``, N(0, 1/index_head_dim)."""
        n = kv_heads * head_dim
        if self._proj is None or self._proj.shape[1] != n or self._proj.device != torch.device(device):
            g = torch.Generator().manual_seed(self.seed)
            self._proj = (torch.randn(self.index_head_dim, n, generator=g) / math.sqrt(self.index_head_dim)).to(device)
        return self._proj

    def index_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """``[..., Hkv, D]`` → ``[..., index_head_dim] float32``."""
        p = self.projection(keys.shape[-2], keys.shape[-1], keys.device)
        return keys.float().flatten(-2) @ p.T

    def index_queries(self, q: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """``[B, Hq, D]`` → ``[B, Hq, index_head_dim] float32``."""
        b, hq, d = q.shape
        p = self.projection(kv_heads, d, q.device).view(self.index_head_dim, kv_heads, d)
        group = hq // kv_heads
        blocks = p[:, torch.arange(hq, device=q.device) // group, :]  # [Didx, Hq, D]
        return torch.einsum("bhd,ihd->bhi", q.float(), blocks)

    def prefill_kwargs(self, layer_id: int, keys: torch.Tensor) -> dict[str, Any]:
        self._kv_heads = keys.shape[-2]
        return {"index_keys": self.index_keys(keys)}

    def decode_kwargs(self, layer_id: int, new_keys: torch.Tensor) -> dict[str, Any]:
        return {"index_keys": self.index_keys(new_keys)}

    def queries(self, layer_id: int, q: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        kv_heads = getattr(self, "_kv_heads", None)
        if kv_heads is None:
            raise ValueError("ProjectedIndexerInputs.queries needs prefill_kwargs first (it learns kv_heads there)")
        iq = self.index_queries(q, kv_heads)
        return iq, {"weights": torch.ones(q.shape[0], q.shape[1], device=q.device)}


# ---------------------------------------------------------------------------- metrics
def attention_mass(q: torch.Tensor, keys: torch.Tensor, seq_len: int, page_size: int) -> torch.Tensor:
    """Softmax attention probability of each unit (page / token) averaged over heads.

    q ``[Hq, D]``, keys ``[T, Hkv, D]`` (first ``seq_len`` used). Returns
    ``[ceil(seq_len / page_size)] float32`` summing to 1.
    """
    hq, d = q.shape
    hkv = keys.shape[1]
    k = keys[:seq_len].float()
    logits = torch.einsum("hd,thd->ht", q.float(), k[:, torch.arange(hq, device=q.device) // (hq // hkv)]) / math.sqrt(d)
    p = torch.softmax(logits, dim=1).mean(dim=0)
    units = -(-seq_len // page_size)
    padded = torch.zeros(units * page_size, device=p.device)
    padded[:seq_len] = p
    return padded.view(units, page_size).sum(dim=1)


def mass_recall(mass: torch.Tensor, selected: torch.Tensor, start: int, end: int, top_k: int) -> float:
    """Attention mass of ``selected`` units over the best possible mass of ``top_k`` units
    in ``[start, end)`` (the top-k-by-mass oracle). 1.0 when there is nothing to select."""
    cand = mass[start:end]
    best = float(torch.topk(cand, min(top_k, cand.numel())).values.sum()) if cand.numel() else 0.0
    if best <= 0.0:
        return 1.0
    sel = selected[selected >= 0].long()
    return float(mass[sel].sum()) / best


def plant_needles(keys: torch.Tensor, q: torch.Tensor, positions: torch.Tensor, strength: float = 4.0) -> None:
    """Overwrite ``keys[positions]`` (``[T, Hkv, D]``, in place) with keys aligned to the
    query ``q [Hq, D]``: per KV head, ``strength * sqrt(D)`` times the unit mean query of
    its GQA group."""
    hq, d = q.shape
    hkv = keys.shape[1]
    u = q.float().view(hkv, hq // hkv, d).mean(dim=1)
    u = u / u.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    keys[positions.long()] = (strength * math.sqrt(d) * u).to(keys.dtype)


# ---------------------------------------------------------------------------- report
@dataclass
class AlgorithmReport:
    """What :func:`check_algorithm` measured."""

    algorithm: str
    mode: str
    page_size: int
    top_k_units: int
    retrieve_calls: int = 0
    needle_recall: float = 0.0
    """Fraction of planted needles whose unit was selected (last decode step, all sparse layers)."""
    mass_recall: float = 0.0
    """Mean over rows/layers of selected attention mass / best top-k attention mass."""
    mean_fill: float = 0.0
    """Mean valid_lengths / min(top_k, candidates) over live rows (1.0: uses its budget)."""
    deterministic: bool = False
    representation_bytes: int = 0
    checks: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return (f"{self.algorithm} ({self.mode}, page_size={self.page_size}, top_k={self.top_k_units}): "
                f"needle_recall={self.needle_recall:.3f} mass_recall={self.mass_recall:.3f} "
                f"fill={self.mean_fill:.3f} deterministic={self.deterministic} "
                f"calls={self.retrieve_calls} checks passed: {', '.join(self.checks)}")


def _fail(name: str, msg: str) -> None:
    raise AssertionError(f"check_algorithm[{name}]: {msg}")


def check_api(cls: type) -> None:
    """API conformance: a concrete ``BaseSparseAlgorithm`` subclass whose hooks accept the
    base class's parameters."""
    name = getattr(cls, "__name__", repr(cls))
    if not (isinstance(cls, type) and issubclass(cls, BaseSparseAlgorithm)):
        _fail(name, f"{cls!r} is not a BaseSparseAlgorithm subclass")
    if inspect.isabstract(cls):
        _fail(name, f"abstract methods not implemented: {sorted(cls.__abstractmethods__)}")
    if not isinstance(getattr(cls, "mode", None), SparseMode):
        _fail(name, f"class attribute mode must be a SparseMode, got {getattr(cls, 'mode', None)!r}")
    for hook in _HOOKS:
        base_params = inspect.signature(getattr(BaseSparseAlgorithm, hook)).parameters
        params = inspect.signature(getattr(cls, hook)).parameters
        takes_var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
        for pname, p in base_params.items():
            if pname == "self" or p.kind is p.VAR_KEYWORD:
                continue
            if pname not in params and not takes_var_kw:
                _fail(name, f"{hook} does not accept parameter {pname!r} (keep BaseSparseAlgorithm's signature)")
        if not takes_var_kw:
            _fail(name, f"{hook} must accept **kwargs (the coordinator passes extra keyword arguments)")


def check_algorithm(
    cls: type,
    config_overrides: Optional[dict[str, Any]] = None,
    device: torch.device | str = "cpu",
    *,
    inputs: Optional[AttentionInputs] = None,
    algorithm_kwargs: Optional[dict[str, Any]] = None,
    num_layers: int = 3,
    q_heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    context_len: int = 160,
    decode_steps: int = 2,
    needles_per_row: int = 2,
    min_needle_recall: Optional[float] = 1.0,
    min_mass_recall: Optional[float] = None,
    seed: int = 0,
) -> AlgorithmReport:
    """Run the author checks on ``cls`` and return an :class:`AlgorithmReport`.

    config_overrides: ``SparseConfig`` fields; defaults are small: page-wise ``page_size=4,
                      top_k=32`` tokens (8 pages), token-wise ``page_size=1, top_k=16``;
                      ``sink_tokens = recent_tokens = page_size`` (4 for token mode).
    inputs:           how the algorithm's inputs derive from attention q/k (default: as is).
    min_needle_recall / min_mass_recall: thresholds (None: measure only).

    Raises AssertionError (message names the check) on the first failure.
    """
    from sparsehi.config import SparseConfig

    name = getattr(cls, "__name__", repr(cls))
    check_api(cls)
    report_checks = ["api"]
    token_wise = cls.mode is SparseMode.TOKEN_WISE
    ps0 = 1 if token_wise else 4
    cfg_kw: dict[str, Any] = dict(
        algorithm=f"{cls.__module__}:{cls.__qualname__}", page_size=ps0, top_k=(16 if token_wise else 32),
        device_buffer_size=(64 if token_wise else 128), sink_tokens=4, recent_tokens=4,
        min_sparse_prompt_len=0,
    )
    cfg_kw.update(config_overrides or {})
    config = SparseConfig(**cfg_kw)
    ps = config.page_size
    dev = torch.device(device)
    inputs = inputs or AttentionInputs()
    gen = torch.Generator().manual_seed(seed)

    def make() -> BaseSparseAlgorithm:
        a = cls(config, dev, **(algorithm_kwargs or {}))
        if not isinstance(a.mode, SparseMode):
            _fail(name, f"instance mode must be a SparseMode, got {a.mode!r}")
        return a

    alg = make()
    sparse_layers = [layer for layer in range(num_layers) if alg.is_sparse_layer(layer)]
    if not sparse_layers:
        _fail(name, f"no sparse layer among the {num_layers} test layers (dense_layers={alg.dense_layers()})")

    # Batch rows: a long one, a partial last page, one with fewer candidates than top_k,
    # one too short for any candidate, one masked off. Request slots out of batch order.
    k_units = config.top_k_units
    lens = [context_len, context_len - 3 * ps // 2 - 1 if ps > 1 else context_len - 7,
            (config.sink_units + config.recent_units + max(1, k_units // 2)) * ps - (ps // 2),
            max(1, (config.sink_units + config.recent_units) * ps - 1), context_len // 2]
    lens = [max(1, n) for n in lens]
    sparse_mask = torch.tensor([True, True, True, True, False], device=dev)
    b = len(lens)
    max_reqs = 6
    # the long row sits in the last slot: a padding row's -1 that wraps around lands there
    req = torch.tensor([max_reqs - 1, 0, 3, 1, 4], dtype=torch.int64, device=dev)
    max_ctx = context_len + decode_steps + ps

    alg.initialize_representation_pool(0, num_layers, max_reqs, max_ctx, kv_heads=kv_heads, head_dim=head_dim, dtype=torch.float32)
    report = AlgorithmReport(algorithm=name, mode=alg.mode.value, page_size=ps, top_k_units=k_units)

    # Keys per layer in a shuffled device pool; needles planted per row at prefill.
    num_slots = b * max_ctx
    q_layers = [torch.randn(b, q_heads, head_dim, generator=gen).to(dev) for _ in range(num_layers)]
    key_pools, slots = [], torch.randperm(num_slots, generator=gen).view(b, max_ctx).to(dev)
    needles: list[list[int]] = []
    for b_i in range(b):
        n = lens[b_i]
        units = -(-n // ps)
        cs, ce = min(config.sink_units, units), max(min(config.sink_units, units), units - config.recent_units)
        pool_units = list(range(cs, ce))
        perm = torch.randperm(len(pool_units), generator=gen)[: min(needles_per_row, k_units, len(pool_units))]
        needles.append([pool_units[int(i)] for i in perm])
    keys_logical = []  # per layer [b, max_ctx, Hkv, D]
    for layer in range(num_layers):
        kl = torch.randn(b, max_ctx, kv_heads, head_dim, generator=gen).to(dev)
        for b_i in range(b):
            if needles[b_i]:
                pos = torch.tensor([u * ps + int(torch.randint(0, min(ps, lens[b_i] - u * ps), (1,), generator=gen))
                                    for u in needles[b_i]])
                plant_needles(kl[b_i], q_layers[layer][b_i], pos.to(dev))
        kb = torch.zeros(num_slots, kv_heads, head_dim, device=dev)
        kb[slots.reshape(-1)] = kl.reshape(-1, kv_heads, head_dim)
        keys_logical.append(kl)
        key_pools.append(kb)

    seq = torch.tensor(lens, dtype=torch.int32, device=dev)

    def prefill(a: BaseSparseAlgorithm) -> None:
        for layer in range(num_layers):
            kl = keys_logical[layer]
            masked = kl * (torch.arange(max_ctx, device=dev)[None, :, None, None] < seq.long()[:, None, None, None])
            a.construct_representations(layer, req, seq, key_pools[layer], slots,
                                        **inputs.prefill_kwargs(layer, masked))

    def decode(a: BaseSparseAlgorithm, cur: torch.Tensor) -> None:
        for layer in range(num_layers):
            new = keys_logical[layer][torch.arange(b, device=dev), cur.long()]
            key_pools[layer][slots[torch.arange(b, device=dev), cur.long()]] = new
            a.update_representations(layer, req, cur.long(), new, **inputs.decode_kwargs(layer, new))

    def candidates(cur_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        units = (cur_len.long() + ps - 1) // ps
        cs = torch.clamp(torch.full_like(units, config.sink_units), max=units)
        ce = torch.maximum(cs, units - config.recent_units)
        return cs.to(torch.int32), ce.to(torch.int32)

    def retrieve(a: BaseSparseAlgorithm, layer: int, cur_len: torch.Tensor):
        cs, ce = candidates(cur_len)
        qa, extra = inputs.queries(layer, q_layers[layer])
        out = a.retrieve_topk(qa, layer, req, sparse_mask, seq_lens=cur_len.to(torch.int32),
                              candidate_start=cs, candidate_end=ce, top_k=k_units, **extra)
        if not (isinstance(out, tuple) and len(out) == 2):
            _fail(name, f"retrieve_topk must return (selected_indices, valid_lengths), got {type(out).__name__}")
        sel, valid = out
        try:
            check_selection(sel, valid, k_units, cs, ce)
        except ValueError as e:
            _fail(name, f"layer {layer}: selection breaks the contract: {e}")
        if bool((valid.long() > sel.shape[1]).any()) or bool((valid < 0).any()):
            _fail(name, f"layer {layer}: valid_lengths {valid.tolist()} outside [0, {sel.shape[1]}] (budget top_k={k_units})")
        if bool(valid[~sparse_mask].ne(0).any()):
            _fail(name, "rows with sparse_mask False must return valid_lengths == 0")
        return sel, valid, cs, ce

    prefill(alg)
    report_checks.append("prefill")
    cur = seq.clone()
    fills, masses, needle_hits, needle_total = [], [], 0, 0
    last: dict[int, tuple] = {}
    for step in range(decode_steps):
        decode(alg, cur)
        cur = cur + 1
        for layer in sparse_layers:
            sel, valid, cs, ce = retrieve(alg, layer, cur)
            report.retrieve_calls += 1
            n_cand = (ce - cs).clamp(min=0).clamp(max=k_units)
            live = sparse_mask & (n_cand > 0)
            if bool(live.any()):
                fills.append(float((valid[live].float() / n_cand[live].float()).mean()))
            last[layer] = (sel, valid, cs, ce)
    report_checks += ["shapes/padding", "budget", "candidates", "sparse_mask"]

    # determinism: the same call again, and a fresh instance fed the same history
    fresh = make()
    fresh.initialize_representation_pool(0, num_layers, max_reqs, max_ctx, kv_heads=kv_heads, head_dim=head_dim, dtype=torch.float32)
    # keys written during decode are in key_pools already; rebuild from the full prefix
    seq_saved = seq
    seq = cur.clone()
    prefill(fresh)
    seq = seq_saved
    for layer in sparse_layers:
        s1, v1, _, _ = retrieve(alg, layer, cur)
        s0, v0, _, _ = last[layer]
        if not (torch.equal(s0, s1) and torch.equal(v0, v1)):
            _fail(name, f"layer {layer}: two identical retrieve_topk calls returned different selections")
        s2, v2, _, _ = retrieve(fresh, layer, cur)
        if not (torch.equal(torch.sort(s0, dim=1).values, torch.sort(s2, dim=1).values) and torch.equal(v0, v2)):
            _fail(name, f"layer {layer}: prefill of the whole context and prefill + decode steps select differently "
                        "(update_representations disagrees with construct_representations)")
    report.deterministic = True
    report_checks.append("determinism")

    # padding rows: strong needle keys written with req_pool_index -1 at the first position
    # of candidate units of row 0 must change no selection
    cs0, ce0 = (int(x[0]) for x in candidates(cur))
    if ce0 > cs0:
        units = cs0 + (torch.arange(b, device=dev) * (ce0 - cs0)) // b
        pad_pos = units * ps
        pad_req = torch.full((b,), -1, dtype=torch.int64, device=dev)
        for layer in sparse_layers:
            pad = torch.zeros(b, kv_heads, head_dim, device=dev)
            plant_needles(pad, q_layers[layer][0], torch.arange(b, device=dev), strength=20.0)
            alg.update_representations(layer, pad_req, pad_pos, pad, **inputs.decode_kwargs(layer, pad))
        for layer in sparse_layers:
            s1, v1, _, _ = retrieve(alg, layer, cur)
            s0, v0, _, _ = last[layer]
            if not (torch.equal(torch.sort(s0, dim=1).values, torch.sort(s1, dim=1).values) and torch.equal(v0, v1)):
                _fail(name, f"layer {layer}: update_representations with padding rows (req_pool_indices == -1) "
                            "changed a live request's selection: padding rows must write nothing")
    report_checks.append("padding rows")

    # recall vs the oracle on the planted needles (last step)
    for layer in sparse_layers:
        sel, valid, cs, ce = last[layer]
        for b_i in range(b):
            if not bool(sparse_mask[b_i]) or int(ce[b_i]) <= int(cs[b_i]):
                continue
            chosen = set(sel[b_i, : int(valid[b_i])].tolist())
            needle_total += len(needles[b_i])
            needle_hits += sum(1 for u in needles[b_i] if u in chosen)
            m = attention_mass(q_layers[layer][b_i], keys_logical[layer][b_i], int(cur[b_i]), ps)
            masses.append(mass_recall(m, sel[b_i], int(cs[b_i]), int(ce[b_i]), k_units))
    report.needle_recall = needle_hits / needle_total if needle_total else 1.0
    report.mass_recall = sum(masses) / len(masses) if masses else 1.0
    report.mean_fill = sum(fills) / len(fills) if fills else 1.0
    report.representation_bytes = int(alg.representation_bytes())
    if min_needle_recall is not None and report.needle_recall < min_needle_recall:
        _fail(name, f"needle recall {report.needle_recall:.3f} < required {min_needle_recall} "
                    f"({needle_hits}/{needle_total} planted needles selected)")
    if min_mass_recall is not None and report.mass_recall < min_mass_recall:
        _fail(name, f"attention-mass recall {report.mass_recall:.3f} < required {min_mass_recall}")
    report_checks.append("recall")
    report.checks = report_checks
    return report
