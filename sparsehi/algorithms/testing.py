"""Author test kit: check a ``BaseSparseAlgorithm`` subclass the way the coordinator will
use it, on small synthetic inputs, in one call::

    from sparsehi.algorithms.testing import check_algorithm
    report = check_algorithm(MyAlgorithm)          # AssertionError with a reason on failure
    print(report)                                  # the numbers

Checks, in order: API conformance (a subclass, ``mode`` set, the four hooks implemented
with the base signatures); a prefill + decode run on a batch with awkward rows (partial
pages, fewer candidates than ``top_k``, an empty candidate range, a ``sparse_mask`` False
row, request slots that are not the batch order) with every ``retrieve_topk`` result
checked (:func:`check_result`: two torch tensors, :func:`~sparsehi.algorithms.base.check_selection`,
padding exactly ``-1``, nothing for masked or padding rows); determinism (same inputs →
same output; prefill of the whole context == prefill + decode); padding rows
(``req_pool_index == -1``, as the unused rows of a CUDA-graph batch) writing nothing and
selecting nothing; decoded keys (for an algorithm whose selection depends on key content:
decoded tokens with keys aligned to the query must get their units selected once those
leave the recent window); capture safety (:mod:`sparsehi.algorithms.graph_safety`:
emulated capture and replay everywhere, a real CUDA graph on CUDA); and recall against the
oracle on planted-needle inputs: the fraction of planted needles selected, and the share of
the best-possible top-k attention mass the selection captures.

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
    """Selection budget in the algorithm's units (pages, or tokens when token-wise)."""
    top_k_tokens: int = 0
    """The same budget as configured, in tokens (``SparseConfig.top_k``)."""
    retrieve_calls: int = 0
    needle_recall: float = 0.0
    """Fraction of planted needles whose unit was selected (last decode step, all sparse layers)."""
    mass_recall: float = 0.0
    """Mean over rows/layers of selected attention mass / best top-k attention mass."""
    mean_fill: float = 0.0
    """Mean valid_lengths / min(top_k, candidates) over live rows (1.0: uses its budget)."""
    deterministic: bool = False
    content_dependent: Optional[bool] = None
    """Whether selections change with the key content (None: not probed)."""
    representation_bytes: int = 0
    capture: list[str] = field(default_factory=list)
    """One line per capture-safety check run (or skipped, and why)."""
    capture_findings: list[str] = field(default_factory=list)
    """Capture-safety problems found and not raised (``"report"`` settings)."""
    checks: list[str] = field(default_factory=list)

    @property
    def budget(self) -> str:
        """``"64 tokens (4 pages of 16)"``, or ``"16 tokens"`` for a token-wise algorithm."""
        if self.mode == SparseMode.TOKEN_WISE.value:
            return f"{self.top_k_tokens} tokens"
        pages = "page" if self.top_k_units == 1 else "pages"
        return f"{self.top_k_tokens} tokens ({self.top_k_units} {pages} of {self.page_size})"

    def __str__(self) -> str:
        capture = "; ".join(self.capture) if self.capture else "not checked"
        found = f" CAPTURE FINDINGS: {' | '.join(self.capture_findings)}" if self.capture_findings else ""
        return (f"{self.algorithm} ({self.mode}, page_size={self.page_size}, top_k={self.budget}): "
                f"needle_recall={self.needle_recall:.3f} mass_recall={self.mass_recall:.3f} "
                f"fill={self.mean_fill:.3f} deterministic={self.deterministic} "
                f"content_dependent={self.content_dependent} calls={self.retrieve_calls} "
                f"capture: {capture}; checks passed: {', '.join(self.checks)}{found}")


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


def check_result(name: str, where: str, out: Any, top_k: int, candidate_start: torch.Tensor,
                 candidate_end: torch.Tensor, sparse_mask: torch.Tensor,
                 req_pool_indices: torch.Tensor, ascending: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One ``retrieve_topk`` result against the contract; returns ``(selected, valid)``.

    On top of :func:`~sparsehi.algorithms.base.check_selection`: two torch tensors, padding
    exactly ``-1``, ``valid_lengths`` in ``[0, K]``, nothing for ``sparse_mask`` False rows
    and nothing for padding rows (``req_pool_indices < 0``). AssertionError naming the rule.
    """
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        _fail(name, f"{where}: retrieve_topk must return (selected_indices, valid_lengths), got {type(out).__name__}")
    sel, valid = out
    if not (isinstance(sel, torch.Tensor) and isinstance(valid, torch.Tensor)):
        _fail(name, f"{where}: retrieve_topk must return two torch.Tensor (selected_indices [B, top_k] int32, "
                    f"valid_lengths [B] int32) on the device, got ({type(sel).__name__}, {type(valid).__name__})")
    try:
        check_selection(sel, valid, top_k, candidate_start, candidate_end)
    except ValueError as e:
        _fail(name, f"{where}: selection breaks the contract: {e}")
    if bool((valid.long() > sel.shape[1]).any()) or bool((valid < 0).any()):
        _fail(name, f"{where}: valid_lengths {valid.tolist()} outside [0, {sel.shape[1]}] (budget top_k={top_k})")
    cols = torch.arange(sel.shape[1], device=sel.device)[None, :]
    pad = cols >= valid.long()[:, None]
    bad = pad & (sel != -1)
    if bool(bad.any()):
        _fail(name, f"{where}: selected_indices pads with {sorted(set(sel[bad].tolist()))} after the valid ids: "
                    "the padding value is exactly -1")
    if bool(valid[~sparse_mask.to(valid.device).bool()].ne(0).any()):
        _fail(name, f"{where}: rows with sparse_mask False must return valid_lengths == 0")
    padding = (req_pool_indices < 0).to(valid.device)
    if bool(padding.any()) and bool(valid[padding].ne(0).any() or sel[padding].ne(-1).any()):
        rows = [i for i in range(valid.shape[0]) if bool(padding[i])]
        _fail(name, f"{where}: rows {rows} have req_pool_indices == -1 (padding rows of a CUDA-graph batch) and "
                    f"returned valid_lengths {valid[padding].tolist()}, ids {sel[padding].tolist()}: padding rows "
                    "must get valid_lengths == 0 "
                    "and all -1 ids, whatever their sparse_mask, seq_lens and candidates")
    if ascending:  # the algorithm declares selects_ascending: the coordinator skips its sort
        cols_v = cols < valid.long()[:, None]
        nxt = torch.cat([sel[:, 1:], torch.full_like(sel[:, :1], torch.iinfo(torch.int32).max)], 1)
        if bool((cols_v & (cols + 1 < valid.long()[:, None]) & (sel >= nxt)).any()):
            _fail(name, f"{where}: selects_ascending is True but a row's ids are not in ascending order "
                        "(the coordinator relies on it and skips its sort)")
    return sel, valid


def _same_selection(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                    rows: Optional[slice] = None) -> bool:
    """Equal ``(selected, valid)`` up to the order of the ids in a row."""
    rows = rows or slice(None)
    sa, va = a[0][rows], a[1][rows]
    sb, vb = b[0][rows], b[1][rows]
    return (sa.shape == sb.shape and torch.equal(va.cpu(), vb.cpu())
            and torch.equal(torch.sort(sa, dim=1).values.cpu(), torch.sort(sb, dim=1).values.cpu()))


# ---------------------------------------------------------------------------- synthetic batch
PADDING_ROWS = 2
"""Rows with ``req_pool_indices == -1`` appended where the kit checks padding rows."""


class _Case:
    """The synthetic batch every check runs on, and the calls made with it.

    Rows: a long one, a partial last page, one with fewer candidates than top_k, one too
    short for any candidate, one masked off; request slots out of batch order, the long row
    in the last slot (a padding row's -1 that wraps around lands there). Keys per layer in a
    shuffled slot pool, needles (keys aligned with the row's query) planted at prefill, and
    a decode plan: after ``decode_steps`` plain steps, ``probe_steps`` more whose keys at
    ``probe_positions`` are strongly aligned with the query, spaced two units apart.
    """

    def __init__(self, config: Any, dev: torch.device, inputs: AttentionInputs, *, num_layers: int, q_heads: int,
                 kv_heads: int, head_dim: int, context_len: int, decode_steps: int, needles_per_row: int,
                 sparse_layers: list[int], seed: int) -> None:
        self.config, self.dev, self.inputs = config, dev, inputs
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.sparse_layers = sparse_layers
        self.ascending = False  # the algorithm's selects_ascending claim, checked on every result
        ps = self.ps = config.page_size
        self.k_units = config.top_k_units
        gen = torch.Generator().manual_seed(seed)
        lens = [context_len, context_len - 3 * ps // 2 - 1 if ps > 1 else context_len - 7,
                (config.sink_units + config.recent_units + max(1, self.k_units // 2)) * ps - (ps // 2),
                max(1, (config.sink_units + config.recent_units) * ps - 1), context_len // 2]
        self.lens = [max(1, n) for n in lens]
        self.b = b = len(self.lens)
        self.sparse_mask = torch.tensor([True, True, True, True, False], device=dev)
        self.max_reqs = 6
        self.req = torch.tensor([self.max_reqs - 1, 0, 3, 1, 4], dtype=torch.int64, device=dev)
        self.seq0 = torch.tensor(self.lens, dtype=torch.int32, device=dev)
        self.cur0 = self.seq0 + decode_steps

        # decode plan: probe tokens at the middle of units u0, u0 + 2, ... (u0: the first
        # unit starting at or after the row's length after the plain decode steps), then
        # enough tokens that the last probe unit leaves the recent window
        self.probes_per_row = min(3, self.k_units)
        self.probe_units: list[list[int]] = []
        self.probe_positions: list[list[int]] = []
        steps = 0
        for n in self.cur0.tolist():
            u0 = -(-n // ps)
            units = [u0 + 2 * j for j in range(self.probes_per_row)]
            self.probe_units.append(units)
            self.probe_positions.append([u * ps + ps // 2 for u in units])
            steps = max(steps, (units[-1] + config.recent_units) * ps + 1 - n)
        self.probe_steps = steps
        self.max_ctx = max_ctx = max(self.lens) + decode_steps + steps + ps

        num_slots = b * max_ctx
        self.q_layers = [torch.randn(b, q_heads, head_dim, generator=gen).to(dev) for _ in range(num_layers)]
        self.slots = torch.randperm(num_slots, generator=gen).view(b, max_ctx).to(dev)
        self.needles: list[list[int]] = []
        for b_i in range(b):
            n = self.lens[b_i]
            units = -(-n // ps)
            cs = min(config.sink_units, units)
            ce = max(cs, units - config.recent_units)
            pool_units = list(range(cs, ce))
            perm = torch.randperm(len(pool_units), generator=gen)[: min(needles_per_row, self.k_units, len(pool_units))]
            self.needles.append([pool_units[int(i)] for i in perm])
        self.keys_logical: list[torch.Tensor] = []  # per layer [b, max_ctx, Hkv, D]
        self.key_pools: list[torch.Tensor] = []  # per layer [num_slots, Hkv, D]
        for layer in range(num_layers):
            kl = torch.randn(b, max_ctx, kv_heads, head_dim, generator=gen).to(dev)
            for b_i in range(b):
                q = self.q_layers[layer][b_i]
                if self.needles[b_i]:
                    pos = torch.tensor([u * ps + int(torch.randint(0, min(ps, self.lens[b_i] - u * ps), (1,),
                                                                   generator=gen))
                                        for u in self.needles[b_i]])
                    plant_needles(kl[b_i], q, pos.to(dev))
                plant_needles(kl[b_i], q, torch.tensor(self.probe_positions[b_i], device=dev), strength=20.0)
            self.keys_logical.append(kl)
            self.key_pools.append(self.pool_of(kl))

    def pool_of(self, keys_logical: torch.Tensor) -> torch.Tensor:
        """``[b, max_ctx, Hkv, D]`` logical keys -> the shuffled slot pool ``[num_slots, Hkv, D]``."""
        kb = torch.zeros(self.b * self.max_ctx, self.kv_heads, self.head_dim, device=self.dev)
        kb[self.slots.reshape(-1)] = keys_logical.reshape(-1, self.kv_heads, self.head_dim)
        return kb

    def make(self, cls: type, name: str, algorithm_kwargs: Optional[dict[str, Any]]) -> BaseSparseAlgorithm:
        a = cls(self.config, self.dev, **(algorithm_kwargs or {}))
        if not isinstance(a.mode, SparseMode):
            _fail(name, f"instance mode must be a SparseMode, got {a.mode!r}")
        a.initialize_representation_pool(0, self.num_layers, self.max_reqs, self.max_ctx, kv_heads=self.kv_heads,
                                         head_dim=self.head_dim, dtype=torch.float32)
        return a

    def candidates(self, cur_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[candidate_start, candidate_end)`` ``[B] int32`` each, as the coordinator computes them."""
        units = (cur_len.long() + self.ps - 1) // self.ps
        cs = torch.clamp(torch.full_like(units, self.config.sink_units), max=units)
        ce = torch.maximum(cs, units - self.config.recent_units)
        return cs.to(torch.int32), ce.to(torch.int32)

    def prefill(self, a: BaseSparseAlgorithm, seq: torch.Tensor, keys: Optional[list[torch.Tensor]] = None) -> None:
        keys = keys if keys is not None else self.keys_logical
        pools = self.key_pools if keys is self.keys_logical else [self.pool_of(k) for k in keys]
        for layer in range(self.num_layers):
            visible = torch.arange(self.max_ctx, device=self.dev)[None, :, None, None] < seq.long()[:, None, None, None]
            a.construct_representations(layer, self.req, seq, pools[layer], self.slots,
                                        **self.inputs.prefill_kwargs(layer, keys[layer] * visible))

    # -- per-call inputs as dicts of tensors: eager calls get fresh ones, a StaticCall
    #    gets them as its static buffers and `load`s later ones into them
    def _rows(self, cur: torch.Tensor, pad: int, padding_only: bool = False):
        req, mask, cur = self.req, self.sparse_mask, cur.to(torch.int32)
        if padding_only:
            req = torch.full_like(req, -1)
        if pad:
            req = torch.cat([req, torch.full((pad,), -1, dtype=req.dtype, device=self.dev)])
            mask = torch.cat([mask, torch.ones(pad, dtype=torch.bool, device=self.dev)])
            # padding rows copy the long row's length: they would have candidates if treated as live
            cur = torch.cat([cur, cur[:1].expand(pad)])
        return req, mask, cur

    def retrieve_inputs(self, cur: torch.Tensor, pad: int = 0) -> dict[str, torch.Tensor]:
        """Inputs of ``retrieve_topk`` for every sparse layer at context lengths ``cur``."""
        req, mask, cur = self._rows(cur, pad)
        cs, ce = self.candidates(cur)
        x = {"req": req, "mask": mask, "seq": cur, "cs": cs, "ce": ce}
        for layer in self.sparse_layers:
            q = self.q_layers[layer]
            if pad:
                q = torch.cat([q, q[:1].expand(pad, -1, -1)])
            qa, extra = self.inputs.queries(layer, q)
            x[f"q{layer}"] = qa
            x.update({f"x{layer}:{k}": v for k, v in extra.items()})
        return x

    def update_inputs(self, cur: torch.Tensor, pad: int = 0, padding_only: bool = False) -> dict[str, torch.Tensor]:
        """Inputs of ``update_representations`` for every layer: the token at ``cur`` of each row."""
        req, _, pos = self._rows(cur, pad, padding_only)
        rows = torch.cat([torch.arange(self.b, device=self.dev), torch.zeros(pad, dtype=torch.long, device=self.dev)])
        x = {"req": req, "pos": pos.long()}
        for layer in range(self.num_layers):
            new = self.keys_logical[layer][rows, pos.long()]
            x[f"k{layer}"] = new
            x.update({f"x{layer}:{k}": v for k, v in self.inputs.decode_kwargs(layer, new).items()})
        return x

    @staticmethod
    def _extra(x: dict[str, torch.Tensor], layer: int) -> dict[str, Any]:
        p = f"x{layer}:"
        return {k[len(p):]: v for k, v in x.items() if k.startswith(p)}

    def call_retrieve(self, a: BaseSparseAlgorithm, x: dict[str, torch.Tensor]) -> list[Any]:
        return [a.retrieve_topk(x[f"q{layer}"], layer, x["req"], x["mask"], seq_lens=x["seq"], candidate_start=x["cs"],
                                candidate_end=x["ce"], top_k=self.k_units, **self._extra(x, layer))
                for layer in self.sparse_layers]

    def call_update(self, a: BaseSparseAlgorithm, x: dict[str, torch.Tensor]) -> None:
        for layer in range(self.num_layers):
            a.update_representations(layer, x["req"], x["pos"], x[f"k{layer}"], **self._extra(x, layer))

    def checked(self, name: str, where: str, outs: list[Any], x: dict[str, torch.Tensor]):
        """Every layer's result of :meth:`call_retrieve` through :func:`check_result`."""
        return {layer: check_result(name, f"layer {layer} ({where})", out, self.k_units, x["cs"], x["ce"], x["mask"],
                                    x["req"], ascending=self.ascending)
                for layer, out in zip(self.sparse_layers, outs)}


# ---------------------------------------------------------------------------- checks
def _check_padding_row_selections(name: str, case: _Case, alg: BaseSparseAlgorithm, cur: torch.Tensor,
                                  last: dict[int, tuple]) -> None:
    """Padding rows (``req_pool_indices == -1``, sparse_mask True, a long row's candidates)
    appended to the batch select nothing, and the live rows select as without them."""
    x = case.retrieve_inputs(cur, pad=PADDING_ROWS)
    got = case.checked(name, "batch with padding rows", case.call_retrieve(alg, x), x)
    for layer, sv in got.items():
        if not _same_selection(sv, last[layer][:2], slice(0, case.b)):
            _fail(name, f"layer {layer}: appending padding rows (req_pool_indices == -1) changed the live rows' "
                        "selections: rows are independent")


def _probe_content(case: _Case, cls: type, name: str, algorithm_kwargs: Optional[dict[str, Any]], cur: torch.Tensor,
                   last: dict[int, tuple], seed: int) -> bool:
    """Does the selection depend on key content? A fresh instance prefilled with other
    keys (random, no needles) at the same lengths, same queries: any selection differs."""
    gen = torch.Generator().manual_seed(seed + 7919)
    other = [torch.randn(k.shape, generator=gen).to(case.dev) for k in case.keys_logical]
    alt = case.make(cls, name, algorithm_kwargs)
    case.prefill(alt, cur, keys=other)
    x = case.retrieve_inputs(cur)
    got = case.checked(name, "prefilled with other keys", case.call_retrieve(alt, x), x)
    return any(not _same_selection(got[layer], last[layer][:2]) for layer in case.sparse_layers)


def _check_decoded_keys(name: str, case: _Case, alg: BaseSparseAlgorithm, cur: torch.Tensor) -> int:
    """Decode the probe steps; then each live row's probe units (decoded tokens whose keys
    are aligned with the query, ranked first by the exact-score oracle on the true keys)
    must be selected. Returns the number of (layer, row) pairs checked."""
    from sparsehi.algorithms.oracle import exact_token_scores, page_max_scores

    for t in range(case.probe_steps):
        case.call_update(alg, case.update_inputs(cur + t))
    end = cur + case.probe_steps
    x = case.retrieve_inputs(end)
    got = case.checked(name, "after the decoded-key probe", case.call_retrieve(alg, x), x)
    unit = "page" if alg.mode is SparseMode.PAGE_WISE and case.ps > 1 else "token"
    checked = 0
    for layer, (sel, valid) in got.items():
        for i in range(case.b):
            cs, ce, n = int(x["cs"][i]), int(x["ce"][i]), int(end[i])
            probes = case.probe_units[i]
            if not bool(case.sparse_mask[i]) or not all(cs <= u < ce for u in probes):
                continue
            q = case.q_layers[layer][i]
            scores = exact_token_scores(q[None], case.keys_logical[layer][i][None, :n])
            per_unit = page_max_scores(scores, torch.tensor([n], device=case.dev), case.ps)[0, cs:ce]
            top = set((torch.topk(per_unit, len(probes)).indices + cs).tolist())
            if top != set(probes):  # the planted keys do not dominate: nothing to claim here
                continue
            checked += 1
            chosen = set(sel[i, : int(valid[i])].tolist())
            missing = [u for u in probes if u not in chosen]
            if missing:
                _fail(name, f"layer {layer}, batch row {i} (request slot {int(case.req[i])}): decoded tokens at "
                            f"positions {case.probe_positions[i]} have keys aligned with the query (the exact-score oracle ranks "
                            f"their {unit}s {probes} first), but retrieve_topk missed {unit}(s) {missing} "
                            f"(selected {sorted(chosen)}): update_representations must fold each decoded key into "
                            f"{unit} positions // page_size of request slot req_pool_indices[b]; an update that does "
                            f"nothing, or writes another {unit} or request slot, fails here")
    return checked


_CAPTURE_RULE = ("retrieve_topk / update_representations run inside CUDA graphs: no host sync, no data-dependent "
                 "shapes, nothing derived from the inputs cached across calls (docs/algorithms.md, 'Capture safety')")


def _check_capture(name: str, case: _Case, cls: type, algorithm_kwargs: Optional[dict[str, Any]], cur: torch.Tensor,
                   report: AlgorithmReport, capture_check: str, replay_check: str) -> None:
    """Capture, then replay: the probe decode steps through a captured update_representations
    (warmed up and captured on padding rows), then retrieve_topk captured at the start and
    replayed at the end; both must equal eager calls on a twin instance. Emulated on every
    device; a real CUDA graph as well on CUDA."""
    from sparsehi.algorithms.graph_safety import CaptureUnsafe, CudaGraphReplay, EmulatedReplay, raised_finding

    eager = case.make(cls, name, algorithm_kwargs)
    case.prefill(eager, cur)
    for t in range(case.probe_steps):
        case.call_update(eager, case.update_inputs(cur + t, pad=PADDING_ROWS))
    end = cur + case.probe_steps
    x_end = case.retrieve_inputs(end, pad=PADDING_ROWS)
    want = case.checked(name, "eager twin", case.call_retrieve(eager, x_end), x_end)

    kinds: list[type] = [EmulatedReplay] + ([CudaGraphReplay] if case.dev.type == "cuda" else [])
    for kind in kinds:
        label = kind.kind
        g = case.make(cls, name, algorithm_kwargs)
        case.prefill(g, cur)
        upd_in = case.update_inputs(cur, pad=PADDING_ROWS, padding_only=True)
        ret_in = case.retrieve_inputs(cur, pad=PADDING_ROWS)
        upd = kind("update_representations", lambda g=g, s=upd_in: case.call_update(g, s), upd_in)
        ret = kind("retrieve_topk", lambda g=g, s=ret_in: case.call_retrieve(g, s), ret_in)
        running = upd
        try:
            upd.capture()
            running = ret
            ret.capture()
            running = upd
            for t in range(case.probe_steps):
                upd.load(case.update_inputs(cur + t, pad=PADDING_ROWS))
                upd.replay()
            running = ret
            ret.load({k: x_end[k] for k in ret_in})
            outs = [(s.clone(), v.clone()) if isinstance(s, torch.Tensor) else (s, v) for s, v in ret.replay()]
        except Exception as e:  # noqa: BLE001 - whatever a hook raises under capture is the finding
            finding = e.finding if isinstance(e, CaptureUnsafe) else raised_finding(running.hook, e)
            if capture_check == "require":
                _fail(name, f"capture safety ({label}): {finding} — {_CAPTURE_RULE}")
            report.capture.append(f"{label}: FAILED")
            report.capture_findings.append(f"{label}: {finding}")
            continue
        problems = []
        try:
            eager_g = case.checked(name, f"{label} instance, eager", case.call_retrieve(g, x_end), x_end)
        except AssertionError as e:  # its representations came from the replayed updates
            eager_g = None
            problems.append(f"update_representations replayed ({label}), then an eager retrieve_topk: {e}")
        try:
            replayed = case.checked(name, f"{label} replay", outs, ret_in)
        except AssertionError as e:
            replayed = None
            problems.append(f"retrieve_topk replayed ({label}) with new inputs in its static buffers: {e}")
        for layer in case.sparse_layers:
            if eager_g is not None and not _same_selection(eager_g[layer], want[layer]):
                problems.append(f"layer {layer}: update_representations replayed ({label}) leaves other "
                                "representations than eager calls with the same inputs (selections differ)")
            if eager_g is not None and replayed is not None and not _same_selection(replayed[layer], eager_g[layer]):
                problems.append(f"layer {layer}: retrieve_topk replayed ({label}) with new inputs in its static "
                                "buffers selects other ids than an eager call with the same inputs")
        if problems:
            if replay_check == "require":
                _fail(name, f"capture safety ({label}): {problems[0]} — something derived from the inputs is "
                            f"computed once and reused (e.g. a cache keyed on tensor identity); {_CAPTURE_RULE}")
            report.capture.append(f"{label}: replay differs from eager")
            report.capture_findings.extend(f"{label}: {p}" for p in problems)
            continue
        report.capture.append(f"{label}: passed ({case.probe_steps} update replays, retrieve replay == eager)")
    if case.dev.type != "cuda":
        report.capture.append(f"cuda graph: skipped (device {case.dev.type}; run the kit with device='cuda')")


_CHECK_MODES = ("require", "report", "off")


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
    capture_check: str = "require",
    replay_check: str = "require",
    seed: int = 0,
) -> AlgorithmReport:
    """Run the author checks on ``cls`` and return an :class:`AlgorithmReport`.

    config_overrides: ``SparseConfig`` fields; defaults are small: page-wise ``page_size=4,
                      top_k=32`` tokens (8 pages), token-wise ``page_size=1, top_k=16``;
                      ``sink_tokens = recent_tokens = page_size`` (4 for token mode).
    inputs:           how the algorithm's inputs derive from attention q/k (default: as is).
    min_needle_recall / min_mass_recall: thresholds (None: measure only).
    capture_check:    ``"require"`` (default): a host sync or data-dependent shape in
                      ``retrieve_topk`` / ``update_representations`` (or a CUDA capture that
                      raises) fails the check; ``"report"``: recorded in the report only;
                      ``"off"``: not run (nor is the replay comparison).
    replay_check:     ``"require"`` (default): replayed hooks must equal eager calls;
                      ``"report"``: a difference is recorded in ``report.capture_findings``
                      and printed, not raised.

    Raises AssertionError (message names the check) on the first failure.
    """
    from sparsehi.config import SparseConfig

    for pname, v, allowed in (("capture_check", capture_check, _CHECK_MODES),
                              ("replay_check", replay_check, _CHECK_MODES[:2])):
        if v not in allowed:
            raise ValueError(f"{pname}={v!r} is invalid: one of {allowed}")
    if not isinstance(decode_steps, int) or decode_steps < 1:
        raise ValueError(f"decode_steps={decode_steps!r} is invalid: an integer >= 1")
    name = getattr(cls, "__name__", repr(cls))
    check_api(cls)
    report_checks = ["api"]
    token_wise = cls.mode is SparseMode.TOKEN_WISE
    cfg_kw: dict[str, Any] = dict(
        algorithm=f"{cls.__module__}:{cls.__qualname__}", page_size=1 if token_wise else 4,
        top_k=(16 if token_wise else 32), device_buffer_size=(64 if token_wise else 128), sink_tokens=4,
        recent_tokens=4, min_sparse_prompt_len=0,
    )
    cfg_kw.update(config_overrides or {})
    config = SparseConfig(**cfg_kw)
    dev = torch.device(device)
    inputs = inputs or AttentionInputs()

    probe = cls(config, dev, **(algorithm_kwargs or {}))
    sparse_layers = [layer for layer in range(num_layers) if probe.is_sparse_layer(layer)]
    if not sparse_layers:
        _fail(name, f"no sparse layer among the {num_layers} test layers (dense_layers={probe.dense_layers()})")
    case = _Case(config, dev, inputs, num_layers=num_layers, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                 context_len=context_len, decode_steps=decode_steps, needles_per_row=needles_per_row,
                 sparse_layers=sparse_layers, seed=seed)
    alg = case.make(cls, name, algorithm_kwargs)
    case.ascending = bool(getattr(alg, "selects_ascending", False))
    k_units = case.k_units
    report = AlgorithmReport(algorithm=name, mode=alg.mode.value, page_size=case.ps, top_k_units=k_units,
                             top_k_tokens=config.top_k)

    case.prefill(alg, case.seq0)
    report_checks.append("prefill")
    cur = case.seq0.clone()
    fills: list[float] = []
    last: dict[int, tuple] = {}
    for step in range(decode_steps):
        case.call_update(alg, case.update_inputs(cur))
        cur = cur + 1
        x = case.retrieve_inputs(cur)
        got = case.checked(name, f"decode step {step}", case.call_retrieve(alg, x), x)
        for layer, (sel, valid) in got.items():
            report.retrieve_calls += 1
            n_cand = (x["ce"] - x["cs"]).clamp(min=0).clamp(max=k_units)
            live = case.sparse_mask & (n_cand > 0)
            if bool(live.any()):
                fills.append(float((valid[live].float() / n_cand[live].float()).mean()))
            last[layer] = (sel, valid, x["cs"], x["ce"])
    report_checks += ["shapes/padding", "budget", "candidates", "sparse_mask"]

    # determinism: the same call again, and a fresh instance fed the same history
    fresh = case.make(cls, name, algorithm_kwargs)
    case.prefill(fresh, cur)
    x = case.retrieve_inputs(cur)
    again = case.checked(name, "repeated call", case.call_retrieve(alg, x), x)
    other = case.checked(name, "fresh instance", case.call_retrieve(fresh, x), x)
    for layer in sparse_layers:
        s0, v0 = last[layer][:2]
        s1, v1 = again[layer]
        if not (torch.equal(s0, s1) and torch.equal(v0, v1)):
            _fail(name, f"layer {layer}: two identical retrieve_topk calls returned different selections")
        if not _same_selection(other[layer], (s0, v0)):
            _fail(name, f"layer {layer}: prefill of the whole context and prefill + decode steps select differently "
                        "(update_representations disagrees with construct_representations)")
    report.deterministic = True
    report_checks.append("determinism")

    # padding rows, writes: strong needle keys written with req_pool_index -1 at the first
    # position of candidate units of row 0 must change no selection
    cs0, ce0 = (int(v[0]) for v in case.candidates(cur))
    if ce0 > cs0:
        b, dev_ = case.b, case.dev
        pad_pos = (cs0 + (torch.arange(b, device=dev_) * (ce0 - cs0)) // b) * case.ps
        pad_req = torch.full((b,), -1, dtype=torch.int64, device=dev_)
        for layer in sparse_layers:
            pad = torch.zeros(b, case.kv_heads, case.head_dim, device=dev_)
            plant_needles(pad, case.q_layers[layer][0], torch.arange(b, device=dev_), strength=20.0)
            alg.update_representations(layer, pad_req, pad_pos, pad, **inputs.decode_kwargs(layer, pad))
        x = case.retrieve_inputs(cur)
        got = case.checked(name, "after padding-row writes", case.call_retrieve(alg, x), x)
        for layer in sparse_layers:
            if not _same_selection(got[layer], last[layer][:2]):
                _fail(name, f"layer {layer}: update_representations with padding rows (req_pool_indices == -1) "
                            "changed a live request's selection: padding rows must write nothing")
    report_checks.append("padding-row writes")
    _check_padding_row_selections(name, case, alg, cur, last)
    report_checks.append("padding-row selections")

    # decoded keys: only where the selection depends on key content at all (a query-blind
    # algorithm such as a sliding window needs no representations)
    report.content_dependent = _probe_content(case, cls, name, algorithm_kwargs, cur, last, seed)
    if report.content_dependent:
        _check_decoded_keys(name, case, alg, cur)
        report_checks.append("decoded keys")
    else:
        report_checks.append("decoded keys (n/a: selection ignores key content)")

    if capture_check != "off":
        _check_capture(name, case, cls, algorithm_kwargs, cur, report, capture_check, replay_check)
        report_checks.append("capture safety")
    else:
        report.capture.append("not checked (capture_check='off')")

    # recall vs the oracle on the planted needles (last plain decode step)
    masses: list[float] = []
    needle_hits = needle_total = 0
    for layer in sparse_layers:
        sel, valid, cs, ce = last[layer]
        for b_i in range(case.b):
            if not bool(case.sparse_mask[b_i]) or int(ce[b_i]) <= int(cs[b_i]):
                continue
            chosen = set(sel[b_i, : int(valid[b_i])].tolist())
            needle_total += len(case.needles[b_i])
            needle_hits += sum(1 for u in case.needles[b_i] if u in chosen)
            m = attention_mass(case.q_layers[layer][b_i], case.keys_logical[layer][b_i], int(cur[b_i]), case.ps)
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
