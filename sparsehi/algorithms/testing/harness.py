"""The synthetic batch every check runs on, and the hook calls made with it, with the
inputs the coordinator would pass."""
from __future__ import annotations

from typing import Any, Optional

import torch

from sparsehi.algorithms.base import BaseSparseAlgorithm, SparseMode
from sparsehi.algorithms.testing.contract import _fail, check_result
from sparsehi.algorithms.testing.fidelity import plant_needles
from sparsehi.algorithms.testing.inputs import AttentionInputs

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
