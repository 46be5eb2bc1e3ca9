"""bench_sglang_server's result file: its rows and fields, merging with an earlier file,
the schema check and the tokens-equal verdicts."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

RESULT_NAME = "sglang_server.json"
RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
ROW_FIELDS = ("context", "plugin", "batch_held", "b1_tok_s", "best_tok_s", "best_batch", "ttft_s",
              "peak_gpu_gib", "peak_host_gib")
TOP_FIELDS = ("device", "date", "rows", "defaults_start", "tokens_equal_full_topk")
CHECK_KEYS = ("prompts", "prompt_len", "new_tokens", "seed")  # what makes the check's prompts the same


def empty_row(context: int, plugin: bool, server: str) -> dict[str, Any]:
    return {"context": context, "plugin": plugin, "server": server, **{k: None for k in ROW_FIELDS[2:]}}


def merge_results(old: Optional[dict[str, Any]], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` over ``old``: rows by (context, plugin) (new replaces old), servers by tag,
    top-level values that ``new`` leaves None taken from ``old``."""
    if not old:
        return new
    out = dict(old)
    for k, v in new.items():
        if k in ("rows", "servers", "check"):
            continue
        if v is not None or k not in out:
            out[k] = v
    keyed = {(r["context"], r["plugin"]): r for r in old.get("rows", [])}
    for r in new.get("rows", []):
        keyed[(r["context"], r["plugin"])] = r
    out["rows"] = sorted(keyed.values(), key=lambda r: (r["context"], r["plugin"]))
    out["servers"] = {**old.get("servers", {}), **new.get("servers", {})}
    old_check, new_check = dict(old.get("check") or {}), dict(new.get("check") or {})
    if any(old_check.get(k) != new_check.get(k) for k in CHECK_KEYS if k in new_check):
        out["check"] = new_check  # other prompts: the old reference and verdicts do not apply
    else:
        out["check"] = {**old_check, **{k: v for k, v in new_check.items() if v is not None}}
    return out


def check_schema(payload: dict[str, Any]) -> list[str]:
    """Problems with a result payload's required fields (empty: fine)."""
    bad = [f"missing {k}" for k in TOP_FIELDS if k not in payload]
    for k in ("defaults_start", "tokens_equal_full_topk"):
        if k in payload and payload[k] is not None and not isinstance(payload[k], bool):
            bad.append(f"{k} is not a bool")
    for i, r in enumerate(payload.get("rows", [])):
        bad += [f"row {i}: missing {k}" for k in ROW_FIELDS if k not in r]
        if not isinstance(r.get("plugin"), bool):
            bad.append(f"row {i}: plugin is not a bool")
        if not isinstance(r.get("context"), int):
            bad.append(f"row {i}: context is not an int")
        for k in ("batch_held", "best_batch"):
            if r.get(k) is not None and not isinstance(r[k], int):
                bad.append(f"row {i}: {k} is not an int")
        for k in ("b1_tok_s", "best_tok_s", "ttft_s", "peak_gpu_gib", "peak_host_gib"):
            if r.get(k) is not None and not isinstance(r[k], (int, float)):
                bad.append(f"row {i}: {k} is not a number")
    return bad


def tokens_verdict(ref: Optional[list], got: Optional[list]) -> dict[str, Any]:
    """Per-prompt comparison of greedy tokens: ``{equal, first_mismatch: [index or None]}``
    (equal None when either side is missing)."""
    if not ref or not got or len(ref) != len(got) or any(x is None for x in list(ref) + list(got)):
        return {"equal": None, "first_mismatch": None}
    firsts = []
    for a, b in zip(ref, got):
        idx = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if idx is None and len(a) != len(b):
            idx = min(len(a), len(b))
        firsts.append(idx)
    return {"equal": all(i is None for i in firsts), "first_mismatch": firsts}


def combine_tokens_equal(graphed: Optional[bool], eager: Optional[bool]) -> Optional[bool]:
    """True when every check that ran passed, False if one failed, None if none ran."""
    ran = [v for v in (graphed, eager) if v is not None]
    return None if not ran else all(ran)
