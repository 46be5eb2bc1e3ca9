"""SGLang 0.5.23's scheduler over the plugin's host-backed KV memory (CPU).

SGLang's own scheduling and memory classes run here as its scheduler runs them: requests
are ``Req`` objects, admitted by its ``PrefillAdder`` (over the plugin's allocator's prefill
budget and the plugin's hook on ``_request_slot_reserve_for_req``), batched and allocated by
``ScheduleBatch`` (``prepare_for_extend`` / ``prepare_for_decode``: SGLang's
``alloc_for_extend`` / ``alloc_for_decode`` over the host-backed allocator), cached in the
default tree of 0.5.23 (``UnifiedRadixCache``, made by ``registry.create_tree_cache``),
checkpointed and released by ``mem_cache.common``'s ``checkpoint_kv_cache`` /
``release_kv_cache`` inside the allocator's free groups as ``process_batch_result_*`` does,
retracted by ``ScheduleBatch.retract_decode``, aborted as ``abort_request`` /
``process_pending_chunked_abort`` do. ``Server`` is the scheduler's non-overlap event loop
in miniature (``get_next_batch_to_run`` -> forward -> result processing) with those calls
in SGLang's order (SGLang's ``Scheduler`` itself needs its server stack, not installed
here; the plugin's hooks on its methods wrap the loop's methods of the same names); the
forward is the kit's ``World`` (SGLang's pools, translator, ``RadixAttention`` and CPU
backend, the plugin's model-runner hooks).

The "model" (``Model``) gives every token q/k/v that depend on the token sequence up to it
(identical prefixes have identical KV, a re-prefill recomputes what a decode wrote) and a
greedy next token. Outputs are checked against SGLang alone (a ``World(None)`` prefill of
the same sequence) for what SGLang's attention computes, and against the runtime's
``sparse-hier`` decode (``ReferenceHier``) for sparse decode steps. After every step the
slot bookkeeping is audited: SGLang's free list, the tree's values and each request's own
slots partition the virtual slots exactly (no leak, no double free, no slot free or shared
while a request owns it), and the GPU residency's invariants hold.
"""
from __future__ import annotations

import zlib
from array import array
from dataclasses import dataclass
from types import MethodType, SimpleNamespace
from typing import Optional

import pytest

pytest.importorskip("sglang.srt.plugins", reason="SGLang is not installed (run scripts/setup_sglang_env.sh)")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from sglang.srt.disaggregation.utils import prepare_abort  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req, ScheduleBatch  # noqa: E402
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder  # noqa: E402
from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker  # noqa: E402
from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry, HookType, _wrap_fn  # noqa: E402
from sglang.srt.runtime_context import get_context, get_server_args  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from sgl_kit import HKV, HQ, D, L, ReferenceHier, World, sparse_config  # noqa: E402

VOCAB = 1000
TOL = dict(rtol=1e-5, atol=1e-5)
SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
SCHEDULER_METHODS = ("get_next_batch_to_run", "get_new_batch_prefill", "update_running_batch",
                     "process_batch_result_prefill", "process_batch_result_decode")


@pytest.fixture(autouse=True)
def sglang_server_args():
    """SGLang's runtime context published as its scheduler process has it (its own test
    facility: a dummy ``ServerArgs`` with these fields), restored after the test."""
    override = get_context().override_server_args(device="cpu", attention_backend="torch_native")
    override.install()
    yield
    override.restore()


# ---------------------------------------------------------------------------------- model
class Model:
    """q/k/v of a token (per layer) as a function of the token sequence up to it; the next
    token greedy from the sequence."""

    def __init__(self) -> None:
        self._rows: dict[int, torch.Tensor] = {}

    @staticmethod
    def _hash(ids, upto: int, start: int = 0, h: int = 0) -> int:
        return zlib.crc32(array("q", ids[start:upto]).tobytes(), h)

    def rows(self, ids, start: int, end: int) -> torch.Tensor:
        """``[end - start, L, HQ*D + 2*HKV*D]``: positions ``[start, end)`` of ``ids``."""
        h = self._hash(ids, start)
        out = []
        for p in range(start, end):
            h = self._hash(ids, p + 1, p, h)
            row = self._rows.get(h)
            if row is None:
                gen = torch.Generator().manual_seed(h)
                row = self._rows[h] = torch.randn(L, HQ * D + 2 * HKV * D, generator=gen)
            out.append(row)
        return torch.stack(out) if out else torch.zeros(0, L, HQ * D + 2 * HKV * D)

    def qkv(self, spans) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per layer (q, k, v) of the tokens of ``spans`` (``(ids, start, end)``) in order."""
        x = torch.cat([self.rows(ids, s, e) for ids, s, e in spans])
        return [(x[:, i, :HQ * D].contiguous(), x[:, i, HQ * D:HQ * D + HKV * D].contiguous(),
                 x[:, i, HQ * D + HKV * D:].contiguous()) for i in range(L)]

    def kv(self, ids, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer k / v ``[n, HKV*D]`` of the first ``n`` tokens of ``ids``."""
        layers = self.qkv([(ids, 0, n)])
        return [k for _, k, _ in layers], [v for _, _, v in layers]

    def next_token(self, ids) -> int:
        return 10 + self._hash(ids, len(ids)) % (VOCAB - 10)


def prompt(seed: int, n: int) -> list[int]:
    g = np.random.default_rng(seed)
    return [int(x) for x in g.integers(10, VOCAB, size=n)]


# ---------------------------------------------------------------------------------- server
@dataclass
class Span:
    rid: str
    ids: list[int]  # the request's tokens up to `end`
    start: int
    end: int
    row: int
    sparse: bool  # decode: decoded on the plugin's sparse path
    prefix_resident: bool  # extend: its cached prefix was on the GPU for the forward
    retractions: int = 0  # the request's retractions before this step


@dataclass
class Step:
    mode: str  # "extend" / "decode"
    spans: list[Span]
    qkv: list
    out: list


class Server:
    """SGLang's scheduler loop (non-overlap, one rank) in miniature, over its own classes;
    see the module docstring. Its methods carry the names of the ``Scheduler`` methods they
    stand for; the hooks the plugin registers on those (``load_plugins()`` cannot apply them
    here: SGLang's scheduler module needs its server stack) wrap them as SGLang's
    ``HookRegistry`` wraps the Scheduler's. ``free_groups``: result processing frees inside
    the allocator's free groups, as SGLang does (off: each free at once)."""

    def __init__(self, cfg, *, pool_tokens: int = 512, max_reqs: int = 4, sgl_page: int = 1,
                 chunk: Optional[int] = None, free_groups: bool = True, max_prefill_tokens: int = 16384) -> None:
        self.world = World(cfg, pool_tokens=pool_tokens, max_reqs=max_reqs, sgl_page=sgl_page)
        w = self.world
        self.req_to_token_pool = w.req_pool
        self.token_to_kv_pool_allocator = self.alloc = w.alloc  # read after the plugin installed its own
        self.page_size = w.sgl_page
        params = CacheInitParams(disable=False, req_to_token_pool=w.req_pool, token_to_kv_pool_allocator=w.alloc,
                                 page_size=self.page_size)
        ctx = TreeCacheBuildContext(server_args=get_server_args(), params=params, is_hybrid_swa=False,
                                    is_hybrid_ssm=False, enable_hierarchical_cache=False, disable_radix_cache=False,
                                    tp_worker=None, model_config=None, tp_size=1, tp_rank=0, tp_group=None)
        self.tree_cache = self.tree = create_tree_cache(ctx)  # SGLang's default selection chain
        assert isinstance(self.tree, UnifiedRadixCache)
        self.model_config = SimpleNamespace(vocab_size=VOCAB, is_encoder_decoder=False)
        self.model = Model()
        self.chunked_prefill_size = chunk
        self.free_groups = free_groups
        self.max_prefill_tokens = max_prefill_tokens
        self.new_token_ratio_tracker = NewTokenRatioTracker.from_config()
        self.waiting_queue: list[Req] = []
        self.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
        self.chunked_req: Optional[Req] = None
        self.last_batch: Optional[ScheduleBatch] = None
        self.pending_abort: Optional[Req] = None
        self.retract_next = False
        self.reqs: dict[str, Req] = {}
        self.steps: list[Step] = []
        self.refused = 0  # candidates refused for memory (AddReqResult.NO_TOKEN)
        self.retracted: list[str] = []
        self.max_sparse_running = 0  # most registered (sparse) rows in one decode step
        self.max_running = 0  # most rows in one decode step
        self.max_context_over_gpu = 0.0  # most context tokens decoded in one step / GPU tokens of SGLang's kernels
        for name in SCHEDULER_METHODS:
            fn = getattr(type(self), name)
            hooks_ = sorted(HookRegistry._hooks.get(f"{SCHEDULER}.{name}", []),
                            key=lambda h: 0 if h[0] == HookType.REPLACE else 1)
            for hook_type, hook, _ in hooks_:
                fn = _wrap_fn(fn, hook, hook_type)
            setattr(self, name, MethodType(fn, self))

    # -------------------------------------------------------------- requests
    def submit(self, rid: str, ids: list[int], max_new: int = 4, cache_salt: Optional[str] = None) -> Req:
        sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
        sp.verify(VOCAB)
        sp.normalize(None)  # what the tokenizer manager does before the scheduler sees it
        # the scheduler hands a request's cache_salt (GenerateReqInput.cache_salt) to its Req
        req = Req(rid, "", array("q", ids), sp, vocab_size=VOCAB, cache_salt=cache_salt)
        self.reqs[rid] = req
        self.waiting_queue.append(req)
        return req

    def abort(self, rid: str) -> None:
        """A client abort (``Scheduler.abort_request``): of the request being chunk-prefilled,
        deferred to the top of the next scheduling step (``process_pending_chunked_abort``);
        of a running one, ``to_finish`` (its next result finishes and releases it)."""
        req = self.reqs[rid]
        if req is self.chunked_req:
            self.pending_abort = req
        else:
            assert any(r is req for r in self.running_batch.reqs)
            req.to_finish = FINISH_ABORT()

    @property
    def bridge(self):
        return self.world.bridge

    # -------------------------------------------------------------- the loop
    def step(self) -> Optional[Step]:
        """One turn of SGLang's ``event_loop_normal``."""
        batch = self.get_next_batch_to_run()
        if batch is None:
            self.new_token_ratio_tracker.reset()  # self_check_during_idle
            return None
        step = self._forward(batch)
        if batch.forward_mode.is_extend():
            self.process_batch_result_prefill(batch)
        else:
            self.process_batch_result_decode(batch)
        self.last_batch = batch
        self.steps.append(step)
        self.audit()
        return step

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if self.step() is None:
                return
        raise AssertionError("the server did not go idle")

    def get_next_batch_to_run(self) -> Optional[ScheduleBatch]:
        if self.pending_abort is not None:
            self.process_pending_chunked_abort()
        exclude = []
        if self.chunked_req is not None:
            exclude.append(self.chunked_req)
            if self.chunked_req.extend_end > self.chunked_req.prefix_len:
                checkpoint_kv_cache(self.chunked_req, self.tree)  # stash_chunked_request
        last, running = self.last_batch, self.running_batch
        if last is not None and last.forward_mode.is_extend():
            if last.chunked_req is not None:
                exclude.append(last.chunked_req)
            last_bs = last.batch_size()
            last.filter_batch(reqs_to_exclude=exclude)
            if last.batch_size() < last_bs:
                running.batch_is_full = False
            if not last.is_empty() and last is not running:
                if running.is_empty():
                    running = self.running_batch = last
                else:
                    running.merge_batch(last)
        running_bs = running.batch_size()
        running.filter_batch()
        if running.batch_size() < running_bs:
            running.batch_is_full = False
        new = self.get_new_batch_prefill(running)
        if new is not None:
            return new
        if not running.is_empty():
            return self.update_running_batch(running)
        return None

    def get_new_batch_prefill(self, running_batch: ScheduleBatch) -> Optional[ScheduleBatch]:
        # (with _get_new_batch_prefill_raw)
        running = running_batch
        if running.is_empty():
            running.batch_is_full = False
        if (running.batch_is_full or not self.waiting_queue) and self.chunked_req is None:
            return None
        pool = self.req_to_token_pool
        if pool.available_size() <= 0 and self.chunked_req is None:  # get_num_allocatable_reqs
            running.batch_is_full = True
            return None
        adder = PrefillAdder(self.page_size, self.tree, self.alloc, running, self.new_token_ratio_tracker.current,
                             self.max_prefill_tokens, self.chunked_prefill_size, 0, 0, max_prefill_bs=0,
                             max_running_requests=self.world.max_reqs, waiting_queue_len=len(self.waiting_queue))
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for req in list(self.waiting_queue):
            if adder.budget_state() == AddReqResult.OTHER:
                break
            held = sum(r.kv.holds_kv for r in adder.can_run_list)
            if len(adder.can_run_list) >= pool.available_size() + held:
                running.batch_is_full = True
            if running.batch_is_full:
                break
            req.init_next_round_input(self.tree)
            res = adder.add_one_req(req, has_chunked_req=self.chunked_req is not None, truncation_align_size=None)
            if res != AddReqResult.CONTINUE:
                if res == AddReqResult.NO_TOKEN:
                    self.refused += int(not (adder.can_run_list and req is adder.can_run_list[-1]))
                    running.batch_is_full = len(adder.can_run_list) > 0 or not running.is_empty()
                break
        can_run = adder.can_run_list
        if not can_run:
            return None
        admitted = set(map(id, can_run))
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.inflight_middle_chunks += 1
        batch = ScheduleBatch.init_new(can_run, pool, self.alloc, self.tree, self.model_config, False,
                                       SpeculativeAlgorithm.NONE, chunked_req=self.chunked_req)
        batch.prepare_for_extend()
        batch.decoding_reqs = None
        return batch

    def update_running_batch(self, batch: ScheduleBatch) -> Optional[ScheduleBatch]:
        initial_bs = batch.batch_size()
        if not batch.check_decode_mem() or self.retract_next:  # (SGLang's TEST_RETRACT forces it too)
            self.retract_next = False
            retracted, ratio, aborted = batch.retract_decode()
            assert not aborted
            self.new_token_ratio_tracker.current = ratio
            self.retracted += [r.rid for r in retracted]
            self.waiting_queue += retracted  # _add_request_to_queue(is_retracted=True)
        else:
            self.new_token_ratio_tracker.decay_step()
        if batch.batch_size() < initial_bs:
            batch.batch_is_full = False
        if batch.is_empty():
            return None
        batch.prepare_for_decode()
        return batch

    def process_pending_chunked_abort(self) -> None:
        req = self.pending_abort
        prepare_abort(req, "Aborted")
        release_kv_cache(req, self.tree, checkpoint=False)
        self.chunked_req = None
        self.pending_abort = None

    # -------------------------------------------------------------- forward
    def _forward(self, batch: ScheduleBatch) -> Step:
        fb = self.world.forward_batch(batch)
        decode = batch.forward_mode.is_decode()
        spans = []
        for i, req in enumerate(batch.reqs):
            ids = list(req.origin_input_ids) + list(req.output_ids)
            end = int(batch.seq_lens_cpu[i])
            start = end - 1 if decode else int(batch.prefix_lens[i])
            spans.append(Span(req.rid, ids[:end], start, end, int(batch.req_pool_indices_cpu[i]), False, False,
                              req.retraction_count))
        layers = self.model.qkv([(s.ids, s.start, s.end) for s in spans])
        out = self.world.run(fb, layers, hooked=self.bridge is not None)
        b, rtt = self.bridge, self.world.req_pool.req_to_token
        if decode:
            self.max_running = max(self.max_running, len(spans))
        if b is None:
            return Step("decode" if decode else "extend", spans, layers, out)
        for s in spans:
            if decode:
                s.sparse = bool(b.registered[s.row])
            elif s.start:
                vids = rtt[s.row, :s.start].long()
                s.prefix_resident = bool((b.residency.physical_slots(vids, self.page_size) >= 0).all())
        if decode:
            self.max_sparse_running = max(self.max_sparse_running, int(b.registered.sum()))
            # tokens of context the running requests hold against the GPU tokens SGLang's kernels have
            context = sum(s.end for s in spans)
            self.max_context_over_gpu = max(self.max_context_over_gpu, context / (b.physical_pages * self.page_size))
        return Step("decode" if decode else "extend", spans, layers, out)

    # -------------------------------------------------------------- result processing
    def _group(self, begin: bool) -> None:
        if self.free_groups:
            (self.alloc.free_group_begin if begin else self.alloc.free_group_end)()

    def process_batch_result_prefill(self, batch: ScheduleBatch) -> None:
        self._group(True)
        for req in batch.reqs:
            if req.finished() or req.is_retracted:
                continue
            if req.inflight_middle_chunks <= 0:
                req.output_ids.append(self.model.next_token(list(req.origin_input_ids) + list(req.output_ids)))
                req.update_finish_state()
                if req.finished():
                    release_kv_cache(req, self.tree, checkpoint=True)
                else:
                    checkpoint_kv_cache(req, self.tree)
            else:
                req.inflight_middle_chunks -= 1
        self._group(False)

    def process_batch_result_decode(self, batch: ScheduleBatch) -> None:
        self._group(True)
        for req in batch.reqs:
            req.output_ids.append(self.model.next_token(list(req.origin_input_ids) + list(req.output_ids)))
            req.update_finish_state(1)
            if req.finished():
                release_kv_cache(req, self.tree, checkpoint=True)
        self._group(False)

    # -------------------------------------------------------------- checks
    def free_pages(self) -> list[int]:
        """SGLang's free list (pages; slots at page size 1)."""
        a = self.alloc
        if self.page_size == 1:
            return torch.cat([a.free_pages, a.release_pages]).tolist()
        return a.get_all_free_pages().tolist()

    def audit(self) -> None:
        """SGLang's free list, the tree's values and the requests' own slots partition the
        virtual pages exactly (no leak, no double free, nothing free or shared that a request
        owns); every request's tree-owned prefix is the tree's; the residency's invariants."""
        ps = self.page_size
        free = self.free_pages()
        assert len(set(free)) == len(free), "a page is on the free list twice (double free)"
        values = self.tree.all_values_flatten()
        tree = sorted(set((values // ps).tolist()))
        assert len(values) == len(tree) * ps, "the tree holds a slot twice"
        owned: list[int] = []
        rtt = self.world.req_pool.req_to_token
        for req in self.reqs.values():
            if not req.kv.holds_kv:
                continue
            row, protected, allocated = req.kv.req_pool_idx, req.kv.cache_protected_len, req.kv.kv_allocated_len
            assert set(rtt[row, :protected].tolist()) <= set(values.tolist()), \
                f"{req.rid}: its protected prefix is not the tree's"
            owned += sorted(set((rtt[row, protected:allocated].long() // ps).tolist()))
        assert len(set(owned)) == len(owned), "two requests own one page"
        for name, other in (("free", free), ("the tree's", tree)):
            both = set(owned) & set(other)
            assert not both, f"pages owned by a running request are {name}: {sorted(both)[:8]}"
        assert not set(free) & set(tree), "pages both free and in the tree"
        pages = self.alloc.size // ps
        assert len(free) + len(tree) + len(owned) == pages, \
            f"{len(free)} free + {len(tree)} cached + {len(owned)} owned != {pages} pages (leak)"
        if self.bridge is not None:
            assert self.alloc.size == self.bridge.virtual_tokens
            self.bridge.residency.check()

    def assert_idle(self) -> None:
        """SGLang's idle check (``SchedulerInvariantChecker``'s full-pool conservation, the
        request rows all free), and no GPU page held."""
        leak, msg = SchedulerInvariantChecker._check_pool_invariant(
            "full", self.alloc.available_size(), self.tree.evictable_size(), self.tree.protected_size(), 0,
            self.world.runner.max_total_num_tokens)
        assert not leak, msg
        assert self.tree.protected_size() == 0
        assert self.world.req_pool.available_size() == self.world.max_reqs
        b = self.bridge
        assert b.residency.counts() == {"free": b.physical_pages, "resident": 0, "pinned": 0}
        assert not b.registered.any() and (b.pinned_len == 0).all() and len(b.free_slots) == b.max_sparse
        self.audit()

    def cached_slots(self, ids, cache_salt: Optional[str] = None) -> torch.Tensor:
        """The virtual slots the tree's own ``match_prefix`` gives for ``ids`` (under ``cache_salt``)."""
        res = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids), cache_salt=cache_salt)))
        return self.tree.path_device_indices(res.last_device_node)[:res.device_prefix_len]


# ---------------------------------------------------------------------------------- oracles
class Oracle:
    """What each step's outputs must be: SGLang alone (``World(None)``, a prefill of the
    sequence up to the span's end) for extend spans and dense decode rows; the runtime's
    sparse-hier decode (``ReferenceHier``, prefilled with the prompt at the request's
    registration) for sparse decode rows."""

    def __init__(self, cfg, model: Model) -> None:
        self.cfg, self.model = cfg, model
        self.plain = World(None, pool_tokens=1024)
        self.ref = ReferenceHier(cfg, max_reqs=16)
        self.ref_slot: dict[tuple[str, int], int] = {}
        self.checked = {"extend": 0, "dense": 0, "sparse": 0}

    def sglang(self, ids, start: int, end: int) -> list[torch.Tensor]:
        w = self.plain
        out = w.run(w.extend([1], [end]), self.model.qkv([(ids, 0, end)]), hooked=False)
        w.finish(1)
        return [o[start:end] for o in out]

    def check(self, server: Server) -> None:
        """Every step the server ran since the last check."""
        for step in server.steps:
            sparse = self._sparse(step) if step.mode == "decode" else {}
            at = 0
            for s in step.spans:
                n = s.end - s.start
                got = [o[at:at + n] for o in step.out]
                if s.rid in sparse:
                    want = sparse[s.rid]
                    self.checked["sparse"] += 1
                else:
                    want = self.sglang(s.ids, s.start, s.end)
                    self.checked["dense" if step.mode == "decode" else "extend"] += 1
                for i in range(L):
                    torch.testing.assert_close(got[i], want[i], **TOL, msg=lambda m: f"{step.mode} {s.rid} "
                                               f"[{s.start}, {s.end}) layer {i}: {m}")
                at += n
        server.steps.clear()

    def _sparse(self, step: Step) -> dict[str, list[torch.Tensor]]:
        """The sparse-hier decode of a step's sparse rows (one batch, as the plugin's)."""
        at, slots, picks = 0, [], []
        for s in step.spans:
            if s.sparse:
                key = (s.rid, s.retractions)
                slot = self.ref_slot.get(key)
                if slot is None:  # registered at this step: its prompt is what precedes the new token
                    slot = self.ref_slot[key] = len(self.ref_slot)
                    k, v = self.model.kv(s.ids, s.start)
                    self.ref.prefill(slot, k, v)
                assert self.ref.seq[slot] == s.start, (s.rid, self.ref.seq[slot], s.start)
                slots.append(slot)
                picks.append(at)
            at += s.end - s.start
        if not slots:
            return {}
        idx = torch.tensor(picks)
        out = self.ref.decode(slots, [(q[idx], k[idx], v[idx]) for q, k, v in step.qkv])
        rids = [s.rid for s in step.spans if s.sparse]
        return {rid: [o[j:j + 1] for o in out] for j, rid in enumerate(rids)}


# ---------------------------------------------------------------------------------- tests
def test_finished_request_leaves_the_tree_host_backed_and_a_prefix_hit_is_prefilled_over_it():
    """A long request is prefilled (checkpointed into the tree after its prefill), decodes
    sparsely, finishes (released with a checkpoint): the server is idle by SGLang's own
    check, no GPU page is held, the tree's slots hold the request's KV in the host pool. A
    later request matching its prefix through the tree is prefilled over it (the prefix
    brought back to the GPU; SGLang's attention equals SGLang alone) and decodes sparsely
    as the runtime's sparse-hier decode."""
    cfg = sparse_config()
    srv = Server(cfg)
    oracle = Oracle(cfg, srv.model)
    a_ids = prompt(1, 60)
    a = srv.submit("a", a_ids, max_new=6)
    srv.step()  # prefill
    assert a.kv.cache_protected_len == 60 and srv.tree.protected_size() == 60  # checkpointed after its prefill
    srv.run()
    assert a.finished() and not srv.waiting_queue and len(srv.steps) == 6
    assert [s.spans[0].sparse for s in srv.steps[1:]] == [True] * 5
    oracle.check(srv)
    srv.assert_idle()
    # the tree keeps every token with KV (prompt + all outputs but the last); its slots
    # hold that KV in the host pool, and no GPU page holds any of it
    seq = list(a.origin_input_ids) + list(a.output_ids)
    slots = srv.cached_slots(seq)
    assert len(slots) == 65 and srv.tree.evictable_size() == 65
    assert sorted(slots.tolist()) == sorted(srv.tree.all_values_flatten().tolist())
    k_all, _ = srv.model.kv(seq, 65)
    host = srv.bridge.host_pool
    for i in range(L):
        torch.testing.assert_close(host.read_tokens(i, slots)[0], k_all[i].view(65, HKV, D), rtol=0, atol=0)
    assert (srv.bridge.residency.v2p[slots] == 0).all()
    # a later request over its first 48 tokens
    b_ids = a_ids[:48] + prompt(2, 20)
    b = srv.submit("b", b_ids, max_new=5)
    step = srv.step()
    assert step.mode == "extend" and (step.spans[0].start, step.spans[0].end) == (48, 68)
    assert b.cached_tokens == 48 and step.spans[0].prefix_resident
    srv.run()
    assert b.finished() and all(s.spans[0].sparse for s in srv.steps[1:])
    oracle.check(srv)
    assert oracle.checked == {"extend": 2, "dense": 0, "sparse": 9}
    srv.assert_idle()


def test_admission_follows_gpu_memory_and_runs_more_sparse_requests_than_sglangs_pool_holds():
    """A GPU pool of 512 tokens (most of it the sparse buffers) with 4x host memory: SGLang's
    PrefillAdder admits long prompts by the free GPU tokens (refusing, never failing an
    allocation, while a prefill would not fit), and as each registered prompt leaves the
    GPU it admits the next, until more sparse requests decode at once than SGLang's own
    pool of the same 512 tokens holds (the same server without the plugin, measured)."""
    # (the running sparse requests' decode headroom is not charged in GPU tokens: their new
    # tokens need one GPU page at a time; the host's count of free GPU pages learns of a
    # registration's freed pages a forward or two later, which only delays the next admission)
    n_req, plen, max_new = 7, 100, 24
    cfg = sparse_config(max_sparse_requests=6, host_to_device_ratio=4.0)
    srv = Server(cfg, pool_tokens=512, max_reqs=n_req)
    gpu_tokens = srv.bridge.physical_pages
    assert plen < gpu_tokens < 2 * plen  # one prompt's prefill at a time fits the GPU
    plain = Server(None, pool_tokens=512, max_reqs=n_req)
    for s in (srv, plain):
        for i in range(n_req):
            s.submit(f"r{i}", prompt(100 + i, plen), max_new=max_new)
        s.run(max_steps=400)
        assert all(r.finished() for r in s.reqs.values())
    assert plain.max_running * (plen + max_new) <= 512  # SGLang's pool holds this many
    assert srv.max_sparse_running == 6 > plain.max_running
    assert srv.max_context_over_gpu > 3  # the running requests' context is several times the GPU's
    assert srv.refused > 0 and not srv.retracted
    oracle = Oracle(cfg, srv.model)
    oracle.check(srv)
    srv.assert_idle()


def _row(srv: Server, rid: str, n: int) -> list[int]:
    req = srv.reqs[rid]
    return srv.world.req_pool.req_to_token[req.kv.req_pool_idx, :n].tolist()


@pytest.mark.parametrize("sgl_page", [1, 4])
def test_identical_prompts_prefilled_together_are_deduplicated_at_checkpoint(sgl_page):
    """Three requests with the same prompt are prefilled in one batch (all computed before
    any is checkpointed): the later checkpoints rewrite their rows to the first's slots and
    free their duplicates, which a fourth request then reuses (SGLang's paged allocator
    hands freed pages out first). Two decode sparsely (as the runtime's sparse-hier decode),
    the third on SGLang's path (no sparse slot left) — over the first's pages, which must
    stay on the GPU for it after the sparse ones register and let go of their prompts (as
    SGLang alone computes it). The fourth's writes change nothing of theirs; nothing leaks."""
    cfg = sparse_config(max_sparse_requests=2)
    srv = Server(cfg, sgl_page=sgl_page)
    oracle = Oracle(cfg, srv.model)
    same = prompt(3, 60)
    reqs = [srv.submit(rid, same, max_new=6) for rid in ("a", "b", "e")]
    step = srv.step()
    assert [s.rid for s in step.spans] == ["a", "b", "e"]
    assert _row(srv, "b", 60) == _row(srv, "a", 60) == _row(srv, "e", 60)  # the tree's (a's) slots
    assert all(r.kv.cache_protected_len == 60 for r in reqs) and srv.tree.protected_size() == 60
    freed = set(srv.free_pages())
    srv.submit("c", prompt(4, 60), max_new=6)
    for _ in range(4):  # admitted once the host's count of free GPU pages holds the freed duplicates
        step = srv.step()
        if step.mode == "extend":
            break
    assert [s.rid for s in step.spans] == ["c"]
    c_pages = {v // sgl_page for v in _row(srv, "c", 60)}
    if sgl_page > 1:
        assert c_pages & freed  # (with the free list's order) c got pages the duplicates freed
    srv.run()
    assert all(r.finished() for r in srv.reqs.values())
    decoded = {(sp.rid, sp.sparse) for st in srv.steps for sp in st.spans if st.mode == "decode"}
    assert decoded == {("a", True), ("b", True), ("e", False), ("c", False)}
    oracle.check(srv)
    assert oracle.checked == {"extend": 4, "dense": 10, "sparse": 10}
    srv.assert_idle()


def test_identical_short_prompts_on_a_small_gpu_are_deduplicated_and_decode_as_sglang():
    """The dense variant on a small GPU (its free pages fewer than a prompt after two
    prefills): two short identical prompts decoded on SGLang's own path; the second's
    checkpoint moves its pins to the first's slots without new GPU pages; both decode as
    SGLang alone; a third short request reuses what was freed; nothing leaks."""
    cfg = sparse_config(max_sparse_requests=1)
    srv = Server(cfg, pool_tokens=160)
    gpu = srv.bridge.physical_pages
    plen = 36
    assert 2 * plen < gpu < 3 * plen
    oracle = Oracle(cfg, srv.model)
    same = prompt(5, plen)
    srv.submit("a", same, max_new=3)
    srv.submit("b", same, max_new=6)  # decodes on over a's pages after a is gone
    step = srv.step()
    assert [s.rid for s in step.spans] == ["a", "b"]
    assert _row(srv, "b", plen) == _row(srv, "a", plen)
    assert srv.bridge.residency.counts()["resident"] == plen  # the duplicates left the GPU with their slots
    srv.submit("c", prompt(6, plen), max_new=4)
    srv.run()
    assert all(r.finished() for r in srv.reqs.values())
    assert not any(sp.sparse for st in srv.steps for sp in st.spans)
    oracle.check(srv)
    assert oracle.checked == {"extend": 3, "dense": 10, "sparse": 0}
    srv.assert_idle()


def test_a_sparse_requests_newest_page_deduplicated_at_release_keeps_other_pins():
    """A sparse request whose whole sequence is already cached (an earlier request with the
    same prompt and output) is released with a checkpoint: its newest token's page, the
    one page it pins, is rewritten to the tree's copy — which a request decoding on
    SGLang's path (its context a prefix hit on that copy) has on the GPU. Releasing the
    sparse request must leave that request's pages on the GPU: it decodes as SGLang alone."""
    cfg = sparse_config(max_sparse_requests=1)
    srv = Server(cfg)
    oracle = Oracle(cfg, srv.model)
    p = prompt(7, 50)
    d = srv.submit("d", p, max_new=4)
    srv.run()
    seq = list(d.origin_input_ids) + list(d.output_ids)[:3]  # the 53 tokens with KV in the tree
    # a: the same request again (its decode writes its own copies of d's output tokens);
    # c: d's cached sequence and more, decoded by SGLang (the one sparse slot is a's)
    srv.submit("a", p, max_new=4)
    srv.submit("c", seq + prompt(8, 6), max_new=8)
    srv.run()
    c_steps = [sp for st in srv.steps for sp in st.spans if sp.rid == "c"]
    assert c_steps[0].start == 53 and c_steps[0].prefix_resident and not any(sp.sparse for sp in c_steps)
    assert [sp.sparse for st in srv.steps for sp in st.spans if sp.rid == "a" and st.mode == "decode"] == [True] * 3
    oracle.check(srv)
    srv.assert_idle()


def test_abort_mid_chunked_prefill_and_retraction_leave_no_leak():
    """A chunked request (48-token chunks; its first chunk stashed into the tree) is aborted
    after its second chunk and released without a checkpoint; a sparse request is retracted
    by SGLang's retract_decode while decoding (released without a checkpoint), re-admitted
    with its prompt matched in the tree, re-prefilled and decodes as the runtime's
    sparse-hier decode of its whole sequence; another, aborted while decoding, is released
    by its next result. Nothing leaks; SGLang's idle check holds."""
    cfg = sparse_config()
    srv = Server(cfg, chunk=48)
    oracle = Oracle(cfg, srv.model)
    x = srv.submit("x", prompt(9, 110), max_new=4)
    srv.step()
    srv.step()
    assert x.kv.cache_protected_len == 48 and x.kv.kv_committed_len == 96  # chunk 1 cached, chunk 2 its own
    assert srv.bridge.residency.counts()["pinned"] == 96
    srv.abort("x")
    srv.submit("a", prompt(10, 44), max_new=8)
    srv.step()  # the abort (top of the step), then a's prefill
    assert x.finished() and not x.kv.holds_kv and srv.tree.evictable_size() == 48
    assert srv.bridge.residency.counts()["pinned"] == 44  # x's pins went with its row
    srv.submit("b", prompt(11, 46), max_new=8)
    srv.step()
    srv.step()  # first decode: both registered
    srv.retract_next = True
    srv.step()
    assert srv.retracted == ["b"]  # fewest outputs, then longest prompt, goes first
    b = srv.reqs["b"]
    assert not b.kv.holds_kv and srv.tree.evictable_size() == 48 + 46  # its prompt stays cached
    srv.step()
    srv.step()
    srv.abort("a")  # a running sparse request: released with its next result
    srv.step()
    a = srv.reqs["a"]
    assert isinstance(a.finished_reason, FINISH_ABORT) and not a.kv.holds_kv and len(a.output_ids) < 8
    srv.run()
    assert b.finished() and not isinstance(b.finished_reason, FINISH_ABORT)
    b_spans = [sp for st in srv.steps for sp in st.spans if sp.rid == "b"]
    again = [sp for sp in b_spans if not sp.sparse and sp.start > 0]
    assert len(again) == 1 and (again[0].start, again[0].end) == (46, 48) and again[0].prefix_resident
    oracle.check(srv)
    assert oracle.ref_slot.keys() >= {("b", 0), ("b", 1)}  # registered twice
    srv.assert_idle()


def _workload(srv: Server) -> None:
    """Finishes, a prefix hit, a dedup at checkpoint, a retraction, tree eviction."""
    base = prompt(12, 56)
    srv.submit("a", base, max_new=5)
    srv.submit("b", base, max_new=3)
    srv.step()
    assert _row(srv, "b", 56) == _row(srv, "a", 56)  # deduplicated at its checkpoint
    srv.submit("c", base[:40] + prompt(13, 12), max_new=6)
    srv.submit("d", prompt(14, 20), max_new=6)
    srv.step()
    srv.step()
    srv.retract_next = True
    srv.run()
    assert srv.retracted
    for i in range(3):  # more than the virtual slots hold with the cache: SGLang evicts the tree
        srv.submit(f"e{i}", prompt(20 + i, 60), max_new=3)
    srv.run()
    assert all(r.finished() for r in srv.reqs.values())
    cached = sum(len(r.origin_input_ids) + len(r.output_ids) - 1 for r in srv.reqs.values())
    assert srv.tree.evictable_size() < cached  # the tree evicted


def test_frees_deferred_past_the_row_free_reach_the_same_end_state():
    """SGLang's result processing frees inside the allocator's free groups, so a released
    request's slots reach the allocator (and its GPU pages the residency) after its row is
    freed (the plugin's free_rows hook); without groups they come before. Both orders run
    the same workload to the same outputs (each as SGLang alone / the sparse-hier decode)
    and the same idle state: nothing leaks, no GPU page is held."""
    cfg = sparse_config(host_to_device_ratio=1.2)
    ends, outs = [], []
    for free_groups in (True, False):
        srv = Server(cfg, free_groups=free_groups)
        oracle = Oracle(cfg, srv.model)
        _workload(srv)
        outs.append([o for st in srv.steps for o in st.out])
        oracle.check(srv)
        srv.assert_idle()
        ends.append((srv.alloc.available_size(), srv.tree.evictable_size(),
                     sorted(srv.tree.all_values_flatten().tolist()), srv.free_pages(), srv.bridge.residency.counts()))
    assert ends[0] == ends[1]
    assert len(outs[0]) == len(outs[1]) and all(torch.equal(x, y) for x, y in zip(*outs))


def _fp8_pages(k: torch.Tensor) -> torch.Tensor:
    """``k [n, HKV*D]`` (whole pages of 4 tokens) as FP8 host pages store it."""
    from hicache.kv_page_format import fp8_round_trip

    return fp8_round_trip(k.view(-1, 1, 4, HKV, D)).reshape(k.shape)


def test_fp8_host_pages_through_the_scheduler():
    """FP8 host KV (``--sparsehi-host-kv-dtype fp8_e4m3``, SGLang's page size = the sparse
    page size, 4): a finished request leaves the tree whole pages whose host records are the
    FP8 rounding of its keys (its partial last page went back with its slots); a prefix hit
    over them comes back to the GPU as those values; then the mixed workload (dedup at
    checkpoint, retraction, tree eviction) — every step audited, nothing leaks, the server
    ends idle."""
    cfg = sparse_config(host_kv_dtype="fp8_e4m3", host_to_device_ratio=1.2)
    srv = Server(cfg, sgl_page=4)
    a_ids = prompt(1, 60)
    a = srv.submit("a", a_ids, max_new=7)
    srv.run()
    assert a.finished() and all(s.spans[0].sparse for s in srv.steps[1:])
    srv.assert_idle()
    seq = list(a.origin_input_ids) + list(a.output_ids)
    slots = srv.cached_slots(seq)
    assert len(slots) == 64  # 66 tokens with KV, whole pages cached
    k_all, _ = srv.model.kv(seq, 64)
    host = srv.bridge.host_pool
    assert host.kv_format.quantized
    for i in range(L):
        assert torch.equal(host.read_tokens(i, slots)[0].reshape(64, HKV * D), _fp8_pages(k_all[i]))
    srv.submit("b", a_ids[:48] + prompt(2, 20), max_new=5)
    step = srv.step()
    assert step.mode == "extend" and step.spans[0].start == 48 and step.spans[0].prefix_resident
    b = srv.bridge
    phys = b.residency.physical_slots(slots[:48], 4)
    for i in range(L):
        assert torch.equal(b.device_pool.get_key_buffer(i)[phys].reshape(48, HKV * D), _fp8_pages(k_all[i][:48]))
    srv.run()
    srv.assert_idle()
    _workload(srv)
    srv.assert_idle()
