"""Per-step time split of a decode step: named sections timed with CUDA events (wall clock
on CPU), collected after the step. Sections must not nest."""
from __future__ import annotations

import time
from contextlib import contextmanager
from functools import wraps
from typing import Any, Callable, Iterator

import torch

SPLIT_KEYS = ("attention", "lru_diff", "io", "scoring", "other")


class SectionTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.enabled = False
        self._records: list[tuple[str, Any, Any]] = []

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            yield
            b.record()
            self._records.append((name, a, b))
        else:
            t = time.perf_counter()
            yield
            self._records.append((name, t, time.perf_counter()))

    def collect(self) -> dict[str, float]:
        """Milliseconds per section name since the last collect (synchronises)."""
        out: dict[str, float] = {}
        if self.cuda:
            torch.cuda.synchronize()
        for name, a, b in self._records:
            ms = a.elapsed_time(b) if self.cuda else (b - a) * 1e3
            out[name] = out.get(name, 0.0) + ms
        self._records.clear()
        return out


def wrap_method(obj: Any, attr: str, timer: SectionTimer, name: str) -> Callable[[], None]:
    """Time every call of ``obj.attr`` as section ``name``; returns an undo function."""
    orig = getattr(obj, attr)

    @wraps(orig)
    def timed(*a: Any, **kw: Any) -> Any:
        with timer.section(name):
            return orig(*a, **kw)

    had_instance_attr = attr in getattr(obj, "__dict__", {})
    setattr(obj, attr, timed)

    def undo() -> None:
        if had_instance_attr:
            setattr(obj, attr, orig)
        else:
            try:
                delattr(obj, attr)
            except AttributeError:
                setattr(obj, attr, orig)

    return undo
