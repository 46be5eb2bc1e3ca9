"""KV shared with LMCache's own serving-engine connectors, in both directions.

LMCache's SGLang connector (``lmcache.integration.sglang.sglang_adapter``) stores a
prompt's KV in chunks of ``chunk_size`` tokens (LMCache's setting, default 256), each one
LMCache memory object holding all layers of the chunk:

- MHA: ``[2, num_layers, chunk tokens, kv_heads * head_dim]`` of the model's KV dtype,
  format ``KV_2LTD`` (K then V; tokens in prompt order);
- MLA: ``[1, num_layers, chunk tokens, head_dim]``, format ``KV_MLA_FMT``;

under ``CacheEngineKey(model_name=<SGLang's model path>, world_size=<tp size>,
worker_id=<tp rank>, chunk_hash=<prefix hash of the chunk's tokens>, dtype=<KV dtype>)``
(MLA keys carry world size 1: LMCache's ``save_only_first_rank``, on by default for MLA).
The chunk hash is LMCache's: a chain of its ``pre_caching_hash_algorithm`` (``builtin``:
Python's ``hash``) over ``(prefix hash, chunk token tuple, ())``, started at 0 without vLLM.

sparsehi's L3 object is one host-pool page record: ``[num_layers, B, page_size, kv_heads,
head_dim]`` (``page_first``; ``page_head`` is ``[kv_heads, num_layers, B, page_size,
head_dim]``) under a SHA-256 chain over the page's tokens (``hicache.storage.keys``),
prefixed by a 56-byte digest and tag (``hicache.storage.lmcache_store``). Keys, token
granularity and the order of axes all differ, so neither side can read the other's objects
in place; the bytes of each (token, layer, K/V, head) are the same, so a conversion is one
copy of the KV, which ``LMCacheInterop`` makes:

- ``read_pages`` / ``import_prefix``: the chunks LMCache holds for a prompt's leading
  tokens (its own token database computes the keys) become page records; imported, they
  are written to sparsehi's L3 under the prompt's page keys, where prefetch finds them.
- ``export_prefix``: the pages sparsehi's L3 holds for a prompt become LMCache chunks
  under LMCache's keys, where LMCache's ``lookup`` / ``retrieve`` (and so SGLang with
  LMCache) find them.

Every call into LMCache runs under the backend's deadline; a fault or an object of another
shape, dtype or format ends the prefix there (a miss, never wrong KV). LMCache's objects
carry no checksum: their bytes are taken as LMCache's own retrieve takes them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from hicache.kv_spec import KVCacheSpec

from .keys import page_hash_chain, salt_root, storage_key
from .lmcache_store import LMCacheStorage

PAGE_LAYOUTS = ("page_first", "page_first_direct", "page_head")


@dataclass(frozen=True)
class LMCacheKVLayout:
    """How LMCache's SGLang connector keys and lays out one model's KV (one TP rank)."""

    model_name: str
    """``model_name`` of LMCache's keys: what SGLang passes, its ``--model-path``."""
    world_size: int
    worker_id: int
    spec: KVCacheSpec
    chunk_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"lmcache model_name must be a non-empty str (SGLang's --model-path), "
                             f"got {self.model_name!r}")
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {self.chunk_size!r}")
        if not 0 <= self.worker_id < self.world_size:
            raise ValueError(f"need 0 <= worker_id < world_size, got {self.worker_id}, {self.world_size}")

    @property
    def use_mla(self) -> bool:
        return self.spec.attention == "mla"

    @property
    def hidden(self) -> int:
        """Last axis of a chunk: ``kv_heads * head_dim`` (MLA: the latent row width)."""
        return self.spec.kv_heads * self.spec.head_dim

    def chunk_shape(self, num_tokens: int) -> torch.Size:
        """``[B, num_layers, num_tokens, hidden]`` (B: 2 for MHA, 1 for MLA)."""
        return torch.Size([self.spec.num_buffers, self.spec.num_layers, num_tokens, self.hidden])

    def memory_format(self) -> Any:
        from lmcache.v1.memory_management import MemoryFormat

        return MemoryFormat.KV_MLA_FMT if self.use_mla else MemoryFormat.KV_2LTD

    def metadata(self) -> Any:
        """LMCache's ``LMCacheMetadata`` as its SGLang adapter (``init_lmcache_engine``) builds it."""
        from lmcache.v1.metadata import LMCacheMetadata

        s = self.spec
        kv_shape = ((s.num_layers, 1, self.chunk_size, 1, s.head_dim) if self.use_mla
                    else (s.num_layers, 2, self.chunk_size, s.kv_heads, s.head_dim))
        return LMCacheMetadata(model_name=self.model_name, world_size=self.world_size,
                               local_world_size=self.world_size, worker_id=self.worker_id,
                               local_worker_id=self.worker_id, kv_dtype=s.dtype, kv_shape=kv_shape,
                               use_mla=self.use_mla, chunk_size=self.chunk_size)


# -- layouts: pure tensor code, no LMCache ---------------------------------------------------
def _check_layout(host_layout: str) -> None:
    if host_layout not in PAGE_LAYOUTS:
        raise ValueError(f"host_layout must be one of {PAGE_LAYOUTS} (a page layout), got {host_layout!r}")


def record_shape(spec: KVCacheSpec, host_layout: str) -> tuple[int, ...]:
    """Shape of one host-pool page record (no extra token buffers) in ``host_layout``."""
    _check_layout(host_layout)
    b, ps, h, d, nl = spec.num_buffers, spec.page_size, spec.kv_heads, spec.head_dim, spec.num_layers
    return (h, nl, b, ps, d) if host_layout == "page_head" else (nl, b, ps, h, d)


def chunks_to_pages(chunks: Sequence[torch.Tensor], spec: KVCacheSpec, host_layout: str) -> torch.Tensor:
    """Page records ``[n_pages, *record_shape]`` (``spec.dtype``) holding the whole pages
    of the tokens of ``chunks`` (LMCache chunk tensors ``[B, L, T_i, H * D]`` of
    consecutive tokens); tokens after the last whole page are left out."""
    _check_layout(host_layout)
    b, nl, ps, h, d = spec.num_buffers, spec.num_layers, spec.page_size, spec.kv_heads, spec.head_dim
    for i, c in enumerate(chunks):
        if c.dim() != 4 or tuple(c.shape[:2]) != (b, nl) or c.shape[3] != h * d or c.dtype != spec.dtype:
            raise ValueError(f"chunks[{i}] must be [{b}, {nl}, tokens, {h * d}] {spec.dtype}, "
                             f"got {list(c.shape)} {c.dtype}")
    tokens = sum(c.shape[2] for c in chunks)
    n = tokens // ps
    if n == 0:
        return torch.empty((0, *record_shape(spec, host_layout)), dtype=spec.dtype)
    out = torch.empty((n, *record_shape(spec, host_layout)), dtype=spec.dtype)
    # the pages as [B, L, n, ps, H, D]: each chunk's whole pages are copied straight in
    view = out.permute(3, 2, 0, 4, 1, 5) if host_layout == "page_head" else out.permute(2, 1, 0, 3, 4, 5)
    if all(c.shape[2] % ps == 0 for c in chunks[:-1]):
        start = 0
        for c in chunks:
            pages = min(c.shape[2] // ps, n - start)
            if pages > 0:
                view[:, :, start:start + pages].copy_(c[:, :, : pages * ps].reshape(b, nl, pages, ps, h, d))
            start += c.shape[2] // ps
        return out
    kv = torch.cat(list(chunks), dim=2)  # chunk edges inside pages
    view.copy_(kv[:, :, : n * ps].reshape(b, nl, n, ps, h, d))
    return out


def pages_to_chunks(pages: torch.Tensor, spec: KVCacheSpec, host_layout: str, chunk_size: int) -> list[torch.Tensor]:
    """LMCache chunks ``[B, L, chunk_size, H * D]`` (contiguous) of the whole chunks of the
    tokens in ``pages`` (``[n_pages, *record_shape]``, consecutive pages); tokens after the
    last whole chunk are left out."""
    shape = record_shape(spec, host_layout)
    if pages.dim() != 1 + len(shape) or tuple(pages.shape[1:]) != shape or pages.dtype != spec.dtype:
        raise ValueError(f"pages must be [n, {', '.join(map(str, shape))}] {spec.dtype}, "
                         f"got {list(pages.shape)} {pages.dtype}")
    b, nl, ps, h, d = spec.num_buffers, spec.num_layers, spec.page_size, spec.kv_heads, spec.head_dim
    kv = pages.permute(3, 2, 0, 4, 1, 5) if host_layout == "page_head" else pages.permute(2, 1, 0, 3, 4, 5)
    kv = kv.reshape(b, nl, pages.shape[0] * ps, h * d)  # [B, L, tokens, H * D]
    return [kv[:, :, i:i + chunk_size].contiguous()
            for i in range(0, kv.shape[2] - kv.shape[2] % chunk_size, chunk_size)]


def _leading(flags: Sequence[bool]) -> int:
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


class LMCacheInterop:
    """Moves one model's KV between LMCache's chunks (as its SGLang connector writes them)
    and sparsehi's pages in the L3 of ``storage`` (an ``LMCacheStorage``, whose LMCache
    engine, settings and deadline it uses). ``spec`` and ``host_layout`` describe this
    rank's host-pool pages (no extra per-token buffers: LMCache's chunks hold KV only);
    ``lmcache_model_name`` is the ``model_name`` of LMCache's keys (SGLang's
    ``--model-path``). TP rank and size are the storage config's."""

    def __init__(self, storage: LMCacheStorage, spec: KVCacheSpec, host_layout: str,
                 lmcache_model_name: str) -> None:
        if not isinstance(storage, LMCacheStorage):
            raise ValueError(f"storage must be an LMCacheStorage, got {type(storage).__name__}")
        if not isinstance(spec, KVCacheSpec):
            raise ValueError(f"spec must be a KVCacheSpec, got {type(spec).__name__}")
        _check_layout(host_layout)
        if storage.config.is_mla != (spec.attention == "mla"):
            raise ValueError(f"storage config is_mla={storage.config.is_mla} but spec.attention={spec.attention!r}")
        from lmcache.v1.token_database import ChunkedTokenDatabase

        config = storage.engine.config
        self.storage = storage
        self.spec = spec
        self.host_layout = host_layout
        self.layout = LMCacheKVLayout(lmcache_model_name, storage.config.tp_size, storage.config.tp_rank, spec,
                                      config.chunk_size)
        self._fmt = self.layout.memory_format()
        self._tokens_db = ChunkedTokenDatabase(config, self.layout.metadata())
        self.record_bytes = spec.token_bytes * spec.page_size
        self.imported_tokens = 0
        """Tokens of the pages ``import_prefix`` wrote to sparsehi's L3 (all calls)."""
        self.exported_tokens = 0
        """Tokens of the chunks ``export_prefix`` wrote to LMCache (all calls)."""

    # -- LMCache's keys ---------------------------------------------------------------------
    def chunk_keys(self, token_ids: Sequence[int]) -> list[tuple[int, int, Any]]:
        """``(start, end, CacheEngineKey)`` of each chunk of ``token_ids``, as LMCache's
        engine computes them (its ``ChunkedTokenDatabase``; a trailing partial chunk only
        with LMCache's ``save_unfull_chunk``)."""
        tokens = _token_list(token_ids)
        return list(self._tokens_db.process_tokens(tokens)) if tokens else []

    def lmcache_held_tokens(self, token_ids: Sequence[int]) -> int:
        """Leading tokens of ``token_ids`` whose chunks some LMCache tier holds (0 on a fault)."""
        keys = self.chunk_keys(token_ids)
        if not keys:
            return 0
        manager = self.storage.engine.manager
        held = self.storage.call_engine("lmcache-lookup", 0,
                                        lambda: _leading([manager.contains(k) is not None for _, _, k in keys]))
        return keys[held - 1][1] if held else 0

    # -- LMCache -> sparsehi ----------------------------------------------------------------
    def read_pages(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Page records ``[n, *record_shape]`` (``spec.dtype``) of the leading whole pages of
        ``token_ids`` that LMCache's chunks hold (n = 0 when none, or on a fault)."""
        keys = self.chunk_keys(token_ids)
        got = self.storage.call_engine("lmcache-read", len(keys), lambda: self._read_chunks(keys)) if keys else None
        return chunks_to_pages(got or [], self.spec, self.host_layout)

    def import_prefix(self, token_ids: Sequence[int], salt: Optional[str] = None) -> int:
        """Write the pages LMCache holds for ``token_ids`` (see ``read_pages``) to sparsehi's
        L3 under their page keys (cache ``salt``), where prefetch finds them; pages sparsehi
        already holds are not written again. Returns the leading tokens sparsehi's L3 holds
        afterwards."""
        keys = self.page_keys(token_ids, salt)
        if not keys:
            return 0
        held = _leading(self.storage.batch_exists(keys))
        if held < len(keys):
            pages = self.read_pages(token_ids)
            todo = list(range(held, min(len(keys), pages.shape[0])))
            if todo:
                ok = _leading(self.storage.batch_set([keys[i] for i in todo], [pages[i] for i in todo]))
                held += ok
                self.imported_tokens += ok * self.spec.page_size
        return held * self.spec.page_size

    # -- sparsehi -> LMCache ----------------------------------------------------------------
    def export_prefix(self, token_ids: Sequence[int], salt: Optional[str] = None) -> int:
        """Write the whole LMCache chunks of ``token_ids`` covered by the leading pages
        sparsehi's L3 holds (cache ``salt``) as LMCache objects under LMCache's keys, where
        LMCache's ``lookup`` / ``retrieve`` find them; chunks LMCache holds are not written
        again. Returns the leading tokens LMCache holds afterwards."""
        cs = self.layout.chunk_size
        ps = self.spec.page_size
        chunk_keys = [k for k in self.chunk_keys(token_ids) if k[1] - k[0] == cs]
        if not chunk_keys:
            return 0
        have = self.lmcache_held_tokens(token_ids) // cs
        if have < len(chunk_keys):
            want_pages = -(-chunk_keys[-1][1] // ps)
            keys = self.page_keys(token_ids, salt)[:want_pages]
            pages = self._sparsehi_pages(keys)
            chunks = pages_to_chunks(pages, self.spec, self.host_layout, cs)
            items = [(chunk_keys[i][2], chunks[i]) for i in range(have, min(len(chunks), len(chunk_keys)))]
            if items:
                put = self.storage.call_engine("lmcache-write", len(items), lambda: self._put_chunks(items))
                self.exported_tokens += (put or 0) * cs
        return self.lmcache_held_tokens(token_ids)

    # -- keys and copies -----------------------------------------------------------------------
    def page_keys(self, token_ids: Sequence[int], salt: Optional[str] = None) -> list[str]:
        """sparsehi's L3 keys of the whole pages of ``token_ids`` (this rank, cache ``salt``)."""
        cfg = self.storage.config
        hashes = page_hash_chain(_token_list(token_ids), self.spec.page_size, salt_root(salt))
        return [storage_key(h, cfg.tp_rank, cfg.is_mla) for h in hashes]

    def _sparsehi_pages(self, keys: list[str]) -> torch.Tensor:
        """The leading pages sparsehi's L3 holds under ``keys``, ``[n, *record_shape]``."""
        shape = record_shape(self.spec, self.host_layout)
        got = self.storage.batch_get(keys) if keys else []
        pages = []
        for page in got:
            if page is None or page.numel() != self.record_bytes:
                break  # a miss, or a record with extra per-token buffers LMCache cannot hold
            pages.append(page.view(self.spec.dtype).view(shape))
        if not pages:
            return torch.empty((0, *shape), dtype=self.spec.dtype)
        return torch.stack(pages)

    def _read_chunks(self, keys: list[tuple[int, int, Any]]) -> list[torch.Tensor]:
        """Copies of the leading chunks LMCache holds under ``keys`` (on the bounded caller's
        thread); an object of another shape, dtype or format ends them, with a warning."""
        manager = self.storage.engine.manager
        out: list[torch.Tensor] = []
        for start, end, key in keys:
            obj = manager.get(key)
            if obj is None:
                break
            try:
                t = obj.tensor
                want = self.layout.chunk_shape(end - start)
                if t is None or t.shape != want or t.dtype != self.spec.dtype or obj.metadata.fmt != self._fmt:
                    got = "no tensor" if t is None else f"{list(t.shape)} {t.dtype} {obj.metadata.fmt}"
                    self.storage.log_fault("lmcache-layout", 1, f"LMCache chunk {key.to_string()} is {got}, expected "
                                           f"{list(want)} {self.spec.dtype} {self._fmt} (another model or settings)")
                    break
                out.append(t.clone())
            finally:
                obj.ref_count_down()
        return out

    def _put_chunks(self, items: list[tuple[Any, torch.Tensor]]) -> int:
        """Put chunks LMCache lacks (on the bounded caller's thread); how many were put."""
        manager = self.storage.engine.manager
        keys, objs = [], []
        try:
            for key, chunk in items:
                if manager.contains(key) is not None:
                    continue
                obj = manager.allocate(chunk.shape, chunk.dtype, fmt=self._fmt, eviction=True, busy_loop=False)
                if obj is None:
                    break  # LMCache's CPU memory is full
                objs.append(obj)
                obj.tensor.copy_(chunk)
                keys.append(key)
        except BaseException:
            for obj in objs:
                obj.ref_count_down()
            raise
        if keys:
            manager.batched_put(keys, objs)  # takes over the allocations' references
            self.storage.wait_written(keys)
        return len(keys)


def _token_list(token_ids: Any) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        return [int(t) for t in token_ids.reshape(-1).tolist()]
    tokens = list(token_ids)
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"token_ids must be ints >= 0, got {t!r}")
    return tokens
