"""L3 storage keys: a SHA-256 chain over token ids, one key per page.

A page's key covers the page and its whole prefix (the previous page's key is hashed in),
so equal keys mean equal prefixes. An optional cache salt starts the chain, so requests
with different salts never share a key. MHA pages are per tensor-parallel rank (each rank
holds its own heads): their keys carry the rank as a suffix; MLA pages are identical on
every rank, stored once under the bare hash.
"""
from __future__ import annotations

import hashlib
from typing import Optional, Sequence


def page_hash(page_tokens: Sequence[int], prior: str = "") -> str:
    """Hex SHA-256 of one page's token ids chained onto ``prior`` (the previous page's hash,
    or the salt's root hash, or "" for the first page)."""
    return hashlib.sha256((prior + ",".join(map(str, page_tokens))).encode()).hexdigest()


def salt_root(salt: Optional[str]) -> str:
    """The chain's starting value for a cache salt ("" without one)."""
    if salt is None or salt == "":
        return ""
    if not isinstance(salt, str):
        raise ValueError(f"cache salt must be a str or None, got {type(salt).__name__}")
    return hashlib.sha256(("salt:" + salt).encode()).hexdigest()


def page_hash_chain(token_ids: Sequence[int], page_size: int, prior: str = "") -> list[str]:
    """Keys of the full pages of ``token_ids`` (a trailing partial page has none)."""
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    out: list[str] = []
    h = prior
    for i in range(0, len(token_ids) - len(token_ids) % page_size, page_size):
        h = page_hash(token_ids[i:i + page_size], h)
        out.append(h)
    return out


def storage_key(page_key: str, tp_rank: int = 0, is_mla: bool = False) -> str:
    """The object name a backend stores a page under: MLA pages are shared by all ranks,
    MHA pages are per rank."""
    return page_key if is_mla else f"{page_key}_{tp_rank}"
