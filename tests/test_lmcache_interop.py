"""KV shared between LMCache's SGLang connector and sparsehi's L3, both ways
(``hicache.storage.lmcache_interop``), against a real LMCache engine and LMCache's server.

The SGLang side is LMCache's own ``LMCacheConnector`` (``lmcache.integration.sglang.
sglang_adapter``: ``store_kv`` / ``load_kv`` over an ``LMCacheEngine`` with its chunk keys,
token database, storage manager and remote tier). Its GPU connector is LMCache's
``SGLangGPUConnector`` with the two CUDA-only steps done on the CPU (``SGLangCPUConnector``
below): the pointer table stays in host memory, and no ``torch.cuda.synchronize`` follows a
copy; the copy itself is LMCache's ``multi_layer_kv_transfer_unilateral`` (its torch
version), the objects its ``get_shape`` says (``[2, layers, tokens, heads * dim]``). Both
sides reach one LMCache server (``tests/lmcache_server.py``), as two processes would.

Tensors are compared bitwise. The layout tests need no LMCache and run everywhere; the rest
skip where LMCache does not import, with the import error as the reason.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")  # read when LMCache is imported

import pytest
import torch

from hicache.device_pool import DeviceKVPool
from hicache.host_pool import HostKVPool
from hicache.kv_spec import KVCacheSpec
from hicache.storage.base import StorageConfig
from hicache.storage.lmcache_interop import chunks_to_pages, pages_to_chunks, record_shape

from lmcache_server import LMCacheServer, lmcache_server, missing_reason  # noqa: F401 (fixture)

_MISSING = missing_reason()
needs_lmcache = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")
SGLANG_MODEL = "org/Tiny-Model-8L"  # SGLang's --model-path: the model_name of LMCache's keys


def spec_of(attention: str, layers: int = 3, heads: int = 2, dim: int = 8, dtype=torch.bfloat16,
            page_size: int = 4) -> KVCacheSpec:
    return KVCacheSpec(attention, layers, 1 if attention == "mla" else heads, dim, dtype, page_size)


def random_kv(spec: KVCacheSpec, tokens: int, seed: int) -> torch.Tensor:
    """``[B, L, tokens, H, D]`` of ``spec.dtype`` with random bits (NaN patterns included)."""
    g = torch.Generator().manual_seed(seed)
    shape = (spec.num_buffers, spec.num_layers, tokens, spec.kv_heads, spec.head_dim)
    bits = torch.randint(0, 256, (*shape[:-1], spec.head_dim * spec.element_size), generator=g, dtype=torch.uint8)
    return bits.view(spec.dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def host_pool_with(spec: KVCacheSpec, layout: str, kv: torch.Tensor) -> HostKVPool:
    """A host pool whose first pages hold ``kv`` ([B, L, T, H, D]) token by token, written
    through ``HostKVPool.write_tokens`` (not through the converter)."""
    pages = -(-kv.shape[2] // spec.page_size)
    host = HostKVPool(DeviceKVPool(spec, spec.page_size * pages, "cpu"), hicache_ratio=2.0, layout=layout)
    slots = torch.arange(kv.shape[2])
    for layer in range(spec.num_layers):
        host.write_tokens(layer, slots, *[kv[b, layer] for b in range(spec.num_buffers)])
    return host


# -- layouts (no LMCache) -----------------------------------------------------------------------
@pytest.mark.parametrize("attention, layout", [("mha", "page_first"), ("mha", "page_first_direct"),
                                               ("mha", "page_head"), ("mla", "page_first")])
@pytest.mark.parametrize("chunk_size", [8, 6])  # 6: chunk edges inside pages
def test_chunks_become_host_pool_pages(attention, layout, chunk_size):
    spec = spec_of(attention)
    kv = random_kv(spec, 30, seed=1)  # 30 tokens: 7 whole pages of 4
    flat = kv.flatten(3)  # [B, L, T, H * D]: LMCache's chunk rows
    chunks = [flat[:, :, i:i + chunk_size].contiguous() for i in range(0, 30, chunk_size)]
    pages = chunks_to_pages(chunks, spec, layout)
    host = host_pool_with(spec, layout, kv)
    assert pages.shape == (7, *record_shape(spec, layout))
    for p in range(7):
        assert same_bits(pages[p], host.page_tensor(p))
    back = pages_to_chunks(pages, spec, layout, chunk_size)  # 28 tokens: whole chunks only
    assert len(back) == 28 // chunk_size
    for i, c in enumerate(back):
        assert same_bits(c, chunks[i])


def test_layout_errors_name_the_parameter():
    spec = spec_of("mha")
    with pytest.raises(ValueError, match="host_layout"):
        chunks_to_pages([], spec, "layer_first")
    with pytest.raises(ValueError, match=r"chunks\[0\]"):
        chunks_to_pages([torch.zeros(2, 3, 4, 15, dtype=torch.bfloat16)], spec, "page_first")
    with pytest.raises(ValueError, match="pages must be"):
        pages_to_chunks(torch.zeros(1, 3, 2, 4, 2, 8), spec, "page_first", 8)  # float32, not bf16


# -- the SGLang side: LMCache's own connector ---------------------------------------------------
@dataclass
class SGLangModelConfig:
    """The fields of SGLang's ``ModelConfig`` that LMCache's SGLang adapter reads."""

    model_path: str
    num_hidden_layers: int
    num_kv_heads: int
    head_dim: int
    attention_arch: str = "MHA"

    def get_num_kv_heads(self, tp_size: int) -> int:
        return self.num_kv_heads // tp_size


def _cpu_connector_class():
    from lmcache import device_ops
    from lmcache.utils import EngineType
    from lmcache.v1.gpu_connector.gpu_connectors import SGLangGPUConnector
    from lmcache.v1.gpu_connector.utils import (get_device, get_group_data_ptrs, get_num_layers,
                                                get_page_buffer_size, normalize_kv_and_discover_format)
    import lmcache.lmcache_native as native

    class SGLangCPUConnector(SGLangGPUConnector):
        """LMCache's SGLang connector with its pointer table in host memory and no CUDA sync."""

        def _initialize_pointers(self, kv_caches):
            if not self.use_mla and isinstance(kv_caches, list) and isinstance(kv_caches[0], torch.Tensor):
                # SGLang's k_pool + v_pool: the same K-then-V pointer table as [k_pool, v_pool],
                # the form LMCache's torch fallback reads as MHA (a flat list reads as MLA there)
                kv_caches = [kv_caches[:self.num_layers], kv_caches[self.num_layers:]]
            self.engine_kv_format, kv_caches = normalize_kv_and_discover_format(kv_caches, EngineType.SGLANG)
            n = get_num_layers(kv_caches, self.engine_kv_format)
            ptrs = get_group_data_ptrs(kv_caches, self.engine_kv_format, list(range(n)))
            assert len(ptrs) == self.num_kv_cache
            self.kv_cache_pointers.numpy()[:] = ptrs
            self.page_buffer_size = get_page_buffer_size(kv_caches, self.engine_kv_format)
            return self.kv_cache_pointers

        def from_gpu(self, memory_obj, start, end, **kwargs):
            kvcaches = kwargs["kvcaches"]
            ptrs = self._initialize_pointers(kvcaches)
            device_ops.multi_layer_kv_transfer_unilateral(
                memory_obj.tensor, ptrs, kwargs["slot_mapping"][start:end], get_device(kvcaches),
                self.page_buffer_size, native.TransferDirection.D2H, self.engine_kv_format)

    return SGLangCPUConnector


class SGLangSide:
    """One SGLang worker's LMCache connector over a paged KV pool of ``slots`` tokens
    (per layer ``[slots, heads, dim]``, K and V; MLA: one ``[slots, 1, dim]``)."""

    def __init__(self, monkeypatch, tmp_path, spec: KVCacheSpec, lmcache: dict, slots: int = 4096,
                 model_path: str = SGLANG_MODEL) -> None:
        import yaml
        from lmcache.integration.sglang import sglang_adapter

        conn_cls = _cpu_connector_class()

        def create_connector(config, metadata, engine):
            num_layer, _, chunk_size, heads, dim = metadata.kv_shape
            return conn_cls(heads * dim, num_layer, use_gpu=False, chunk_size=chunk_size, dtype=metadata.kv_dtype,
                            device=torch.device("cpu"), use_mla=metadata.use_mla)

        monkeypatch.setattr(sglang_adapter, "CreateGPUConnector", create_connector)
        path = tmp_path / "lmcache-sglang.yaml"
        path.write_text(yaml.safe_dump(lmcache))
        self.spec = spec
        self.pools = [[torch.zeros(slots, spec.kv_heads, spec.head_dim, dtype=spec.dtype)
                       for _ in range(spec.num_layers)] for _ in range(spec.num_buffers)]
        mla = spec.attention == "mla"
        model = SGLangModelConfig(model_path, spec.num_layers, spec.kv_heads, spec.head_dim, "MLA" if mla else "MHA")
        self.connector = sglang_adapter.LMCacheConnector(model, 1, 0, self.pools[0], [] if mla else self.pools[1],
                                                         str(path))
        self.sglang_adapter = sglang_adapter

    def store(self, tokens: list[int], kv: torch.Tensor, seed: int) -> torch.Tensor:
        """Put ``kv`` ([B, L, T, H, D]) at random slots and store it through the connector."""
        slots = torch.randperm(self.pools[0][0].shape[0], generator=torch.Generator().manual_seed(seed))[:len(tokens)]
        for b, pool in enumerate(self.pools):
            for layer, t in enumerate(pool):
                t[slots] = kv[b, layer]
        self.connector.store_kv(self.sglang_adapter.StoreMetadata(None, tokens, slots, 0))
        self._wait_written(tokens)
        return slots

    def _wait_written(self, tokens: list[int], timeout: float = 10.0) -> None:
        """LMCache writes its remote tier asynchronously: wait until no write of these
        tokens' chunks is in flight (what a second process sees later anyway)."""
        engine = self.connector.lmcache_engine
        keys = [k for _, _, k in engine.token_database.process_tokens(tokens)]
        backends = engine.storage_manager.storage_backends.values()
        end = time.monotonic() + timeout
        while any(b.exists_in_put_tasks(k) for b in backends for k in keys):
            assert time.monotonic() < end, "LMCache's writes did not finish"
            time.sleep(0.005)

    def load(self, tokens: list[int], seed: int) -> tuple[int, torch.Tensor]:
        """Clear the pool, load ``tokens`` through the connector; (tokens loaded, KV
        ``[B, L, T, H, D]`` read back from the slots)."""
        for pool in self.pools:
            for t in pool:
                t.zero_()
        slots = torch.randperm(self.pools[0][0].shape[0], generator=torch.Generator().manual_seed(seed))[:len(tokens)]
        n = self.connector.load_kv(self.sglang_adapter.LoadMetadata(tokens, slots, 0))
        kv = torch.stack([torch.stack([t[slots] for t in pool]) for pool in self.pools])
        return n, kv

    def close(self) -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        LMCacheEngineBuilder.destroy(self.sglang_adapter.ENGINE_NAME)


# -- both directions through LMCache's server --------------------------------------------------
@pytest.fixture(scope="module")
def server(lmcache_server):
    return lmcache_server


def lmcache_settings(server, chunk_size: int) -> dict:
    """One LMCache configuration for both sides: pages and chunks meet on the server."""
    return {"chunk_size": chunk_size, "local_cpu": False, "max_local_cpu_size": 0.05, "remote_url": server.url}


def sparsehi_side(server, spec: KVCacheSpec, chunk_size: int, layout: str = "page_first",
                  model_path: str = SGLANG_MODEL, settings: dict | None = None):
    from hicache.storage.lmcache_interop import LMCacheInterop
    from hicache.storage.lmcache_store import LMCacheStorage

    # sparsehi's namespace names the geometry and host layout, as `sparsehi run` does
    name = f"tiny-L{spec.num_layers}-{spec.attention}-p{spec.page_size}-{layout}"
    storage = LMCacheStorage(StorageConfig(is_mla=spec.attention == "mla", model_name=name,
                                           extra=settings or lmcache_settings(server, chunk_size)))
    return storage, LMCacheInterop(storage, spec, layout, model_path)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@needs_lmcache
@pytest.mark.parametrize("attention, layout", [("mha", "page_first"), ("mha", "page_head"), ("mla", "page_first")])
def test_kv_sglang_stored_in_lmcache_becomes_sparsehi_pages(server, monkeypatch, tmp_path, attention, layout):
    spec = spec_of(attention, layers=8, heads=2, dim=16, page_size=16)
    tokens = prompt(1100, seed=3)  # 4 whole chunks of 256; LMCache keeps no partial chunk by default
    kv = random_kv(spec, len(tokens), seed=4)
    model = f"org/tiny-{attention}"  # one model per attention kind, as in a deployment
    sg = SGLangSide(monkeypatch, tmp_path, spec, lmcache_settings(server, 256), model_path=model)
    storage, interop = sparsehi_side(server, spec, 256, layout, model_path=model)
    try:
        sg.store(tokens, kv, seed=5)
        assert interop.lmcache_held_tokens(tokens) == 1024
        pages = interop.read_pages(tokens)
        assert pages.shape == (64, *record_shape(spec, layout))
        host = host_pool_with(spec, layout, kv[:, :, :1024])
        for p in range(64):
            assert same_bits(pages[p], host.page_tensor(p)), p
        # imported: sparsehi's L3 holds them under the prompt's page keys
        assert interop.import_prefix(tokens) == 1024
        keys = interop.page_keys(tokens, None)
        assert storage.batch_exists(keys) == [True] * 64 + [False] * 4
        assert same_bits(storage.get(keys[17]).view(spec.dtype).view(pages[17].shape), pages[17])
        assert interop.import_prefix(tokens, salt="other tenant") == 1024  # other keys, same KV
        assert interop.import_prefix(prompt(600, seed=9)) == 0  # tokens LMCache never saw
    finally:
        storage.close()
        sg.close()


@needs_lmcache
@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_pages_sparsehi_wrote_are_retrieved_by_lmcache(server, monkeypatch, tmp_path, attention):
    spec = spec_of(attention, layers=8, heads=2, dim=16, page_size=16)
    tokens = prompt(800, seed=13)  # 3 whole chunks of 256 (768 tokens) and 32 more
    kv = random_kv(spec, len(tokens), seed=14)
    model = f"org/tiny-export-{attention}"
    settings = lmcache_settings(server, 256)
    if attention == "mla":
        # LMCache's default for MLA (one rank saves, world size 1 in the keys) makes its
        # in-process SGLang retrieve broadcast to the other ranks through its
        # mock_up_broadcast_object_fn, which raises, even at TP 1
        settings["extra_config"] = {"save_only_first_rank": False}
    storage, interop = sparsehi_side(server, spec, 256, model_path=model, settings=settings)
    host = host_pool_with(spec, "page_first", kv)
    keys = interop.page_keys(tokens, None)
    storage.register_host_pool(host)
    assert storage.set_pages(keys, list(range(len(keys)))) == [True] * 50
    sg = SGLangSide(monkeypatch, tmp_path, spec, settings, model_path=model)
    try:
        assert sg.load(tokens, seed=15)[0] == 0  # not yet in LMCache's layout
        assert interop.export_prefix(tokens) == 768
        assert interop.export_prefix(tokens) == 768  # held: nothing written again
        n, got = sg.load(tokens, seed=16)
        assert n == 768
        assert same_bits(got[:, :, :768], kv[:, :, :768])
        assert not got[:, :, 768:].view(torch.uint8).any()  # the partial chunk is not LMCache's
    finally:
        storage.close()
        sg.close()


@needs_lmcache
def test_prefetch_reads_what_lmcache_sglang_stored(server, monkeypatch, tmp_path):
    """A sparsehi tree (the l3_kit geometry) prefetches, after the import, the KV that
    LMCache's SGLang connector stored, and its host pool holds those bytes."""
    from l3_kit import HEADS, LAYERS, PS, build, expected, no_leaks, prefetch, read_host, settle
    from hicache.storage.lmcache_interop import LMCacheInterop
    from hicache.storage.lmcache_store import LMCacheStorage
    from hicache.storage_controller import StoragePolicy

    spec = KVCacheSpec("mha", LAYERS, HEADS, 4, torch.float32, PS)
    tokens = prompt(70, seed=21)  # chunks of 16: 64 tokens in LMCache
    kv = expected(tokens).permute(1, 0, 2, 3, 4)  # [B, L, T, H, D]
    sg = SGLangSide(monkeypatch, tmp_path, spec, lmcache_settings(server, 16), slots=256)
    storage = LMCacheStorage(StorageConfig(model_name="l3-kit", extra=lmcache_settings(server, 16)))
    tree, _, host = build(storage, StoragePolicy(prefetch_threshold=8, io_batch_pages=2))
    try:
        sg.store(tokens, kv, seed=22)
        interop = LMCacheInterop(storage, spec, host.layout, SGLANG_MODEL)
        assert interop.import_prefix(tokens) == 64
        n, _ = prefetch(tree, "r", tokens)
        assert n == 68  # every whole page reserved; L3 holds the first 16
        settle(tree, "r")
        m = tree.match_prefix(tokens)
        assert m.backed_length == 64
        assert same_bits(read_host(host, m.backed_host_indices), expected(tokens[:64]))
        no_leaks(tree)
    finally:
        tree.close()
        storage.close()
        sg.close()


@needs_lmcache
def test_chunk_of_another_geometry_is_a_miss(server, monkeypatch, tmp_path):
    """Same model name and dtype, other layer count: the chunk keys are equal, the objects
    are not pages of this model; the read stops there (a fault, never wrong KV)."""
    stored = spec_of("mha", layers=4, heads=2, dim=16, page_size=16)
    tokens = prompt(512, seed=31)
    sg = SGLangSide(monkeypatch, tmp_path, stored, lmcache_settings(server, 256))
    storage, interop = sparsehi_side(server, spec_of("mha", layers=8, heads=2, dim=16, page_size=16), 256)
    try:
        sg.store(tokens, random_kv(stored, 512, seed=32), seed=33)
        assert interop.lmcache_held_tokens(tokens) == 512  # LMCache's keys match
        assert interop.read_pages(tokens).shape[0] == 0
        assert interop.import_prefix(tokens) == 0
        assert storage.stats.faults >= 1
    finally:
        storage.close()
        sg.close()


@needs_lmcache
def test_server_gone_is_a_miss_both_ways(monkeypatch, tmp_path):
    spec = spec_of("mha", layers=2, heads=2, dim=8, page_size=16)
    tokens = prompt(512, seed=41)
    with LMCacheServer() as srv:
        sg = SGLangSide(monkeypatch, tmp_path, spec, lmcache_settings(srv, 256))
        storage, interop = sparsehi_side(srv, spec, 256)
        try:
            sg.store(tokens, random_kv(spec, 512, seed=42), seed=43)
            srv.kill()
            assert interop.import_prefix(tokens) == 0
            assert interop.export_prefix(tokens) == 0
            assert storage.stats.faults >= 1
        finally:
            storage.close()
            sg.close()


# -- the runtime: `sparsehi run` / ModelRunner with interop_model_path ---------------------------
RT_PS = 4
RT_CHUNK = 16


def _runtime_runner(storage=None, layout: str = "page_first_direct"):
    from hicache.storage_controller import StoragePolicy
    from sparsehi.config import SparseConfig
    from sparsehi.runtime.model_config import get_model_config
    from sparsehi.runtime.runner import ModelRunner
    from sparsehi.runtime.runtime_config import RuntimeConfig
    from sparsehi.runtime.weights import build_model

    model = build_model(config=get_model_config("tiny-gqa", num_layers=2))
    sc = SparseConfig(algorithm="quest", page_size=RT_PS, top_k=2 * RT_PS, device_buffer_size=4 * RT_PS,
                      sink_tokens=RT_PS, recent_tokens=RT_PS, min_sparse_prompt_len=0, dense_layers=(0,),
                      io_backend="direct")
    rt = RuntimeConfig(mode="sparse-hier", sparse=sc, max_num_reqs=1, max_context_len=96, host_kv_tokens=64 * RT_PS,
                       host_layout=layout, storage=storage,
                       storage_policy=StoragePolicy(prefetch_policy="wait_complete", prefetch_threshold=RT_PS)
                       if storage is not None else None)
    return ModelRunner(model, rt)


def _tree_kv(mode, tokens: list[int]) -> torch.Tensor:
    """``[B, L, len(tokens), H, D]``: the KV the mode's prefix tree holds in host memory for
    ``tokens`` (whole pages)."""
    m = mode.tree.match_prefix(tokens)
    assert m.backed_length == len(tokens)
    slots = m.backed_host_indices[:len(tokens)].cpu()
    return torch.stack([torch.stack(mode.host.read_tokens(layer, slots))
                        for layer in range(mode.spec.num_layers)]).transpose(0, 1)


@needs_lmcache
@pytest.mark.usefixtures("one_thread")
def test_sparse_hier_run_uses_lmcache_kv_and_lmcache_retrieves_its_kv(server, monkeypatch, tmp_path):
    """(a) the prompt's KV, computed by the model, is stored through LMCache's SGLang
    connector; (b) a fresh sparse-hier runner with ``interop_model_path`` imports it at its
    prefetch, reuses it and generates what a cold run does; (c) LMCache's own retrieve then
    returns, for the whole chunks of prompt and generated tokens, the KV sparsehi holds."""
    from hicache.storage.lmcache_store import LMCacheStorage

    tokens = [t % 512 for t in prompt(70, seed=51)]  # tiny-gqa's vocabulary
    cold = _runtime_runner()
    cold_res = cold.generate([tokens], 12)
    # the model's own KV of the prompt (the tree holds whole pages of prompt + decoded tokens)
    prompt_kv = _tree_kv(cold.mode, (tokens + cold_res.tokens[0])[:72])[:, :, :70]
    cold.mode.close()

    settings = lmcache_settings(server, RT_CHUNK)
    sg = SGLangSide(monkeypatch, tmp_path, cold.mode.spec, settings, slots=256)
    storage = LMCacheStorage(StorageConfig(model_name="tiny-gqa-runtime-interop",
                                           extra={**settings, "interop_model_path": SGLANG_MODEL}))
    assert storage.interop_model_path == SGLANG_MODEL
    try:
        sg.store(tokens, prompt_kv, seed=52)  # LMCache keeps whole chunks: 64 tokens
        warm = _runtime_runner(storage)
        res = warm.generate([tokens], 12)
        st = warm.mode.l3_stats()
        assert st["lmcache_imported_tokens"] == 64 and st["l3_hit_tokens"] == 64
        assert res.prefix_hits == [64]  # prefill computed the last 6 tokens only
        assert res.tokens == cold_res.tokens
        # 70 prompt + 11 decoded tokens: 80 in whole pages, one more chunk than LMCache had
        seq = tokens + res.tokens[0][:11]
        assert st["lmcache_exported_tokens"] == 16
        held = _tree_kv(warm.mode, seq[:80])
        assert same_bits(held[:, :, :70], prompt_kv)  # the imported prompt KV is the model's
        n, got = sg.load(seq[:80], seed=53)
        assert n == 80
        assert same_bits(got, held)
        warm.mode.close()
        # a salted request shares KV only with its salt: LMCache's unsalted chunks are not its
        tenant = _runtime_runner(storage)
        res = tenant.generate([tokens], 12, cache_salts=["tenant-a"])
        st = tenant.mode.l3_stats()
        assert res.prefix_hits == [0] and st["l3_hit_tokens"] == 0
        assert st["lmcache_imported_tokens"] == st["lmcache_exported_tokens"] == 0
        tenant.mode.close()
    finally:
        storage.close()
        sg.close()


@needs_lmcache
def test_interop_model_path_is_checked():
    from hicache.storage.lmcache_config import LMCacheSettings

    assert LMCacheSettings.from_extra({"interop_model_path": "org/m"}, env={}).interop_model_path == "org/m"
    assert "interop_model_path" not in LMCacheSettings.from_extra({"interop_model_path": "org/m"}, env={}).overrides
    for bad in ("", 3, "a@b", "x" * 101):
        with pytest.raises(ValueError, match="interop_model_path"):
            LMCacheSettings.from_extra({"interop_model_path": bad}, env={})


@needs_lmcache
def test_interop_refuses_host_pages_lmcache_cannot_hold(server):
    """LMCache's chunks hold the model's KV only: a DSA run (its index keys ride in the host
    pages) or FP8 host pages cannot be shared; the runner says so, naming the key."""
    from hicache.storage.lmcache_store import LMCacheStorage
    from sparsehi.config import SparseConfig
    from sparsehi.runtime.model_config import get_model_config
    from sparsehi.runtime.runner import ModelRunner
    from sparsehi.runtime.runtime_config import RuntimeConfig
    from sparsehi.runtime.weights import build_model

    extra = {**lmcache_settings(server, RT_CHUNK), "interop_model_path": SGLANG_MODEL}
    dsa = SparseConfig(algorithm="dsa", page_size=1, top_k=8, device_buffer_size=16, sink_tokens=2,
                       recent_tokens=2, min_sparse_prompt_len=0, io_backend="direct")
    storage = LMCacheStorage(StorageConfig(is_mla=True, model_name="tiny-dsa-refused", extra=extra))
    try:
        rt = RuntimeConfig(mode="sparse-hier", sparse=dsa, max_num_reqs=1, max_context_len=64,
                           host_layout="page_first_direct", storage=storage)
        with pytest.raises(ValueError, match="interop_model_path needs host pages of KV only"):
            ModelRunner(build_model(config=get_model_config("tiny-dsa")), rt)
    finally:
        storage.close()
    quest = SparseConfig(algorithm="quest", page_size=RT_PS, top_k=8, device_buffer_size=16, sink_tokens=RT_PS,
                         recent_tokens=RT_PS, min_sparse_prompt_len=0, host_kv_dtype="fp8_e4m3")
    storage = LMCacheStorage(StorageConfig(model_name="tiny-gqa-fp8-refused", extra=extra))
    try:
        rt = RuntimeConfig(mode="sparse-hier", sparse=quest, max_num_reqs=1, max_context_len=64,
                           host_layout="page_first", storage=storage)
        with pytest.raises(ValueError, match="interop_model_path needs host KV pages of the model's dtype"):
            ModelRunner(build_model(config=get_model_config("tiny-gqa", num_layers=2)), rt)
    finally:
        storage.close()


CLI_RUN = ["run", "--context", "96", "--batch", "1", "--decode-tokens", "4", "--num-layers", "2", "--modes",
           "sparse-hier", "--top-k", "32", "--sink-tokens", "16", "--recent-tokens", "16", "--page-size", "16",
           "--device", "cpu", "--no-forced", "--no-progress", "--hicache-storage-backend", "lmcache", "--hicache-storage-prefetch-policy", "wait_complete"]


@needs_lmcache
@pytest.mark.usefixtures("one_thread")
def test_sparsehi_run_command_line_exports_then_imports(server, tmp_path, capsys):
    """Two `sparsehi run` commands with interop_model_path: the first exports its KV as
    LMCache chunks; the second, whose sparsehi namespace differs (another host layout), has
    no page of it in sparsehi's L3, imports LMCache's chunks, prefetches them and
    generates the same tokens."""
    import json

    from sparsehi.cli import main

    extra = json.dumps({**lmcache_settings(server, RT_CHUNK), "interop_model_path": "org/tiny-gqa-cli",
                        "prefetch_threshold": 16})

    def run(layout: str, io: str, out: str) -> tuple[dict, dict]:
        assert main([*CLI_RUN, "--hicache-mem-layout", layout, "--hicache-io-backend", io,
                     "--hicache-storage-backend-extra-config", extra,
                     "--output-dir", str(tmp_path / out)]) == 0
        data = json.loads((tmp_path / out / "run.json").read_text())
        return data, next(r for r in data["rows"] if r["mode"] == "sparse-hier")

    first, r1 = run("page_first_direct", "direct", "a")
    assert r1["l3_hit_tokens"] == 0 and r1["lmcache_imported_tokens"] == 0
    assert r1["lmcache_exported_tokens"] == 96  # 96 prompt + 3 decoded tokens: 6 whole chunks
    second, r2 = run("page_head", "kernel", "b")
    assert second["l3_model_name"] != first["l3_model_name"]
    assert r2["lmcache_imported_tokens"] == 96 and r2["l3_hit_tokens"] == 96 and r2["prefix_reused_tokens"] == 80
    assert r2["lmcache_exported_tokens"] == 0  # LMCache holds every whole chunk already
    assert second["tokens"] == first["tokens"]
    out = capsys.readouterr().out
    assert "LMCache interop: 96 tokens" in out
