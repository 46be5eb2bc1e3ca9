"""Prefill/decode disaggregation over an L3 backend (Mooncake's store): the prefill side
computes prompts and publishes their KV (``hicache.storage.kv_handoff``), the decode side
takes that KV straight into its host pool and decodes sparse-hier without a prefill.

Decode side, per request (``decode_from_handoff``):

1. wait (bounded) for the prompt's ready record, check it names this prompt;
2. read every page the record names into freshly allocated host pages and verify each
   against the record's digest;
3. *adopt* the prompt: the request takes a row, its host pages become its KV, the pages
   are loaded host->device layer by layer and the algorithm builds its representations
   from them (the same ``attention_end`` calls a prefill makes, with a prefix covering the
   whole prompt, so no model forward runs), then the GPU buffers are set up
   (``end_prefill``) and the prefill's first token becomes the request's first output;
4. decode the batch sparse-hier; at request end the prefix tree writes the decoded
   tokens' pages to the same backend (``RuntimeConfig.storage``), for later reuse.

A missing record (timeout), a record for other tokens, or a page that is missing or fails
its digest never reaches step 3: with ``on_missing="recompute"`` the request is prefilled
locally (the prefix tree may still reuse the complete pages L3 holds); with ``"refuse"``
``HandoffRefused`` is raised and nothing is decoded.

``PromptComputeCounter`` counts, with a forward hook on the model, the prompt positions any
model call computed, so a caller can show that an adopted request cost no prefill compute.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from hicache.storage.kv_handoff import (HandoffError, HandoffKeys, HandoffRecord, handoff_keys, load_pages, publish,
                                        wait_for_record)
from sparsehi.runtime.runner import GenerationResult, ModelRunner
from sparsehi.runtime.runtime_mode import Request, RuntimeMode, _sync

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
ON_MISSING = ("recompute", "refuse")


class HandoffRefused(HandoffError):
    """The decode side refused a request whose hand-off is missing or incomplete."""


@dataclass(frozen=True)
class DisaggregationConfig:
    """``sparsehi run --disaggregation ...``."""

    role: str
    """``prefill`` (compute prompts, publish their KV) or ``decode`` (take it, decode)."""
    wait_timeout_s: float = 30.0
    """Decode: longest wait for a prompt's ready record."""
    on_missing: str = "recompute"
    """Decode, when a hand-off is missing or incomplete: ``recompute`` the prompt locally or
    ``refuse`` the request (HandoffRefused)."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"disaggregation role must be one of {ROLES}, got {self.role!r}")
        if self.on_missing not in ON_MISSING:
            raise ValueError(f"on_missing must be one of {ON_MISSING}, got {self.on_missing!r}")
        t = self.wait_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0:
            raise ValueError(f"wait_timeout_s must be a number of seconds >= 0, got {t!r}")


class PromptComputeCounter:
    """Counts prompt positions computed by ``model``'s forward calls (a forward pre-hook):
    positions below ``prompt_len`` (the shortest prompt of the batch), so decode steps, whose
    positions are at or past their prompt's end, are not counted. Remove with ``close``."""

    def __init__(self, model: torch.nn.Module, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        self.positions = 0
        self._hook = model.register_forward_pre_hook(self._count)

    def _count(self, module: Any, args: tuple) -> None:
        pos = args[1]
        self.positions += int((pos < self.prompt_len).sum())

    def close(self) -> None:
        self._hook.remove()


@dataclass
class HandoffOutcome:
    """How one request's prompt KV was obtained on the decode side."""

    request_key: str
    adopted: bool
    """True: the prompt's KV came from the hand-off; False: it was recomputed."""
    reason: str = ""
    """Why it was recomputed (the hand-off error)."""
    pages: int = 0


@dataclass
class DecodeResult:
    """``decode_from_handoff``'s tokens and how each prompt's KV arrived."""

    generation: GenerationResult
    outcomes: list[HandoffOutcome]
    prompt_positions_computed: int
    """Prompt positions any model forward computed during the call (0 when all adopted)."""
    l3: dict[str, int] = field(default_factory=dict)


def _keys(mode: RuntimeMode, prompt: list[int], salt: Optional[str]) -> HandoffKeys:
    storage = mode.rt.storage
    cfg = storage.config
    return handoff_keys(prompt, mode.rt.page_size, salt, cfg.tp_rank, cfg.is_mla)


def _check_mode(runner: ModelRunner) -> RuntimeMode:
    mode = runner.mode
    if runner.rt.mode != "sparse-hier" or getattr(mode, "tree", None) is None:
        raise ValueError(f"disaggregation needs a sparse-hier runner with prefix_cache=True, got mode "
                         f"{runner.rt.mode!r}")
    if runner.rt.storage is None:
        raise ValueError("disaggregation needs RuntimeConfig.storage: the L3 backend the KV is handed over through")
    if mode.host.layout == "layer_first":
        raise ValueError("disaggregation moves whole host pages: host_layout must be page_first, "
                         "page_first_direct or page_head, got layer_first")
    if mode.host.kv_format.quantized:
        raise ValueError("disaggregation with --host-kv-dtype fp8_e4m3 is not supported: a prompt's partial last "
                         "page is not quantised until decode completes it, so it cannot be handed over")
    if mode.state_bytes and not mode.keeps_state:
        raise ValueError(f"{runner.rt.sparse.algorithm} keeps per-token state that the host pages must carry; "
                         f"this host pool has no state buffer")
    return mode


def prefill_and_publish(runner: ModelRunner, prompts: list[list[int]],
                        cache_salts: Optional[list[Optional[str]]] = None,
                        on_pages_written: Optional[Callable[[int], None]] = None) -> list[HandoffRecord]:
    """Prefill each prompt, publish its KV (pages, then ready record) to
    ``runner.rt.storage`` and end the request. Returns the records, one per prompt."""
    mode = _check_mode(runner)
    runner.check_prompts(prompts, 1)
    records = []
    for req in runner.new_requests(prompts, cache_salts):
        try:
            first = runner.prefill(req)
            ps = mode.rt.page_size
            n = len(req.prompt)
            pages = (req.host_slots[: -(-n // ps) * ps: ps] // ps).tolist()
            keys = _keys(mode, req.prompt, req.cache_salt)
            records.append(publish(mode.rt.storage, mode.host, req.prompt, pages, first, keys, on_pages_written))
        except BaseException:
            runner._abandon([req])
            raise
        mode.end_request(req)
    mode.tree.flush_storage()
    return records


def adopt_prompt(runner: ModelRunner, req: Request, record: HandoffRecord) -> None:
    """Make ``record``'s pages (read and verified as they land in the host pool) ``req``'s
    prompt KV, with no model forward (``SparseCoordinatorMode.adopt_host_prompt``). Raises
    HandoffIncomplete (nothing held) when a page cannot be used."""
    mode = runner.mode
    try:
        mode.adopt_host_prompt(req, lambda pages: load_pages(mode.rt.storage, mode.host, record, pages))
    except BaseException:
        runner._abandon([req])
        raise
    req.output.append(record.first_token)


def _take_or_recompute(runner: ModelRunner, req: Request, timeout_s: float, on_missing: str) -> HandoffOutcome:
    mode = runner.mode
    keys = _keys(mode, req.prompt, req.cache_salt)
    try:
        record = wait_for_record(mode.rt.storage, req.prompt, keys, mode.rt.page_size, timeout_s)
        adopt_prompt(runner, req, record)
        return HandoffOutcome(keys.request_key, True, pages=len(record.keys))
    except HandoffError as exc:
        if on_missing == "refuse":
            raise HandoffRefused(f"request {req.rid} refused: {exc}") from exc
        logger.warning("request %d: recomputing its %d-token prompt: %s", req.rid, len(req.prompt), exc)
        runner.prefill(req)
        return HandoffOutcome(keys.request_key, False, reason=str(exc))


@torch.no_grad()
def decode_from_handoff(runner: ModelRunner, prompts: list[list[int]], decode_steps: int,
                        cache_salts: Optional[list[Optional[str]]] = None, timeout_s: float = 30.0,
                        on_missing: str = "recompute") -> DecodeResult:
    """Take each prompt's KV from its hand-off (or recompute / refuse it, ``on_missing``),
    decode ``decode_steps`` greedy steps as one batch, end the requests (their pages go to
    L3) and wait for those writes. ``tokens[r]`` holds the prefill's first token, then one
    per step, as ``ModelRunner.generate`` returns them."""
    mode = _check_mode(runner)
    if on_missing not in ON_MISSING:
        raise ValueError(f"on_missing must be one of {ON_MISSING}, got {on_missing!r}")
    runner.check_prompts(prompts, decode_steps)
    counter = PromptComputeCounter(runner.model, min(len(p) for p in prompts))
    reqs = runner.new_requests(prompts, cache_salts)
    outcomes: list[HandoffOutcome] = []
    try:
        t0 = time.perf_counter()
        for r in reqs:
            outcomes.append(_take_or_recompute(runner, r, timeout_s, on_missing))
        if decode_steps:
            runner.graphs.warm(len(reqs), mode.decode_graph_key(reqs))
        _sync(mode.device)
        t1 = time.perf_counter()
        runner.decode_steps(reqs, decode_steps)
        _sync(mode.device)
        t2 = time.perf_counter()
    except BaseException:
        counter.close()
        runner._abandon(reqs)
        raise
    counter.close()
    stats, memory = mode.stats(), mode.memory()
    for r in reqs:
        mode.end_request(r)
    gen = GenerationResult(mode=runner.rt.mode, tokens=[r.output for r in reqs],
                           prefix_hits=[r.prefix_hit for r in reqs], prefill_s=t1 - t0, decode_s=t2 - t1,
                           decode_steps=decode_steps, batch_size=len(reqs), memory=memory, stats=stats)
    return DecodeResult(gen, outcomes, counter.positions, mode.l3_stats())
