"""Prefill -> decode KV hand-off through an L3 backend (prefill/decode disaggregation).

A prefill process computes a prompt's KV, then ``publish`` writes it to the backend in the
host pool's page format:

1. every full page under the key the L3 tier uses for it (``page_hash_chain`` over the
   prompt, salted like the prefix tree's chain, rank-suffixed like ``StorageController``'s
   keys), so the pages are ordinary L3 pages that any later request can reuse;
2. the partial last page (the prompt's ``n % page_size`` trailing tokens), which has no
   prefix key, under ``handoff-tail-<request key>``;
3. last, the *ready record* under ``handoff-ready-<request key>``: the token count, a
   SHA-256 of the token ids, the page keys, each page's length and CRC-32, and the first
   generated token (the prefill's argmax over the last prompt position).

The record is written only after every page was acknowledged by the backend, so a record
that exists names pages that were all stored; a writer that dies part-way leaves pages
but no record. A decode process ``wait_for_record`` (bounded; ``HandoffTimeout``), checks
the record against its own prompt, then ``load_pages`` reads the pages into host-pool pages
and verifies each against the record's digest (beyond the backend's own check): a page
that is missing, evicted since, short or different raises ``HandoffIncomplete``, and the
caller recomputes or refuses; it never decodes over a partial prompt.

The request key is the SHA-256 chain value over all prompt tokens (page size and salt
included), so a prefill and a decode process that agree on the prompt agree on the keys
without exchanging anything else. The backend's namespace (``StorageConfig.model_name``)
separates models, dtypes, page sizes and layouts.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from .base import HiCacheStorage
from .integrity import PageDigest
from .keys import page_hash, page_hash_chain, salt_root, storage_key

RECORD_VERSION = 1
READY_PREFIX = "handoff-ready-"
TAIL_PREFIX = "handoff-tail-"
PUBLISH_BATCH_PAGES = 8
"""Pages per backend write call while publishing."""


class HandoffError(RuntimeError):
    """The hand-off of a prompt's KV cannot be used."""


class HandoffTimeout(HandoffError):
    """No ready record appeared within the wait."""


class HandoffIncomplete(HandoffError):
    """A ready record exists but does not describe this prompt, or a page it names is
    missing or fails its digest."""


@dataclass(frozen=True)
class HandoffRecord:
    """What the prefill side publishes once every page of a prompt is stored."""

    num_tokens: int
    page_size: int
    tokens_sha256: str
    page_keys: tuple[str, ...]
    """Backend keys of the full pages, in prompt order (the L3 tier's keys)."""
    tail_key: Optional[str]
    """Backend key of the partial last page; None when ``num_tokens % page_size == 0``."""
    page_digests: tuple[tuple[int, int], ...]
    """``(length, crc32)`` of each page: the full pages, then the tail page."""
    first_token: int
    """The token the prefill generated (argmax at the last prompt position)."""
    version: int = RECORD_VERSION

    @property
    def keys(self) -> list[str]:
        """Every page key: full pages, then the tail page."""
        return list(self.page_keys) + ([self.tail_key] if self.tail_key else [])

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "HandoffRecord":
        """The record; HandoffIncomplete when ``raw`` is not a record of this version."""
        try:
            d = json.loads(bytes(raw).decode())
            if d.get("version") != RECORD_VERSION:
                raise ValueError(f"version {d.get('version')!r}, expected {RECORD_VERSION}")
            return cls(num_tokens=int(d["num_tokens"]), page_size=int(d["page_size"]),
                       tokens_sha256=str(d["tokens_sha256"]), page_keys=tuple(map(str, d["page_keys"])),
                       tail_key=None if d["tail_key"] is None else str(d["tail_key"]),
                       page_digests=tuple((int(a), int(b)) for a, b in d["page_digests"]),
                       first_token=int(d["first_token"]), version=int(d["version"]))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise HandoffIncomplete(f"unreadable ready record: {exc}") from None


@dataclass(frozen=True)
class HandoffKeys:
    """The backend keys of one prompt's hand-off."""

    request_key: str
    page_keys: tuple[str, ...]
    tail_key: Optional[str]

    @property
    def ready_key(self) -> str:
        return READY_PREFIX + self.request_key


def handoff_keys(tokens: Sequence[int], page_size: int, cache_salt: Optional[str] = None,
                 tp_rank: int = 0, is_mla: bool = False) -> HandoffKeys:
    """Keys of ``tokens``' hand-off: page keys as the L3 tier names them, the tail page's
    and the request's (the chain value over every token, partial page included)."""
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise ValueError("tokens must be a non-empty list of token ids")
    root = salt_root(cache_salt)
    chain = page_hash_chain(tokens, page_size, root)
    rest = tokens[len(chain) * page_size:]
    request = page_hash([page_size, *rest], chain[-1] if chain else root)
    pages = tuple(storage_key(h, tp_rank, is_mla) for h in chain)
    tail = storage_key(TAIL_PREFIX + request, tp_rank, is_mla) if rest else None
    return HandoffKeys(request, pages, tail)


def tokens_sha256(tokens: Sequence[int]) -> str:
    return hashlib.sha256(",".join(str(int(t)) for t in tokens).encode()).hexdigest()


def _page_bytes(host_pool: Any, page: int) -> torch.Tensor:
    return host_pool.page_tensor(int(page)).view(torch.uint8).view(-1)


def publish(storage: HiCacheStorage, host_pool: Any, tokens: Sequence[int], host_pages: Sequence[int],
            first_token: int, keys: HandoffKeys,
            on_pages_written: Optional[Callable[[int], None]] = None) -> HandoffRecord:
    """Write the prompt's pages (``host_pages``: the host-pool page of each logical page,
    ``ceil(n / page_size)`` of them), then its ready record. Raises HandoffError, with no
    record written, when the backend does not hold a page afterwards.
    ``on_pages_written(count)`` runs after each write call."""
    n, ps = len(tokens), host_pool.page_size
    want = -(-n // ps)
    if len(host_pages) != want:
        raise ValueError(f"host_pages must name {want} pages for {n} tokens (page_size {ps}), got {len(host_pages)}")
    all_keys = list(keys.page_keys) + ([keys.tail_key] if keys.tail_key else [])
    values = [_page_bytes(host_pool, p) for p in host_pages]
    digests = tuple((d.length, d.crc32) for d in map(PageDigest.of, values))
    done = 0
    for i in range(0, len(all_keys), PUBLISH_BATCH_PAGES):
        ok = storage.batch_set(all_keys[i:i + PUBLISH_BATCH_PAGES], values[i:i + PUBLISH_BATCH_PAGES])
        if not all(ok):
            bad = all_keys[i + ok.index(False)]
            raise HandoffError(f"the backend did not store page {bad} ({sum(ok)} of {len(ok)} in the call); "
                               f"no ready record published for request {keys.request_key}")
        done += len(ok)
        if on_pages_written is not None:
            on_pages_written(done)
    record = HandoffRecord(num_tokens=n, page_size=ps, tokens_sha256=tokens_sha256(tokens),
                           page_keys=keys.page_keys, tail_key=keys.tail_key, page_digests=digests,
                           first_token=int(first_token))
    blob = torch.frombuffer(bytearray(record.to_bytes()), dtype=torch.uint8)
    if not storage.set(keys.ready_key, blob):
        raise HandoffError(f"the backend did not store the ready record {keys.ready_key}")
    return record


def read_record(storage: HiCacheStorage, tokens: Sequence[int], keys: HandoffKeys,
                page_size: int) -> Optional[HandoffRecord]:
    """The ready record of ``tokens`` (None while absent); HandoffIncomplete when the record
    held under the key is unreadable or describes other tokens."""
    raw = storage.get(keys.ready_key)
    if raw is None:
        return None
    rec = HandoffRecord.from_bytes(raw.numpy().tobytes())
    expect = (len(tokens), page_size, tokens_sha256(tokens), keys.page_keys, keys.tail_key)
    got = (rec.num_tokens, rec.page_size, rec.tokens_sha256, rec.page_keys, rec.tail_key)
    if got != expect or len(rec.page_digests) != len(rec.keys):
        raise HandoffIncomplete(f"ready record {keys.ready_key} does not describe this prompt "
                                f"(records {rec.num_tokens} tokens, page size {rec.page_size}; "
                                f"expected {len(tokens)} tokens, page size {page_size})")
    return rec


def wait_for_record(storage: HiCacheStorage, tokens: Sequence[int], keys: HandoffKeys, page_size: int,
                    timeout_s: float, poll_s: float = 0.05) -> HandoffRecord:
    """Poll for the ready record until it appears (returned) or ``timeout_s`` passes
    (HandoffTimeout naming the key and the wait)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s < 0:
        raise ValueError(f"timeout_s must be a number of seconds >= 0, got {timeout_s!r}")
    deadline = time.monotonic() + timeout_s
    while True:
        rec = read_record(storage, tokens, keys, page_size)
        if rec is not None:
            return rec
        if time.monotonic() >= deadline:
            raise HandoffTimeout(f"no ready record {keys.ready_key} for this {len(tokens)}-token prompt after "
                                 f"{timeout_s:g} s: the prefill has not finished writing its KV (or died, or "
                                 f"uses another model namespace / page size / host layout)")
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


def load_pages(storage: HiCacheStorage, host_pool: Any, record: HandoffRecord, host_pages: Sequence[int]) -> None:
    """Read every page the record names into ``host_pages`` (in order) and verify each
    against the record's digest. HandoffIncomplete names the first page that is missing or
    differs; the pages' contents are then undefined."""
    keys = record.keys
    if len(host_pages) != len(keys):
        raise ValueError(f"host_pages must name {len(keys)} pages, got {len(host_pages)}")
    targets = [_page_bytes(host_pool, p) for p in host_pages]
    if targets and targets[0].numel() != record.page_digests[0][0]:
        raise HandoffIncomplete(f"pages are {record.page_digests[0][0]} bytes, this host pool's are "
                                f"{targets[0].numel()} (another layout or model)")
    got = storage.batch_get(keys, targets)
    for i, (res, tgt, (length, crc)) in enumerate(zip(got, targets, record.page_digests)):
        if res is None:
            raise HandoffIncomplete(f"page {i} of {len(keys)} ({keys[i]}) is missing from the store or failed "
                                    f"the backend's integrity check")
        d = PageDigest.of(tgt)
        if (d.length, d.crc32) != (length, crc):
            raise HandoffIncomplete(f"page {i} of {len(keys)} ({keys[i]}) differs from the one the prefill "
                                    f"published (crc32 {d.crc32:#010x} != {crc:#010x})")
