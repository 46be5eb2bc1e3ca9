"""Host (pinned) KV pool — the L2 tier holding the full KV, in one of four layouts."""
from __future__ import annotations

import logging
import mmap
import os
import weakref

import numpy as np
import torch

from hicache.allocator import PagedSlotAllocator
from hicache.config import HOST_LAYOUTS  # re-exported: ``from hicache.host_pool import HOST_LAYOUTS``
from hicache.device_pool import DeviceKVPool, check_slots
from hicache.kv_page_format import KVPageFormat, check_host_kv_dtype

logger = logging.getLogger(__name__)


def _host_shape(layout: str, num_pages: int, page_size: int, layers: int, bufs: int, heads: int, dim: int) -> tuple[int, ...]:
    if layout == "layer_first":
        return (bufs, layers, num_pages * page_size, heads, dim)
    if layout in ("page_first", "page_first_direct"):
        return (num_pages, layers, bufs, page_size, heads, dim)
    return (num_pages, heads, layers, bufs, page_size, dim)  # page_head


HOST_ALLOC_MODES = ("hugepage", "register", "torch")


def _host_buffer(nbytes: int, hugepage: bool) -> np.ndarray:
    """Zeroed ``uint8`` host buffer; with ``hugepage`` an anonymous mapping advised for
    transparent huge pages (fewer GPU/IOMMU translations for scattered zero-copy reads)."""
    if hugepage and hasattr(mmap, "MADV_HUGEPAGE"):
        mm = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # pragma: no cover - THP disabled
            pass
        return np.frombuffer(mm, dtype=np.uint8)
    return np.zeros(max(nbytes, 1), dtype=np.uint8)  # calloc: zero pages without a memset pass


def alloc_pinned(nbytes: int, mode: str | None = None) -> torch.Tensor:
    """``uint8 [nbytes]`` page-locked host memory.

    torch's pinned allocator rounds every block up to a power of two (a 40 GB pool would
    lock 64 GB), so the pool is plain host memory registered with cudaHostRegister; with
    unified addressing that memory is mapped into the GPU's address space at the same
    pointer, which the zero-copy Triton kernel relies on. The registration is undone when
    the last tensor viewing the memory dies (weakref on the owning numpy array).
    ``mode`` (None: the ``SPARSEHI_HOST_ALLOC`` environment variable) picks ``hugepage``
    (default: THP-advised mapping), ``register`` (plain calloc) or ``torch`` (torch's pinned
    allocator).
    """
    if mode is None:
        mode = os.environ.get("SPARSEHI_HOST_ALLOC", "hugepage")
        if mode not in HOST_ALLOC_MODES:
            raise ValueError(f"SPARSEHI_HOST_ALLOC must be one of {HOST_ALLOC_MODES}, got {mode!r}")
    elif mode not in HOST_ALLOC_MODES:
        raise ValueError(f"mode must be one of {HOST_ALLOC_MODES} or None, got {mode!r}")
    if mode == "torch":
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    arr = _host_buffer(nbytes, hugepage=mode == "hugepage")
    cudart = torch.cuda.cudart()
    ptr = arr.ctypes.data
    err = cudart.cudaHostRegister(ptr, arr.nbytes, 0)
    if int(err) != 0:
        logger.warning("cudaHostRegister failed (%s); falling back to torch's pinned allocator", err)
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    weakref.finalize(arr, cudart.cudaHostUnregister, ptr)
    return torch.from_numpy(arr)[:nbytes]


def _available_host_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return None


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def _check_extra(extra_token_buffers) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    if extra_token_buffers is None:
        return out
    if not isinstance(extra_token_buffers, dict):
        raise ValueError(f"extra_token_buffers must be a dict name -> (per-token shape, dtype), "
                         f"got {type(extra_token_buffers).__name__}")
    for name, spec in extra_token_buffers.items():
        ok = (isinstance(name, str) and name and isinstance(spec, tuple) and len(spec) == 2
              and isinstance(spec[1], torch.dtype) and isinstance(spec[0], tuple)
              and all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in spec[0]))
        if not ok:
            raise ValueError(f"extra_token_buffers[{name!r}] must be (per-token shape: tuple of ints >= 1, "
                             f"torch dtype), got {spec!r}")
        out[name] = (tuple(spec[0]), spec[1])
    return out


class HostKVPool:
    """Full KV in host memory, ``num_slots`` token slots of all layers.

    Layouts (``B`` = buffers: k, v for MHA; kv for MLA):

    - ``layer_first``       ``[B, layers, slots, heads, dim]`` — matches the GPU pool.
    - ``page_first``        ``[pages, layers, B, page_size, heads, dim]`` — one page of all
      layers is contiguous (zero-copy to L3 via ``page_tensor``).
    - ``page_first_direct`` same memory as ``page_first``; the ``direct`` io backend moves
      whole (page, layer) blocks with one copy each instead of gathering tokens.
    - ``page_head``         ``[pages, heads, layers, B, page_size, dim]`` — page_first split
      per kv head, so a rank with a different TP degree reads its heads contiguously.

    Size: ``hicache_size`` GB (1e9, per rank) when > 0, else ``hicache_ratio`` × the device
    pool; either must exceed the device pool. Pinned iff CUDA is available unless
    ``pin_memory`` says otherwise.

    Extra per-token buffers (``extra_token_buffers``: name -> (per-token shape, dtype)) hold
    data a caller keeps with each token's KV that the device pool does not have (e.g. a
    sparse-attention index key per layer); they are allocated, freed and evicted with the
    token's slot and never moved by the KV transfers (``read_extra`` / ``write_extra``). In
    the page layouts each page is one contiguous record: the KV page followed by the page's
    extra buffers (each ``[page_size, *shape]``), so ``page_tensor`` — the object L3 stores
    — carries them too. ``kv_data`` is then a strided view of the records.

    ``host_kv_dtype="fp8_e4m3"`` (``page_first`` only) stores each page's KV as
    an FP8 record (``hicache.kv_page_format``): E4M3 values then per layer, buffer and head
    scales, half the bytes of bf16 plus the scales; the pool then holds as many more tokens in
    ``hicache_size`` GB. Its pages are read through ``fp8_values`` / ``fp8_scales`` (the
    transfer engine dequantises loads and quantises whole-page backups); ``paged_view`` has
    no meaning there and refuses.
    """

    def __init__(self, device_pool: DeviceKVPool, hicache_ratio: float = 2.0, hicache_size: float = 0.0,
                 layout: str = "layer_first", pin_memory: bool | None = None,
                 extra_token_buffers: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
                 host_kv_dtype: str = "auto"):
        if not isinstance(device_pool, DeviceKVPool):
            raise ValueError(f"device_pool must be a DeviceKVPool, got {type(device_pool).__name__}")
        if layout not in HOST_LAYOUTS:
            raise ValueError(f"layout must be one of {HOST_LAYOUTS}, got {layout!r}")
        spec = device_pool.spec
        ps = spec.page_size
        extras = _check_extra(extra_token_buffers)
        self.kv_format = KVPageFormat(spec, check_host_kv_dtype(host_kv_dtype))
        if self.kv_format.quantized and layout != "page_first":
            raise ValueError(f"host_kv_dtype='fp8_e4m3' needs layout='page_first', got layout={layout!r}")
        # page record: the KV page, then each extra buffer's page, each part 64-byte aligned;
        # the record is a whole number of KV rows so the strided KV view keeps row strides
        kv_page = self.kv_format.page_bytes
        offsets: dict[str, int] = {}
        record = kv_page
        for name, (shape, dt) in extras.items():
            record = _align(record, 64)
            offsets[name] = record
            record += ps * int(np.prod(shape)) * torch.empty((), dtype=dt).element_size()
        if extras:
            record = _align(record, int(np.lcm(64, spec.row_bytes)))
        token_bytes = record / ps
        if hicache_size is None or hicache_size < 0:
            raise ValueError(f"hicache_size must be >= 0 (GB per rank; 0 = use hicache_ratio), got {hicache_size!r}")
        if hicache_size > 0:
            num_slots = int(hicache_size * 1e9 // token_bytes) // ps * ps
            if num_slots <= device_pool.num_slots:
                raise ValueError(
                    f"hicache_size={hicache_size} GB holds {num_slots} slots, which must exceed the device "
                    f"pool's {device_pool.num_slots} slots ({device_pool.num_slots * token_bytes / 1e9:.3g} GB)")
        else:
            if not hicache_ratio > 1:
                raise ValueError(f"hicache_ratio must be > 1 (host pool larger than the device pool), got {hicache_ratio!r}")
            num_slots = int(device_pool.num_slots * hicache_ratio) // ps * ps
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA; pass pin_memory=None or False on a CPU-only machine")

        self.spec = spec
        self.device_pool = device_pool
        self.layout = layout
        self.page_size = ps
        self.num_slots = num_slots
        self.num_pages = num_slots // ps
        self.pin_memory = bool(pin_memory)
        self.allocator = PagedSlotAllocator(num_slots, ps, "cpu")

        self.extra_specs = extras
        self.page_nbytes = record
        """Bytes of one page record (KV and extra buffers): what ``page_tensor`` spans."""
        nbytes = self.num_pages * record if extras and layout != "layer_first" else self.num_pages * kv_page
        avail = _available_host_bytes()
        if avail is not None and nbytes > avail:
            raise ValueError(f"host pool needs {nbytes / 1e9:.3g} GB but only {avail / 1e9:.3g} GB of host memory "
                             f"is available; lower hicache_ratio/hicache_size")
        shape = _host_shape(layout, self.num_pages, ps, spec.num_layers, spec.num_buffers, spec.kv_heads, spec.head_dim)
        raw = alloc_pinned(nbytes) if self.pin_memory else torch.zeros(nbytes, dtype=torch.uint8)
        self.raw = raw
        """All of the pool's host memory (``uint8``): what a storage backend registers."""
        self.extra: dict[str, torch.Tensor] = {}
        """name -> ``[pages, page_size, *shape]`` view of each extra buffer."""
        self.fp8_values: torch.Tensor | None = None
        """FP8 pools: ``[pages, layers, buffers, page_size, heads, dim]`` uint8 (E4M3 bits)."""
        self.fp8_scales: torch.Tensor | None = None
        """FP8 pools: ``[pages, layers, buffers, heads]`` float32 (powers of two)."""
        self._make_views(kv_page, offsets, extras, shape)

    def _make_views(self, kv_page: int, offsets: dict[str, int], extras: dict, shape: tuple[int, ...]) -> None:
        """``kv_data`` (and the FP8 views) and the extra buffers' views over ``raw``."""
        spec, ps, raw = self.spec, self.page_size, self.raw
        if (extras and self.layout != "layer_first") or self.kv_format.quantized:
            rec = raw.view(self.num_pages, self.page_nbytes)
            if self.kv_format.quantized:
                self.fp8_values, self.fp8_scales = self.kv_format.split(rec[:, :kv_page])
                self.kv_data = self.fp8_values
            else:
                self.kv_data = rec[:, :kv_page].view(spec.dtype).view(shape)
            for name, (eshape, dt) in extras.items():
                nb = ps * int(np.prod(eshape)) * torch.empty((), dtype=dt).element_size()
                part = rec[:, offsets[name]:offsets[name] + nb]
                self.extra[name] = part.view(dt).view(self.num_pages, ps, *eshape)
        else:
            self.kv_data = raw.view(spec.dtype).view(shape)
            for name, (eshape, dt) in extras.items():  # layer_first: no page records, no L3
                self.extra[name] = torch.zeros((self.num_pages, ps, *eshape), dtype=dt,
                                               pin_memory=self.pin_memory)

    # --- allocation --------------------------------------------------------------------
    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """``int64 [pages * page_size]`` host slots (CPU), or None when the pool is short."""
        return self.allocator.alloc(num_tokens)

    def free(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    def available_size(self) -> int:
        return self.allocator.available_size()

    # --- views -------------------------------------------------------------------------
    def paged_view(self) -> torch.Tensor:
        """6-D view ``[pages, page_size, layers, buffers, heads, dim]`` of the pool,
        whatever the layout (what ``hicache.kernels.kv_copy`` addresses). Not for FP8 pools."""
        if self.kv_format.quantized:
            raise ValueError("an FP8 host pool (host_kv_dtype='fp8_e4m3') has no view in the model's dtype: read "
                             "it through fp8_values / fp8_scales (the transfer engine dequantises)")
        d = self.kv_data
        if self.layout == "layer_first":
            b, l, _, h, dim = d.shape
            return d.view(b, l, self.num_pages, self.page_size, h, dim).permute(2, 3, 1, 0, 4, 5)
        if self.layout in ("page_first", "page_first_direct"):
            return d.permute(0, 3, 1, 2, 4, 5)
        return d.permute(0, 4, 2, 3, 1, 5)

    def page_tensor(self, page: int) -> torch.Tensor:
        """One page of every layer, contiguous (page layouts only): the object L3 stores.
        With extra per-token buffers, the whole page record as ``uint8 [page_nbytes]``."""
        if self.layout == "layer_first":
            raise ValueError("page_tensor needs layout in ('page_first', 'page_first_direct', 'page_head'), "
                             "got 'layer_first'")
        if not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise ValueError(f"page must be an int in [0, {self.num_pages}), got {page!r}")
        if self.extra or self.kv_format.quantized:
            return self.raw.view(self.num_pages, self.page_nbytes)[page]
        return self.kv_data[page]

    def _extra(self, name: str) -> torch.Tensor:
        if name not in self.extra:
            raise ValueError(f"extra buffer {name!r} is not in this pool (it has {sorted(self.extra)})")
        return self.extra[name]

    def read_extra(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        """Copy of extra buffer ``name`` at ``slots``: ``[N, *shape]`` of its dtype (CPU)."""
        buf = self._extra(name)
        check_slots(slots, "slots", self.num_slots, (torch.device("cpu"),))
        s = slots.to(torch.int64)
        return buf[s // self.page_size, s % self.page_size].clone()

    def write_extra(self, name: str, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values [N, *shape]`` into extra buffer ``name`` at ``slots`` (unique)."""
        buf = self._extra(name)
        check_slots(slots, "slots", self.num_slots, (torch.device("cpu"),), unique=True)
        want = (slots.numel(), *buf.shape[2:])
        if tuple(values.shape) != want:
            raise ValueError(f"values must have shape {want} for extra buffer {name!r}, got {tuple(values.shape)}")
        s = slots.to(torch.int64)
        buf[s // self.page_size, s % self.page_size] = values.to(device="cpu", dtype=buf.dtype)

    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or not 0 <= layer < self.spec.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.spec.num_layers}), got {layer!r}")

    def read_tokens(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copies of ``slots``' rows of ``layer``: (k, v) MHA / (kv,) MLA, each ``[N, heads, dim]``."""
        self._check_layer(layer)
        check_slots(slots, "slots", self.num_slots, (torch.device("cpu"),))
        s = slots.to(torch.int64)
        if self.kv_format.quantized:
            q = self.fp8_values[s // self.page_size, layer, :, s % self.page_size]  # [N, B, H, D]
            scale = self.fp8_scales[s // self.page_size, layer]  # [N, B, H]
            rows = (q.view(torch.float8_e4m3fn).float() * scale[..., None]).to(self.spec.dtype)
        else:
            rows = self.paged_view()[s // self.page_size, s % self.page_size, layer]  # [N, B, H, D]
        return tuple(rows[:, b].clone() for b in range(self.spec.num_buffers))

    def write_tokens(self, layer: int, slots: torch.Tensor, *bufs: torch.Tensor) -> None:
        """Write ``bufs`` (k, v MHA / kv MLA; each ``[N, heads, dim]``) into ``slots`` of ``layer``.
        Not for FP8 pools (a page's scale needs all of its tokens: ``write_pages``)."""
        if self.kv_format.quantized:
            raise ValueError("write_tokens cannot write single tokens of an FP8 host pool; use write_pages")
        self._check_layer(layer)
        check_slots(slots, "slots", self.num_slots, (torch.device("cpu"),), unique=True)
        if len(bufs) != self.spec.num_buffers:
            raise ValueError(f"bufs must be {self.spec.num_buffers} tensors for {self.spec.attention}, got {len(bufs)}")
        want = (slots.numel(), self.spec.kv_heads, self.spec.head_dim)
        for i, t in enumerate(bufs):
            if tuple(t.shape) != want:
                raise ValueError(f"bufs[{i}] must have shape {want}, got {tuple(t.shape)}")
        s = slots.to(torch.int64)
        data = torch.stack([t.to(device="cpu", dtype=self.spec.dtype) for t in bufs], dim=1)  # [N, B, H, D]
        self.paged_view()[s // self.page_size, s % self.page_size, layer] = data

    def write_pages(self, pages: torch.Tensor, values: torch.Tensor) -> None:
        """Write whole pages: ``values [P, layers, buffers, page_size, heads, dim]`` (the
        model's dtype) into host ``pages [P]`` (int, unique), quantised for an FP8 pool."""
        check_slots(pages, "pages", self.num_pages, (torch.device("cpu"),), unique=True)
        want = (pages.numel(), *self.kv_format.value_shape)
        if tuple(values.shape) != want:
            raise ValueError(f"values must have shape {want}, got {tuple(values.shape)}")
        p = pages.to(torch.int64)
        if self.kv_format.quantized:
            records = torch.empty((p.numel(), self.page_nbytes), dtype=torch.uint8)
            self.kv_format.quantize_into(values.to(device="cpu", dtype=self.spec.dtype), records)
            self.raw.view(self.num_pages, self.page_nbytes)[p] = records
            return
        view = self.paged_view()  # [pages, page_size, layers, buffers, heads, dim]
        view[p] = values.to(device="cpu", dtype=self.spec.dtype).permute(0, 3, 1, 2, 4, 5)

    def nbytes(self) -> int:
        return self.raw.numel() + sum(t.numel() * t.element_size() for t in self.extra.values()
                                      if t.untyped_storage().data_ptr() != self.raw.untyped_storage().data_ptr())

    def __repr__(self) -> str:
        return (f"HostKVPool(layout={self.layout}, {self.kv_format.namespace_tag}, num_slots={self.num_slots}, "
                f"{self.nbytes() / 1e9:.3g} GB, pinned={self.pin_memory})")
