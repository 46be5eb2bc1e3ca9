"""``sparsehi run --disaggregation prefill|decode``: one side of a prefill/decode split.

Both sides build the same prompts as ``sparsehi run`` (``make_prompts`` with the same
seed, context, batch and shared prefix) and the same L3 namespace (``l3_model_name``), so
they agree on every key without talking to each other; the KV goes through the
``--hicache-storage-backend`` (``sparsehi.runtime.disaggregation``). The prefill side
prints one line per published prompt; the decode side decodes sparse-hier and writes
``run.json`` with the tokens (``tokens["sparse-hier"]``, as ``sparsehi run`` writes them),
how each prompt's KV arrived, the prompt positions its model computed, and its L3 counters.
"""
from __future__ import annotations

import time
from typing import Any

from sparsehi.runtime.demo import (DemoConfig, _l3_backend, _load_model, _runtime_config, _uses_l3, l3_model_name,
                                   make_prompts)
from sparsehi.runtime.disaggregation import DisaggregationConfig, decode_from_handoff, prefill_and_publish
from sparsehi.runtime.report import prepare_output_dir, write_json
from sparsehi.runtime.runner import ModelRunner

PD_FILES = ("run.json",)


def _check(cfg: DemoConfig) -> None:
    if cfg.modes != ["sparse-hier"]:
        raise ValueError(f"--disaggregation runs the sparse-hier mode only (--modes sparse-hier), got {cfg.modes}")
    if not _uses_l3(cfg):
        raise ValueError("--disaggregation needs --hicache-storage-backend (e.g. mooncake): the KV is handed over "
                         "through it")


def run_disaggregated(cfg: DemoConfig, pd: DisaggregationConfig) -> dict[str, Any]:
    """Run ``pd.role`` for ``cfg``'s batch; returns what the decode side writes to
    ``run.json`` (the prefill side: its records' summary)."""
    _check(cfg)
    out = prepare_output_dir(cfg.output_dir, PD_FILES) if pd.role == "decode" else None
    model, checkpoint = _load_model(cfg)
    mcfg = model.cfg
    prompts = make_prompts(mcfg.vocab_size, cfg.batch, cfg.context, cfg.seed, cfg.shared_prefix)
    name = l3_model_name(cfg, mcfg, checkpoint)
    storage, policy = _l3_backend(cfg, name, mcfg.family == "mla")
    rt = _runtime_config(cfg, "sparse-hier", cfg.context + cfg.decode_tokens + 1, storage, policy)
    runner = ModelRunner(model, rt)
    salts = [cfg.cache_salt] * len(prompts)
    try:
        if pd.role == "prefill":
            return _prefill(runner, prompts, salts, name)
        return _decode(cfg, pd, runner, prompts, salts, name, out)
    finally:
        runner.mode.close()
        storage.close()  # connections only: the published KV stays in the store


def _prefill(runner: ModelRunner, prompts: list[list[int]], salts: list, name: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    records = prefill_and_publish(runner, prompts, salts)
    dt = time.perf_counter() - t0
    for i, rec in enumerate(records):
        print(f"prefill: request {i}: {rec.num_tokens} tokens, {len(rec.keys)} pages published "
              f"(namespace {name}), first token {rec.first_token}")
    print(f"prefill: {len(records)} prompt(s) computed and published in {dt:.2f} s")
    return {"role": "prefill", "l3_model_name": name,
            "records": [{"num_tokens": r.num_tokens, "pages": len(r.keys), "first_token": r.first_token}
                        for r in records]}


def _decode(cfg: DemoConfig, pd: DisaggregationConfig, runner: ModelRunner, prompts: list[list[int]],
            salts: list, name: str, out: Any) -> dict[str, Any]:
    res = decode_from_handoff(runner, prompts, cfg.decode_tokens, salts, pd.wait_timeout_s, pd.on_missing)
    gen = res.generation
    for i, o in enumerate(res.outcomes):
        how = f"KV taken from the hand-off ({o.pages} pages)" if o.adopted else f"prompt recomputed ({o.reason})"
        print(f"decode: request {i}: {how}")
    print(f"decode: {gen.decode_steps} steps x {gen.batch_size} request(s) in {gen.decode_s:.2f} s; prompt "
          f"positions computed here: {res.prompt_positions_computed}; decode pages written to L3: "
          f"{res.l3.get('l3_pages_written', 0)}")
    payload = {
        "role": "decode", "model": runner.model.cfg.name, "context": cfg.context, "batch": cfg.batch,
        "decode_tokens": cfg.decode_tokens, "l3_model_name": name,
        "tokens": {"sparse-hier": gen.tokens},
        "handoff": [{"request_key": o.request_key, "adopted": o.adopted, "pages": o.pages, "reason": o.reason}
                    for o in res.outcomes],
        "prompt_positions_computed": res.prompt_positions_computed,
        "l3": res.l3, "l3_storage_stats": runner.rt.storage.stats.as_dict(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(f"wrote {write_json(out / 'run.json', payload)}")
    return payload
