"""FaultInjectingStorage: wraps any L3 backend and injects faults at seeded rates, to prove
that a storage fault becomes a cache miss (or a retry), never a wrong answer or a leak.

Fault kinds (``FaultPlan`` rates are probabilities per backend call or per page):

- ``raise_rate`` (per call of ``get_pages`` / ``batch_get`` / ``batch_exists`` /
  ``set_pages`` / ``batch_set``): the call raises ``InjectedFault`` out of the public method,
  as a backend that breaks the "faults are misses" contract would; callers must contain it.
- ``delay_rate`` (per read call): the read sleeps ``delay_s`` first (a backend slower than the
  prefetch timeout); the pages arrive after the scheduler stopped waiting for them.
- ``drop_write_rate`` (per page written): the page is reported stored but silently lost (a
  write that never reached the medium); later existence checks say it is missing.
- ``truncate_rate`` / ``corrupt_rate`` (per page read): the page's bytes are damaged after the
  inner backend delivered them (cut short: the tail is lost; corrupted: one byte flipped).

Every page the wrapper hands out is verified against the length and CRC-32 it recorded when
the page was written through it (``integrity.PageDigest``), so a damaged page, and any page
the inner backend returns changed, is served as a miss and counted (``stats.faults``,
``stats.corrupt``). Pages written before the wrapper existed have no recorded digest; they
are never damaged (the wrapper could not tell) and rely on the inner backend's own checks.

At most one fault is injected per call, so each injected read fault is exactly one failed
read the caller sees: an exception or one page served as a miss. ``counts`` records what
was injected, by kind (``FaultCounts``).

Registration: ``register_fault_injection()`` adds the name ``fault-injection`` (or another)
to the backend registry; its extra config names the wrapped backend and the plan::

    {"fault_injection": {"backend": "file", "seed": 0, "raise_rate": 0.01, ...},
     "file_path": "/tmp/l3"}          # every other key goes to the wrapped backend
"""
from __future__ import annotations

import random
import threading
import time
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional, Sequence

import torch

from hicache.storage.base import HiCacheStorage, StorageConfig
from hicache.storage.integrity import CorruptPage, PageDigest

FAULT_KINDS = ("raise", "delay", "drop_write", "truncate", "corrupt")
READ_FAULT_KINDS = ("raise_read", "truncate", "corrupt")
"""Injected faults a reader sees as a failed read (a delay only makes the read late)."""


class InjectedFault(RuntimeError):
    """The exception ``raise_rate`` throws out of a wrapped call."""


@dataclass(frozen=True)
class FaultPlan:
    """Seeded fault rates (probabilities in [0, 1]) and the injected delay."""

    seed: int = 0
    raise_rate: float = 0.0
    delay_rate: float = 0.0
    delay_s: float = 0.0
    """How long a delayed read sleeps (seconds >= 0): set it past the prefetch timeout."""
    drop_write_rate: float = 0.0
    truncate_rate: float = 0.0
    corrupt_rate: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"FaultPlan.seed must be an int, got {self.seed!r}")
        for f in fields(self):
            if f.name.endswith("_rate"):
                v = getattr(self, f.name)
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.0 <= v <= 1.0:
                    raise ValueError(f"FaultPlan.{f.name} must be a probability in [0, 1], got {v!r}")
        if not isinstance(self.delay_s, (int, float)) or isinstance(self.delay_s, bool) or self.delay_s < 0:
            raise ValueError(f"FaultPlan.delay_s must be a number of seconds >= 0, got {self.delay_s!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FaultPlan":
        """A plan from a dict of its fields (unknown keys are an error naming the allowed ones)."""
        if not isinstance(d, dict):
            raise ValueError(f"fault plan must be a dict, got {type(d).__name__}")
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise ValueError(f"fault plan has unknown keys {unknown}: allowed {sorted(allowed)}")
        return cls(**d)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class FaultCounts:
    """Faults injected so far, by kind (monotonic)."""

    raise_read: int = 0
    """Exceptions thrown out of read calls (``get_pages`` / ``batch_get``)."""
    raise_exists: int = 0
    raise_write: int = 0
    delay: int = 0
    drop_write: int = 0
    truncate: int = 0
    corrupt: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    @property
    def reads_failed(self) -> int:
        """Injected faults that a reader sees as a failed read."""
        return sum(getattr(self, k) for k in READ_FAULT_KINDS)

    def as_dict(self) -> dict[str, int]:
        out = asdict(self)
        out["total"] = self.total
        return out


class FaultInjectingStorage(HiCacheStorage):
    """``inner`` with faults injected per ``plan`` (see the module docstring). Thread-safe:
    one seeded generator behind a lock, so a single-threaded caller sees the same faults
    every run (with I/O threads the draw order follows their interleaving)."""

    def __init__(self, inner: HiCacheStorage, plan: FaultPlan, config: Optional[StorageConfig] = None) -> None:
        if not isinstance(inner, HiCacheStorage):
            raise ValueError(f"inner must be a HiCacheStorage, got {type(inner).__name__}")
        if not isinstance(plan, FaultPlan):
            raise ValueError(f"plan must be a FaultPlan, got {type(plan).__name__}")
        super().__init__(config or inner.config)
        self.inner = inner
        self.plan = plan
        self.counts = FaultCounts()
        self.enabled = True
        """Switch injection off (e.g. to drain a run) without unwrapping."""
        self._rng = random.Random(plan.seed)
        self._lock = threading.Lock()
        self._digests: dict[str, PageDigest] = {}
        """Length + CRC-32 of every page written through this wrapper, by key."""

    # ------------------------------------------------------------------ draws
    def _draw(self, rate: float, n: int = 1) -> int:
        """Index in ``range(n)`` of the one item hit by a fault of probability ``rate`` per
        item (at most one per call), or -1."""
        if not self.enabled or rate <= 0.0 or n <= 0:
            return -1
        with self._lock:
            for i in range(n):
                if self._rng.random() < rate:
                    return i
        return -1

    def _inject(self, kind: str) -> None:
        with self._lock:
            setattr(self.counts, kind, getattr(self.counts, kind) + 1)

    def _maybe_raise(self, kind: str, what: str) -> None:
        if self._draw(self.plan.raise_rate) >= 0:
            self._inject(kind)
            raise InjectedFault(f"injected fault: {what} raised")

    def _maybe_delay(self) -> None:
        if self.plan.delay_s > 0 and self._draw(self.plan.delay_rate) >= 0:
            self._inject("delay")
            time.sleep(self.plan.delay_s)

    def _damage_pick(self, n: int) -> tuple[int, str]:
        """(page index, kind) of the one page of ``n`` to damage, or (-1, "")."""
        p = self.plan
        i = self._draw(p.truncate_rate + p.corrupt_rate, n)
        if i < 0:
            return -1, ""
        with self._lock:
            kind = "truncate" if self._rng.random() * (p.truncate_rate + p.corrupt_rate) < p.truncate_rate else "corrupt"
        return i, kind

    # ------------------------------------------------------------------ verification
    def _record(self, key: str, buf: torch.Tensor) -> None:
        d = PageDigest.of(buf)
        with self._lock:
            self._digests[key] = d

    def _verify(self, key: str, buf: torch.Tensor) -> bool:
        """Whether ``buf`` (the delivered bytes of ``key``) matches the digest recorded when it
        was written; a mismatch is counted as a corrupt-page fault."""
        with self._lock:
            d = self._digests.get(key)
        if d is None:
            return True
        try:
            d.verify(buf)
        except CorruptPage as e:
            self._record_fault("corrupt page", f"{key}: {e}", corrupt=True)
            return False
        return True

    @staticmethod
    def _apply_damage(kind: str, page: torch.Tensor) -> torch.Tensor:
        """The bytes a damaged read delivers: cut short (the tail never arrived) or with one
        byte flipped; ``page`` itself is changed in the corrupt case (its contents are
        undefined after a failed read anyway)."""
        flat = page.view(torch.uint8).view(-1)
        if kind == "truncate":
            return flat[: flat.numel() // 2]
        flat[flat.numel() // 3] ^= 0x5A
        return flat

    # ------------------------------------------------------------------ reads
    def get_pages(self, keys: Sequence[str], host_pages: Sequence[int]) -> list[bool]:
        self._maybe_raise("raise_read", "get_pages")
        self._maybe_delay()
        ok = list(self.inner.get_pages(keys, host_pages))
        if len(ok) != len(keys):
            return [False] * len(keys)
        pool = self._pool()
        victim, kind = self._damage_pick(len(keys))
        out = []
        for i, (k, p, good) in enumerate(zip(keys, host_pages, ok)):
            good = bool(good)
            if good:
                page = pool.page_tensor(int(p)).view(torch.uint8).view(-1)
                if i == victim and k in self._digests:
                    self._inject(kind)
                    page = self._apply_damage(kind, page)
                good = self._verify(k, page)
            out.append(good)
        hits = sum(out)
        page_bytes = pool.page_tensor(0).view(torch.uint8).numel()
        self._count(gets=len(out), hits=hits, misses=len(out) - hits, bytes_read=hits * page_bytes)
        return out

    def batch_get(self, keys: Sequence[str],
                  targets: Optional[Sequence[torch.Tensor]] = None) -> list[Optional[torch.Tensor]]:
        self._maybe_raise("raise_read", "batch_get")
        self._maybe_delay()
        got = list(self.inner.batch_get(keys, targets))
        if len(got) != len(keys):
            return [None] * len(keys)
        victim, kind = self._damage_pick(len(keys))
        out: list[Optional[torch.Tensor]] = []
        nbytes = 0
        for i, (k, t) in enumerate(zip(keys, got)):
            if t is not None:
                view = t.view(torch.uint8).view(-1)
                if i == victim and k in self._digests:
                    self._inject(kind)
                    view = self._apply_damage(kind, view)
                if not self._verify(k, view):
                    t = None
                else:
                    nbytes += view.numel()
            out.append(t)
        hits = sum(t is not None for t in out)
        self._count(gets=len(keys), hits=hits, misses=len(keys) - hits, bytes_read=nbytes)
        return out

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        self._maybe_raise("raise_exists", "batch_exists")
        return list(self.inner.batch_exists(keys))

    # ------------------------------------------------------------------ writes
    def _dropped(self, keys: Sequence[str]) -> int:
        i = self._draw(self.plan.drop_write_rate, len(keys))
        if i >= 0:
            self._inject("drop_write")
        return i

    def set_pages(self, keys: Sequence[str], host_pages: Sequence[int]) -> list[bool]:
        self._maybe_raise("raise_write", "set_pages")
        pool = self._pool()
        drop = self._dropped(keys)
        keep = [i for i in range(len(keys)) if i != drop]
        res = list(self.inner.set_pages([keys[i] for i in keep], [host_pages[i] for i in keep])) if keep else []
        if len(res) != len(keep):
            return [False] * len(keys)
        out = [True] * len(keys)  # a dropped page is reported stored: the loss is silent
        for i, r in zip(keep, res):
            out[i] = bool(r)
            if r:
                self._record(keys[i], pool.page_tensor(int(host_pages[i])).view(torch.uint8).view(-1))
        self._count(sets=sum(out))
        return out

    def batch_set(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[bool]:
        self._maybe_raise("raise_write", "batch_set")
        drop = self._dropped(keys)
        keep = [i for i in range(len(keys)) if i != drop]
        res = list(self.inner.batch_set([keys[i] for i in keep], [values[i] for i in keep])) if keep else []
        if len(res) != len(keep):
            return [False] * len(keys)
        out = [True] * len(keys)
        for i, r in zip(keep, res):
            out[i] = bool(r)
            if r:
                self._record(keys[i], values[i].contiguous().view(torch.uint8).view(-1))
        self._count(sets=sum(out))
        return out

    # ------------------------------------------------------------------ lifecycle
    def register_host_pool(self, host_pool: Any) -> None:
        super().register_host_pool(host_pool)
        self.inner.register_host_pool(host_pool)

    def clear(self) -> None:
        self.inner.clear()
        with self._lock:
            self._digests.clear()

    def close(self) -> None:
        self.inner.close()


FAULT_CONFIG_KEY = "fault_injection"


def create_fault_injecting_backend(config: StorageConfig) -> FaultInjectingStorage:
    """Registry factory: the backend ``extra["fault_injection"]["backend"]`` names, built with
    the rest of the extra config, wrapped with the plan's other keys."""
    from dataclasses import replace

    from hicache.storage.registry import create_storage_backend

    spec = config.extra.get(FAULT_CONFIG_KEY)
    if not isinstance(spec, dict) or not isinstance(spec.get("backend"), str):
        raise ValueError(f"extra config {FAULT_CONFIG_KEY!r} must be a dict with 'backend' (the wrapped backend's "
                         f"name) and fault plan keys {[f.name for f in fields(FaultPlan)]}, got {spec!r}")
    plan_keys = {k: v for k, v in spec.items() if k != "backend"}
    plan = FaultPlan.from_dict(plan_keys)
    inner_extra = {k: v for k, v in config.extra.items() if k != FAULT_CONFIG_KEY}
    inner = create_storage_backend(spec["backend"], replace(config, extra=inner_extra))
    return FaultInjectingStorage(inner, plan, config)


def register_fault_injection(name: str = "fault-injection", replace: bool = True) -> str:
    """Make ``--hicache-storage-backend <name>`` build a fault-injecting wrapper (see the
    module docstring for its extra config). Returns ``name``."""
    from hicache.storage.registry import register_storage_backend

    register_storage_backend(name, create_fault_injecting_backend, replace=replace)
    return name
