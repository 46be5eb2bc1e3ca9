"""A sparse-hier run's L3 shared with LMCache's own serving-engine connectors.

With the ``lmcache`` L3 backend and its extra-config key ``interop_model_path`` (the model
path SGLang serves with LMCache, which names the model in LMCache's chunk keys), the run:

- before a request's L3 prefetch, copies the chunks LMCache holds for the prompt's leading
  tokens (as LMCache's SGLang connector stored them) into sparsehi's L3 as pages under the
  prompt's page keys (``LMCacheInterop.import_prefix``), so the prefetch finds them as
  ordinary L3 pages;
- at a request's end, once the tree's L3 writes of it landed, copies the whole LMCache
  chunks of its prompt and generated tokens that sparsehi's L3 holds into LMCache under
  LMCache's keys (``LMCacheInterop.export_prefix``), where LMCache's ``lookup`` /
  ``retrieve`` find them.

LMCache's keys carry no cache salt: its chunks are shared by every request with the same
tokens, as unsalted requests share sparsehi's cache. A request with a ``cache_salt`` shares
KV only with requests of the same salt, so it neither imports nor exports.

Both copies run under the backend's deadline; a fault or timeout ends the copy there (a
miss). The export waits for the tree's L3 writes of every finished request (one wait per
request end), which a run without interop does not do.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from hicache.kv_spec import KVCacheSpec


class LMCacheL3Interop:
    """The runtime's side of ``hicache.storage.lmcache_interop.LMCacheInterop``: when to
    import and export, and the counters the run reports."""

    def __init__(self, interop: Any) -> None:
        self.interop = interop

    def import_prefix(self, tokens: Sequence[int], salt: Optional[str]) -> None:
        """Before the prefetch of a prompt: LMCache's chunks for it become L3 pages (unsalted
        requests only)."""
        if salt is None:
            self.interop.import_prefix(tokens)

    def export_prefix(self, tree: Any, tokens: Sequence[int], salt: Optional[str]) -> None:
        """At a request's end, after ``tree.write_backup_storage`` of its pages: wait for the
        tree's L3 writes, then write the whole chunks of ``tokens`` (whole pages of the
        prompt and generated tokens) to LMCache (unsalted requests only)."""
        if salt is None:
            tree.flush_storage()
            self.interop.export_prefix(tokens)

    def stats(self) -> dict[str, int]:
        """``lmcache_imported_tokens``: tokens taken from LMCache's chunks into sparsehi's L3;
        ``lmcache_exported_tokens``: tokens written to LMCache as its chunks."""
        return {"lmcache_imported_tokens": self.interop.imported_tokens,
                "lmcache_exported_tokens": self.interop.exported_tokens}


def lmcache_interop_for(storage: Any, spec: KVCacheSpec, host: Any) -> Optional[LMCacheL3Interop]:
    """The interop of ``storage`` when it is an ``lmcache`` backend with ``interop_model_path``
    set (None otherwise; LMCache's code is imported only then). ``spec`` and ``host`` are
    the mode's KV spec and host pool; LMCache's chunks hold KV in the model's dtype only, so
    the host pages must be the same (ValueError naming the key otherwise)."""
    path = getattr(storage, "interop_model_path", None)
    if not path:
        return None
    if spec.fp8_latent_rows:
        raise ValueError("interop_model_path needs KV in the model's dtype (LMCache's chunks hold it), got "
                         "kv_cache_dtype='fp8_e4m3' (FP8 latent rows)")
    if host.kv_format.quantized:
        raise ValueError(f"interop_model_path needs host KV pages of the model's dtype (LMCache's chunks hold "
                         f"{spec.dtype}), got --host-kv-dtype {host.kv_format.host_kv_dtype}")
    if host.extra:
        raise ValueError(f"interop_model_path needs host pages of KV only: LMCache's chunks have no room for the "
                         f"host pool's per-token buffers {sorted(host.extra)} (the sparse algorithm's state)")
    from hicache.storage.lmcache_interop import LMCacheInterop

    return LMCacheL3Interop(LMCacheInterop(storage, spec, host.layout, path))
