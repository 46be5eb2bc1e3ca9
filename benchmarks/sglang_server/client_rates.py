"""Decode rates as bench_sglang_server's client sees them, from streamed requests' chunk
arrival times, and the sizes of its held run."""
from __future__ import annotations

import bisect
from typing import Any, Optional


def tokens_at(chunks: list[tuple[float, int]], t: float, times: Optional[list[float]] = None) -> int:
    """Tokens a stream had received by time ``t`` (chunks: (arrival, cumulative tokens), in
    arrival order; ``times``: their arrival times, if at hand)."""
    i = bisect.bisect_right(times if times is not None else [c[0] for c in chunks], t)
    return chunks[i - 1][1] if i else 0


def first_step(chunks: list[tuple[float, int]]) -> dict[str, Optional[float]]:
    """A streamed request's first decode step (its token 1 to token 2: the step in which the
    plugin registers the prompt) against its steady step (the mean from token 3 on), in ms,
    and their ratio (``first_step_ratio``); None where the stream does not resolve them
    (tokens arriving several to a chunk)."""
    at = {n: t for t, n in chunks}
    out: dict[str, Optional[float]] = {"first_step_ms": None, "steady_step_ms": None, "first_step_ratio": None}
    if 1 not in at or 2 not in at or 3 not in at:
        return out
    last_t, last_n = chunks[-1]
    if last_n <= 3:
        return out
    first = (at[2] - at[1]) * 1e3
    steady = (last_t - at[3]) * 1e3 / (last_n - 3)
    out.update(first_step_ms=round(first, 3), steady_step_ms=round(steady, 3),
               first_step_ratio=round(first / steady, 3) if steady > 0 else None)
    return out


def window_rates(streams: list[dict[str, Any]], min_steps: int = 16, start_token: int = 2) -> dict[int, float]:
    """Client-side decode tok/s per batch size from streamed requests that ran together.

    Each stream: ``{"chunks": [(arrival time, cumulative completion tokens), ...]}``; the
    arrival of its token ``start_token`` (2: after the prefill's token and the first decode
    step, the one where the plugin registers the prompt, a once-per-request cost) and its
    last chunk are events. Between two consecutive events the requests decoding (started
    before the window, last chunk after it) are fixed; the window's rate is the tokens they
    received in it over its length. Windows where a decoding request advanced fewer than
    ``min_steps`` tokens (others prefilling, too short to time) are left out. Per batch
    size: the best window."""
    live = []
    for s in streams:
        ch = [(t, n) for t, n in s.get("chunks", []) if n >= start_token]
        if len(ch) >= 2:
            live.append((ch[0][0], ch[-1][0], ch, [c[0] for c in ch]))
    times = sorted({t for f, d, _, _ in live for t in (f, d)})
    best: dict[int, float] = {}
    for a, b in zip(times, times[1:]):
        if b <= a:
            continue
        active = [(ch, ts) for f, d, ch, ts in live if f <= a and d >= b]
        if not active:
            continue
        adv = [tokens_at(ch, b, ts) - tokens_at(ch, a, ts) for ch, ts in active]
        if min(adv) < min_steps:
            continue
        rate = sum(adv) / (b - a)
        c = len(active)
        if rate > best.get(c, 0.0):
            best[c] = rate
    return {c: round(r, 1) for c, r in sorted(best.items())}


def best_rate(rates: dict[int, float]) -> tuple[Optional[float], Optional[int]]:
    """(best tok/s, its batch) over ``rates`` (the larger batch on a tie)."""
    if not rates:
        return None, None
    c = max(rates, key=lambda k: (rates[k], k))
    return rates[c], c


def b1_rate(t_one: Optional[float], t_n: Optional[float], n: int) -> Optional[float]:
    """serve_probe's decode tok/s at batch 1: (n - 1) / (T(n) - T(1))."""
    if t_one is None or t_n is None or t_n <= t_one or n < 2:
        return None
    return round((n - 1) / (t_n - t_one), 1)


def held_plan(max_total_tokens: Optional[int], max_running: Optional[int], context: int, extra: int,
              cap: int) -> int:
    """How many requests the held run sends: what the KV pool can hold at most
    (``max_total_tokens // context``) plus ``extra``, at most ``cap`` (and
    ``max_running + extra``); ``cap`` when the pool size is unknown."""
    if not max_total_tokens:
        return max(1, cap)
    est = max_total_tokens // context
    if max_running:
        est = min(est, max_running)
    return max(1, min(cap, est + extra))


def ramp_new_tokens(n: int, base: int, step: int, limit: int) -> list[int]:
    """max_new_tokens of the held run's requests: base + i * step, at most ``limit``."""
    return [max(1, min(limit, base + i * step)) for i in range(n)]
