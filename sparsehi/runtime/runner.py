"""Model runner: a batch of requests through prefix match, prefill and greedy decode in
one runtime mode. The mode's KV handling lives in a :class:`RuntimeMode`; the runner only
sequences the model calls and times them.
"""
from __future__ import annotations

import logging
import numbers
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional

import torch

from sparsehi.kernels.table_scatter import table_scatter
from sparsehi.runtime.runtime_mode import Request, RuntimeMode, _sync
from sparsehi.runtime.decode_graph import DecodeGraphRunner, DecodeInputs
from sparsehi.runtime.runtime_config import RuntimeConfig
from sparsehi.runtime.weights import Model

logger = logging.getLogger(__name__)


def _check_salts(cache_salts: Optional[list[Optional[str]]], n: int) -> list[Optional[str]]:
    if cache_salts is None:
        return [None] * n
    if isinstance(cache_salts, str) or not isinstance(cache_salts, (list, tuple)) or len(cache_salts) != n:
        raise ValueError(f"cache_salts must be a list of {n} entries (one per prompt, each a str or None), "
                         f"got {cache_salts!r:.80}")
    for i, s in enumerate(cache_salts):
        if s is not None and not isinstance(s, str):
            raise ValueError(f"cache_salts[{i}] must be a str or None, got {type(s).__name__}")
    return [s or None for s in cache_salts]


def make_mode(model: Model, rt: RuntimeConfig) -> RuntimeMode:
    """The RuntimeMode of ``rt.mode``."""
    from sparsehi.runtime import runtime_mode

    if rt.mode == "dense":
        return runtime_mode.DenseMode(model.cfg, rt)
    if rt.mode in ("sparse-gpu", "sparse-hier"):
        from sparsehi.runtime.sparse_mode import SparseCoordinatorMode

        return SparseCoordinatorMode(model.cfg, rt)
    from sparsehi.runtime.offload_mode import OffloadFullMode

    return OffloadFullMode(model.cfg, rt)


@dataclass
class PendingStep:
    """A decode step issued by ``ModelRunner.launch_decode`` whose tokens are not read yet."""

    reqs: list[Request]
    tokens: torch.Tensor
    """``[B] int64`` on the host, written by an asynchronous copy (complete with ``event``)."""
    event: Optional[Any]
    host_ms: float
    """Host time of the step outside the device's work: issuing it, then (once finished)
    reading its tokens; the wait for the device is not counted."""
    split: dict[str, float]
    """``host_ms`` by part: ``prepare`` (the mode's host part), ``launch`` (inputs,
    replay, read-back start, ``end_decode``), ``after`` (recording the tokens)."""
    feeds_next: bool = False
    """The next step consumed these tokens on the device (their ``Request.consumed`` entries are
    added when they are read)."""
    finished: bool = False


@dataclass
class GenerationResult:
    """What one ``generate`` call produced and measured."""

    mode: str
    tokens: list[list[int]]
    """Generated token ids per request (first from prefill, then one per decode step)."""
    prefix_hits: list[int]
    prefill_s: float
    decode_s: float
    decode_steps: int
    batch_size: int
    memory: dict[str, float]
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_steps * self.batch_size / self.decode_s if self.decode_s > 0 else 0.0


class ModelRunner:
    """Runs ``model`` in one mode; ``self.mode`` (pools, tree, coordinator) persists across
    ``generate`` calls, so a later request can reuse an earlier one's prefix.

    Decode steps run through a :class:`DecodeGraphRunner`: CUDA-graph replays on CUDA
    (``rt.cuda_graph``), the same padded step eagerly otherwise."""

    def __init__(self, model: Model, rt: RuntimeConfig) -> None:
        self.model = model
        self.rt = rt
        if rt.batch_invariant:
            if not hasattr(model, "use_batch_invariant_ops"):
                raise ValueError(f"RuntimeConfig.batch_invariant=True needs a model with use_batch_invariant_ops(); "
                                 f"{type(model).__name__} has none")
            model.use_batch_invariant_ops()
        self.mode = make_mode(model, rt)
        self._next_rid = 0
        if rt.cuda_graph and torch.device(rt.device).type == "cuda" and not rt.uses_cuda_graph:
            logger.info("%s: decode runs eagerly (io_backend='direct' reads indices on the host; "
                        "CUDA graphs need io_backend='kernel')", rt.mode)
        self.graphs = DecodeGraphRunner(self._decode_body, rt.max_num_reqs, self.mode.device,
                                        enabled=rt.uses_cuda_graph)
        self.last_host_ms = 0.0
        self.last_host_split: dict[str, float] = {}
        """``last_host_ms`` by part: the mode's host part, input copy + launch, after the step."""
        """Host time of the last decode step outside the device's work: the host part,
        the input copy and graph launch (or eager launches), and the bookkeeping after the
        tokens came back; the wait for the device is not counted."""

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, attn: Callable) -> torch.Tensor:
        """The model over ``ids`` / ``pos`` ``[T] int64`` with the mode's attention; an MLA
        model computes its indexer only for a mode that reads it (``reads_index_inputs``)."""
        if getattr(getattr(self.model, "cfg", None), "family", None) == "mla":
            return self.model(ids, pos, attn, with_indexer=self.mode.reads_index_inputs)
        return self.model(ids, pos, attn)

    @torch.no_grad()
    def prefill(self, req: Request) -> int:
        """Prefill one request; returns its first generated token."""
        mode = self.mode
        prefix = mode.begin_request(req)
        mode.prefill_slots(req, prefix)
        n = len(req.prompt)
        dev = mode.device
        ids = torch.tensor(req.prompt[prefix:], dtype=torch.int64, device=dev)
        pos = torch.arange(prefix, n, dtype=torch.int64, device=dev)
        hidden = self._forward(ids, pos, mode.prefill_attention(req, prefix))
        mode.end_prefill(req, prefix)
        tok = int(self.model.logits(hidden[-1:]).argmax(-1)[0])
        req.output.append(tok)
        return tok

    @torch.no_grad()
    def _decode_body(self, inputs: DecodeInputs, nb: int, graph_key: Hashable) -> dict:
        """The device part of a decode step over ``nb`` (padded) rows: what a graph holds."""
        rows = inputs.req_pool_indices[:nb]
        seq = inputs.seq_lens[:nb].to(torch.int32)
        tables = self.mode.page_entry_tables()
        if tables is not None:  # the pages this step's rows opened (prepare_decode)
            table_scatter(inputs.page_entries, tables[0], tables[1])
        attn, close = self.mode.decode_device(rows, seq, graph_key)
        hidden = self._forward(inputs.input_ids[:nb], inputs.positions[:nb], attn)
        outputs = close()
        torch.argmax(self.model.logits(hidden), dim=-1, out=inputs.next_tokens[:nb])
        return outputs

    @torch.no_grad()
    def decode_step(self, reqs: list[Request], feed: Optional[list[int]] = None) -> list[int]:
        """One greedy decode step for every request of the batch, waited for. ``feed``
        (teacher forcing) overrides the token each request consumes; its own argmax is
        still recorded."""
        return self.finish_decode(self.launch_decode(reqs, feed))

    @torch.no_grad()
    def launch_decode(self, reqs: list[Request], feed: Optional[list[int]] = None,
                      after: Optional[PendingStep] = None) -> PendingStep:
        """Issue one decode step without waiting for it (SGLang's overlap scheduler): the
        host part (``prepare_decode``, the inputs, the replay, ``end_decode``) runs while
        the device still works on ``after``, the previous step, whose tokens are not read
        yet. With ``after`` and no ``feed`` this step consumes ``after``'s tokens straight
        from the device; that needs the same requests in the same order (otherwise
        ``after`` is finished first). Call ``finish_decode(after)`` next, then this step's."""
        t0 = time.perf_counter()
        mode = self.mode
        on_device = (after is not None and feed is None and not after.finished
                     and [r.rid for r in after.reqs] == [r.rid for r in reqs])
        if after is not None and not after.finished and not on_device and feed is None:
            self.finish_decode(after)  # its tokens are this step's inputs
        last = None
        if not on_device:
            last = [int(t) for t in (feed if feed is not None else [r.output[-1] for r in reqs])]
            for r, t in zip(reqs, last):
                r.consumed.append(t)
        graph_key = mode.prepare_decode(reqs)
        tp = time.perf_counter()
        _, outputs = self.graphs.run(last, [r.seq_len for r in reqs], [r.req_pool_idx for r in reqs],
                                     [r.seq_len + 1 for r in reqs], graph_key, mode.take_page_entries(),
                                     ids_on_device=on_device)
        host, event = self.graphs.read_tokens(len(reqs))
        if on_device:
            after.feeds_next = True
        # lengths and outputs now, in stream order: the next step's replay overwrites them
        mode.end_decode(reqs, outputs)
        t1 = time.perf_counter()
        return PendingStep(list(reqs), host, event, host_ms=1e3 * (t1 - t0),
                           split={"prepare": 1e3 * (tp - t0), "launch": 1e3 * (t1 - tp)})

    @torch.no_grad()
    def decode_steps(self, reqs: list[Request], steps: int, force_tokens: Optional[list[list[int]]] = None,
                     on_step: Optional[Callable[[int, PendingStep], None]] = None) -> None:
        """``steps`` greedy decode steps of the batch ``reqs``, overlapped when
        ``rt.overlap_schedule`` (step ``t + 1`` issued before step ``t`` is read), else each
        waited for. ``force_tokens[r][t]``: the token request ``r`` consumes at step ``t``
        (teacher forcing). ``on_step(t, step)`` runs once step ``t``'s tokens are recorded
        (``step.host_ms``: its host time, ``step.split`` by part)."""
        def close(step: PendingStep, t: int) -> None:
            if not step.finished:  # launch_decode finishes its ``after`` itself when it must
                self.finish_decode(step)
            if on_step:
                on_step(t, step)

        pending: Optional[PendingStep] = None
        for t in range(steps):
            feed = None if force_tokens is None else [f[t] for f in force_tokens]
            step = self.launch_decode(reqs, feed, after=pending)
            if pending is not None:
                close(pending, t - 1)
            pending = step
            if not self.rt.overlap_schedule:
                close(pending, t)
                pending = None
        if pending is not None:
            close(pending, steps - 1)

    def finish_decode(self, pending: PendingStep) -> list[int]:
        """Wait for a launched step's tokens and record them (``Request.output``; the
        inputs of the step launched after it too when it consumed them on the device)."""
        if pending.finished:
            raise ValueError("finish_decode: this step was already finished")
        if pending.event is not None:
            pending.event.synchronize()
        t2 = time.perf_counter()
        toks = pending.tokens.tolist()
        pending.finished = True
        for r, t in zip(pending.reqs, toks):
            r.output.append(t)
            if pending.feeds_next:
                r.consumed.append(t)
        pending.split["after"] = 1e3 * (time.perf_counter() - t2)
        pending.host_ms += pending.split["after"]
        self.last_host_ms = pending.host_ms
        self.last_host_split = dict(pending.split)
        return toks

    def check_prompts(self, prompts: Any, decode_steps: int = 0) -> None:
        """ValueError unless ``prompts`` is a list of at most ``max_num_reqs`` non-empty
        token lists, each id an int in ``[0, vocab_size)``, each prompt leaving room for
        ``decode_steps`` more tokens within ``max_context_len``. Nothing is allocated."""
        rt, vocab = self.rt, self.model.cfg.vocab_size
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"prompts must be a non-empty list of token id lists, got {type(prompts).__name__}")
        if len(prompts) > rt.max_num_reqs:
            raise ValueError(f"{len(prompts)} prompts exceed max_num_reqs={rt.max_num_reqs} (requests decoded together)")
        room = rt.max_context_len - max(decode_steps, 1)
        for i, p in enumerate(prompts):
            if isinstance(p, (str, bytes)) or not isinstance(p, (list, tuple)) or not p:
                raise ValueError(f"prompts[{i}] must be a non-empty list of token ids, got {p!r:.60}")
            bad = next((t for t in p if not isinstance(t, numbers.Integral) or isinstance(t, bool)
                        or not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"prompts[{i}] holds token id {bad!r}: ids are ints in [0, vocab_size={vocab})")
            if len(p) > room:
                raise ValueError(f"prompts[{i}] has {len(p)} tokens: with decode_steps={decode_steps} it must have at "
                                 f"most max_context_len={rt.max_context_len} - {max(decode_steps, 1)} = {room}")

    def _abandon(self, reqs: list[Request]) -> None:
        """After a failed ``generate``: end the requests that took a row, so the runner can
        take new ones (their KV is dropped). A failure here is logged: the first error is
        the one the caller sees."""
        for r in reqs:
            if r.req_pool_idx < 0:
                continue
            r.aborted = True
            try:
                self.mode.end_request(r)
            except Exception:  # pragma: no cover - depends on where the first error struck
                logger.exception("could not release request %d after a failed generate", r.rid)

    def new_requests(self, prompts: list[list[int]],
                     cache_salts: Optional[list[Optional[str]]] = None) -> list[Request]:
        """Requests for ``prompts``; ``cache_salts`` (one per prompt, None entries allowed)
        isolates their cached KV by tenant (see ``Request.cache_salt``)."""
        salts = _check_salts(cache_salts, len(prompts))
        out = []
        for p, s in zip(prompts, salts):
            out.append(Request(rid=self._next_rid, prompt=list(p), cache_salt=s))
            self._next_rid += 1
        return out

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], decode_steps: int,
                 progress: Optional[Callable[[str, int], None]] = None,
                 force_tokens: Optional[list[list[int]]] = None,
                 cache_salts: Optional[list[Optional[str]]] = None) -> GenerationResult:
        """Prefill every prompt (one at a time), then ``decode_steps`` batched greedy
        steps; requests end afterwards. ``progress(phase, n)`` is called per unit done.

        force_tokens: per request, the tokens to consume at decode steps ``0..n-1``
        (teacher forcing with another run's output, ``tokens[r][t]`` is then this run's
        prediction given the *forced* context); None = free-running greedy decode.

        cache_salts: per request, its cache salt (``Request.cache_salt``); None = unsalted."""
        if not isinstance(decode_steps, int) or isinstance(decode_steps, bool) or decode_steps < 0:
            raise ValueError(f"decode_steps must be an int >= 0, got {decode_steps!r}")
        self.check_prompts(prompts, decode_steps)
        if force_tokens is not None and (len(force_tokens) != len(prompts)
                                         or any(len(f) < decode_steps for f in force_tokens)):
            raise ValueError("force_tokens must hold >= decode_steps tokens for every prompt")
        mode = self.mode
        reqs = self.new_requests(prompts, cache_salts)
        try:
            _sync(mode.device)
            t0 = time.perf_counter()
            for r in reqs:
                self.prefill(r)
                if progress:
                    progress("prefill", 1)
            if decode_steps:
                self.graphs.warm(len(reqs), mode.decode_graph_key(reqs))  # capture outside the timed steps
            _sync(mode.device)
            t1 = time.perf_counter()
            self.decode_steps(reqs, decode_steps, force_tokens,
                              on_step=(lambda t, _pending: progress("decode", 1)) if progress else None)
        except BaseException:
            _sync(mode.device)  # a launched step may still run: it must not outlive its requests
            self._abandon(reqs)
            raise
        _sync(mode.device)
        t2 = time.perf_counter()
        stats = mode.stats()
        memory = mode.memory()
        for r in reqs:
            mode.end_request(r)
        return GenerationResult(
            mode=self.rt.mode, tokens=[r.output for r in reqs], prefix_hits=[r.prefix_hit for r in reqs],
            prefill_s=t1 - t0, decode_s=t2 - t1, decode_steps=decode_steps, batch_size=len(reqs),
            memory=memory, stats=stats,
        )
