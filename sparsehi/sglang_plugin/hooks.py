"""Hooks the plugin installs in SGLang through its ``HookRegistry`` (imports SGLang lazily).

Targets are dotted paths that ``HookRegistry.apply_hooks`` resolves, so registering
imports nothing of SGLang beyond the registry itself.
"""
from __future__ import annotations

import argparse
import logging
from typing import Any, Callable

from sparsehi.sglang_plugin import options
from sparsehi.sglang_plugin.sglang_api import (FORWARD_BATCH, MODEL_RUNNER, PREFILL_ADDER, RADIX_ATTENTION,
                                               REQ_TO_TOKEN_POOL, SCHEDULER, SERVER_ARGS, TREE_CACHES)

logger = logging.getLogger(__name__)

ROPE_PARTS = ("q_rope", "k_rope")
"""MLA's split form of ``RadixAttention.forward`` (SGLang's DeepSeek attention with the rope
part apart): the latent ``q`` / ``k`` with their rope parts as keywords."""

BRIDGE_ATTR = "sparsehi_bridge"
"""Attribute of SGLang's ``ModelRunner`` holding its ``SGLangSparseBridge`` (absent: sparsehi off)."""

# Bridges by the id of the ReqToTokenPool they watch (its free hook has only the pool) and
# by the id of the allocator they installed (the tree's and the adder's hooks have that).
_BY_REQ_POOL: dict[int, Any] = {}
_BY_ALLOCATOR: dict[int, Any] = {}
# The forwards in flight: (SGLang's ForwardBatch, bridge, state), eager or being recorded
# into a CUDA graph. The layer hook acts only on those very batch objects, so attention
# outside a hooked forward is SGLang's own.
_ACTIVE: list[tuple[Any, Any, Any]] = []


def after_add_cli_args(result: Any, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
    """AFTER ``ServerArgs.add_cli_args(parser)``: add the ``--sparsehi-*`` options."""
    options.add_arguments(parser)
    return None


def around_from_cli_args(original: Callable[..., Any], cls: type, ns: argparse.Namespace, *args: Any,
                         **kwargs: Any) -> Any:
    """AROUND ``ServerArgs.from_cli_args``: build SGLang's record, then check our options
    and keep the resulting ``SparseConfig`` (or None) on it as ``sparsehi_config``."""
    cfg = options.config_from_namespace(ns, sglang_page_size=getattr(ns, "page_size", None))
    if cfg is not None:
        options.check_sglang_features(ns, cfg)
    server_args = original(cls, ns, *args, **kwargs)
    setattr(server_args, options.ATTR, cfg)
    if cfg is not None:
        logger.info("sparsehi on: %s", cfg)
    return server_args


def after_alloc_memory_pool(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``ModelRunner.alloc_memory_pool``: with sparsehi on, build the bridge (it takes
    over SGLang's KV memory, installs the host-backed allocator and switches the runner's
    KV index translator, see ``bridge``) and add its decode CUDA-graph capture hooks to
    the runner's ``capture_head_hooks`` / ``capture_tail_hooks``."""
    cfg = getattr(getattr(runner, "server_args", None), options.ATTR, None)
    if cfg is None:
        return None
    from sparsehi.sglang_plugin.bridge import SGLangSparseBridge

    old = getattr(runner, BRIDGE_ATTR, None)
    if old is not None:  # pools rebuilt (e.g. after a weight update): forget the old ones
        _BY_REQ_POOL.pop(id(old.req_to_token_pool), None)
        _BY_ALLOCATOR.pop(id(old.allocator), None)
    bridge = SGLangSparseBridge(cfg, runner)
    setattr(runner, BRIDGE_ATTR, bridge)
    _BY_REQ_POOL[id(runner.req_to_token_pool)] = bridge
    _BY_ALLOCATOR[id(bridge.allocator)] = bridge
    for name, hook in (("capture_head_hooks", capture_head), ("capture_tail_hooks", capture_tail)):
        hooks = getattr(runner, name, None)
        if hooks is not None and hook not in hooks:
            hooks.append(hook)
    return None


def after_forward_batch_init_new(result: Any, cls: type, batch: Any = None, model_runner: Any = None, *args: Any,
                                 **kwargs: Any) -> None:
    """AFTER ``ForwardBatch.init_new(batch, model_runner)``, for a runner with sparsehi on:
    a decode batch keeps the scheduler's host copy of its row ids
    (``batch.req_pool_indices_cpu``, which ``init_new`` passes on for extend batches only)
    so the forward hook needs no read-back from the device; an extend batch keeps each
    request's full prompt length (a long one is prepared for sparse decode from its first
    chunk on)."""
    batch = kwargs.get("batch", batch)
    model_runner = kwargs.get("model_runner", model_runner)
    if getattr(model_runner, BRIDGE_ATTR, None) is None:
        return None
    from sparsehi.sglang_plugin import sglang_api
    from sparsehi.sglang_plugin.bridge_state import PROMPT_LENS_ATTR, ROWS_CPU_ATTR

    mode = getattr(result, "forward_mode", None)
    if mode is not None and mode.is_extend():
        lens = sglang_api.extend_prompt_lens(batch)
        if lens is not None and len(lens) == len(result.req_pool_indices):
            setattr(result, PROMPT_LENS_ATTR, lens)
    if getattr(result, "req_pool_indices_cpu", None) is not None:
        return None
    rows = getattr(batch, "req_pool_indices_cpu", None)
    if rows is not None:
        setattr(result, ROWS_CPU_ATTR, rows)
    return None


def around_forward_raw(original: Callable[..., Any], runner: Any, forward_batch: Any, *args: Any,
                       **kwargs: Any) -> Any:
    """AROUND ``ModelRunner._forward_raw``: the bridge's host part before the model (pins,
    prefix pages back from host, registration, the static buffers a replayed decode graph
    reads), its end after it (write-through to host, demotions, the decode step's end).
    While a decode forward with rows of ours runs, SGLang's attention backend sees their
    lengths as one token (``SGLangSparseBridge.sglang_lengths``). Without a bridge:
    SGLang's forward, untouched."""
    from sparsehi.sglang_plugin.bridge_state import DecodeState

    bridge = getattr(runner, BRIDGE_ATTR, None)
    if bridge is None:
        return original(runner, forward_batch, *args, **kwargs)
    state = bridge.begin_forward(forward_batch)
    decode = isinstance(state, DecodeState)  # the layer hooks take part only in these
    lengths = bridge.sglang_lengths(forward_batch, state) if decode else {}
    saved = {name: getattr(forward_batch, name) for name in lengths}
    for name, value in lengths.items():
        setattr(forward_batch, name, value)
    entry = (forward_batch, bridge, state)
    if decode:
        _ACTIVE.append(entry)
    try:
        out = original(runner, forward_batch, *args, **kwargs)
    except BaseException:
        bridge.abort_forward(state)
        raise
    finally:
        if decode:
            _ACTIVE[:] = [e for e in _ACTIVE if e is not entry]
        for name, value in saved.items():
            setattr(forward_batch, name, value)
    bridge.end_forward(state)
    return out


def capture_head(graph_runner: Any, forward_batch: Any) -> None:
    """SGLang's capture head hook (``ModelRunner.capture_head_hooks``), first in every run of
    a decode CUDA-graph capture: the layer hooks take part in this forward, recording the
    bridge's layer path over its static buffers."""
    bridge = getattr(getattr(graph_runner, "model_runner", None), BRIDGE_ATTR, None)
    if bridge is None:
        return
    _ACTIVE[:] = [entry for entry in _ACTIVE if not entry[2].recorded]  # a capture that raised half-way
    _ACTIVE.append((forward_batch, bridge, bridge.begin_capture(forward_batch)))


def capture_tail(graph_runner: Any, out: Any, forward_batch: Any, *args: Any) -> None:
    """SGLang's capture tail hook, last in every run of a decode CUDA-graph capture: the
    step's end is recorded too."""
    for i in range(len(_ACTIVE) - 1, -1, -1):
        fb, bridge, state = _ACTIVE[i]
        if fb is forward_batch and state.recorded:
            del _ACTIVE[i]
            bridge.end_forward(state)
            return


def around_radix_attention(original: Callable[..., Any], layer: Any, q: Any, k: Any, v: Any, forward_batch: Any,
                           save_kv_cache: bool = True, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``RadixAttention.forward``: inside a forward the bridge takes part in,
    ``attention_begin`` / adapter attention / ``attention_end`` for our rows; anywhere
    else SGLang's own call."""
    def call() -> Any:
        return original(layer, q, k, v, forward_batch, save_kv_cache, *args, **kwargs)

    entry = next((e for e in reversed(_ACTIVE) if e[0] is forward_batch), None)
    if entry is None:
        return call()
    _, bridge, state = entry
    rope = {name: kwargs[name] for name in ROPE_PARTS if kwargs.get(name) is not None}
    other = sorted(name for name in kwargs if name not in ROPE_PARTS)
    if args or other or (rope and len(rope) != len(ROPE_PARTS)):
        raise NotImplementedError(f"sparsehi decode does not take RadixAttention's extra arguments "
                                  f"{other or sorted(kwargs)} (layer {layer.layer_id}); covered: attn(q, k, v, "
                                  f"forward_batch) and MLA's attn(q_nope, k_nope, k_nope, forward_batch, "
                                  f"q_rope=, k_rope=)")
    return bridge.attention(state, layer, q, k, v, forward_batch, save_kv_cache, call, **rope)


def before_free_rows(pool: Any, indices: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``ReqToTokenPool.free_rows``: the rows SGLang frees drop their GPU-page pins
    and, if they decoded sparsely, end in the coordinator (``SGLangSparseBridge.release_rows``)."""
    bridge = _BY_REQ_POOL.get(id(pool))
    if bridge is not None:
        bridge.release_rows([int(i) for i in indices])
    return None


def before_clear(pool: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``ReqToTokenPool.clear``: every request of ours ends."""
    bridge = _BY_REQ_POOL.get(id(pool))
    if bridge is not None:
        bridge.release_all()
    return None


def around_tree_checkpoint(original: Callable[..., Any], tree: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND a radix tree's ``checkpoint(req, *, up_to)``: the tree may rewrite the
    request's row to its own slots (a prefix another request inserted first); the bridge
    orders that after its own reads of the row and follows the new slots."""
    bridge = _BY_ALLOCATOR.get(id(getattr(tree, "token_to_kv_pool_allocator", None)))
    if bridge is None:
        return original(tree, req, *args, **kwargs)
    token = bridge.before_checkpoint(req)
    out = original(tree, req, *args, **kwargs)
    bridge.after_checkpoint(req, token)
    return out


def around_request_slot_reserve(original: Callable[..., Any], adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``PrefillAdder._request_slot_reserve_for_req``: a new request's cached prefix
    may be only in host memory (the plugin's slots are host-backed) and must be brought
    back to the GPU before its extend forward reads it, so admission charges it too."""
    reserve = original(adder, req, *args, **kwargs)
    bridge = _BY_ALLOCATOR.get(id(getattr(adder, "token_to_kv_pool_allocator", None)))
    if bridge is None:
        return reserve
    from sparsehi.sglang_plugin import sglang_api

    prefix = int(getattr(req, "prefix_len", 0) or 0)
    if prefix and sglang_api.req_row(req) is None:
        ps = bridge.sgl_ps
        reserve += -(-prefix // ps) * ps
    return reserve


def around_running_request_offset(original: Callable[..., Any], adder: Any, req: Any, *args: Any,
                                  **kwargs: Any) -> Any:
    """AROUND ``PrefillAdder._get_running_request_total_token_offset(req)``: a running
    request's future tokens, which admission keeps room for. A request that decodes
    sparsely needs host slots for them (SGLang's count, unchanged) and one GPU page at a
    time, so the rest is exempt from the prefill budget's GPU side."""
    offset = original(adder, req, *args, **kwargs)
    bridge = _BY_ALLOCATOR.get(id(getattr(adder, "token_to_kv_pool_allocator", None)))
    if bridge is None:
        return offset
    from sparsehi.sglang_plugin import sglang_api

    row = sglang_api.req_row(req)
    budget = getattr(adder, "memory_budget", None)
    if row is not None and budget is not None and bridge.decodes_sparsely(row):
        budget.gpu_exempt = getattr(budget, "gpu_exempt", 0) + max(0.0, offset - bridge.sgl_ps)
    return offset


def around_get_new_batch_prefill(original: Callable[..., Any], scheduler: Any, running_batch: Any, *args: Any,
                                 **kwargs: Any) -> Any:
    """AROUND ``Scheduler.get_new_batch_prefill(running_batch)``: SGLang stops admitting
    while ``running_batch.batch_is_full`` (a request did not fit; cleared when one leaves).
    GPU memory also comes back when the plugin registers a prompt (it leaves the GPU), and
    the host's count of free GPU pages learns of device-side frees a forward or two later,
    so the flag is cleared while such frees are pending."""
    bridge = _BY_ALLOCATOR.get(id(getattr(scheduler, "token_to_kv_pool_allocator", None)))
    if (bridge is not None and running_batch is not None and getattr(running_batch, "batch_is_full", False)
            and bridge.gpu_frees_pending()):
        running_batch.batch_is_full = False
    return original(scheduler, running_batch, *args, **kwargs)


def register_hooks(registry: Any, hook_type: Any) -> list[str]:
    """Register every hook on ``registry`` (SGLang's ``HookRegistry``); returns the targets."""
    targets = []
    entries = [
        (f"{SERVER_ARGS}.add_cli_args", after_add_cli_args, hook_type.AFTER),
        (f"{SERVER_ARGS}.from_cli_args", around_from_cli_args, hook_type.AROUND),
        (f"{MODEL_RUNNER}.alloc_memory_pool", after_alloc_memory_pool, hook_type.AFTER),
        (f"{MODEL_RUNNER}._forward_raw", around_forward_raw, hook_type.AROUND),
        (f"{FORWARD_BATCH}.init_new", after_forward_batch_init_new, hook_type.AFTER),
        (f"{RADIX_ATTENTION}.forward", around_radix_attention, hook_type.AROUND),
        (f"{REQ_TO_TOKEN_POOL}.free_rows", before_free_rows, hook_type.BEFORE),
        (f"{REQ_TO_TOKEN_POOL}.clear", before_clear, hook_type.BEFORE),
        (f"{PREFILL_ADDER}._request_slot_reserve_for_req", around_request_slot_reserve, hook_type.AROUND),
        (f"{PREFILL_ADDER}._get_running_request_total_token_offset", around_running_request_offset,
         hook_type.AROUND),
        (f"{SCHEDULER}.get_new_batch_prefill", around_get_new_batch_prefill, hook_type.AROUND),
    ]
    entries += [(f"{tree}.checkpoint", around_tree_checkpoint, hook_type.AROUND) for tree in TREE_CACHES]
    for target, hook, kind in entries:
        registry.register(target, hook, kind)
        targets.append(target)
    # sgl.Engine(sparsehi_*=...) keywords: Engine.server_args_class wrapped (engine_options.py)
    from sparsehi.sglang_plugin import engine_options
    targets += engine_options.register(registry, hook_type)
    return targets
